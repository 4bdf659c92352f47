"""The write side of a shard's extraction: host chunk buffers, writer threads and the committer.

The compute thread fills a host chunk buffer (HostBufferPool) and submits it; a writer thread streams it to a
temp file (hashing as it writes), fsyncs and renames it, gives the buffer back and hands the chunk to the
committer thread, which appends written chunks to the shard manifest strictly in chunk order. A writer never
waits for the chunks before its own: on a disk-bound run every writer keeps a write in flight. The pool is
bounded, so a slow disk holds the GPU back instead of filling memory. The first error of any thread is kept;
the others stop at their next check and nothing after it is committed (a re-run overwrites uncommitted files).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from eagle3.extract.format import ChunkRecord, ShardManifest, write_chunk
from eagle3.extract.plan import ShardData
from eagle3.faults import InjectedFault, maybe_inject_fault

log = logging.getLogger(__name__)

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


class StateBuffers:
    """aux/final states of up to `rows` tokens (+ fp8 scales): device staging or a host chunk buffer.

    The tensors are views of one allocation: the pinned host allocator rounds every request up to a power of
    two and page-locks all of it, so four requests pinned up to twice the bytes (1.5 GiB for a 1 GiB chunk at
    the Qwen3-30B-A3B shape), and one block of a fixed size is found again by a later pool of the same size."""

    ALIGN = 256  # each view starts on this many bytes

    def __init__(self, rows: int, n_capture: int, hidden: int, dtype: torch.dtype, device, pin: bool = False):
        fp8 = dtype == torch.float8_e4m3fn
        shapes = [((rows, n_capture * hidden), dtype), ((rows, hidden), dtype)]
        if fp8:
            shapes += [((rows, n_capture), torch.float32), ((rows,), torch.float32)]
        sizes = [-(-int(np.prod(s)) * d.itemsize // self.ALIGN) * self.ALIGN for s, d in shapes]
        self.block = torch.empty(sum(sizes), dtype=torch.uint8, device=device, pin_memory=pin)
        views, at = [], 0
        for (shape, d), size in zip(shapes, sizes):
            views.append(self.block[at:at + int(np.prod(shape)) * d.itemsize].view(d).view(shape))
            at += size
        self.aux, self.final = views[:2]
        self.aux_scale, self.final_scale = views[2:] if fp8 else (None, None)
        self.event = None  # staging: its last copy-out is done; host: the chunk's copies have landed

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.aux, self.final, self.aux_scale, self.final_scale) if t is not None]


def store_states(dst: torch.Tensor, scale: torch.Tensor | None, x: torch.Tensor) -> None:
    """dst[:] = x in the storage dtype; for fp8, one scale per token so amax maps to the fp8 max."""
    if scale is None:
        dst.copy_(x)
        return
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    dst.copy_((xf / s).clamp_(-FP8_MAX, FP8_MAX))
    scale.copy_(s.squeeze(-1))


class HostBufferPool:
    """Host chunk buffers (pinned on a GPU run), at most `limit`. Pinning page-locks every page of a GB-sized
    buffer (0.4-0.5 s a GB on the H200 machine) under a driver lock that stalls every thread's CUDA calls, so
    the extractor makes its buffers ahead, on a thread, while the model loads (`make_ahead`), and waits for
    them before the first forward (`wait`): pinning beside the forwards, in a background thread or by
    cudaHostRegister, measured no faster (docs/benchmarks.md run 10), and beside the autotuner's timings it
    would skew the configs it picks. Any buffer beyond those is made on demand, on the compute thread.
    `get` runs on the compute thread only, after `wait`; writers `put` buffers back."""

    def __init__(self, limit: int, make: Callable[[], StateBuffers]):
        self.limit, self.make, self.made = limit, make, 0
        self.free: queue.Queue = queue.Queue()
        self.waited_s = 0.0  # time `get` blocked for a writer to give a buffer back: the disk holding compute back
        self.made_s = 0.0  # time spent making (pinning) buffers on the compute thread
        self.made_ahead_s = 0.0  # time the `make_ahead` thread spent making its buffers
        self._ahead: threading.Thread | None = None
        self._ahead_error: BaseException | None = None

    def make_ahead(self, n: int) -> None:
        """Start making min(n, limit) buffers on a thread; `wait` joins it."""
        n = min(n, self.limit - self.made)
        self.made += n  # counted now: `get` never makes more than limit

        def fill() -> None:
            t = time.perf_counter()
            try:
                for _ in range(n):
                    self.free.put(self.make())
            except BaseException as e:  # raised by `wait`, on the compute thread
                self._ahead_error = e
            finally:
                self.made_ahead_s = time.perf_counter() - t

        self._ahead = threading.Thread(target=fill, name="host-buffers", daemon=True)
        self._ahead.start()

    def wait(self) -> None:
        """Join the `make_ahead` thread (if any) and raise its error."""
        if self._ahead is not None:
            self._ahead.join()
            self._ahead = None
        if self._ahead_error is not None:
            error, self._ahead_error = self._ahead_error, None
            raise error

    def put(self, buf) -> None:
        self.free.put(buf)

    def get(self, timeout: float):
        """A free buffer, a new one while fewer than `limit` exist, or None after waiting `timeout` seconds."""
        try:
            return self.free.get_nowait()
        except queue.Empty:
            pass
        if self.made < self.limit:
            self.made += 1
            t = time.perf_counter()
            try:
                return self.make()
            finally:
                self.made_s += time.perf_counter() - t
        t = time.perf_counter()
        try:
            return self.free.get(timeout=timeout)
        except queue.Empty:
            return None
        finally:
            self.waited_s += time.perf_counter() - t


@dataclass
class Progress:
    """One attempt at a shard: the shard's committed totals (all attempts) and this attempt's timing."""

    tokens: int  # committed tokens of the shard
    bytes: int  # committed bytes of the shard
    total_tokens: int  # the shard's planned tokens
    t0: float  # perf_counter when this attempt's pipeline started
    last_log: float
    run_tokens: int = 0  # committed by this attempt
    writer_busy_s: float = 0.0
    first_forward: float | None = None
    loop_end: float | None = None  # the last batch was enqueued
    first_commit: tuple[float, int] | None = None  # (time, run_tokens): the steady state starts here
    last_commit: tuple[float, int] | None = None

    def rate(self, now: float) -> float:
        return self.run_tokens / max(now - self.t0, 1e-9)

    def steady_tok_per_s(self) -> float:
        if self.first_commit is None or self.last_commit[0] <= self.first_commit[0]:
            return 0.0
        (t0, n0), (t1, n1) = self.first_commit, self.last_commit
        return (n1 - n0) / (t1 - t0)


class ChunkPipeline:
    """Writers and the committer of one attempt at a shard; a context manager that stops both on exit.

    `manifest` already holds the committed chunks; chunk `first_chunk` is the next to commit."""

    def __init__(self, shard_dir: Path, manifest: ShardManifest, chunk_meta: dict, data: ShardData,
                 pool: HostBufferPool, writer_threads: int, log_every_s: float, total_tokens: int):
        self.shard_dir, self.manifest, self.chunk_meta, self.data = shard_dir, manifest, chunk_meta, data
        self.pool, self.log_every_s, self.shard = pool, log_every_s, manifest.shard
        now = time.perf_counter()
        self.progress = Progress(tokens=manifest.tokens, bytes=sum(c.bytes for c in manifest.chunks),
                                 total_tokens=total_tokens, t0=now, last_log=now)
        self.next_commit = len(manifest.chunks)
        self._lock = threading.Condition()
        self._error: BaseException | None = None
        self._written: queue.Queue = queue.Queue()
        self._futures: list[Future] = []
        self._writers = ThreadPoolExecutor(max_workers=writer_threads, thread_name_prefix=f"shard{self.shard}-w")
        self._committer = threading.Thread(target=self._commit_loop, name=f"shard{self.shard}-commit", daemon=True)

    def __enter__(self) -> "ChunkPipeline":
        self._committer.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self.fail(exc)
        self._writers.shutdown(wait=True, cancel_futures=True)
        if self._committer.is_alive():  # an error: the committer stops at None without committing more
            self._written.put(None)
            self._committer.join()

    # -- the compute thread's side ---------------------------------------------------------
    def take_buffer(self) -> StateBuffers:
        """A host chunk buffer; waits for a writer to give one back (raising any thread's error meanwhile)."""
        while True:
            self.raise_if_failed()
            buf = self.pool.get(timeout=0.5)
            if buf is not None:
                return buf
            self.maybe_log()

    def submit(self, ci: int, buf: StateBuffers, n: int, order: np.ndarray) -> None:
        """Chunk ci: the first n rows of `buf` hold the states of the samples `order` (local indices)."""
        self._futures.append(self._writers.submit(self.write, ci, buf, n, order))
        self.raise_if_failed()

    def finish(self) -> None:
        """Wait until every submitted chunk is committed (or raise the first error)."""
        self.progress.loop_end = time.perf_counter()
        for f in self._futures:
            f.result()
        self._written.put(None)  # every chunk is written: the committer ends after committing them
        self._committer.join()
        self.raise_if_failed()
        self.maybe_log(force=True)

    def raise_if_failed(self) -> None:
        # no lock: reading one attribute is atomic (the compute thread asks after every batch)
        err = self._error
        if err is not None:
            raise err

    def fail(self, e: BaseException) -> None:
        """Record the first error of any thread: the others stop at their next check."""
        with self._lock:
            if self._error is None:
                self._error = e
            self._lock.notify_all()

    # -- writers -------------------------------------------------------------------------------
    def write(self, ci: int, buf: StateBuffers, n: int, order: np.ndarray) -> None:
        data = self.data
        try:
            if buf.event is not None:
                buf.event.synchronize()
            lens = data.lengths[order]
            idx = np.concatenate([np.arange(data.offsets[i], data.offsets[i + 1]) for i in order])
            tensors = {
                "input_ids": torch.from_numpy(data.input_ids[idx]),
                "loss_mask": torch.from_numpy(data.loss_mask[idx]),
                "aux_hidden": buf.aux[:n],
                "final_hidden": buf.final[:n],
                "sample_offsets": torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)),
                "sample_rows": torch.from_numpy(data.rows[order].astype(np.int64)),
            }
            if buf.aux_scale is not None:
                tensors["aux_scale"] = buf.aux_scale[:n]
                tensors["final_scale"] = buf.final_scale[:n]
            with self._lock:
                if self._error is not None:
                    return
            t = time.perf_counter()
            rec = write_chunk(self.shard_dir, ci, tensors, metadata={**self.chunk_meta, "chunk": ci})
            with self._lock:
                self.progress.writer_busy_s += time.perf_counter() - t
            # the chunk's bytes are in its file: the compute thread may refill the buffer, and this writer
            # takes the next chunk while the committer appends this one after the chunks before it
            buf.event = None
            self.pool.put(buf)
            buf = None
            self.hand_off(ci, rec)
        except BaseException as e:
            self.fail(e)
        finally:
            if buf is not None:
                buf.event = None
                self.pool.put(buf)

    def hand_off(self, ci: int, rec: ChunkRecord) -> None:
        """A writer's last step: chunk ci's file is complete; the committer thread commits it in turn."""
        self._written.put((ci, rec))

    # -- the committer ---------------------------------------------------------------------
    def _commit_loop(self) -> None:
        """Appends written chunks to the manifest strictly in chunk order (writers finish out of order), one
        manifest save per chunk, so a fault or kill after chunk k leaves exactly chunks 0..k committed. Ends on
        None; after an error it commits nothing more."""
        waiting: dict[int, ChunkRecord] = {}
        try:
            while (item := self._written.get()) is not None:
                waiting[item[0]] = item[1]
                while self.next_commit in waiting and self._error is None:
                    self._commit(waiting.pop(self.next_commit))
        except BaseException as e:
            self.fail(e)

    def _commit(self, rec: ChunkRecord) -> None:
        m, p = self.manifest, self.progress
        m.chunks.append(rec)
        now = time.perf_counter()
        # progress for the shard view (eagle3.extract.status): this attempt's rate and its last commit
        m.params["updated_at"] = time.time()
        m.params["tokens_per_s"] = round((p.run_tokens + rec.tokens) / max(now - p.t0, 1e-9), 1)
        m.save(self.shard_dir)
        with self._lock:
            p.tokens += rec.tokens
            p.run_tokens += rec.tokens
            p.bytes += rec.bytes
            p.first_commit = p.first_commit or (now, p.run_tokens)
            p.last_commit = (now, p.run_tokens)
        self.maybe_log(force=True, what=f"chunk {self.next_commit} committed")
        try:
            maybe_inject_fault(self.shard, len(m.chunks))
        except InjectedFault as e:
            self.fail(e)
        with self._lock:  # whoever waits for a chunk to be committed (the bench's baseline) wakes
            self.next_commit += 1
            self._lock.notify_all()

    # -- the log ---------------------------------------------------------------------------------
    def maybe_log(self, force: bool = False, what: str = "") -> None:
        """A rate/ETA line at least every log_every_s (the compute thread asks after every batch) and at every
        commit."""
        now = time.perf_counter()
        with self._lock:
            p = self.progress
            if not force and now - p.last_log < self.log_every_s:
                return
            p.last_log = now
            rate, tokens, nbytes = p.rate(now), p.tokens, p.bytes
        left = max(p.total_tokens - tokens, 0)
        eta = f"{left / rate:.0f}s" if rate > 0 else "?"
        log.info("shard %d: %s%d/%d tokens (%.1f%%), %.0f tok/s, %.2f GB written, ETA %s", self.shard,
                 f"{what}: " if what else "", tokens, p.total_tokens, 100.0 * tokens / max(p.total_tokens, 1),
                 rate, nbytes / 1e9, eta)
