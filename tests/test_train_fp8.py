"""Training on fp8-stored states (extract's storage_dtype float8_e4m3fn): the states travel to the device as stored,
1 byte a value with their per-token scales, and are dequantized there exactly as the reader dequantizes them on the
host; so a run on fp8 storage trains as one on the bf16 states those fp8 values stand for."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3.extract.format import ShardManifest, load_chunk, write_chunk
from eagle3.extract.pipeline import store_states
import pytest

from tests.test_train_config import CAPTURE, HIDDEN, write_tiny_target
from tests.test_train_selection import selection_config, write_learnable_shard


def write_fp8_copy(src: Path, dst: Path) -> None:
    """src's shard stored in fp8 (each token's states scaled to e4m3 per layer, as the extractor stores them)."""
    man = ShardManifest.load(src)
    t = load_chunk(src, man.chunks[0])
    T, n = len(t["input_ids"]), len(CAPTURE)
    aux = torch.empty(T, n * HIDDEN, dtype=torch.float8_e4m3fn)
    aux_scale = torch.empty(T, n)
    for k in range(n):
        layer = slice(k * HIDDEN, (k + 1) * HIDDEN)
        store_states(aux[:, layer], aux_scale[:, k], t["aux_hidden"][:, layer])
    final = torch.empty(T, HIDDEN, dtype=torch.float8_e4m3fn)
    final_scale = torch.empty(T)
    store_states(final, final_scale, t["final_hidden"])
    dst.mkdir(parents=True)
    fp8 = ShardManifest(shard=0, model_path="tiny", capture_layers=CAPTURE, hidden_size=HIDDEN, dtype="float8_e4m3fn")
    fp8.chunks.append(write_chunk(dst, 0, {**t, "aux_hidden": aux, "final_hidden": final, "aux_scale": aux_scale,
                                           "final_scale": final_scale}, fsync=False))
    fp8.complete = True
    fp8.save(dst)


def write_dequantized_copy(src: Path, dst: Path) -> None:
    """src's fp8 shard as the bf16 states its values stand for (the host's dequantization)."""
    man = ShardManifest.load(src)
    dst.mkdir(parents=True)
    bf16 = ShardManifest(shard=0, model_path="tiny", capture_layers=CAPTURE, hidden_size=HIDDEN, dtype="bfloat16")
    bf16.chunks.append(write_chunk(dst, 0, load_chunk(src, man.chunks[0]), fsync=False))
    bf16.complete = True
    bf16.save(dst)


@pytest.fixture
def stored(tmp_path):
    """The learnable shard (test_train_selection) stored in fp8 (`fp8`) and as its dequantized bf16 (`bf16`)."""
    write_learnable_shard(tmp_path / "shard", write_tiny_target(tmp_path / "target"))
    write_fp8_copy(tmp_path / "shard", tmp_path / "fp8")
    write_dequantized_copy(tmp_path / "fp8", tmp_path / "bf16")
    return tmp_path


def test_fp8_batches_stay_fp8_on_the_host_and_equal_the_host_dequantized_ones(stored):
    from eagle3.extract.reader import HiddenStateReader
    from eagle3.train.batches import BatchOrder, collate, to_device

    fp8, bf16 = (BatchOrder(HiddenStateReader([stored / d]), 4, 0, {3, 7}) for d in ("fp8", "bf16"))
    pairs = [(a, b) for e in range(2) for (_, a), (_, b) in zip(fp8.epoch(e), bf16.epoch(e))]
    pairs += list(zip(fp8.held_out_batches(), bf16.held_out_batches()))
    assert len(pairs) == 2 * 6 + 1
    for stored_fp8, dequantized in pairs:
        batch = collate(stored_fp8, 20, 8, rows=6)  # padded columns and rows: their scales are 0 too
        assert batch["aux"].dtype == batch["final"].dtype == torch.float8_e4m3fn
        assert batch["aux_scale"].shape == (6, 16, len(CAPTURE)) and batch["final_scale"].shape == (6, 16)
        got = to_device(batch, torch.device("cpu"))
        want = to_device(collate(dequantized, 20, 8, rows=6), torch.device("cpu"))
        assert sorted(got) == sorted(want) == ["aux", "final", "input_ids", "loss_mask"]
        for k in want:
            assert torch.equal(got[k], want[k]), k


def test_training_on_fp8_storage_equals_training_on_its_bf16_states(stored):
    from eagle3.train.trainer import train

    runs = {}
    for name in ("fp8", "bf16"):
        train(selection_config(stored, shard_dirs=[str(stored / name)], output_dir=str(stored / f"t-{name}"),
                               max_steps=4))
        rows = [json.loads(ln) for ln in (stored / f"t-{name}" / "metrics.jsonl").read_text().splitlines()]
        # the host's share of the wall time spent reading and batching samples (timing, so kept out of the equality)
        assert all(0 < r["data_share"] < 1 for r in rows)
        runs[name] = [{k: v for k, v in r.items() if k not in ("tokens_per_s", "data_share")} for r in rows]
    assert len(runs["fp8"]) == 4 and runs["fp8"][0]["loss"] != runs["fp8"][-1]["loss"]
    assert runs["fp8"] == runs["bf16"]
