"""The shard extractor on the CPU with the real SmolLM2-135M-Instruct."""

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3.errors import ConfigError
from eagle3.extract.batches import AUTO_PAD_MULTIPLE, padded_length, plan_batches
from eagle3.extract.config import ExtractConfig, ShardPlanConfig
from eagle3.extract.extractor import ExtractOOMError, resolve_for_device
from eagle3.extract.run import extract_shard
from eagle3.extract.format import CorruptChunkError, ShardManifest
from eagle3.extract.plan import load_shard_data, plan_shards
from eagle3.extract.reader import HiddenStateReader
from tests.support.reference import reference_states
from tests.support.synthetic import write_merged_dataset
from eagle3.faults import ENV_VAR as FAULT_ENV, InjectedFault
from eagle3.extract.status import FAILURE_NAME
from tests.support.configs import phase

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [1, 2, 15, 27]  # low to high (HF hidden_states indices)
# fp32 on CPU: 5 x 576 x 4 bytes = 11.5 KB a token, so chunk_mb=0.1 gives chunks of <= 9 tokens
# (a chunk is never smaller than one batch: here every batch is a chunk); the samples are 129..150 tokens, so
# the least budget (256) runs each alone and a budget of 300 padded tokens batches two of unequal length
CHUNK_MB = 0.1
BUDGET = 256
BATCHED = 300
LENGTHS = [140, 129, 150, 133]


def chunk_bytes(shard_dir: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(shard_dir.glob("chunk-*.safetensors"))}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, smollm2_tokenizer):
    """A small merged dataset of real text (two files), LENGTHS tokens: kept small for the 2-core CI."""
    tok = smollm2_tokenizer
    text = " ".join(["Hi", "What is 2+2?", "Name three colors of the rainbow.", "ok", "Why is the sky blue?",
                     "Translate 'good morning' to French.", "Count to five, then stop.", "The sea and the wind."] * 12)
    words = tok(text)["input_ids"]
    samples = [[1] + words[7 * i:7 * i + n - 2] + [2] for i, n in enumerate(LENGTHS)]  # <|im_start|> ... <|im_end|>
    masks = [[0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2) for ids in samples]
    d = tmp_path_factory.mktemp("merge")
    write_merged_dataset(d, samples, rows_per_file=3, loss_masks=masks)
    return d, samples, masks


@pytest.fixture(scope="module")
def reference(dataset, smollm2_model):
    """The oracle: one plain forward per sample with output_hidden_states=True."""
    return [reference_states(smollm2_model, ids, LAYERS) for ids in dataset[1]]


@pytest.fixture(scope="module")
def spec(dataset):
    return plan_shards(ShardPlanConfig(str(dataset[0]), 1))[0]


def config(smollm2_path, out, **kw):
    kw = {"capture_layers": LAYERS, "device": "cpu", "dtype": "float32", "token_budget": BUDGET,
          "chunk_mb": CHUNK_MB, "writer_threads": 2, **kw}
    return phase(ExtractConfig, model_path=str(smollm2_path), extract_dir=str(out), **kw)


@pytest.fixture(scope="module")
def batched(tmp_path_factory, smollm2_path, spec):
    out = tmp_path_factory.mktemp("batched")
    summary = extract_shard(config(smollm2_path, out), spec)
    return out / "shard-00000", summary


TINY_SHAPE = {"num_layers": 4, "hidden_size": 64, "intermediate_size": 128}


@pytest.fixture(scope="module")
def tiny_model():
    """A random 4-layer Llama: the write pipeline's tests need chunks, not the real model's compute (a chunk of
    130+ tokens through SmolLM2 takes seconds on a loaded 2-core machine, against a few ms here)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=49152)
    return AutoModelForCausalLM.from_config(cfg).eval()


def tiny_run(tiny_model, spec, out, try_number=None, **kw):
    """extract_shard with the tiny model: 4 x 64 fp32 values a token, so chunk_mb=0.1 gives chunks of <= 101
    tokens: every batch is a chunk."""
    from eagle3.extract.backend import HFBackend

    cfg = phase(ExtractConfig, **{"model_path": "tiny", "extract_dir": str(out), "capture_layers": [1, 2, 3],
                           "device": "cpu", "dtype": "float32", "token_budget": BUDGET, "chunk_mb": CHUNK_MB,
                           "writer_threads": 2, **kw})
    return extract_shard(cfg, spec, backend=HFBackend(model=tiny_model), model_config=TINY_SHAPE,
                         try_number=try_number)


@pytest.fixture(scope="module")
def tiny_done(tmp_path_factory, tiny_model, spec):
    out = tmp_path_factory.mktemp("tiny")
    summary = tiny_run(tiny_model, spec, out)
    return out / "shard-00000", summary


def test_states_equal_output_hidden_states_batched_and_unbatched(batched, dataset, spec, smollm2_path,
                                                                 reference, tmp_path):
    _, samples, masks = dataset
    shard_dir, summary = batched
    assert summary["complete"] and summary["tokens"] == spec.tokens
    # the wall time outside the steady state, as the summary splits it
    assert 0 < summary["setup_s"] < summary["seconds"] and 0 < summary["tail_s"] < summary["seconds"]
    # the fixture's token_budget=256 runs every sample (129..150 tokens) alone, no padding; this one batches
    batched2 = extract_shard(config(smollm2_path, tmp_path, token_budget=BATCHED), spec)
    assert batched2["tokens"] == spec.tokens
    for d in (shard_dir, Path(batched2["shard_dir"])):
        got = {s.row: s for s in HiddenStateReader([d], verify=True)}
        assert sorted(got) == list(range(len(samples)))
        for row, ids in enumerate(samples):
            s = got[row]
            assert s.input_ids.tolist() == ids and s.loss_mask.tolist() == masks[row]
            aux, final = reference[row]
            for k in range(len(LAYERS)):  # every capture layer separately
                torch.testing.assert_close(s.aux_hidden[:, k * 576:(k + 1) * 576], aux[:, k * 576:(k + 1) * 576],
                                           rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(s.final_hidden, final, rtol=1e-4, atol=1e-4)
    # the batched run really batched (several samples, unequal lengths, in one forward: padding)
    data = load_shard_data(spec)
    batches = [b for c in plan_batches(data.lengths, data.rows, BATCHED, 9) for b in c]
    assert any(len(b) > 1 and len(set(data.lengths[b])) > 1 for b in batches)
    assert len(ShardManifest.load(shard_dir).chunks) >= 3


def test_fault_hook_fails_once_then_resume_is_byte_identical(tiny_done, tiny_model, spec, tmp_path, monkeypatch):
    once = tmp_path / "failed-once"
    monkeypatch.setenv(FAULT_ENV, f"shard=0,after_chunks=1,once_file={once}")
    with pytest.raises(InjectedFault, match="shard 0 after 1 committed chunks"):
        tiny_run(tiny_model, spec, tmp_path / "out", try_number=3)
    m = ShardManifest.load(tmp_path / "out" / "shard-00000")
    assert len(m.chunks) == 1 and not m.complete and once.exists()
    # the failure, for the shard view: the error's first line and the try that failed
    failure = json.loads((tmp_path / "out" / "shard-00000" / FAILURE_NAME).read_text())
    assert failure["error"].startswith("InjectedFault: injected fault") and failure["try_number"] == 3
    resumed = tiny_run(tiny_model, spec, tmp_path / "out", try_number=4)  # once_file exists: no fault
    assert resumed["resumed_from_chunk"] == 1 and resumed["complete"]
    assert not (tmp_path / "out" / "shard-00000" / FAILURE_NAME).exists()  # a new attempt removes the record
    assert chunk_bytes(tmp_path / "out" / "shard-00000") == chunk_bytes(tiny_done[0])


def test_writers_do_not_wait_for_earlier_chunks_to_commit(tiny_done, tiny_model, spec, tmp_path, monkeypatch):
    """Chunk 0's write stalls until chunk 2's file exists: the other writer must write chunks 1 and 2 meanwhile
    (a writer that held itself until its chunk's turn to commit would sit on chunk 1 and chunk 2 would never
    start). The manifest still lists the chunks in order and the files equal an ordinary run's."""
    import eagle3.extract.pipeline as ex

    out = tmp_path / "out" / "shard-00000"
    real_write, seen = ex.write_chunk, {}

    def write_chunk(shard_dir, index, tensors, metadata=None):
        if index == 0:
            deadline = time.monotonic() + 20
            while not (out / "chunk-000002.safetensors").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            seen["chunk 2 written while chunk 0 was in flight"] = (out / "chunk-000002.safetensors").exists()
            assert not (out / "manifest.json").exists() or not ShardManifest.load(out).chunks  # nothing committed
        return real_write(shard_dir, index, tensors, metadata=metadata)

    monkeypatch.setattr(ex, "write_chunk", write_chunk)
    summary = tiny_run(tiny_model, spec, tmp_path / "out", writer_threads=2)
    assert seen == {"chunk 2 written while chunk 0 was in flight": True}
    m = ShardManifest.load(out)
    assert summary["complete"] and [c.file for c in m.chunks] == [f"chunk-{i:06d}.safetensors" for i in range(len(m.chunks))]
    assert chunk_bytes(out) == chunk_bytes(tiny_done[0])


def test_summary_says_when_the_writers_bound_the_run(spec, tiny_model, tmp_path, monkeypatch):
    """A writer that takes 1.5 s a chunk (a slow disk) holds the compute thread back: the summary shows it waiting
    for host buffers and the writer busy most of the wall time; with the real writer (a forward of 0.2 s a chunk)
    it waits far less."""
    import eagle3.extract.pipeline as ex
    from eagle3.extract.backend import HFBackend

    real_capture = HFBackend.capture  # a forward of 0.2 s: the tiny model's own is too quick to bind anything
    monkeypatch.setattr(HFBackend, "capture", lambda self, ids: time.sleep(0.2) or real_capture(self, ids))
    fast = tiny_run(tiny_model, spec, tmp_path / "fast", writer_threads=1)
    real_write = ex.write_chunk

    def slow_write(*a, **kw):
        time.sleep(1.5)
        return real_write(*a, **kw)

    monkeypatch.setattr(ex, "write_chunk", slow_write)
    slow = tiny_run(tiny_model, spec, tmp_path / "slow", writer_threads=1)
    assert slow["chunks"] == fast["chunks"] >= 3
    # one writer, two host buffers on the CPU: after the first two chunks each one waits for a write
    assert slow["compute_waited_for_writers_s"] > 0.5 * (slow["chunks"] - 2)
    assert slow["writer_busy_fraction"] > 0.5 and slow["writer_busy_fraction"] > 2 * fast["writer_busy_fraction"]
    assert fast["compute_waited_for_writers_s"] < slow["compute_waited_for_writers_s"] / 2


KILL_CHILD = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    real_fsync = os.fsync

    def fsync(fd):
        # block forever inside the write of chunk 1 (after its bytes, before its rename) and tell the parent
        name = os.readlink(f"/proc/self/fd/{{fd}}")
        if ".chunk-000001.safetensors.tmp-" in name:
            open({marker!r}, "w").write(name)
            time.sleep(600)
        return real_fsync(fd)

    os.fsync = fsync
    from eagle3.extract.config import ExtractConfig
    from eagle3.extract.run import extract_shard
    from eagle3.knobs import build
    import json
    cfg = build(ExtractConfig, json.loads({cfg!r}), "extract")
    extract_shard(cfg, json.loads({spec!r}))
""")


@pytest.mark.slow
def test_sigkill_during_chunk_write_then_rerun_gives_identical_files(batched, spec, smollm2_path, tmp_path):
    out, marker = tmp_path / "out", tmp_path / "in-write"
    cfg = config(smollm2_path, out)
    code = KILL_CHILD.format(root=str(ROOT), marker=str(marker), cfg=json.dumps(dataclasses.asdict(cfg)),
                             spec=json.dumps(spec.to_dict()))
    child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.time() + 180
        while not marker.exists():
            assert child.poll() is None, "child ended before writing chunk 1"
            assert time.time() < deadline, "child never reached the write of chunk 1"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    shard = out / "shard-00000"
    assert Path(marker.read_text()).exists()  # the half-written temp file of chunk 1 is on disk
    m = ShardManifest.load(shard)
    assert [c.file for c in m.chunks] == ["chunk-000000.safetensors"] and not m.complete
    # garbage under the next chunk's final name (as a kill between rename and commit leaves): overwritten
    (shard / "chunk-000001.safetensors").write_bytes(b"garbage from a killed run")
    summary = extract_shard(cfg, spec)
    assert summary["resumed_from_chunk"] == 1 and summary["complete"]
    assert not [p for p in shard.iterdir() if ".tmp-" in p.name]
    assert chunk_bytes(shard) == chunk_bytes(batched[0])
    assert [c.sha256 for c in ShardManifest.load(shard).chunks] == [c.sha256 for c in ShardManifest.load(batched[0]).chunks]


def test_finished_shard_rerun_is_a_noop_and_only_state_params_are_refused(batched, spec, smollm2_path):
    """A finished shard re-run loads no model; a plan or runtime param that differs does not block it (the stored
    states are the same); a state param that differs is refused, naming it with both values, nothing overwritten."""
    shard_dir, first = batched
    before = {p.name: p.stat().st_mtime_ns for p in shard_dir.iterdir()}
    for kw in ({}, {"token_budget": BATCHED, "chunk_mb": 5, "pad_multiple": 8, "writer_threads": 1, "log_every_s": 1}):
        t = time.perf_counter()
        out = extract_shard(config(smollm2_path, shard_dir.parent, **kw), spec)
        assert time.perf_counter() - t < 5  # no model load, no forward
        json.dumps(out)
        assert out["skipped"] and out["chunks"] == first["chunks"] and out["tokens"] == first["tokens"]
    assert {p.name: p.stat().st_mtime_ns for p in shard_dir.iterdir()} == before
    with pytest.raises(ConfigError, match=r"chunks are committed with storage_dtype='float32', this run has "
                                          r"storage_dtype='float8_e4m3fn'.*delete .*shard-00000"):
        extract_shard(config(smollm2_path, shard_dir.parent, storage_dtype="float8_e4m3fn"), spec)
    # nothing overwritten; the refusal is recorded for the shard view (removed by the next attempt)
    error = json.loads((shard_dir / FAILURE_NAME).read_text())["error"]
    assert error.startswith("ConfigError: ") and "committed with storage_dtype='float32'" in error
    (shard_dir / FAILURE_NAME).unlink()
    assert {p.name: p.stat().st_mtime_ns for p in shard_dir.iterdir()} == before


def test_corrupt_chunk_is_detected_and_reextracted(batched, spec, smollm2_path, tmp_path):
    src = batched[0]
    shard = tmp_path / "x" / "shard-00000"
    shutil.copytree(src, shard)
    last = ShardManifest.load(shard).chunks[-1].file
    data = bytearray((shard / last).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (shard / last).write_bytes(bytes(data))
    with pytest.raises(CorruptChunkError, match=f"{last}: checksum mismatch"):
        list(HiddenStateReader([shard], verify=True))
    # resume with verification: the corrupt chunk (and only what follows it) is extracted again
    out = extract_shard(config(smollm2_path, tmp_path / "x", verify_existing=True), spec)
    assert out["complete"]
    assert chunk_bytes(shard) == chunk_bytes(src)
    # truncated: caught without verify too
    (shard / last).write_bytes(data[:100])
    with pytest.raises(CorruptChunkError, match=last):
        list(HiddenStateReader([shard]))


def test_wrong_layer_and_dtype_give_clear_errors(spec, smollm2_path, tmp_path):
    # preflight checks the run's layers against config.json (TargetConfig.resolved); a caller that gives the
    # extractor others directly is stopped where the model's layers are known
    with pytest.raises(ConfigError, match=r"capture layers \[30\] do not exist: the model has 30 decoder layers.* 1\.\.29"):
        extract_shard(config(smollm2_path, tmp_path, capture_layers=[2, 30]), spec)
    with pytest.raises(ConfigError, match=r"target param capture_layers must be >= 1, got \[-1\]"):
        extract_shard(config(smollm2_path, tmp_path, capture_layers=[-1]), spec)
    with pytest.raises(ConfigError, match="dtype='float16' is not supported on cpu"):
        extract_shard(config(smollm2_path, tmp_path / "f16", dtype="float16"), spec)


def test_out_of_memory_then_a_smaller_token_budget_succeeds(tiny_done, tiny_model, spec, tmp_path, monkeypatch):
    """Doing what the out-of-memory error says works: the failed attempt committed nothing, so the retry with a
    smaller token_budget in the same folder is not refused, and its chunks are the ordinary run's."""
    # a budget whose batch (all 4 samples, 600 padded tokens) cannot fit the free memory: caught before any work
    free_for(monkeypatch, 300)
    with pytest.raises(ExtractOOMError, match=r"token_budget=100000000 needs about .* GB for its largest batch .* "
                                               r"but only .* GB is free on cpu .*: set a smaller token_budget .* "
                                               r"e\.g\. token_budget=\d+"):
        tiny_run(tiny_model, spec, tmp_path, token_budget=100_000_000)
    assert not list((tmp_path / "shard-00000").glob("chunk-*"))
    out = tiny_run(tiny_model, spec, tmp_path)
    assert out["complete"] and not out["skipped"] and out["tokens"] == spec.tokens
    assert chunk_bytes(tmp_path / "shard-00000") == chunk_bytes(tiny_done[0])


def test_resume_with_another_token_budget_extracts_every_sample_once(tiny_done, tiny_model, spec, tmp_path,
                                                                    monkeypatch):
    """Killed after one chunk, resumed with another token_budget: the committed chunk is kept, the rest is
    planned with the new budget (recorded in the manifest), every sample lands exactly once and its states equal
    an uninterrupted run's. A state param that differs is refused on the partial shard too, naming it."""
    monkeypatch.setenv(FAULT_ENV, f"shard=0,after_chunks=1,once_file={tmp_path / 'failed-once'}")
    with pytest.raises(InjectedFault):
        tiny_run(tiny_model, spec, tmp_path / "out")
    shard = tmp_path / "out" / "shard-00000"
    committed = ShardManifest.load(shard).chunks
    assert len(committed) == 1
    with pytest.raises(ConfigError, match=r"1 chunks are committed with capture_layers=\[1, 2, 3\], this "
                                          r"run has capture_layers=\[2, 3\]"):
        tiny_run(tiny_model, spec, tmp_path / "out", capture_layers=[2, 3])
    out = tiny_run(tiny_model, spec, tmp_path / "out", token_budget=BATCHED)
    assert out["complete"] and out["resumed_from_chunk"] == 1 and out["tokens"] == spec.tokens
    m = ShardManifest.load(shard)
    # chunk 0: the longest sample alone (budget 256); then 140 + 133 in one batch (budget 300), 129 alone
    assert m.chunks[0] == committed[0] and [c.samples for c in m.chunks] == [1, 2, 1]
    assert [(s["from_chunk"], s["token_budget"]) for s in m.params["plans"]] == [(0, BUDGET), (1, BATCHED)]
    rows = [s.row for s in HiddenStateReader([shard], verify=True)]
    assert sorted(rows) == list(range(len(LENGTHS)))  # every sample exactly once
    ref = {s.row: s for s in HiddenStateReader([tiny_done[0]])}
    for s in HiddenStateReader([shard]):
        torch.testing.assert_close(s.aux_hidden, ref[s.row].aux_hidden, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(s.final_hidden, ref[s.row].final_hidden, rtol=1e-4, atol=1e-4)
    # a re-run with the first budget again: complete, same states, nothing to do
    assert tiny_run(tiny_model, spec, tmp_path / "out")["skipped"]


def test_progress_lines_come_every_log_every_s_and_at_every_commit(spec, tiny_model, tmp_path, monkeypatch, caplog):
    """One chunk of four batches, each forward slowed to 0.3 s, log_every_s=0.5: rate/ETA lines come while the
    chunk is computed, not only when it is committed; then one line per commit. The default is every 10 s."""
    from eagle3.extract.backend import HFBackend

    assert phase(ExtractConfig, model_path="m", extract_dir="x").log_every_s == 10
    real_capture = HFBackend.capture
    monkeypatch.setattr(HFBackend, "capture", lambda self, ids: time.sleep(0.3) or real_capture(self, ids))
    caplog.set_level(logging.INFO, logger="eagle3.extract")
    out = tiny_run(tiny_model, spec, tmp_path, chunk_mb=100, log_every_s=0.5)
    assert out["chunks"] == 1
    lines = [r.getMessage() for r in caplog.records if "ETA" in r.getMessage()]
    before_commit = lines[:next(i for i, line in enumerate(lines) if "chunk 0 committed" in line)]
    assert len(before_commit) >= 2, lines


def test_padding_batches_to_a_length_multiple_keeps_the_states(batched, spec, smollm2_path, reference, tmp_path,
                                                               monkeypatch):
    """pad_multiple=8: every forward runs at a length that is a multiple of 8 (a bounded set of shapes), the
    extra right padding changes no real token's states, and the shard records the param (a shard extracted
    without it is not resumed with it)."""
    from eagle3.extract.backend import HFBackend

    shapes, real_capture = [], HFBackend.capture

    def capture(self, input_ids):
        shapes.append(tuple(input_ids.shape))
        return real_capture(self, input_ids)

    monkeypatch.setattr(HFBackend, "capture", capture)
    out = extract_shard(config(smollm2_path, tmp_path / "padded", pad_multiple=8), spec)
    assert out["complete"] and out["tokens"] == spec.tokens
    data = load_shard_data(spec)
    planned = [b for c in plan_batches(data.lengths, data.rows, BUDGET, 9, pad_multiple=8) for b in c]
    assert shapes == [(len(b), padded_length(int(data.lengths[b].max()), 8)) for b in planned]
    assert all(L % 8 == 0 and B * L <= BUDGET for B, L in shapes)
    assert sum(B * L for B, L in shapes) > sum(B * int(data.lengths[b].max()) for b, (B, _) in zip(planned, shapes))
    for s in HiddenStateReader([Path(out["shard_dir"])], verify=True):
        aux, final = reference[s.row]
        torch.testing.assert_close(s.aux_hidden, aux, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(s.final_hidden, final, rtol=1e-4, atol=1e-4)
    # a plan param: the finished shard without padding is not extracted again with it
    assert extract_shard(config(smollm2_path, batched[0].parent, pad_multiple=8), spec)["skipped"]
    with pytest.raises(ConfigError, match="extract param pad_multiple .*must be >= 1, got 0"):
        extract_shard(config(smollm2_path, tmp_path / "zero", pad_multiple=0), spec)


def test_auto_padding_bounds_batch_lengths_and_their_padding(tmp_path):
    """pad_multiple="auto" (the GPU default): lengths 256..8192 meet 145 padded lengths instead of 7,937, each
    within 1/16 of the longest sample, multiples of 64 from 1,024 tokens on; the CPU resolves auto to 1 (its
    kernels build nothing per shape); a rendered template ("16") parses to an int; anything else names the param."""
    padded = {n: padded_length(n, "auto") for n in range(1, 8193)}
    assert all(n <= L and (L - n) * 16 < n for n, L in padded.items() if L != n)
    assert all(L == n for n, L in padded.items() if n < 32)  # too short to pad by under 1/16
    assert all(L % AUTO_PAD_MULTIPLE == 0 for n, L in padded.items() if n >= 16 * AUTO_PAD_MULTIPLE)
    assert len({padded[n] for n in range(256, 8193)}) == 145
    assert [padded_length(n, 64) for n in (1, 64, 65, 300)] == [64, 64, 128, 320]  # an int is an exact multiple
    rng = np.random.default_rng(0)
    lengths = rng.integers(256, 8193, 2000)
    batches = [b for c in plan_batches(lengths, np.arange(2000), 32768, 1 << 40, "auto") for b in c]
    assert sorted(int(i) for b in batches for i in b) == list(range(2000))
    assert all(len(b) * padded_length(int(lengths[b].max()), "auto") <= 32768 for b in batches)
    assert len({(len(b), padded_length(int(lengths[b].max()), "auto")) for b in batches}) <= 2 * 145

    base = dict(model_path="m", extract_dir=str(tmp_path))
    assert resolve_for_device(phase(ExtractConfig, **base, device="cpu")).pad_multiple == 1
    assert resolve_for_device(phase(ExtractConfig, **base, device="cuda")).pad_multiple == "auto"
    assert phase(ExtractConfig, **base, device="cpu", pad_multiple=16).pad_multiple == 16
    # the form's text "16" is read as 16 where the form is read (eagle3.config), not by the config
    from eagle3.config import RunConfig

    assert RunConfig.from_params({"extract_pad_multiple": "16"}, "r").extract.pad_multiple == 16
    for bad in ("sixty", "-4", "16", 0, True):
        with pytest.raises(ConfigError, match=rf"extract param pad_multiple \(trigger-form param "
                                              rf"extract_pad_multiple\) must .*got {bad!r}"):
            phase(ExtractConfig, **base, device="cpu", pad_multiple=bad)
    # token_budget and chunk_mb: auto = big batches and chunk files on a GPU, small ones on the CPU (AUTO_PLAN)
    cpu, gpu = (resolve_for_device(phase(ExtractConfig, **base, device=d)) for d in ("cpu", "cuda"))
    assert (cpu.token_budget, cpu.chunk_mb, gpu.token_budget, gpu.chunk_mb) == (256, 1, 16384, 1024)
    given = resolve_for_device(phase(ExtractConfig, **base, device="cpu", token_budget=4096, chunk_mb=0.5))
    assert (given.token_budget, given.chunk_mb) == (4096, 0.5)
    form = RunConfig.from_params({"token_budget": "512", "chunk_mb": "0.5"}, "r").extract  # the form's text
    assert (form.token_budget, form.chunk_mb) == (512, 0.5)
    for name, bad, why in (("token_budget", "big", "must match"), ("chunk_mb", "2", "must be a number or 'auto'"),
                           ("chunk_mb", 0, "must be > 0")):
        with pytest.raises(ConfigError, match=rf"extract param {name} .*{why}"):
            phase(ExtractConfig, **base, **{name: bad})


def test_fp8_storage_halves_bytes_and_stays_close(batched, spec, smollm2_path, reference, tmp_path):
    out = extract_shard(config(smollm2_path, tmp_path, storage_dtype="float8_e4m3fn"), spec)
    assert out["bytes"] < 0.3 * batched[1]["bytes"]  # 1 byte instead of 4 (fp32) per value, + scales
    for s in HiddenStateReader([Path(out["shard_dir"])], verify=True):
        aux, final = reference[s.row]
        assert s.aux_hidden.dtype == torch.bfloat16
        for got, ref in ((s.aux_hidden.float(), aux), (s.final_hidden.float(), final)):
            rel = (got - ref).norm() / ref.norm()
            assert rel < 0.05, rel  # e4m3 has a 3-bit mantissa: ~2-3% relative error


@pytest.mark.slow
def test_compiled_backend_equals_eager_and_compiles_once_for_all_layers(dataset, spec, smollm2_path, reference,
                                                                        tmp_path):
    """compile=True (regional torch.compile of every decoder layer, dynamic batch and length) gives the eager
    states, keeps the capture hooks working, and builds one graph for the 30 layers, not one per layer or shape."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    out = extract_shard(config(smollm2_path, tmp_path, compile=True), spec)
    assert out["complete"] and out["tokens"] == spec.tokens
    got = {s.row: s for s in HiddenStateReader([Path(out["shard_dir"])], verify=True)}
    for row, (aux, final) in enumerate(reference):  # compiled kernels sum in another order: see the fused test
        torch.testing.assert_close(got[row].aux_hidden, aux, rtol=1e-4, atol=5e-4)
        torch.testing.assert_close(got[row].final_hidden, final, rtol=1e-4, atol=5e-4)
    # graphs: the layer (traced for the first shape, then once more with dynamic sizes at most) + the norm
    assert 2 <= counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])


def test_compiled_graph_runs_the_pinned_kernel_after_another_kernel_filled_the_cache(smollm2_path, tmp_path,
                                                                                       monkeypatch):
    """torch's compile caches key a graph without the SDPA kernel it was traced under (pytorch#185449; on the H200
    a cudnn run was handed a FlashAttention graph). A compiled run with attention="math" after one with "flash",
    same model, same cache folder, must run the math path, and the flash run its flash kernel."""
    from torch.profiler import ProfilerActivity, profile

    from eagle3.extract.backend import HFBackend

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32)
    ids = torch.randint(3, 1000, (2, 24))
    ran = {}
    for attention in ("flash", "math"):
        torch._dynamo.reset()
        backend = HFBackend(model=model, compile=True, attention=attention)
        backend.load(str(smollm2_path), "float32", "cpu", [2, 15])
        backend.capture(ids)  # compiles
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            backend.capture(ids)
        ran[attention] = {e.key for e in prof.key_averages()}
        backend.close()
    flash_op = "aten::_scaled_dot_product_flash_attention_for_cpu"
    assert flash_op in ran["flash"]
    assert flash_op not in ran["math"], sorted(k for k in ran["math"] if k.startswith("aten::"))


def test_compile_param_resolves_per_device_and_rejects_junk(tmp_path):
    base = dict(model_path="m", extract_dir=str(tmp_path))
    assert resolve_for_device(phase(ExtractConfig, **base, device="cpu")).compile is False
    assert resolve_for_device(phase(ExtractConfig, **base, device="cuda")).compile is True
    assert resolve_for_device(phase(ExtractConfig, **base, device="cuda", compile=False)).compile is False
    for junk in ("maybe", "False"):  # a native config has no text booleans
        with pytest.raises(ConfigError, match=f"extract param compile must be true, false or 'auto', got '{junk}'"):
            phase(ExtractConfig, **base, device="cpu", compile=junk)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_fused_llama_backend_equals_output_hidden_states(dataset, spec, smollm2_path, reference, tmp_path, compile):
    """backend='fused-llama' (one GEMM for q/k/v, one for gate/up) captures what a plain HF forward returns,
    batched with padding, eager and compiled. (Compiled kernels sum in another order: over 130-150 tokens one fp32
    value in 3e5 differed by 1.4e-4.)"""
    out = extract_shard(config(smollm2_path, tmp_path, backend="fused-llama", compile=compile, token_budget=BATCHED),
                        spec)
    assert out["complete"] and out["tokens"] == spec.tokens
    got = {s.row: s for s in HiddenStateReader([Path(out["shard_dir"])], verify=True)}
    atol = 5e-4 if compile else 1e-4
    for row, (aux, final) in enumerate(reference):
        torch.testing.assert_close(got[row].aux_hidden, aux, rtol=1e-4, atol=atol)
        torch.testing.assert_close(got[row].final_hidden, final, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("attention", ["math", "flash"])
def test_pinned_attention_kernel_runs_and_gives_the_same_states(dataset, spec, smollm2_path, reference, tmp_path,
                                                                  attention):
    """attention='<kernel>' pins SDPA to that kernel for the whole forward (seen from inside a decoder layer),
    and the states still equal a plain forward's."""
    from eagle3.extract.backend import HFBackend

    backend = HFBackend(attention=attention)
    seen = []
    orig_load = backend.load

    def load(*a):
        orig_load(*a)
        backend.base.layers[3].register_forward_hook(
            lambda *_: seen.append((torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled())))

    backend.load = load
    out = extract_shard(config(smollm2_path, tmp_path, attention=attention), spec, backend=backend)
    assert out["complete"] and seen and set(seen) == {(attention == "math", attention == "flash")}
    assert torch.backends.cuda.math_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()  # restored after
    got = {s.row: s for s in HiddenStateReader([Path(out["shard_dir"])], verify=True)}
    # The math kernel sums attention in another order than the reference's default kernel: one fp32 value in
    # 3e5 was seen 1.06e-4 away (CI, 2026-12-04), so atol is 2e-4 here.
    for row, (aux, final) in enumerate(reference):
        torch.testing.assert_close(got[row].aux_hidden, aux, rtol=1e-4, atol=2e-4)
        torch.testing.assert_close(got[row].final_hidden, final, rtol=1e-4, atol=2e-4)


def test_attention_param_rejects_unknown_and_cuda_only_kernels_on_cpu(tmp_path):
    base = dict(model_path="m", extract_dir=str(tmp_path), device="cpu")
    with pytest.raises(ConfigError, match=r"attention \(trigger-form param extract_attention\)='flash3': use one of "
                                          r"\['auto', 'flash', 'cudnn'"):
        phase(ExtractConfig, **base, attention="flash3")
    with pytest.raises(ConfigError, match="attention='cudnn' needs a CUDA device, the run is on cpu"):
        resolve_for_device(phase(ExtractConfig, **base, attention="cudnn"))
    assert resolve_for_device(phase(ExtractConfig, **{**base, "device": "cuda"}, attention="cudnn")).attention == "cudnn"
    # a pinned kernel that cannot run the call (flash on the CPU, 4 query heads over 2 KV heads without
    # enable_gqa) names the param instead of torch's bare "No available kernel"
    from eagle3.extract.backend import pinned_attention

    q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ConfigError, match=r"attention='flash': torch has no flash SDPA kernel .* on cpu .*"
                                          r"use attention='auto'"):
        with pinned_attention("flash", "cpu"):
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True)


def test_fused_llama_backend_refuses_other_architectures_by_name(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from eagle3.extract.fused_llama import FusedLlamaBackend

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, attention_bias=True, hidden_act="gelu")
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ConfigError, match="backend 'fused-llama' cannot run model_type 'llama': attention "
                                          "projections have biases; hidden_act is 'gelu', not 'silu'"):
        FusedLlamaBackend(model=model).load("", "float32", "cpu", [1])
    with pytest.raises(ConfigError, match=r"backend \(trigger-form param extract_backend\)='tensorrt': use one of "
                                          r"\['hf', 'fused-llama'\]"):
        phase(ExtractConfig, model_path="m", extract_dir=str(tmp_path), backend="tensorrt")


def test_host_buffer_pool_makes_buffers_only_when_all_are_in_use():
    import threading

    from eagle3.extract.pipeline import HostBufferPool

    made = []
    pool = HostBufferPool(3, lambda: time.sleep(0.02) or made.append(object()) or made[-1])
    a = pool.get(timeout=0.01)
    pool.put(a)
    assert pool.get(timeout=0.01) is a and len(made) == 1  # a free buffer is reused, none made
    b, c = pool.get(timeout=0.01), pool.get(timeout=0.01)
    assert len({id(a), id(b), id(c)}) == 3 and pool.made == 3
    assert pool.get(timeout=0.05) is None and len(made) == 3  # at the limit: waits, makes no fourth
    threading.Timer(0.05, pool.put, args=(b,)).start()  # a writer hands one back
    assert pool.get(timeout=5) is b
    # the time accounts the summary reports: making (pinning) buffers, and waiting for writers to free one
    assert 0.06 <= pool.made_s < 1 and 0.1 <= pool.waited_s < 1


def test_torch_free_choices_equal_what_the_torch_side_accepts():
    """The trigger form offers the config's choices; each must be one the torch side runs, and none missing. The
    config, the batch plan and the shard plan import no torch (the DAG and the run config import them)."""
    from eagle3.extract import config as c
    from eagle3.extract.backend import DTYPES, SDPA_KERNELS
    from eagle3.extract.extractor import BACKENDS, STORAGE_DTYPES

    assert c.ATTENTION_CHOICES == tuple(SDPA_KERNELS)
    assert c.BACKEND_CHOICES == tuple(BACKENDS)
    assert c.DTYPE_CHOICES == ("auto", *DTYPES)
    assert c.STORAGE_DTYPE_CHOICES == ("auto", *STORAGE_DTYPES)
    code = ("import sys; import eagle3.extract.config, eagle3.extract.batches, eagle3.extract.plan, "
            "eagle3.merge.dataset; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def tiny_per_token_bytes() -> int:
    from eagle3.extract.extractor import estimate_batch_bytes

    return estimate_batch_bytes(1, TINY_SHAPE["hidden_size"], TINY_SHAPE["intermediate_size"], 3, 4, 4)


def free_for(monkeypatch, tokens: int) -> None:
    """The device's free memory set so that 0.9 x free holds `tokens` padded tokens of the tiny model."""
    monkeypatch.setattr("eagle3.extract.extractor.free_device_memory",
                        lambda device: int(tiny_per_token_bytes() * tokens / 0.9) + 1)


def test_memory_check_sizes_the_largest_batch_not_the_budget(tiny_model, tmp_path, monkeypatch):
    """A sample longer than token_budget runs alone in a batch larger than the budget: memory for the budget
    but not for that sample is refused before any work, saying no budget helps and what does."""
    samples = [[1] + [5 + i % 7] * (n - 2) + [2] for i, n in enumerate([600, 100, 90, 80])]
    write_merged_dataset(tmp_path / "merge", samples)
    long_spec = plan_shards(ShardPlanConfig(str(tmp_path / "merge"), 1))[0]
    free_for(monkeypatch, 400)  # room for the budget (256) but not for the 600-token sample
    with pytest.raises(ExtractOOMError, match=r"largest batch \(600 padded tokens\).*the longest sample alone "
                                               r"\(600 tokens\) does not fit.*capture fewer layers.*extract_tp_size"
                                               r".*float8_e4m3fn.*max_seq_len"):
        tiny_run(tiny_model, long_spec, tmp_path / "out")
    assert not list((tmp_path / "out" / "shard-00000").glob("chunk-*"))
    free_for(monkeypatch, 700)
    assert tiny_run(tiny_model, long_spec, tmp_path / "out")["complete"]


def test_out_of_memory_advice_passes_its_own_check(tiny_model, spec, tmp_path, monkeypatch):
    """The budget the check advises is one the same check accepts; at the knob's floor it says what else helps."""
    import re

    free_for(monkeypatch, 400)  # the budget's batch holds all 4 samples: 600 padded tokens
    with pytest.raises(ExtractOOMError) as e:
        tiny_run(tiny_model, spec, tmp_path / "a", token_budget=4096)
    advised = int(re.search(r"e\.g\. token_budget=(\d+)", str(e.value)).group(1))
    assert max(LENGTHS) <= advised <= 400
    assert tiny_run(tiny_model, spec, tmp_path / "a", token_budget=advised)["complete"]
    free_for(monkeypatch, 200)  # every sample (<= 150 tokens) fits, the least budget (256) does not
    with pytest.raises(ExtractOOMError, match=r"token_budget cannot go below 256, so a smaller token_budget does "
                                               r"not help: capture fewer layers") as e:
        tiny_run(tiny_model, spec, tmp_path / "b", token_budget=300)
    assert "e.g. token_budget" not in str(e.value)


def test_out_of_memory_in_the_forward_advises_a_smaller_batch_or_says_what_else_helps():
    from eagle3.extract.extractor import oom_message

    assert "e.g. token_budget=512" in oom_message(1024, "cuda:0", longest=150)
    assert "e.g. token_budget=600" in oom_message(1024, "cuda:0", longest=600)
    floor = oom_message(256, "cuda:0", longest=150)
    assert "e.g." not in floor and "fp8" in floor and "extract_tp_size" in floor
    assert "e.g." not in oom_message(512, "cuda:0", longest=2048)
