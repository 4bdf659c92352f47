"""The exported checkpoint is chosen by simulated acceptance on a held-out slice (eagle3.train.validation), on the
tiny target of test_train_config with data a drafter can learn: each token follows from the one before, and the
stored final state points the teacher at the next token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3.errors import PipelineError
from eagle3.extract.format import ShardManifest, write_chunk
from eagle3.knobs import build
from eagle3.train.config import TrainConfig
from tests.test_train_config import CAPTURE, HIDDEN, VOCAB, required, write_tiny_target

SAMPLES, LENGTH = 24, 16


def write_learnable_shard(d: Path, target: Path) -> Path:
    """SAMPLES samples of LENGTH tokens: t_{i+1} = t_i + 7 (mod V) from a random start; the final state of token i
    is 3 x the lm_head row of token i+1 (the teacher's argmax is the next token, as on greedy answers) and the
    first aux layer carries it too."""
    from safetensors.torch import load_file

    head = load_file(str(target / "model.safetensors"))["lm_head.weight"]
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, VOCAB, (SAMPLES, 1), generator=g)
    ids = ((starts + 7 * torch.arange(LENGTH)) % VOCAB).flatten()
    final = 3.0 * head[torch.cat([ids[1:], ids[:1]])]
    aux = 0.1 * torch.randn(len(ids), len(CAPTURE) * HIDDEN, generator=g)
    aux[:, :HIDDEN] += final
    man = ShardManifest(shard=0, model_path="tiny", capture_layers=CAPTURE, hidden_size=HIDDEN, dtype="float32")
    d.mkdir(parents=True)
    man.chunks.append(write_chunk(d, 0, {
        "input_ids": ids.to(torch.int32), "loss_mask": (torch.arange(LENGTH) >= 2).to(torch.uint8).repeat(SAMPLES),
        "aux_hidden": aux, "final_hidden": final, "sample_offsets": torch.arange(0, len(ids) + 1, LENGTH),
        "sample_rows": torch.arange(SAMPLES)}, fsync=False))
    man.complete = True
    man.save(d)
    return d


@pytest.fixture
def learnable(tmp_path):
    write_learnable_shard(tmp_path / "shard", write_tiny_target(tmp_path / "target"))
    return tmp_path


def selection_config(tmp_path: Path, **kw) -> TrainConfig:
    # a constant lr this high climbs, then overshoots: on this data the best validation (step 6) is not the last
    return build(TrainConfig, {**required(tmp_path), "max_steps": 8, "batch_size": 4, "ttt_steps": 3, "lr": 0.05,
                               "warmup_ratio": 0.0, "min_lr_ratio": 1.0, "checkpoint_every": 100, "device": "cpu",
                               "holdout_fraction": 0.25, "validate_every": 2, "keep_checkpoints": 20, **kw}, "train")


def exported_state(export: Path) -> dict:
    from eagle3.train.export import load_exported

    return load_exported(export)[0].state_dict()


def test_the_export_is_the_best_validated_checkpoint_not_the_last(learnable):
    from eagle3.train.run import train_phase

    report = train_phase(selection_config(learnable))
    out = learnable / "train"
    rows = [json.loads(ln) for ln in (out / "validation.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6, 8]  # every validate_every steps, each with a checkpoint
    assert rows[-1]["sim_tau"] > rows[0]["sim_tau"] > 1.0  # it learns: drafts get accepted on unseen samples
    best = max(rows, key=lambda r: r["sim_tau"])
    sel = report["checkpoint_selection"]
    assert best["step"] != 8, "the data and lr are meant to make an earlier checkpoint the best"
    assert sel == {"held_out_samples": 6, "validations": 4, "best_step": best["step"], "best_sim_tau": best["sim_tau"],
                   "last_step": 8, "last_sim_tau": rows[-1]["sim_tau"],
                   "gain_over_last": best["sim_tau"] - rows[-1]["sim_tau"], "exported": "best"}
    assert sel["gain_over_last"] > 0
    # the export holds the weights of the checkpoint written at the best step, not those of the last one
    ckpts = out / "checkpoints"
    at_best = torch.load(ckpts / f"step-{best['step']:08d}.pt", weights_only=False)["model"]
    last = torch.load(ckpts / "step-00000008.pt", weights_only=False)["model"]
    assert [p.name for p in ckpts.glob("best-step-*.pt")] == [f"best-step-{best['step']:08d}.pt"]
    exported = exported_state(Path(report["export_dir"]))
    name = "midlayer.self_attn.q_proj.weight"
    torch.testing.assert_close(exported[name], at_best[name].to(torch.bfloat16).float())
    assert not torch.allclose(exported[name], last[name].to(torch.bfloat16).float())
    assert json.loads((out / "report.json").read_text())["checkpoint_selection"] == sel


def test_a_restart_drops_validations_and_best_weights_written_after_the_last_checkpoint(learnable):
    from eagle3.train.trainer import train

    cfg = selection_config(learnable)
    first = train(cfg)["selection"]
    out = learnable / "train"
    # what a run killed after its last checkpoint would have left: a later validation and its best weights
    with open(out / "validation.jsonl", "a") as f:
        f.write(json.dumps({"step": 9, "sim_tau": 9.0, "accepted_past_depth": [1, 1, 1], "slots": 1}) + "\n")
    torch.save({"model": {}, "step": 9, "sim_tau": 9.0}, out / "checkpoints" / "best-step-00000009.pt")
    again = train(cfg)["selection"]
    assert again == first
    assert not (out / "checkpoints" / "best-step-00000009.pt").exists()
    assert [json.loads(ln)["step"] for ln in (out / "validation.jsonl").read_text().splitlines()] == [2, 4, 6, 8]


def test_held_out_samples_never_train_and_the_slice_is_named_when_too_large(learnable):
    from eagle3.extract.reader import HiddenStateReader
    from eagle3.train.batches import BatchOrder, held_out_samples

    reader = HiddenStateReader([learnable / "shard"])
    held = held_out_samples(SAMPLES, 0.25, seed=0)
    assert len(held) == 6 and held == held_out_samples(SAMPLES, 0.25, seed=0)
    order = BatchOrder(reader, 4, 0, held)
    aux = reader.load(reader.chunks()[0])["aux_hidden"].view(SAMPLES, LENGTH, -1)
    index = {float(a[0, HIDDEN]): i for i, a in enumerate(aux)}  # a noise value names each sample
    trained = [index[float(s["aux_hidden"][0, HIDDEN])] for e in range(2) for _, b in order.epoch(e) for s in b]
    validated = [index[float(s["aux_hidden"][0, HIDDEN])] for b in order.held_out_batches() for s in b]
    assert len(index) == SAMPLES
    assert sorted(validated) == sorted(held) and not set(trained) & held
    assert sorted(trained) == sorted(2 * [i for i in range(SAMPLES) if i not in held])
    assert order.batches_per_epoch == 5  # 18 training samples in batches of 4
    # no slice: the same batches as before the slice existed (every sample, the same seeded order)
    assert BatchOrder(reader, 4, 0).batches_per_epoch == 6
    with pytest.raises(PipelineError, match=r"holdout_fraction 0.1 holds out 1 of 1 samples"):
        held_out_samples(1, 0.1, seed=0)  # one sample: the slice takes it
