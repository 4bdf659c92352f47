"""The shard extractor's write pipeline, resume after a fault and memory guard, on the CPU with a tiny random Llama
(chunks in milliseconds: what is tested is the writes, commits and plans, not the model's states)."""

import json
import logging
import time

import pytest
import torch

from eagle3.errors import ConfigError
from eagle3.extract.config import ExtractConfig, ShardPlanConfig
from eagle3.extract.format import ShardManifest
from eagle3.extract.memory import ExtractOOMError
from eagle3.extract.plan import plan_shards
from eagle3.extract.reader import HiddenStateReader
from eagle3.extract.status import FAILURE_NAME
from eagle3.faults import ENV_VAR as FAULT_ENV, InjectedFault
from tests.support.configs import phase
from tests.support.extract_fixtures import (  # noqa: F401  (pytest fixtures, imported by name)
    BATCHED, BUDGET, LENGTHS, TINY_SHAPE, chunk_bytes, dataset, spec, tiny_done, tiny_model, tiny_run)
from tests.support.synthetic import write_merged_dataset


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


def test_each_batch_goes_up_before_the_batch_before_it_is_copied_out(tiny_done, tiny_model, spec, tmp_path,
                                                                      monkeypatch):
    """On a GPU the next batch's ids are queued on the compute stream behind this batch's forward and ahead of its
    copy-out: queued after it, the compute stream idled a batch on an H100 (the upload likely waited for the copy).
    The order of the calls is what sets that; the chunks stay an ordinary run's."""
    import eagle3.extract.extractor as ex
    from eagle3.extract.backend import HFBackend

    calls = []
    real_inputs, real_store, real_capture = ex.batch_inputs, ex.store_states, HFBackend.capture

    def batch_inputs(data, rows, *a):
        calls.append(("up", int(rows[0])))
        return real_inputs(data, rows, *a)

    def store_states(dst, scale, x):
        if calls[-1][0] != "store":
            calls.append(("store",))
        return real_store(dst, scale, x)

    def capture(self, ids):
        calls.append(("forward",))
        return real_capture(self, ids)

    monkeypatch.setattr(ex, "batch_inputs", batch_inputs)
    monkeypatch.setattr(ex, "store_states", store_states)
    monkeypatch.setattr(HFBackend, "capture", capture)
    summary = tiny_run(tiny_model, spec, tmp_path / "out")
    kinds = [c[0] for c in calls]
    n = kinds.count("forward")
    assert n > 2 and kinds.count("up") == n and kinds.count("store") == n
    # up 0, then for each batch: its forward, the next batch's upload (none after the last), its copy-out
    assert kinds == ["up"] + ["forward", "up", "store"] * (n - 1) + ["forward", "store"]
    assert summary["complete"] and chunk_bytes(tmp_path / "out" / "shard-00000") == chunk_bytes(tiny_done[0])


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
    # the time accounts the summary reports: making (pinning) buffers, and waiting for writers to free one
    assert 0.06 <= pool.made_s < 1 and 0.05 <= pool.waited_s < 1
    timed_out_wait = pool.waited_s
    threading.Timer(0.1, pool.put, args=(b,)).start()  # a writer hands one back
    t = time.perf_counter()
    assert pool.get(timeout=5) is b
    # the wait for the writer is counted too: at most the call's length, and most of the timer's 0.1 s (the test
    # thread may be descheduled between starting the timer and blocking, so not all of it)
    assert 0.02 <= pool.waited_s - timed_out_wait <= time.perf_counter() - t


def test_host_buffer_pool_makes_buffers_ahead_on_a_thread_and_wait_raises_its_error():
    """make_ahead makes its buffers on a thread (within the limit); after `wait` `get` hands them out without
    making any, then makes on demand up to the limit; an error of the thread is raised by `wait`."""
    import threading

    from eagle3.extract.pipeline import HostBufferPool

    threads = []
    pool = HostBufferPool(3, lambda: time.sleep(0.05) or threads.append(threading.current_thread().name) or object())
    pool.make_ahead(5)
    assert pool.made == 3  # counted at once: capped at the limit
    pool.wait()
    assert threads == ["host-buffers"] * 3 and 0.15 <= pool.made_ahead_s < 2
    got = [pool.get(timeout=0.01) for _ in range(3)]
    assert len(set(map(id, got))) == 3 and pool.get(timeout=0.01) is None and pool.made_s == 0
    pool = HostBufferPool(4, lambda: object())
    pool.make_ahead(1)
    pool.wait()
    assert pool.made == 1 and pool.get(timeout=0.01) is not None and pool.get(timeout=0.01) is not None
    assert pool.made == 2  # the second made on demand

    def fail():
        raise RuntimeError("cudaHostAlloc failed")

    pool = HostBufferPool(2, fail)
    pool.make_ahead(2)
    with pytest.raises(RuntimeError, match="cudaHostAlloc failed"):
        pool.wait()


def test_state_buffers_are_views_of_one_block():
    """aux, final (and fp8 scales) share one allocation without overlapping: one pinned request, no rounding of
    each tensor to a power of two."""
    from eagle3.extract.pipeline import StateBuffers

    for dtype, n in ((torch.bfloat16, 2), (torch.float8_e4m3fn, 4)):
        b = StateBuffers(37, 3, 64, dtype, "cpu")
        ts = b.tensors()
        assert len(ts) == n and [t.shape for t in ts][:2] == [(37, 192), (37, 64)]
        assert all(t.untyped_storage().data_ptr() == b.block.untyped_storage().data_ptr() for t in ts)
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in ts)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no overlap
        assert spans[-1][1] <= b.block.data_ptr() + b.block.numel()
        for i, t in enumerate(ts):
            t.fill_(i + 1)
        assert [float(t.float().mean()) for t in ts] == [float(i + 1) for i in range(n)]


def test_extractor_makes_host_buffers_while_the_model_loads(tiny_done, tiny_model, spec, tmp_path, monkeypatch):
    """The host buffers are made on their own thread while the backend loads, all before the first forward; the
    chunks are the same bytes."""
    import threading

    import eagle3.extract.extractor as ex
    from eagle3.extract.backend import HFBackend

    events = []
    real_load, real_capture, real_buffers = HFBackend.load, HFBackend.capture, ex.StateBuffers

    def slow_load(self, *a, **kw):
        events.append(("load", time.perf_counter()))
        time.sleep(0.3)
        events.append(("loaded", time.perf_counter()))
        return real_load(self, *a, **kw)

    def buffers(*a, **kw):
        if threading.current_thread().name == "host-buffers":
            events.append(("host buffer", time.perf_counter()))
        return real_buffers(*a, **kw)

    def capture(self, ids):
        events.append(("forward", time.perf_counter()))
        return real_capture(self, ids)

    monkeypatch.setattr(HFBackend, "load", slow_load)
    monkeypatch.setattr(HFBackend, "capture", capture)
    monkeypatch.setattr(ex, "StateBuffers", buffers)
    summary = tiny_run(tiny_model, spec, tmp_path / "out")
    kinds = [k for k, _ in events]
    first_forward = kinds.index("forward")
    assert kinds.count("host buffer") == 2 and kinds.index("host buffer") < first_forward  # the CPU's two
    made = [t for k, t in events if k == "host buffer"]
    (loading,), (loaded,) = ([t for k, t in events if k == name] for name in ("load", "loaded"))
    assert loading < loaded and made[0] < loaded  # beside the load, not after it
    assert summary["host_buffers_made_ahead_s"] >= 0 and summary["host_buffer_alloc_s"] == 0
    assert chunk_bytes(tmp_path / "out" / "shard-00000") == chunk_bytes(tiny_done[0])


def test_host_buffers_are_freed_when_the_run_returns(tiny_model, spec, tmp_path, monkeypatch):
    """Nothing keeps a finished run's host buffers (no reference cycle through the pool), so they go back to the
    pinned allocator at once, where the process's next shard finds them, not at the next garbage collection."""
    import gc
    import threading
    import weakref

    import eagle3.extract.extractor as ex

    made, real_buffers = [], ex.StateBuffers

    def buffers(*a, **kw):
        b = real_buffers(*a, **kw)
        if threading.current_thread().name == "host-buffers":
            made.append(weakref.ref(b.block))
        return b

    monkeypatch.setattr(ex, "StateBuffers", buffers)
    gc.collect()
    gc.disable()
    try:
        tiny_run(tiny_model, spec, tmp_path / "out")
        assert len(made) == 2 and [r() for r in made] == [None, None]
    finally:
        gc.enable()


def tiny_per_token_bytes() -> int:
    from eagle3.extract.memory import estimate_batch_bytes

    return estimate_batch_bytes(1, TINY_SHAPE["hidden_size"], TINY_SHAPE["intermediate_size"], 3, 4, 4)


def free_for(monkeypatch, tokens: int) -> None:
    """The device's free memory set so that 0.9 x free holds `tokens` padded tokens of the tiny model."""
    monkeypatch.setattr("eagle3.extract.memory.free_device_memory",
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


def test_free_gpu_memory_counts_what_torch_holds_unused(monkeypatch):
    """A second shard in one process (the bench, a worker's retry) finds the first one's batches cached by torch's
    allocator: the driver calls them taken, the next batch reuses them."""
    from eagle3.extract.memory import free_device_memory

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 60 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 31 * gib)
    assert free_device_memory(torch.device("cuda", 0)) == 30 * gib


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
    from eagle3.extract.memory import oom_message

    assert "e.g. token_budget=512" in oom_message(1024, "cuda:0", longest=150)
    assert "e.g. token_budget=600" in oom_message(1024, "cuda:0", longest=600)
    floor = oom_message(256, "cuda:0", longest=150)
    assert "e.g." not in floor and "fp8" in floor and "extract_tp_size" in floor
    assert "e.g." not in oom_message(512, "cuda:0", longest=2048)
