"""Extract one shard: forward passes over length-sorted batches, chunks written by a writer pool.

Work plan (a pure function of the shard spec and params, never of timing, so a killed and
resumed run writes byte-identical chunks): the shard's samples sorted longest first (ties by
row), cut greedily into batches of at most `token_budget` padded tokens, and consecutive
batches grouped into chunks of at most `chunk_tokens` real tokens.

Pipeline on a GPU (one compute stream, one copy stream, a pool of writer threads):
  batch -> forward (hooks keep the capture layers' outputs) -> gather the real tokens into a
  device staging buffer (double-buffered) -> async copy into a pinned host chunk buffer ->
  once a chunk's copies are done, a writer thread streams it to a temp file (hashing as it
  writes), fsyncs and renames it, and hands it to the committer thread, which appends the
  written chunks to the shard manifest in chunk order. A writer never waits for the chunks
  before its own: on a disk-bound run every writer thread keeps a write in flight.
Host chunk buffers come from a small pool, so a slow disk holds the GPU back instead of
filling memory. On the CPU the same code runs with synchronous copies.

Resume: committed chunks (listed in manifest.json) are kept; extraction restarts at the next
chunk of the plan, overwriting any uncommitted chunk file a killed run left.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from eagle3.faults import ENV_VAR as FAULT_ENV, InjectedFault, maybe_inject_fault  # noqa: F401
from eagle3.errors import ConfigError, PipelineError
from eagle3.extract.backend import DTYPES, ExtractionBackend, HFBackend, check_attention
from eagle3.extract.fused_llama import FusedLlamaBackend
from eagle3.extract.format import ChunkRecord, CorruptChunkError, ShardManifest, load_chunk, write_chunk
from eagle3.extract.plan import ShardSpec
from eagle3.io import MANIFEST_NAME, fingerprint, remove_stale_temps
from eagle3.models import default_capture_layers, model_info

log = logging.getLogger(__name__)

FP8 = "float8_e4m3fn"  # optional storage: e4m3 values with one fp32 scale per token and layer
FP8_MAX = 448.0
STORAGE_DTYPES = {**DTYPES, FP8: torch.float8_e4m3fn}
BACKENDS = {"hf": HFBackend, "fused-llama": FusedLlamaBackend}


class ExtractOOMError(PipelineError):
    """The token budget does not fit the device; the message names the param and a smaller value."""


@dataclass
class ExtractConfig:
    model_path: str
    extract_dir: str
    capture_layers: list[int] | None = None  # HF hidden_states indices; None = [2, L//2, L-3]
    device: str = "auto"  # auto = cuda if available else cpu
    dtype: str = "auto"  # compute dtype; auto = bfloat16 on GPU, float32 on CPU
    storage_dtype: str = "auto"  # stored states: auto = the compute dtype; float8_e4m3fn = fp8 + per-token scales
    token_budget: int = 16384  # padded tokens per forward pass (batch rows x longest sample)
    chunk_mb: float = 1024  # target chunk file size (MiB); fixes chunk_tokens = chunk_mb / bytes per token
    # chunks written at once (while one fsyncs, others are written); GPU runs pin up to writer_threads + 1
    # chunk buffers of chunk_mb each (made on demand: HostBufferPool). 6 was best of 3/6 on the H200's disk
    # (docs/benchmarks.md).
    writer_threads: int = 6
    verify_existing: bool = False  # re-hash committed chunks on resume / finished re-run
    log_every_s: float = 30.0
    memory_headroom: float = 0.9  # the budget's estimated memory must fit this fraction of what is free
    # torch.compile each decoder layer (HF backend): auto = on GPU (1.3-1.5x on the H200, docs/benchmarks.md;
    # the first batch pays 13-25 s of compilation), off on CPU
    compile: bool | str = "auto"
    backend: str = "hf"  # "hf": HF transformers modules; "fused-llama": fused q/k/v and gate/up GEMMs (Llama family)
    attention: str = "auto"  # SDPA kernel: auto (torch picks), flash, cudnn, efficient, math
    # right-pad every batch to a length that is a multiple of this, so a shard meets a bounded set of batch shapes:
    # cuDNN attention builds a plan on the host for each new (rows, length), ~40-60 ms on the H200, which at the
    # 135M shape made a run over new shapes 2.8x slower than over known ones (docs/benchmarks.md, run 9).
    # 1 = pad to the longest sample only. "auto" = 1 on CPU; on GPU a multiple of up to AUTO_PAD_MULTIPLE, finer
    # for short batches so padding stays under 1/16 of the length (auto_pad_step).
    pad_multiple: int | str = "auto"

    def resolved(self) -> "ExtractConfig":
        c = ExtractConfig(**asdict(self))
        if c.device == "auto":
            c.device = "cuda" if torch.cuda.is_available() else "cpu"
        if c.dtype == "auto":
            c.dtype = "bfloat16" if c.device.startswith("cuda") else "float32"
        if c.compile == "auto":
            c.compile = c.device.startswith("cuda")
        elif not isinstance(c.compile, bool):
            low = str(c.compile).lower()
            if low not in ("true", "false"):
                raise ConfigError(f"compile must be true, false or 'auto', got {c.compile!r}")
            c.compile = low == "true"
        if c.backend not in BACKENDS:
            raise ConfigError(f"backend={c.backend!r}: use one of {list(BACKENDS)}")
        check_attention(c.attention, c.device)
        if c.storage_dtype == "auto":
            c.storage_dtype = c.dtype
        if c.storage_dtype not in STORAGE_DTYPES:
            raise ConfigError(f"storage_dtype={c.storage_dtype!r}: use one of {list(STORAGE_DTYPES)}")
        for name in ("token_budget", "writer_threads"):
            if not _positive_int(getattr(c, name)):
                raise ConfigError(f"{name} must be a positive int, got {getattr(c, name)!r}")
        if c.pad_multiple == "auto":
            c.pad_multiple = "auto" if c.device.startswith("cuda") else 1
        elif isinstance(c.pad_multiple, str) and c.pad_multiple.strip().isdigit():
            c.pad_multiple = int(c.pad_multiple)
        if c.pad_multiple != "auto" and not _positive_int(c.pad_multiple):
            raise ConfigError(f"pad_multiple must be a positive int or auto, got {c.pad_multiple!r}")
        if isinstance(c.chunk_mb, bool) or not isinstance(c.chunk_mb, (int, float)) or not c.chunk_mb > 0:
            raise ConfigError(f"chunk_mb must be a positive number, got {c.chunk_mb!r}")
        return c


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


# -- the deterministic work plan ----------------------------------------------------------

AUTO_PAD_MULTIPLE = 64


def auto_pad_step(longest: int) -> int:
    """pad_multiple="auto" on GPU: AUTO_PAD_MULTIPLE, or for a batch under 16 x that the largest power of two
    <= longest / 16, so padding stays under 1/16 of the length while a shard meets few lengths (samples of
    256..8192 tokens: 145 instead of 7,937)."""
    return min(AUTO_PAD_MULTIPLE, 1 << max(0, (longest // 16).bit_length() - 1))


def padded_length(longest: int, pad_multiple: int | str) -> int:
    """The length a batch is right-padded to: its longest sample, rounded up to a multiple of pad_multiple
    (of auto_pad_step for "auto")."""
    longest = max(longest, 1)
    step = auto_pad_step(longest) if pad_multiple == "auto" else pad_multiple
    return -(-longest // step) * step


def real_token_index(lens: np.ndarray, L: int) -> np.ndarray:
    """Flat indices of the real tokens in a [len(lens), L] right-padded batch: row j's first lens[j] positions."""
    return np.concatenate([np.arange(j * L, j * L + int(n)) for j, n in enumerate(lens)])


def plan_batches(lengths: np.ndarray, rows: np.ndarray, token_budget: int, chunk_tokens: int,
                 pad_multiple: int | str = 1) -> list[list[np.ndarray]]:
    """Chunks -> batches -> local sample indices. Longest first, so an OOM shows up at once."""
    order = np.lexsort((rows, -lengths))
    batches, i, n = [], 0, len(order)
    while i < n:
        longest = padded_length(int(lengths[order[i]]), pad_multiple)
        size = max(1, token_budget // longest)  # a sample longer than the budget runs alone
        batches.append(order[i:i + size])
        i += size
    chunks, cur, cur_tokens = [], [], 0
    for b in batches:
        t = int(lengths[b].sum())
        if cur and cur_tokens + t > chunk_tokens:
            chunks.append(cur)
            cur, cur_tokens = [], 0
        cur.append(b)
        cur_tokens += t
    if cur:
        chunks.append(cur)
    return chunks


@dataclass
class ShardData:
    """A shard's samples in memory: flat token arrays plus offsets (int32 ids are 4 bytes a token)."""

    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    offsets: np.ndarray  # int64 [n + 1]
    rows: np.ndarray  # int64 [n] global row
    lengths: np.ndarray  # int64 [n]

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.input_ids[a:b], self.loss_mask[a:b]


def load_shard_data(spec: ShardSpec) -> ShardData:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    ids_parts, mask_parts, len_parts, row_parts = [], [], [], []
    for r in spec.ranges:
        path = Path(spec.merge_dir) / r.file
        try:
            table = pq.read_table(path, columns=["input_ids", "loss_mask", "length"])
        except (OSError, KeyError, ValueError) as e:
            raise PipelineError(f"{path}: cannot read input_ids/loss_mask/length: {e}") from e
        if r.row_end > table.num_rows:
            raise PipelineError(f"{path}: shard {spec.shard} wants rows up to {r.row_end}, file has {table.num_rows}")
        t = table.slice(r.row_start, r.row_end - r.row_start)
        ids = t.column("input_ids").combine_chunks()
        mask = t.column("loss_mask").combine_chunks()
        length = t.column("length").to_numpy().astype(np.int64)
        n_ids = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
        n_mask = pc.list_value_length(mask).to_numpy(zero_copy_only=False).astype(np.int64)
        bad = np.nonzero((n_ids != length) | (n_mask != length) | (length < 1))[0]
        if len(bad):
            j = int(bad[0])
            raise PipelineError(
                f"{path}: row {r.row_start + j}: length={int(length[j])}, len(input_ids)={int(n_ids[j])}, "
                f"len(loss_mask)={int(n_mask[j])} (must be equal and > 0)")
        ids_parts.append(ids.flatten().to_numpy(zero_copy_only=False).astype(np.int32))
        mask_parts.append(mask.flatten().to_numpy(zero_copy_only=False).astype(np.uint8))
        len_parts.append(length)
        row_parts.append(np.arange(r.global_row_start, r.global_row_start + len(length), dtype=np.int64))
    lengths = np.concatenate(len_parts) if len_parts else np.zeros(0, np.int64)
    return ShardData(
        input_ids=np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int32),
        loss_mask=np.concatenate(mask_parts) if mask_parts else np.zeros(0, np.uint8),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        rows=np.concatenate(row_parts) if row_parts else np.zeros(0, np.int64),
        lengths=lengths,
    )


# -- memory guard ----------------------------------------------------------------------------

def estimate_batch_bytes(token_budget: int, hidden: int, intermediate: int, n_capture: int,
                         compute_bytes: int, storage_bytes: int) -> int:
    """Peak extra memory of one forward of `token_budget` tokens, plus the two staging buffers.

    Activations: the residual stream, a norm output, q/k/v/attention output (~6 x hidden), the
    MLP's gate/up/act (3 x intermediate), the captured layers kept alive until gathered, and
    fp32 temporaries of norms/rope (~2 x hidden x 4 bytes). Deliberately generous.
    """
    act = token_budget * ((8 + n_capture) * hidden + 3 * intermediate) * compute_bytes
    act += token_budget * 2 * hidden * 4
    staging = 2 * token_budget * (n_capture + 1) * hidden * storage_bytes
    return int(act + staging)


def free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def oom_message(token_budget: int, need: int | None, free: int | None, device) -> str:
    suggest = max(256, token_budget // 2)
    if need and free:
        while suggest > 256 and need * suggest / token_budget > free:
            suggest //= 2
    what = (f"needs about {need / 1e9:.1f} GB but only {free / 1e9:.1f} GB is free on {device}"
            if need and free else f"ran out of memory on {device}")
    return (f"token_budget={token_budget} {what}: set a smaller token_budget (the extraction param "
            f"'token_budget', padded tokens per forward pass), e.g. token_budget={suggest}")


# -- the extractor -------------------------------------------------------------------------

class _StateBuffers:
    """aux/final states of up to `rows` tokens (+ fp8 scales): device staging or a host chunk buffer."""

    def __init__(self, rows: int, n_capture: int, hidden: int, dtype: torch.dtype, device, pin: bool = False):
        kw = dict(device=device, pin_memory=pin)
        self.aux = torch.empty((rows, n_capture * hidden), dtype=dtype, **kw)
        self.final = torch.empty((rows, hidden), dtype=dtype, **kw)
        fp8 = dtype == torch.float8_e4m3fn
        self.aux_scale = torch.empty((rows, n_capture), dtype=torch.float32, **kw) if fp8 else None
        self.final_scale = torch.empty((rows,), dtype=torch.float32, **kw) if fp8 else None
        self.event = None  # staging: its last copy-out is done; host: the chunk's copies have landed

    def tensors(self):
        return [t for t in (self.aux, self.final, self.aux_scale, self.final_scale) if t is not None]


class HostBufferPool:
    """Host chunk buffers (pinned on a GPU run), made on demand up to `limit`. Pinning page-locks every page of a
    GB-sized buffer (0.4-0.5 s a GB on the H200 machine, under a driver lock that stalls every thread's CUDA
    calls), so a run pays for a buffer only when every made one is still in a writer's hands: a compute-bound
    run (few chunks in flight) never makes the rest. Made on the compute thread, the GPU works through it on
    the batches already queued: pinning in a background thread, or by cudaHostRegister, measured no faster
    (docs/benchmarks.md run 10).
    `get` runs on the compute thread only; writers `put` buffers back."""

    def __init__(self, limit: int, make):
        self.limit, self.make, self.made = limit, make, 0
        self.free: queue.Queue = queue.Queue()
        self.waited_s = 0.0  # time `get` blocked for a writer to give a buffer back: the disk holding compute back
        self.made_s = 0.0  # time spent making (pinning) buffers, on the compute thread

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


def _store(dst: torch.Tensor, scale: torch.Tensor | None, x: torch.Tensor) -> None:
    """dst[:] = x in the storage dtype; for fp8, one scale per token so amax maps to the fp8 max."""
    if scale is None:
        dst.copy_(x)
        return
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    dst.copy_((xf / s).clamp_(-FP8_MAX, FP8_MAX))
    scale.copy_(s.squeeze(-1))


class ShardExtractor:
    """Extracts one shard into `<extract_dir>/shard-<k>/`; resumable, idempotent."""

    def __init__(self, cfg: ExtractConfig, spec: ShardSpec | dict, backend: ExtractionBackend | None = None,
                 model_config: dict | None = None):
        self.cfg = cfg.resolved()
        self.spec = spec if isinstance(spec, ShardSpec) else ShardSpec.from_dict(spec)
        self.backend = backend
        self.shard_dir = Path(self.cfg.extract_dir) / f"shard-{self.spec.shard:05d}"
        # model shape: from config.json (cheap) or, for an injected backend model, from the caller
        if model_config is None:
            info = model_info(self.cfg.model_path)
            model_config = {"num_layers": info.num_layers, "hidden_size": info.hidden_size,
                            "intermediate_size": info.intermediate_size}
            self.info = info
        else:
            self.info = None
        self.num_layers = int(model_config["num_layers"])
        self.hidden = int(model_config["hidden_size"])
        self.intermediate = int(model_config["intermediate_size"])
        self.capture_layers = list(self.cfg.capture_layers or default_capture_layers(self.num_layers))
        for i in self.capture_layers:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers:
                raise ConfigError(
                    f"capture layer {i!r} does not exist in {self.cfg.model_path}: the model has {self.num_layers} "
                    f"decoder layers, so capture layers (HF hidden_states indices) must be in 0..{self.num_layers - 1}")
        n = len(self.capture_layers)
        self.storage = STORAGE_DTYPES[self.cfg.storage_dtype]
        st_bytes = self.storage.itemsize
        # states + int32 id + uint8 mask (+ fp32 scales for fp8)
        self.bytes_per_token = (n + 1) * self.hidden * st_bytes + 5 + (4 * (n + 1) if self.storage == torch.float8_e4m3fn else 0)
        self.chunk_tokens = max(1, int(self.cfg.chunk_mb * (1 << 20)) // self.bytes_per_token)
        self.params = {
            "model_path": str(self.cfg.model_path), "capture_layers": self.capture_layers,
            "dtype": self.cfg.dtype, "storage_dtype": self.cfg.storage_dtype,
            "token_budget": self.cfg.token_budget, "chunk_tokens": self.chunk_tokens,
            "spec": self.spec.to_dict(),
            # only when set: shards extracted before the param existed keep their fingerprint
            **({"pad_multiple": self.cfg.pad_multiple} if self.cfg.pad_multiple != 1 else {}),
        }
        self.fingerprint = fingerprint(self.params)
        self._lock = threading.Condition()
        self._error: BaseException | None = None

    # -- manifest -------------------------------------------------------------------------
    def _fresh_manifest(self) -> ShardManifest:
        return ShardManifest(
            shard=self.spec.shard, model_path=str(self.cfg.model_path), capture_layers=self.capture_layers,
            hidden_size=self.hidden, dtype=self.cfg.storage_dtype, rows=self.spec.global_ranges,
            params={**{k: v for k, v in self.params.items() if k != "spec"}, "fingerprint": self.fingerprint,
                    "planned_tokens": self.spec.tokens, "planned_rows": self.spec.rows},
        )

    def _open_manifest(self) -> ShardManifest:
        """The existing manifest (checked against our params, committed chunks checked) or a fresh one."""
        if not (self.shard_dir / MANIFEST_NAME).is_file():
            return self._fresh_manifest()
        m = ShardManifest.load(self.shard_dir)
        if m.params.get("fingerprint") != self.fingerprint:
            raise ConfigError(
                f"{self.shard_dir / MANIFEST_NAME}: this shard was extracted with other params "
                f"({ {k: m.params.get(k) for k in ('model_path', 'capture_layers', 'dtype', 'token_budget', 'chunk_tokens')} }); "
                f"re-run with the same params, or delete {self.shard_dir} to start it over")
        good = []
        for rec in m.chunks:
            path = self.shard_dir / rec.file
            ok = path.is_file() and path.stat().st_size == rec.bytes
            if ok and self.cfg.verify_existing:
                try:
                    load_chunk(self.shard_dir, rec, verify=True)
                except CorruptChunkError:
                    ok = False
            if not ok:
                log.warning("shard %d: committed %s is missing or corrupt; re-extracting from there",
                            self.spec.shard, path)
                m.complete = False
                break
            good.append(rec)
        m.chunks = good
        return m

    def _summary(self, m: ShardManifest, seconds: float, new_tokens: int, skipped: bool, resumed_from: int) -> dict:
        p = getattr(self, "_progress", {})
        steady = 0.0
        if "first_commit" in p and p["last_commit"][0] > p["first_commit"][0]:
            (t0, n0), (t1, n1) = p["first_commit"], p["last_commit"]
            steady = (n1 - n0) / (t1 - t0)
        # where the wall time outside the steady state goes: before the first forward (data, model, buffers),
        # and after the last batch is enqueued (its forward, copies and the last chunks' writes)
        breakdown = {}
        if "first_forward" in p:
            breakdown["setup_s"] = round(p["first_forward"] - self._t_run0, 3)
        if "loop_end" in p:
            breakdown["tail_s"] = round(self._t_run0 + seconds - p["loop_end"], 3)
        # which side bound the run: the compute thread waiting for host buffers means the writers (the disk) were
        # the limit; writers busy for less than their share of the wall time means compute was
        if "pool" in p:
            breakdown["compute_waited_for_writers_s"] = round(p["pool"].waited_s, 3)
            breakdown["host_buffer_alloc_s"] = round(p["pool"].made_s, 3)
            breakdown["writer_busy_fraction"] = round(
                p["writer_busy_s"] / max(self.cfg.writer_threads * seconds, 1e-9), 3)
        return {
            "steady_tok_per_s": round(steady, 1), **breakdown,
            "shard": self.spec.shard, "shard_dir": str(self.shard_dir), "complete": m.complete,
            "chunks": len(m.chunks), "tokens": m.tokens, "samples": m.samples,
            "bytes": sum(c.bytes for c in m.chunks), "seconds": round(seconds, 3),
            "tok_per_s": round(new_tokens / seconds, 1) if seconds > 0 and new_tokens else 0.0,
            "skipped": skipped, "resumed_from_chunk": resumed_from,
        }

    # -- run ------------------------------------------------------------------------------
    def run(self) -> dict:
        t0 = self._t_run0 = time.perf_counter()
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.shard_dir)
        m = self._open_manifest()
        if m.complete:
            log.info("shard %d: already complete (%d chunks, %d tokens): nothing to do",
                     self.spec.shard, len(m.chunks), m.tokens)
            return self._summary(m, time.perf_counter() - t0, 0, True, len(m.chunks))

        data = load_shard_data(self.spec)
        chunks = plan_batches(data.lengths, data.rows, self.cfg.token_budget, self.chunk_tokens, self.cfg.pad_multiple)
        m.params["planned_chunks"] = len(chunks)
        start = len(m.chunks)
        if start > len(chunks):
            raise CorruptChunkError(f"{self.shard_dir / MANIFEST_NAME}: {start} chunks committed, plan has {len(chunks)}")
        m.save(self.shard_dir)
        self.manifest = m
        self._check_fault()  # after_chunks=0 (or a resume landing exactly on k)
        if start:
            log.info("shard %d: resuming after %d committed chunks (%d tokens)", self.spec.shard, start, m.tokens)
        if start < len(chunks):
            self._extract(data, chunks, start, t0)
        m.complete = True
        m.save(self.shard_dir)
        dt = time.perf_counter() - t0
        new_tokens = m.tokens - sum(int(data.lengths[np.concatenate(c)].sum()) for c in chunks[:start])
        log.info("shard %d: complete: %d chunks, %d tokens, %.2f GB in %.1fs", self.spec.shard, len(m.chunks),
                 m.tokens, sum(c.bytes for c in m.chunks) / 1e9, dt)
        return self._summary(m, dt, new_tokens, False, start)

    def _load_backend(self):
        if self.backend is None:
            self.backend = BACKENDS[self.cfg.backend](info=self.info, compile=self.cfg.compile,
                                                      attention=self.cfg.attention)
        self.backend.load(self.cfg.model_path, self.cfg.dtype, self.cfg.device, self.capture_layers)
        return self.backend

    def _check_memory(self, device: torch.device, max_batch_tokens: int) -> None:
        compute_bytes = DTYPES[self.cfg.dtype].itemsize
        need = estimate_batch_bytes(max_batch_tokens, self.hidden, self.intermediate, len(self.capture_layers),
                                    compute_bytes, self.storage.itemsize)
        free = free_device_memory(device)
        if need > free * self.cfg.memory_headroom:
            raise ExtractOOMError(oom_message(self.cfg.token_budget, need, free, device))

    @torch.inference_mode()
    def _extract(self, data: ShardData, chunks: list, start: int, t0: float) -> None:
        backend = self._load_backend()
        dev = backend.device
        cuda = dev.type == "cuda"
        n_cap, H = len(self.capture_layers), self.hidden
        # the memory the budget asks for, against what the device has free, before any work
        self._check_memory(dev, self.cfg.token_budget)
        todo = chunks[start:]
        max_batch = max(int(data.lengths[b].sum()) for c in todo for b in c)
        max_chunk = max(int(data.lengths[np.concatenate(c)].sum()) for c in todo)
        staging = [_StateBuffers(max_batch, n_cap, H, self.storage, dev) for _ in range(2)]
        for st in staging:
            st.event = torch.cuda.Event() if cuda else None
        pool = HostBufferPool(self.cfg.writer_threads + 1 if cuda else 2,
                              lambda: _StateBuffers(max_chunk, n_cap, H, self.storage, "cpu", pin=cuda))
        copy_stream = torch.cuda.Stream(dev) if cuda else None
        total_tokens = self.spec.tokens
        self._progress = {"tokens": self.manifest.tokens, "bytes": sum(c.bytes for c in self.manifest.chunks),
                          "run_tokens": 0, "t0": time.perf_counter(), "last_log": time.perf_counter(),
                          "writer_busy_s": 0.0, "pool": pool}
        self._next_commit = start
        pad_id = 0
        writers = ThreadPoolExecutor(max_workers=self.cfg.writer_threads, thread_name_prefix=f"shard{self.spec.shard}-w")
        self._written: queue.Queue = queue.Queue()
        committer = threading.Thread(target=self._commit_loop, name=f"shard{self.spec.shard}-commit", daemon=True)
        committer.start()
        futures = []
        step = 0
        try:
            for ci, batches in enumerate(todo, start=start):
                buf = self._take(pool)
                pos = 0
                samples = []
                for b in batches:
                    lens = data.lengths[b]
                    L, B = padded_length(int(lens[0]), self.cfg.pad_multiple), len(b)
                    ids = np.full((B, L), pad_id, dtype=np.int64)
                    for j, i in enumerate(b):
                        ids[j, :lens[j]] = data.sample(int(i))[0]
                    real = real_token_index(lens, L)
                    n = len(real)
                    ids_t, real_t = torch.from_numpy(ids), torch.from_numpy(real)
                    if cuda:
                        ids_t = ids_t.pin_memory().to(dev, non_blocking=True)
                        real_t = real_t.pin_memory().to(dev, non_blocking=True)
                    st = staging[step % 2]
                    step += 1
                    try:
                        self._progress.setdefault("first_forward", time.perf_counter())
                        aux, final = backend.capture(ids_t)
                        if cuda:
                            torch.cuda.current_stream(dev).wait_event(st.event)  # its last copy-out is done
                        # gather the real tokens (drop the pads) into the staging buffer
                        for k, a in enumerate(aux):
                            _store(st.aux[:n, k * H:(k + 1) * H],
                                   None if st.aux_scale is None else st.aux_scale[:n, k],
                                   a.reshape(-1, H).index_select(0, real_t))
                        _store(st.final[:n], None if st.final_scale is None else st.final_scale[:n],
                               final.reshape(-1, H).index_select(0, real_t))
                        del aux, final
                    except torch.OutOfMemoryError as e:
                        raise ExtractOOMError(oom_message(self.cfg.token_budget, None, None, dev)) from e
                    except RuntimeError as e:
                        if "can't allocate memory" in str(e) or "out of memory" in str(e).lower():
                            raise ExtractOOMError(oom_message(self.cfg.token_budget, None, None, dev)) from e
                        raise
                    if cuda:
                        copy_stream.wait_stream(torch.cuda.current_stream(dev))
                        with torch.cuda.stream(copy_stream):
                            for h, d in zip(buf.tensors(), st.tensors()):
                                h[pos:pos + n].copy_(d[:n], non_blocking=True)
                            st.event.record(copy_stream)
                    else:
                        for h, d in zip(buf.tensors(), st.tensors()):
                            h[pos:pos + n].copy_(d[:n])
                    pos += n
                    samples.append(b)
                    self._progress["computed"] = True
                if cuda:
                    buf.event = torch.cuda.Event()
                    buf.event.record(copy_stream)
                order = np.concatenate(samples)
                futures.append(writers.submit(self._write_chunk, ci, buf, pos, order, data, pool))
                self._raise_if_failed()
                self._maybe_log(total_tokens)
            self._progress["loop_end"] = time.perf_counter()
            for f in futures:
                f.result()
            self._written.put(None)  # every chunk is written: the committer ends after committing them
            committer.join()
            self._raise_if_failed()
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            writers.shutdown(wait=True, cancel_futures=True)
            if committer.is_alive():  # an error: the committer stops at None without committing more
                self._written.put(None)
                committer.join()
        self._maybe_log(total_tokens, force=True)

    def _take(self, pool: HostBufferPool) -> _StateBuffers:
        while True:
            self._raise_if_failed()
            buf = pool.get(timeout=0.5)
            if buf is not None:
                return buf

    def _raise_if_failed(self) -> None:
        # no lock: reading one attribute is atomic (the compute thread asks after every batch)
        err = self._error
        if err is not None:
            raise err

    def _fail(self, e: BaseException) -> None:
        """Record the first error of any thread: the others stop at their next check."""
        with self._lock:
            if self._error is None:
                self._error = e
            self._lock.notify_all()

    def _write_chunk(self, ci: int, buf: _StateBuffers, n: int, order: np.ndarray, data: ShardData, pool) -> None:
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
            meta = {"shard": self.spec.shard, "chunk": ci, "capture_layers": self.capture_layers,
                    "dtype": self.cfg.storage_dtype, "fingerprint": self.fingerprint}
            with self._lock:
                if self._error is not None:
                    return
            t = time.perf_counter()
            rec = write_chunk(self.shard_dir, ci, tensors, metadata=meta)
            with self._lock:
                self._progress["writer_busy_s"] += time.perf_counter() - t
            # the chunk's bytes are in its file: the compute thread may refill the buffer, and this writer
            # takes the next chunk while the committer appends this one after the chunks before it
            buf.event = None
            pool.put(buf)
            buf = None
            self._hand_off(ci, rec)
        except BaseException as e:
            self._fail(e)
        finally:
            if buf is not None:
                buf.event = None
                pool.put(buf)

    def _hand_off(self, ci: int, rec: ChunkRecord) -> None:
        """A writer's last step: chunk ci's file is complete; the committer thread commits it in turn."""
        self._written.put((ci, rec))

    def _commit_loop(self) -> None:
        """The committer thread: appends written chunks to the manifest strictly in chunk order (writers
        finish out of order), one manifest save per chunk, so a fault or kill after chunk k leaves exactly
        chunks 0..k committed. Ends on None; after an error it commits nothing more (a re-run overwrites the
        uncommitted files)."""
        waiting: dict[int, ChunkRecord] = {}
        try:
            while (item := self._written.get()) is not None:
                waiting[item[0]] = item[1]
                while self._next_commit in waiting and self._error is None:
                    self._commit(waiting.pop(self._next_commit))
        except BaseException as e:
            self._fail(e)

    def _commit(self, rec: ChunkRecord) -> None:
        """Append the next chunk in order to the manifest and save it (the committer thread only)."""
        self.manifest.chunks.append(rec)
        # progress for the shard view (eagle3.monitor): this attempt's rate and its last commit
        p = self._progress
        run_tokens = p["run_tokens"] + rec.tokens
        self.manifest.params["updated_at"] = time.time()
        self.manifest.params["tokens_per_s"] = round(run_tokens / max(time.perf_counter() - p["t0"], 1e-9), 1)
        self.manifest.save(self.shard_dir)
        p["tokens"] += rec.tokens
        p["run_tokens"] = run_tokens
        p["bytes"] += rec.bytes
        now = time.perf_counter()
        p.setdefault("first_commit", (now, run_tokens))  # steady-state rate: from the first commit on
        p["last_commit"] = (now, run_tokens)
        try:
            self._check_fault()
        except InjectedFault as e:
            self._fail(e)
        with self._lock:  # whoever waits for a chunk to be committed (tests, the bench's baseline) wakes
            self._next_commit += 1
            self._lock.notify_all()

    def _check_fault(self) -> None:
        maybe_inject_fault(self.spec.shard, len(self.manifest.chunks))

    def _maybe_log(self, total_tokens: int, force: bool = False) -> None:
        p = self._progress
        now = time.perf_counter()
        if not force and now - p["last_log"] < self.cfg.log_every_s:
            return
        p["last_log"] = now
        dt = max(now - p["t0"], 1e-9)
        rate = p["run_tokens"] / dt
        left = max(total_tokens - p["tokens"], 0)
        eta = f"{left / rate:.0f}s" if rate > 0 else "?"
        log.info("shard %d: %d/%d tokens (%.1f%%), %.0f tok/s, %.2f GB written, ETA %s", self.spec.shard,
                 p["tokens"], total_tokens, 100.0 * p["tokens"] / max(total_tokens, 1), rate, p["bytes"] / 1e9, eta)


def extract_shard(cfg: ExtractConfig, spec: ShardSpec | dict, backend: ExtractionBackend | None = None,
                  model_config: dict | None = None) -> dict:
    """Extract one shard (resumable, a no-op when complete) and return a small JSON-able summary."""
    return ShardExtractor(cfg, spec, backend=backend, model_config=model_config).run()
