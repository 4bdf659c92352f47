"""Extract one shard: forward passes over the planned batches, chunks handed to the write pipeline.

    ShardExtractor(cfg, spec).run()   # the phase's entry is eagle3.extract.run.extract_shard

The plan (eagle3.extract.batches) fixes which samples go into which batch and chunk; its largest batch is
checked against the free memory before any work (eagle3.extract.memory, which also words an OOM's advice); on a
GPU one compute stream runs the forward (hooks keep the capture layers' outputs) and gathers the real tokens into
a device staging buffer (double-buffered), one copy stream copies them into a pinned host chunk buffer, and the
write pipeline (eagle3.extract.pipeline) writes and commits the chunks. On the CPU the same code runs with
synchronous copies.

Resume: committed chunks (listed in manifest.json) are kept and extraction goes on at the next chunk,
overwriting any uncommitted chunk file a killed run left. What a resume may change follows the param kinds of
eagle3.extract.config: a shard with no committed chunk accepts any params; with committed chunks a state param
that differs is refused, naming it; new plan params plan the samples not yet extracted (a new PlanSegment in
the manifest); runtime params never matter. A complete shard with the same state params is a no-op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagle3.errors import ConfigError
from eagle3.extract.backend import DTYPES, ExtractionBackend, HFBackend, check_attention
from eagle3.extract import moe
from eagle3.extract.compile_cache import use_compile_cache
from eagle3.extract.batches import (PlanSegment, host_buffer_rows, padded_length, plan_segments,
                                    real_token_index)
from eagle3.extract.config import ADDED_STATE_PARAMS, AUTO_PLAN, FP8, ExtractConfig, stored_dtype
from eagle3.extract.format import CorruptChunkError, ShardManifest, load_chunk
from eagle3.fit import bytes_per_token, load_config
from eagle3.extract.fused_llama import FusedLlamaBackend
from eagle3.extract.memory import ExtractOOMError, check_batch_fits, is_oom, oom_message
from eagle3.extract.pipeline import ChunkPipeline, HostBufferPool, StateBuffers, store_states
from eagle3.extract.plan import ShardData, ShardSpec, load_shard_data
from eagle3.faults import maybe_inject_fault
from eagle3.io import MANIFEST_NAME, PhaseOutput, fingerprint, remove_stale_temps
from eagle3.models import model_info

log = logging.getLogger(__name__)

STORAGE_DTYPES = {**DTYPES, FP8: torch.float8_e4m3fn}
# state params whose "auto" is resolved at load (backend)
KERNEL_PARAMS = ("experts_implementation", "fp8_linear", "experts_kernel", "mla_joins")
# what else the kernel record names: no param, experts_implementation brings it (records before 2026-12-07 lack it)
ROUTER = "router"
BACKENDS = {"hf": HFBackend, "fused-llama": FusedLlamaBackend}


def backend_options(cfg: ExtractConfig) -> dict:
    """The ExtractConfig values a backend of `cfg.backend` is built with (the MoE and FP8 options are the hf
    backend's)."""
    moe = ({"experts": cfg.experts_implementation, "compile_scope": cfg.compile_scope, "fp8_linear": cfg.fp8_linear,
            "experts_kernel": cfg.experts_kernel, "token_budget": cfg.token_budget, "mla_joins": cfg.mla_joins}
           if cfg.backend == "hf" else {})
    return {"compile": cfg.compile, "attention": cfg.attention, "compile_mode": cfg.compile_mode, **moe}


def resolve_for_device(cfg: ExtractConfig) -> ExtractConfig:
    """The config with every device-dependent "auto" resolved: device, dtype, compile, storage_dtype,
    token_budget and chunk_mb (AUTO_PLAN), and pad_multiple (1 on the CPU, whose kernels build nothing per shape;
    "auto" stays on a GPU)."""
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    dtype = cfg.target.dtype if cfg.target.dtype != "auto" else ("bfloat16" if cuda else "float32")
    check_attention(cfg.attention, device)
    plan = {name: gpu_cpu[0 if cuda else 1] for name, gpu_cpu in AUTO_PLAN.items() if getattr(cfg, name) == "auto"}
    return dataclasses.replace(
        cfg, target=dataclasses.replace(cfg.target, dtype=dtype), device=device,
        compile=cuda if cfg.compile == "auto" else cfg.compile,
        storage_dtype=stored_dtype(cfg.storage_dtype, dtype),
        pad_multiple=1 if cfg.pad_multiple == "auto" and not cuda else cfg.pad_multiple, **plan)


def resolve_compile_mode(cfg: ExtractConfig, backend: ExtractionBackend | None = None) -> ExtractConfig:
    """compile_mode="auto" as the target class's default (eagle3.extract.moe.CLASS_DEFAULTS), read from the
    preloaded model's config or model_path's config.json; "default" where nothing is compiled. A state param: the
    manifest records the mode that ran."""
    if cfg.compile_mode != "auto":
        return cfg
    if not cfg.compile:
        return dataclasses.replace(cfg, compile_mode="default")
    model = getattr(backend, "model", None)
    config = model.config.to_dict() if model is not None else load_config(cfg.target.model_path)
    return dataclasses.replace(cfg, compile_mode=moe.class_compile_mode(config, "auto"))


def batch_inputs(data: ShardData, rows: np.ndarray, pad_multiple, dev, cuda: bool) -> tuple[torch.Tensor, ...]:
    """One batch's right-padded ids (pad id 0) and the flat index of its real tokens, on `dev` (queued on a GPU)."""
    lens = data.lengths[rows]
    L = padded_length(int(lens[0]), pad_multiple)
    ids = np.zeros((len(rows), L), dtype=np.int64)
    for j, i in enumerate(rows):
        ids[j, :lens[j]] = data.sample(int(i))[0]
    ids_t, real_t = torch.from_numpy(ids), torch.from_numpy(real_token_index(lens, L))
    if cuda:
        ids_t = ids_t.pin_memory().to(dev, non_blocking=True)
        real_t = real_t.pin_memory().to(dev, non_blocking=True)
    return ids_t, real_t


def kernels_ran(m: ShardManifest) -> dict | None:
    """The manifest's record of what the kernel params ran (None: chunks from before the record). A record from
    before experts_kernel: the fused experts ran the tiles kernels, the only ones then."""
    ran = m.params.get("kernels")
    if ran is None or "experts_kernel" in ran:
        return ran
    return {**ran, "experts_kernel": "tiles" if ran.get("experts_implementation") == moe.fused_moe.NAME else None}


@dataclass(frozen=True)
class ModelShape:
    """What extraction needs of the target: read from config.json, or given with a model built in memory."""

    path: str
    num_layers: int
    hidden_size: int
    intermediate_size: int


# -- the extractor -------------------------------------------------------------------------

class ShardExtractor:
    """Extracts one shard into `<extract_dir>/shard-<k>/`; resumable, idempotent."""

    pipeline_class = ChunkPipeline  # the benchmark swaps in a baseline of the commit path

    def __init__(self, cfg: ExtractConfig, spec: ShardSpec | dict, backend: ExtractionBackend | None = None,
                 model_config: dict | None = None):
        """`model_config` ({num_layers, hidden_size, intermediate_size}) comes with a `backend` holding a model
        built in memory; otherwise the shape is read from model_path's config.json."""
        self.spec = spec if isinstance(spec, ShardSpec) else ShardSpec.from_dict(spec)
        self.backend = backend
        cfg = resolve_for_device(cfg)
        cfg.target.require_resolved("extract")
        if model_config is None:
            self.info = model_info(cfg.target.model_path)
            self.shape = ModelShape(self.info.path, self.info.num_layers, self.info.hidden_size,
                                    self.info.intermediate_size)
        else:
            self.info = None
            self.shape = ModelShape(str(cfg.target.model_path), int(model_config["num_layers"]),
                                    int(model_config["hidden_size"]), int(model_config["intermediate_size"]))
        self.cfg = cfg = resolve_compile_mode(cfg, backend)
        self.shard_dir = Path(cfg.extract_dir) / f"shard-{self.spec.shard:05d}"
        self.storage = STORAGE_DTYPES[cfg.storage_dtype]
        token_bytes = bytes_per_token(len(cfg.target.capture_layers), self.shape.hidden_size, cfg.storage_dtype)
        self.plan = PlanSegment(0, cfg.token_budget, max(1, int(cfg.chunk_mb * (1 << 20)) // token_bytes),
                                cfg.pad_multiple)
        # what defines the stored states: with chunks committed, a change is refused (naming the param)
        self.states = {**cfg.state_params(), "merge_fingerprint": self.spec.merge_fingerprint,
                       "shard_rows": self.spec.global_ranges}
        self.fingerprint = fingerprint(self.states)
        self.pipeline: ChunkPipeline | None = None
        self.pool: HostBufferPool | None = None

    # -- manifest -------------------------------------------------------------------------
    def _fresh_manifest(self) -> ShardManifest:
        return ShardManifest(
            shard=self.spec.shard, model_path=str(self.cfg.target.model_path), capture_layers=self.cfg.target.capture_layers,
            hidden_size=self.shape.hidden_size, dtype=self.cfg.storage_dtype, rows=self.spec.global_ranges,
            fingerprint=self.fingerprint,
            params={"states": self.states, "planned_tokens": self.spec.tokens, "planned_rows": self.spec.rows},
        )

    def _chunks_intact(self, m: ShardManifest) -> int:
        """How many of m's committed chunks, from the first, are on disk as committed (sha256 checked when
        verify_existing)."""
        for i, rec in enumerate(m.chunks):
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
                return i
        return len(m.chunks)

    def _refuse_other_states(self, m: ShardManifest) -> None:
        path = self.shard_dir / MANIFEST_NAME
        old = m.params.get("states")
        if not isinstance(old, dict):
            raise ConfigError(f"{path}: {len(m.chunks)} chunks were committed by an older version that recorded "
                              f"no state params; delete {self.shard_dir} to extract the shard again")
        old, ran = {**ADDED_STATE_PARAMS, **old}, kernels_ran(m) or {}
        for name, new in self.states.items():
            if old.get(name) == "auto" and name in ran and new == ran[name]:
                self.states[name] = "auto"  # an explicit value naming what "auto" ran: the same states
                continue
            if old.get(name) != new:
                raise ConfigError(
                    f"{path}: {len(m.chunks)} chunks are committed with {name}={old.get(name)!r}, this run has "
                    f"{name}={new!r}; the stored states would mix: re-run with {name}={old.get(name)!r}, or delete "
                    f"{self.shard_dir} to extract the shard again")
        self.fingerprint = fingerprint(self.states)

    def _record_kernels(self, m: ShardManifest, backend: ExtractionBackend) -> None:
        """What the kernel params ran as. "auto" depends on the version's class defaults and on the device (the
        fused experts fall back to grouped_mm off a GPU), so committed chunks record it and a resume that would
        run other kernels over them is refused, naming the value that runs theirs; a manifest from before the
        record resumes unchecked, as does the router where the record predates it."""
        now = {k: v for k, v in getattr(backend, "resolved", {}).items() if k in (*KERNEL_PARAMS, ROUTER)}
        ran = kernels_ran(m)
        if m.chunks and ran is None:
            return  # chunks from before the record: what ran is not known, so nothing is recorded for them
        if ran is not None and "mla_joins" not in ran:  # a record from before mla_joins: transformers' forward ran
            ran = {**ran, "mla_joins": "heads-major" if now.get("mla_joins") else None}
        for name in KERNEL_PARAMS if m.chunks else ():
            if ran.get(name) != now.get(name):
                raise ConfigError(
                    f"{self.shard_dir / MANIFEST_NAME}: {len(m.chunks)} chunks were extracted with {name} running "
                    f"{ran.get(name)!r}, this run's {name}={getattr(self.cfg, name)!r} runs {now.get(name)!r} "
                    f"(another version's default or another device); the stored states would mix: re-run with "
                    f"{name}={ran.get(name)!r}, or delete {self.shard_dir} to extract the shard again")
        if m.chunks and ROUTER in ran and ran[ROUTER] != now.get(ROUTER):  # the same experts, another version
            ran_by, runs = (r or "the model's own" for r in (ran[ROUTER], now.get(ROUTER)))
            experts = now.get("experts_implementation")
            raise ConfigError(
                f"{self.shard_dir / MANIFEST_NAME}: {len(m.chunks)} chunks were extracted with the router running "
                f"{ran_by!r}, this version runs {runs!r} with experts_implementation={experts!r} "
                f"(their ties between experts route apart, so the stored states would mix): resume with the version "
                f"that began the shard, or delete {self.shard_dir} to extract it again")
        m.params["kernels"] = now

    def _open_manifest(self) -> ShardManifest:
        """The manifest to go on with: the existing one if it has committed chunks (its state params checked,
        its chunks kept up to the first bad one), else a fresh one (no committed chunk accepts any params)."""
        if not (self.shard_dir / MANIFEST_NAME).is_file():
            return self._fresh_manifest()
        m = ShardManifest.load(self.shard_dir)
        if not m.chunks:
            return self._fresh_manifest()
        self._refuse_other_states(m)
        good = self._chunks_intact(m)
        if good < len(m.chunks):
            m.chunks, m.complete = m.chunks[:good], False
        return m if m.chunks else self._fresh_manifest()

    def _segments(self, m: ShardManifest) -> list[PlanSegment]:
        """The plan segments of m's committed chunks, plus this run's plan for the rest when it differs."""
        k = len(m.chunks)
        kept = [PlanSegment(**s) for s in m.params.get("plans", []) if s["from_chunk"] < k]
        if kept and kept[-1].same_plan(self.plan):
            return kept
        if kept:
            log.info("shard %d: %d chunks committed with token_budget=%d, chunk_tokens=%d, pad_multiple=%s; the "
                     "rest is planned with token_budget=%d, chunk_tokens=%d, pad_multiple=%s", self.spec.shard, k,
                     kept[-1].token_budget, kept[-1].chunk_tokens, kept[-1].pad_multiple, self.plan.token_budget,
                     self.plan.chunk_tokens, self.plan.pad_multiple)
        return kept + [dataclasses.replace(self.plan, from_chunk=k)]

    def _summary(self, m: ShardManifest, seconds: float, new_tokens: int, skipped: bool, resumed_from: int) -> dict:
        # where the wall time outside the steady state goes: before the first forward (data, model, buffers),
        # and after the last batch is enqueued (its forward, copies and the last chunks' writes); which side
        # bound the run: the compute thread waiting for host buffers means the writers (the disk) were the limit,
        # writers busy for less than their share of the wall time means compute was
        breakdown, p = {}, self.pipeline.progress if self.pipeline else None
        if p is not None:
            breakdown = {"steady_tok_per_s": round(p.steady_tok_per_s(), 1),
                         "compute_waited_for_writers_s": round(self.pool.waited_s, 3),
                         "host_buffer_alloc_s": round(self.pool.made_s, 3),
                         "host_buffers_made_ahead_s": round(self.pool.made_ahead_s, 3),
                         "writer_busy_fraction": round(
                             p.writer_busy_s / max(self.cfg.writer_threads * seconds, 1e-9), 3)}
            if p.first_forward is not None:
                breakdown["setup_s"] = round(p.first_forward - self._t_run0, 3)
            if p.loop_end is not None:
                breakdown["tail_s"] = round(self._t_run0 + seconds - p.loop_end, 3)
        return {
            "steady_tok_per_s": 0.0, **breakdown,
            "shard": self.spec.shard, "shard_dir": str(self.shard_dir), "complete": m.complete,
            "chunks": len(m.chunks), "tokens": m.tokens, "samples": m.samples,
            "bytes": sum(c.bytes for c in m.chunks), "seconds": round(seconds, 3),
            "tok_per_s": round(new_tokens / seconds, 1) if seconds > 0 and new_tokens else 0.0,
            "skipped": skipped, "resumed_from_chunk": resumed_from,
        }

    # -- run ------------------------------------------------------------------------------
    def run(self) -> dict:
        t0 = self._t_run0 = time.perf_counter()
        done = self.completed_summary()
        if done is not None:
            return done

        m = self._open_manifest()
        data = load_shard_data(self.spec)
        segments = self._segments(m)
        chunks = plan_segments(data.lengths, data.rows, segments)
        start = len(m.chunks)
        if start > len(chunks):
            raise CorruptChunkError(f"{self.shard_dir / MANIFEST_NAME}: {start} chunks committed, plan has {len(chunks)}")
        # recorded with the first commit: a failure before it leaves nothing that could block a retry
        m.params.update(plans=[s.to_dict() for s in segments], planned_chunks=len(chunks))
        maybe_inject_fault(self.spec.shard, start)  # after_chunks=0 (or a resume landing exactly on k)
        if start:
            log.info("shard %d: resuming after %d committed chunks (%d tokens)", self.spec.shard, start, m.tokens)
        tokens_before = m.tokens
        if start < len(chunks):
            self._extract(data, chunks, m)
        m.complete = True
        m.save(self.shard_dir)
        dt = time.perf_counter() - t0
        log.info("shard %d: complete: %d chunks, %d tokens, %.2f GB in %.1fs", self.spec.shard, len(m.chunks),
                 m.tokens, sum(c.bytes for c in m.chunks) / 1e9, dt)
        return self._summary(m, dt, m.tokens - tokens_before, False, start)

    def completed_summary(self) -> dict | None:
        """The summary of a shard already complete with these state params (nothing to do), else None."""
        t0 = time.perf_counter()
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.shard_dir)
        out = PhaseOutput(self.shard_dir, self.fingerprint)
        if out.completed(verify=lambda rec: self._chunks_intact(ShardManifest.load(self.shard_dir)) ==
                         len(rec["chunks"])) is None:
            return None
        m = ShardManifest.load(self.shard_dir)
        log.info("shard %d: already complete (%d chunks, %d tokens): nothing to do",
                 self.spec.shard, len(m.chunks), m.tokens)
        return self._summary(m, time.perf_counter() - t0, 0, True, len(m.chunks))

    def _load_backend(self) -> ExtractionBackend:
        if self.cfg.compile:
            log.info("shard %d: compile cache %s", self.spec.shard, use_compile_cache(self.cfg.compile_cache_dir))
        if self.backend is None:
            self.backend = BACKENDS[self.cfg.backend](info=self.info, **backend_options(self.cfg))
        self.backend.load(self.cfg.target.model_path, self.cfg.target.dtype, self.cfg.device, self.cfg.target.capture_layers)
        return self.backend

    @torch.inference_mode()
    def _extract(self, data: ShardData, chunks: list, m: ShardManifest) -> None:
        cuda = torch.device(self.cfg.device).type == "cuda"
        n_cap, H = len(self.cfg.target.capture_layers), self.shape.hidden_size
        todo = chunks[len(m.chunks):]
        rows, storage = host_buffer_rows(data.lengths, todo, self.plan), self.storage
        # (`make` holds no reference to self: the buffers go when the pool does, not at the next garbage collection)
        self.pool = HostBufferPool(self.cfg.writer_threads + 1 if cuda else 2,
                                   lambda: StateBuffers(rows, n_cap, H, storage, "cpu", pin=cuda))
        # all of them (pinned on a GPU) while the model loads: what a run needs depends on the disk, and the
        # next extractor of the process (HostBufferPool) finds every block of this one's size
        self.pool.make_ahead(self.pool.limit)
        try:
            backend = self._load_backend()
            self._record_kernels(m, backend)
            dev = backend.device
            pad = self.cfg.pad_multiple
            longest = padded_length(max(int(data.lengths[b].max()) for c in todo for b in c), pad)
            check_batch_fits(self.cfg, H, self.shape.intermediate_size, self.storage.itemsize, dev,
                             max(len(b) * padded_length(int(data.lengths[b].max()), pad) for c in todo for b in c),
                             longest)
        except BaseException:
            with contextlib.suppress(BaseException):
                self.pool.wait()  # no thread left pinning behind the error
            raise
        self.pool.wait()  # before the first forward (HostBufferPool)
        max_batch = max(int(data.lengths[b].sum()) for c in todo for b in c)
        staging = [StateBuffers(max_batch, n_cap, H, self.storage, dev) for _ in range(2)]
        for st in staging:
            st.event = torch.cuda.Event() if cuda else None
        copy_stream = torch.cuda.Stream(dev) if cuda else None
        chunk_meta = {"shard": self.spec.shard, "capture_layers": self.cfg.target.capture_layers,
                      "dtype": self.cfg.storage_dtype, "fingerprint": self.fingerprint}
        self.pipeline = self.pipeline_class(self.shard_dir, m, chunk_meta, data, self.pool, self.cfg.writer_threads,
                                            self.cfg.log_every_s, self.spec.tokens)
        progress, step = self.pipeline.progress, 0
        # each batch's ids go up one batch ahead, behind the forward before it and ahead of that batch's copy-out.
        # The ~33 ms a batch the compute stream once idled (the copy-out's length, H100 and H200 at DeepSeek-V3's
        # width) was not this upload but a host readback in the forward, queued behind the copy-out
        # (eagle3.extract.attention.rows_not_packed removes it)
        ahead = (batch_inputs(data, b, self.cfg.pad_multiple, dev, cuda) for batches in todo for b in batches)
        nxt = next(ahead)
        with self.pipeline as pipe:
            for ci, batches in enumerate(todo, start=len(m.chunks)):
                buf, pos = pipe.take_buffer(), 0
                for _ in batches:
                    ids_t, real_t = nxt
                    n = len(real_t)
                    st = staging[step % 2]
                    step += 1
                    progress.first_forward = progress.first_forward or time.perf_counter()
                    try:
                        aux, final = backend.capture(ids_t)
                        nxt = next(ahead, None)
                        if cuda:
                            torch.cuda.current_stream(dev).wait_event(st.event)  # its last copy-out is done
                        # gather the real tokens (drop the pads) into the staging buffer
                        for k, a in enumerate(aux):
                            store_states(st.aux[:n, k * H:(k + 1) * H],
                                         None if st.aux_scale is None else st.aux_scale[:n, k],
                                         a.reshape(-1, H).index_select(0, real_t))
                        store_states(st.final[:n], None if st.final_scale is None else st.final_scale[:n],
                                     final.reshape(-1, H).index_select(0, real_t))
                        del aux, final
                    except RuntimeError as e:
                        if is_oom(e):
                            raise ExtractOOMError(oom_message(self.cfg.token_budget, dev, longest=longest)) from e
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
                    pipe.raise_if_failed()
                    pipe.maybe_log()
                if cuda:
                    buf.event = torch.cuda.Event()
                    buf.event.record(copy_stream)
                pipe.submit(ci, buf, pos, np.concatenate(batches))
            pipe.finish()
