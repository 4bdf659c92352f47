"""Extraction benchmark: naive baseline vs the sharded extractor, against the machine's own limits.

In ONE process on one device, side by side:
  - a bf16 (CPU: the compute dtype) matmul rate probe -> the compute roofline in tokens/s
    (model FLOPs per token: 2 x linear params, lm_head excluded, plus causal attention);
  - a sustained disk write probe (files of chunk size, each fsynced, 1 and 2 writers at once;
    fsync defeats the page cache) -> the disk limit in tokens/s at the stored bytes per token;
  - the naive method (batch 1, full model with output_hidden_states=True and logits,
    synchronous .cpu(), one safetensors file per sample, not fsynced: generous to the baseline);
  - this extractor (eagle3.extract.extractor) on the same length distribution.
Reports tokens/s, the fraction of min(roofline, disk limit) and the ratio to naive.

Models: `real` = SmolLM2-135M-Instruct from its HF folder; `135m`, `1b`, `8b` = random-weight
Llama shapes (SmolLM2-135M, Llama-3.2-1B, Llama-3.1-8B) built from a config on the device (only the
135M one could be carried there, in two calls: bench/device/). Random weights cost the same FLOPs and bytes.

    python bench/extract_bench.py --models 135m,1b,8b --tokens 3e6,1e6,6e5 --out results.json
    python bench/extract_bench.py --models 135m,8b --tokens 3e6,6e5 --writers 6 --compile 135m,8b  # eager vs compiled
    python bench/extract_bench.py --models 8b --tokens 2e6 --writers 6 --compile 8b --fused 8b  # + fused-llama
    python bench/extract_bench.py --models 8b --tokens 2e6 --writers 6 --compile 8b --no-eager --attention auto,cudnn
    python bench/extract_bench.py --models 135m --tokens 4e6 --writers 6 --compile 135m --no-eager --rounds 3
    python bench/extract_bench.py --models 135m --tokens 4e6 --writers 6 --compile 135m --no-eager --rounds 3 \
        --round-probe-gb 18 --baselines writer-waits-for-commit,no-early-writeback  # the write path vs its baselines
    python bench/extract_bench.py --models 135m --tokens 4e6 --writers 6 --compile 135m --no-eager --rounds 3 \
        --round-probe-gb 18 --fresh-rounds --pad-multiples 1,auto   # new shapes each run; length buckets
    python bench/extract_bench.py --models 8b --tokens 1.6e6 --writers 6 --compile 8b --no-eager --rounds 2 \
        --fresh-rounds --cold-host-buffers --matmul-seconds 8   # vs the sustained roofline, pinning afresh
    python bench/extract_bench.py --models real --device cpu --dtype bfloat16 --tokens 2e4 --min-len 64 --max-len 512
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import eagle3.extract.format as chunk_format  # noqa: E402
from eagle3.extract.config import ExtractConfig, ShardPlanConfig  # noqa: E402
from eagle3.extract.extractor import BACKENDS, ShardExtractor  # noqa: E402
from eagle3.extract.format import _start_writeback  # noqa: E402
from eagle3.extract.pipeline import ChunkPipeline  # noqa: E402
from eagle3.extract.plan import plan_shards  # noqa: E402
from tests.support.synthetic import write_merged_dataset  # noqa: E402

SHAPES = {
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                 tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
               tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
               tie_word_embeddings=False),
}
DEFAULT_BUDGET = {"real": 65536, "135m": 65536, "1b": 65536, "8b": 32768}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- probes -------------------------------------------------------------------------------

def matmul_probe(device, dtype, n: int, reps: int) -> float:
    """Median FLOP/s of an n x n x n matmul on random data."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / statistics.median(times)


def matmul_sustained(device, dtype, n: int, seconds: float) -> dict:
    """n^3 matmuls back to back for `seconds`, timed in groups of ~0.1 s: the rate the GPU holds once its
    clocks settle under load (an H200 at its power limit clocks down within seconds of dense GEMM work), which
    is what a minutes-long extraction gets, beside the first group's (burst) rate."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    per_group = max(1, int(0.1 * 7e14 / (2 * n ** 3)))  # ~0.1 s at ~700 TFLOP/s
    rates, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        for _ in range(per_group):
            a @ b
        sync(device)
        rates.append(per_group * 2 * n ** 3 / (time.perf_counter() - t))
    half = rates[len(rates) // 2:]
    return {"seconds": seconds, "groups": len(rates), "first_group": rates[0], "max_group": max(rates),
            "sustained": statistics.median(half), "rates": [round(r / 1e12, 1) for r in rates]}


def disk_probe(folder: Path, total_bytes: int, file_bytes: int, writers: int, early_writeback: bool = False) -> float:
    """Sustained bytes/s writing files of `file_bytes`, each fsynced, with `writers` threads at once; with
    `early_writeback`, each 64 MB written is queued for the disk at once, as the extractor's chunk writer does."""
    folder.mkdir(parents=True, exist_ok=True)
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    n_files = max(writers, total_bytes // file_bytes)
    counter = iter(range(n_files))
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            p = folder / f"probe-{i}.bin"
            with open(p, "wb") as f:
                left = file_bytes
                while left > 0:
                    f.write(block[:min(left, len(block))])
                    left -= len(block)
                    if early_writeback:
                        _start_writeback(f)
                f.flush()
                os.fsync(f.fileno())

    t = time.perf_counter()
    threads = [threading.Thread(target=work) for _ in range(writers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    dt = time.perf_counter() - t
    shutil.rmtree(folder, ignore_errors=True)
    return n_files * file_bytes / dt


# -- models and data ------------------------------------------------------------------------

def build_model(name: str, device, dtype, real_path: str | None):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if name == "real":
        model = AutoModelForCausalLM.from_pretrained(real_path, dtype=dtype).to(device).eval()
        return model, str(real_path)
    cfg = LlamaConfig(**SHAPES[name], rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    return model.eval(), f"random-{name}"


def model_flops_per_sample(cfg, lengths: np.ndarray) -> float:
    """Forward FLOPs without lm_head: 2 x linear params per token + causal attention (QK^T and AV)."""
    H, I, Lyr = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    linear = Lyr * (H * q + 2 * H * kv + q * H + 3 * H * I)
    lengths = lengths.astype(np.float64)
    attn = 4.0 * Lyr * q * lengths * (lengths + 1) / 2
    return float((2.0 * linear * lengths + attn).sum())


def make_samples(n_tokens: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < n_tokens:
        n = int(rng.integers(lo, hi + 1))
        out.append(rng.integers(3, vocab, n).tolist())
        total += n
    return out


# -- the two methods ----------------------------------------------------------------------

@torch.inference_mode()
def run_naive(model, samples, layers, device, out_dir: Path, seconds: float) -> dict:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)

    def one(i, s):
        ids = torch.tensor([s], device=device)
        hs = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        aux = torch.cat([hs[j][0] for j in layers], dim=-1).cpu()
        final = hs[-1][0].cpu()
        save_file({"aux_hidden": aux, "final_hidden": final}, str(out_dir / f"sample-{i}.safetensors"))

    one(-1, samples[0])  # warm-up
    sync(device)
    tokens, t0, i = 0, time.perf_counter(), 0
    while i < len(samples) and time.perf_counter() - t0 < seconds:
        one(i, samples[i])
        tokens += len(samples[i])
        i += 1
    dt = time.perf_counter() - t0
    shutil.rmtree(out_dir, ignore_errors=True)
    return {"tokens": tokens, "samples": i, "seconds": round(dt, 3), "tok_per_s": tokens / dt}


class PipelineWriterWaits(ChunkPipeline):
    """The baseline of the commit path (until 2026-12-03, fifth session): a writer thread, once its chunk's file
    was complete, held itself until the chunks before it were committed and then committed its own, so one slow
    fsync left the writers of the chunks after it idle. Now they hand the chunk to the committer thread and take
    the next one; this pipeline waits where the old writer waited."""

    def hand_off(self, ci, rec):
        super().hand_off(ci, rec)
        with self._lock:
            while self.next_commit <= ci and self._error is None:
                self._lock.wait()


class WriterWaitsForItsCommit(ShardExtractor):
    pipeline_class = PipelineWriterWaits


@contextlib.contextmanager
def no_early_writeback():
    """The baseline of the chunk writer (until 2026-12-03, fifth session): the page cache held a chunk's bytes until
    its final fsync, so a writer left the disk idle while it copied and hashed the chunk."""
    real = chunk_format._start_writeback
    chunk_format._start_writeback = lambda f: None
    try:
        yield
    finally:
        chunk_format._start_writeback = real


# side-by-side baselines of the write path for the interleaved rounds: name -> (extractor class, context)
BASELINES = {"writer-waits-for-commit": (WriterWaitsForItsCommit, contextlib.nullcontext),
             "no-early-writeback": (ShardExtractor, no_early_writeback)}


def empty_pinned_host_cache(device=None) -> None:
    """Free the pinned host blocks torch keeps for reuse, so the next pin pays as in a fresh process (without it a
    run after the first pins nothing). torch 2.11 has no public call for it."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch._C._host_emptyCache()


def run_extractor(model, model_path, samples, layers, device, dtype_name, work: Path, budget: int,
                  writers: int, chunk_mb: int, storage: str = "auto", compile: bool = False,
                  backend_name: str = "hf", attention: str = "auto", extractor=ShardExtractor,
                  pad_multiple: int | str = "auto", cold_host_buffers: bool = False) -> dict:
    merge = work / "merge"
    shutil.rmtree(work, ignore_errors=True)
    write_merged_dataset(merge, samples, rows_per_file=512)
    spec = plan_shards(ShardPlanConfig(str(merge), 1))[0]
    c = model.config
    mc = {"num_layers": c.num_hidden_layers, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size}
    cfg = ExtractConfig(model_path=model_path, extract_dir=str(work / "out"), capture_layers=layers,
                        device=str(device), dtype=dtype_name, token_budget=budget, chunk_mb=chunk_mb,
                        writer_threads=writers, log_every_s=5.0, storage_dtype=storage, compile=compile,
                        backend=backend_name, attention=attention, pad_multiple=pad_multiple)
    backend = BACKENDS[backend_name](model=model, compile=compile, attention=attention)
    if cold_host_buffers and device.type == "cuda":
        empty_pinned_host_cache(device)
    t = time.perf_counter()
    out = extractor(cfg, spec, backend=backend, model_config=mc).run()
    wall = time.perf_counter() - t
    shutil.rmtree(work, ignore_errors=True)
    out["wall_s"] = round(wall, 3)
    out["tok_per_s_wall"] = out["tokens"] / wall
    return out


def interleaved_rounds(rounds: int, probe, extracts: dict, bytes_per_token: int) -> dict:
    """probe, extract, probe, extract, ..., probe: each extraction run is measured against the mean of the disk
    probes just before and after it, so a block device whose rate drifts within minutes (this one: 1.67-2.24
    GB/s) is compared with itself at that time, not with a probe taken once at the start. With several variants
    (`extracts`: label -> run), each round runs each of them in turn, every run between two probes."""
    probes, runs = [probe()], []
    for i in range(rounds):
        for label, extract in extracts.items():
            r = extract()
            probes.append(probe())
            limit = (probes[-2] + probes[-1]) / 2 / bytes_per_token
            runs.append({"variant": label, "tok_per_s_wall": r["tok_per_s_wall"],
                         "steady_tok_per_s": r["steady_tok_per_s"], "wall_s": r["wall_s"], "tokens": r["tokens"],
                         "bytes": r["bytes"], "disk_before": probes[-2], "disk_after": probes[-1],
                         "disk_limit_tok_per_s": limit, "fraction_of_disk_limit": r["tok_per_s_wall"] / limit,
                         **{k: r.get(k) for k in ("compute_waited_for_writers_s", "writer_busy_fraction",
                                                  "host_buffer_alloc_s", "setup_s", "tail_s")}})
            print(f"round {i} {label}: {r['tok_per_s_wall']:.0f} tok/s wall ({r['bytes'] / r['wall_s'] / 1e9:.2f} "
                  f"GB/s), disk {probes[-2] / 1e9:.2f} -> {probes[-1] / 1e9:.2f} GB/s, "
                  f"{100 * runs[-1]['fraction_of_disk_limit']:.0f}% of the disk limit; compute waited for writers "
                  f"{r.get('compute_waited_for_writers_s')} s, writers busy {r.get('writer_busy_fraction')}", flush=True)
    by_variant = {}
    for label in extracts:
        mine = [r for r in runs if r["variant"] == label]
        tokens, wall = sum(r["tokens"] for r in mine), sum(r["wall_s"] for r in mine)
        # the disk limit of a variant: its runs' neighbouring probes, weighted by each run's wall time
        limit = sum(r["disk_limit_tok_per_s"] * r["wall_s"] for r in mine) / wall
        by_variant[label] = {"tok_per_s_wall": tokens / wall, "disk_limit_tok_per_s": limit,
                             "fraction_of_disk_limit": tokens / wall / limit}
        print(f"{label}: {tokens / wall:.0f} tok/s over {len(mine)} runs, "
              f"{100 * tokens / wall / limit:.1f}% of the disk limit around them", flush=True)
    return {"probes_bytes_per_s": probes, "runs": runs, "variants": by_variant}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="135m,1b,8b")
    ap.add_argument("--tokens", default="3e6,1e6,6e5", help="tokens extracted per model (comma list)")
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="compute dtype (default bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--budget", default=None, help="token_budget per model (comma list)")
    ap.add_argument("--writers", default="3", help="writer threads; a comma list measures each, the best is reported")
    ap.add_argument("--chunk-mb", default="1024", help="chunk size in MB: one for all models or a comma list")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager variants (measure --compile/--fused only)")
    ap.add_argument("--naive-seconds", type=float, default=8.0)
    ap.add_argument("--disk-gb", type=float, default=6.0)
    ap.add_argument("--matmul-n", type=int, default=None)
    ap.add_argument("--matmul-seconds", type=float, default=0.0, help="also probe the sustained matmul rate for "
                    "this long, before each model and after its runs; the roofline then uses the mean of the two")
    ap.add_argument("--work-dir", default="bench_work")
    ap.add_argument("--real-path", default=None, help="HF folder of the real model (default: ensure_smollm2())")
    ap.add_argument("--fp8", default="", help="models also measured with fp8 storage (comma list)")
    ap.add_argument("--compile", default="", help="models also measured with compile=True (comma list); the "
                    "compiled run gets its own warm-up (compilation) first")
    ap.add_argument("--fused", default="", help="models also measured with backend='fused-llama', compiled "
                    "(comma list)")
    ap.add_argument("--attention", default="auto", help="SDPA kernels the compiled/fused variants are measured with "
                    "(comma list: auto, flash, cudnn, ...); each gets its own warm-up and compilation")
    ap.add_argument("--rounds", type=int, default=0, help="then N more runs of the best variant, each between two "
                    "disk probes (chunk size, writer threads of the run): the fraction against the disk at that time")
    ap.add_argument("--round-probe-gb", type=float, default=None, help="bytes each probe between rounds writes "
                    "(default --disk-gb); about what one run writes, so a probe and a run last alike")
    ap.add_argument("--baselines", default="", help="in each round, also run these baselines of the write path "
                    f"beside the extractor (comma list of {', '.join(BASELINES)})")
    ap.add_argument("--pad-multiples", default="auto", help="in the rounds, the extractor once per value of "
                    "ExtractConfig.pad_multiple (comma list, e.g. 1,auto,64: batches padded to a bounded set of "
                    "shapes); the runs before the rounds use auto")
    ap.add_argument("--fresh-rounds", action="store_true", help="every run in the rounds extracts new samples (same "
                    "length distribution, new seed), as a production shard meets new batch shapes all the time; "
                    "without it the rounds repeat the first run's samples and shapes")
    ap.add_argument("--cold-host-buffers", action="store_true", help="empty torch's cache of pinned host memory "
                    "before every extractor run, so each pins its chunk buffers as a task in a fresh process does")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    device = torch.device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    work = Path(args.work_dir).resolve()
    models = args.models.split(",")
    tokens = [int(float(x)) for x in args.tokens.split(",")]
    budgets = [int(x) for x in args.budget.split(",")] if args.budget else [DEFAULT_BUDGET[m] for m in models]
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:],
           "machine": platform.node(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "dtype": dtype_name, "models": {}}

    n = args.matmul_n or (8192 if device.type == "cuda" else 1024)
    res["matmul_flops"] = matmul_probe(device, dtype, n, reps=20 if device.type == "cuda" else 5)
    print(f"matmul {dtype_name} {n}^3: {res['matmul_flops'] / 1e12:.1f} TFLOP/s", flush=True)
    chunk_mbs = [int(x) for x in args.chunk_mb.split(",")]
    chunk_mbs = chunk_mbs * len(models) if len(chunk_mbs) == 1 else chunk_mbs
    if len(chunk_mbs) != len(models):
        ap.error(f"--chunk-mb: {len(chunk_mbs)} sizes for {len(models)} models")
    # the disk limit is the best of 1, 2 and as many concurrent fsynced writers as the extractor uses (a cloud
    # block device gives more with more streams in flight), over every chunk size used: the best the disk does
    probes = {}
    for mb in sorted(set(chunk_mbs)):
        for w, early in itertools.product(sorted({1, 2, max(int(x) for x in args.writers.split(","))}), (False, True)):
            key = f"{w}_writers" + ("" if len(set(chunk_mbs)) == 1 else f"_{mb}mb") + ("_early_writeback" if early else "")
            probes[key] = disk_probe(work / "disk", int(args.disk_gb * 1e9), mb << 20, writers=w, early_writeback=early)
    res["disk_bytes_per_s"] = probes
    disk = max(probes.values())
    import hashlib
    blob = np.random.default_rng(1).integers(0, 255, 256 << 20, dtype=np.uint8).tobytes()
    t = time.perf_counter()
    hashlib.sha256(blob).hexdigest()
    res["sha256_bytes_per_s"] = len(blob) / (time.perf_counter() - t)
    print(f"sha256 (one thread): {res['sha256_bytes_per_s'] / 1e9:.2f} GB/s", flush=True)
    print("disk write+fsync: " + ", ".join(f"{v / 1e9:.2f} GB/s ({k})" for k, v in probes.items()), flush=True)

    for name, n_tok, budget, chunk_mb in zip(models, tokens, budgets, chunk_mbs):
        try:
            real_path = args.real_path
            if name == "real" and real_path is None:
                from eagle3.models import ensure_smollm2

                real_path = str(ensure_smollm2())
            t = time.perf_counter()
            model, model_path = build_model(name, device, dtype, real_path)
            build_s = time.perf_counter() - t
            c = model.config
            L = c.num_hidden_layers
            layers = [2, L // 2, L - 3]
            samples = make_samples(n_tok, args.min_len, args.max_len, c.vocab_size, seed=1)
            lengths = np.array([len(s) for s in samples])
            flops = model_flops_per_sample(c, lengths)
            roofline = lengths.sum() / (flops / res["matmul_flops"])
            sustained = []
            if args.matmul_seconds and device.type == "cuda":
                sustained.append(matmul_sustained(device, dtype, n, args.matmul_seconds))
                print(f"[{name}] matmul sustained over {args.matmul_seconds:.0f} s: "
                      f"{sustained[-1]['sustained'] / 1e12:.0f} TFLOP/s (first 0.1 s: "
                      f"{sustained[-1]['first_group'] / 1e12:.0f})", flush=True)
            st_bytes = dtype.itemsize
            bpt = (len(layers) + 1) * c.hidden_size * st_bytes + 5
            disk_limit = disk / bpt
            naive = run_naive(model, samples, layers, device, work / "naive", args.naive_seconds)
            print(f"[{name}] naive: {naive['tok_per_s']:.0f} tok/s ({naive['samples']} samples)", flush=True)
            # warm-up run (kernels, allocator, pinned buffers) on a few samples, then the measured run
            warm = make_samples(min(n_tok, 4 * budget), args.min_len, args.max_len, c.vocab_size, seed=2)
            variants, ext = {}, None
            writers_best = int(args.writers.split(",")[0])
            if not args.no_eager:
                run_extractor(model, model_path, warm, layers, device, dtype_name, work / "ext", budget,
                              writers_best, chunk_mb)
                for w in [int(x) for x in args.writers.split(",")]:
                    variants[w] = run_extractor(model, model_path, samples, layers, device, dtype_name,
                                                work / "ext", budget, w, chunk_mb,
                                                cold_host_buffers=args.cold_host_buffers)
                    print(f"[{name}] writers={w}: {variants[w]['tok_per_s_wall']:.0f} tok/s wall, "
                          f"{variants[w]['steady_tok_per_s']:.0f} steady", flush=True)
                writers_best = max(variants, key=lambda w: variants[w]["tok_per_s_wall"])
                ext = dict(variants[writers_best], writer_threads=writers_best, compile=False)
            # compiled variants: the warm-up run pays the compilation, as each task would once
            for (label, backend_name, wanted), attention in itertools.product(
                    (("compiled", "hf", args.compile), ("fused-llama", "fused-llama", args.fused)),
                    args.attention.split(",")):
                if name not in wanted.split(","):
                    continue
                label += "" if attention == "auto" else f"-{attention}"
                torch._dynamo.reset()  # a compiled graph keeps the SDPA kernel it was traced with
                t = time.perf_counter()
                run_extractor(model, model_path, warm, layers, device, dtype_name, work / "ext", budget,
                              writers_best, chunk_mb, compile=True, backend_name=backend_name, attention=attention)
                warm_s = time.perf_counter() - t
                v = run_extractor(model, model_path, samples, layers, device, dtype_name, work / "ext", budget,
                                  writers_best, chunk_mb, compile=True, backend_name=backend_name, attention=attention,
                                  cold_host_buffers=args.cold_host_buffers)
                v["warmup_with_compile_s"] = round(warm_s, 1)
                print(f"[{name}] {label}: {v['tok_per_s_wall']:.0f} tok/s wall, {v['steady_tok_per_s']:.0f} between "
                      f"first and last commit; setup {v.get('setup_s', 0):.1f} s, tail {v.get('tail_s', 0):.1f} s "
                      f"of {v['wall_s']:.1f} s (warm-up incl. compile {warm_s:.0f} s); compute waited for writers "
                      f"{v.get('compute_waited_for_writers_s')} s, writers busy {v.get('writer_busy_fraction')}, "
                      f"host buffers made in {v.get('host_buffer_alloc_s')} s", flush=True)
                variants[label] = v
                if ext is None or v["tok_per_s_wall"] > ext["tok_per_s_wall"]:
                    ext = dict(v, writer_threads=writers_best, compile=True, backend=backend_name, attention=attention)
            if ext is None:
                raise ValueError("--no-eager leaves nothing to measure: name this model in --compile or --fused")
            limit = min(roofline, disk_limit)
            if name in args.fp8.split(","):
                fp8 = run_extractor(model, model_path, samples, layers, device, dtype_name, work / "ext", budget,
                                    writers_best, chunk_mb, storage="float8_e4m3fn")
                bpt8 = (len(layers) + 1) * (c.hidden_size + 4) + 5
                lim8 = min(roofline, disk / bpt8)
                res["models"][name + "-fp8"] = {
                    "storage": "float8_e4m3fn", "bytes_per_token": bpt8, "roofline_tok_per_s": roofline,
                    "disk_limit_tok_per_s": disk / bpt8, "binding_limit": "compute" if roofline < disk / bpt8 else "disk",
                    "naive": naive, "extractor": fp8, "fraction_of_limit": fp8["tok_per_s_wall"] / lim8,
                    "ratio_to_naive": fp8["tok_per_s_wall"] / naive["tok_per_s"]}
                print(f"[{name}-fp8] extractor: {fp8['tok_per_s_wall']:.0f} tok/s, {fp8['bytes'] / 1e9:.1f} GB, "
                      f"{100 * fp8['tok_per_s_wall'] / lim8:.0f}% of limit, "
                      f"{fp8['tok_per_s_wall'] / naive['tok_per_s']:.1f}x naive", flush=True)
            r = {
                "model_path": model_path, "build_s": round(build_s, 1), "params": sum(p.numel() for p in model.parameters()),
                "capture_layers": layers, "token_budget": budget, "samples": len(samples), "tokens": int(lengths.sum()),
                "lengths": [args.min_len, args.max_len], "bytes_per_token": bpt, "chunk_mb": chunk_mb,
                "roofline_tok_per_s": roofline, "disk_limit_tok_per_s": disk_limit,
                "binding_limit": "compute" if roofline < disk_limit else "disk",
                "naive": naive, "extractor": ext,
                "variants": {str(w): {k: v.get(k) for k in ("tok_per_s_wall", "steady_tok_per_s", "warmup_with_compile_s")}
                             for w, v in variants.items()},
                "steady_fraction_of_limit": ext["steady_tok_per_s"] / limit,
                "fraction_of_limit": ext["tok_per_s_wall"] / limit,
                "ratio_to_naive": ext["tok_per_s_wall"] / naive["tok_per_s"],
            }
            if args.rounds:
                kw = dict(compile=bool(ext.get("compile")), backend_name=ext.get("backend", "hf"),
                          attention=ext.get("attention", "auto"))
                w = int(ext["writer_threads"])
                seeds = itertools.count(100)

                def run(extractor=ShardExtractor, context=contextlib.nullcontext, pad_multiple="auto"):
                    mine = (make_samples(n_tok, args.min_len, args.max_len, c.vocab_size, seed=next(seeds))
                            if args.fresh_rounds else samples)
                    with context():
                        return run_extractor(model, model_path, mine, layers, device, dtype_name, work / "ext",
                                             budget, w, chunk_mb, extractor=extractor, pad_multiple=pad_multiple,
                                             cold_host_buffers=args.cold_host_buffers, **kw)

                extracts = {}
                for pm in args.pad_multiples.split(","):  # "auto" or digits: ExtractConfig parses them
                    extracts[f"extractor-pad{pm}"] = functools.partial(run, pad_multiple=pm)
                for b in filter(None, args.baselines.split(",")):
                    extracts[b] = functools.partial(run, *BASELINES[b])
                probe_gb = args.round_probe_gb or args.disk_gb
                # the round probes write the way the faster of the two initial probes at w writers did
                mine = {k: v for k, v in probes.items() if k.startswith(f"{w}_writers")}
                early = max(mine, key=mine.get).endswith("_early_writeback")
                r["interleaved"] = interleaved_rounds(
                    args.rounds, lambda: disk_probe(work / "disk", int(probe_gb * 1e9), chunk_mb << 20, w, early),
                    extracts, bpt)
                r["interleaved"]["probe_early_writeback"] = early
            if sustained:
                sustained.append(matmul_sustained(device, dtype, n, args.matmul_seconds))
                rate = statistics.mean(x["sustained"] for x in sustained)
                roof_s = lengths.sum() / (flops / rate)
                lim_s = min(roof_s, disk_limit)
                r["matmul_sustained"] = {"probes": sustained, "flops": rate, "roofline_tok_per_s": roof_s,
                                         "fraction_of_limit": ext["tok_per_s_wall"] / lim_s,
                                         "steady_fraction_of_limit": ext["steady_tok_per_s"] / lim_s}
                print(f"[{name}] against the sustained matmul rate ({sustained[0]['sustained'] / 1e12:.0f} before, "
                      f"{sustained[1]['sustained'] / 1e12:.0f} TFLOP/s after): roofline {roof_s:.0f} tok/s -> "
                      f"{100 * ext['tok_per_s_wall'] / lim_s:.0f}% of min(roofline, disk limit)", flush=True)
                # the rounds against min(sustained roofline, the disk around each run); x naive
                for rr in r.get("interleaved", {}).get("runs", []):
                    lim_r = min(roof_s, rr["disk_limit_tok_per_s"])
                    rr["fraction_of_limit_sustained"] = rr["tok_per_s_wall"] / lim_r
                    rr["steady_fraction_of_limit_sustained"] = rr["steady_tok_per_s"] / lim_r
                    rr["ratio_to_naive"] = rr["tok_per_s_wall"] / naive["tok_per_s"]
                    print(f"[{name}] {rr['variant']}: {rr['tok_per_s_wall']:.0f} tok/s wall "
                          f"({rr['steady_tok_per_s']:.0f} between first and last commit) = "
                          f"{100 * rr['fraction_of_limit_sustained']:.1f}% "
                          f"({100 * rr['steady_fraction_of_limit_sustained']:.1f}%) of min(sustained roofline, "
                          f"disk), {rr['ratio_to_naive']:.2f}x naive; setup {rr.get('setup_s')} s, tail "
                          f"{rr.get('tail_s')} s, host buffers made in {rr.get('host_buffer_alloc_s')} s", flush=True)
            if device.type == "cuda":
                r["peak_gpu_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
                torch.cuda.reset_peak_memory_stats(device)
            res["models"][name] = r
            print(f"[{name}] extractor: {ext['tok_per_s_wall']:.0f} tok/s ({ext['tokens']} tokens, "
                  f"{ext['bytes'] / 1e9:.1f} GB, {ext['chunks']} chunks, {ext['wall_s']:.1f}s); roofline "
                  f"{roofline:.0f}, disk limit {disk_limit:.0f} -> {100 * r['fraction_of_limit']:.0f}% of "
                  f"{r['binding_limit']} limit, {r['ratio_to_naive']:.1f}x naive", flush=True)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:  # one model failing must not lose the others' figures
            logging.exception("model %s failed", name)
            res["models"][name] = {"error": f"{type(e).__name__}: {e}"}
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2))

    print("\nmodel   naive tok/s  extractor tok/s (commit window*)  roofline  disk limit  %limit (*)  x naive\n"
          "(* first to last chunk commit: an upper bound, it leaves out the pipeline fill)")
    for name, r in res["models"].items():
        if "error" in r:
            print(f"{name:5s}  ERROR {r['error']}")
            continue
        lim = min(r['roofline_tok_per_s'], r['disk_limit_tok_per_s'])
        print(f"{name:6s}  {r['naive']['tok_per_s']:11.0f}  {r['extractor']['tok_per_s_wall']:15.0f} "
              f"({r['extractor']['steady_tok_per_s']:7.0f})  {r['roofline_tok_per_s']:8.0f}  "
              f"{r['disk_limit_tok_per_s']:10.0f}  {100 * r['fraction_of_limit']:5.0f}% "
              f"({100 * r['extractor']['steady_tok_per_s'] / lim:3.0f}%)  {r['ratio_to_naive']:6.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
