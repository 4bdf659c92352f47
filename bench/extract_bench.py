"""Extraction benchmark: the sharded extractor against the naive method and the machine's own limits.

In ONE process on one device, side by side (bench/extract_limits.py holds the targets and the probes,
bench/extract_fp8.py FP8 on load):
  - the bf16 (CPU: the compute dtype) matmul rate -> the roofline in tokens/s (active FLOPs a token, eagle3.flops:
    linear weights a token passes through, MLA and routed experts counted, lm_head excluded, causal attention);
  - the fsynced disk write rate (1, 2 and as many writers as the extractor uses) -> the disk limit in tokens/s;
  - the naive method (batch 1, output_hidden_states=True and logits, synchronous .cpu(), a file per sample);
  - the extractor as the operator runs it, on the same samples: eager, compiled (`--compile`), fused (`--fused`),
    per SDPA kernel (`--attention`); fp8 storage (`--fp8`), an FP8-on-load target (`--fp8-weights`; in DeepSeek-V3's
    FP8 checkpoint layout through the project's kernels: `--fp8-blocks`), runs between
    disk probes (`--rounds`), the sustained matmul rate (`--matmul-seconds`), levers side by side (`--variants`);
  - MoE models: the experts' GEMMs alone at the routed shapes (the ceiling) and both ratios, a skewed router
    (`--skew`): bench/extract_levers.py, bench/extract_moe.py;
  - the forward alone on planned batches, profiled (`--profile-batches`), and the whole extractor, profiled on the
    GPU (`--profile-extractor`: the compute's busy share, its idle gaps and the CUDA calls that held the host):
    bench/extract_profile.py;
  - a shard larger than the disk, or the extractor without the disk: `--discard-chunks` (with --work-dir on tmpfs).
Reports tokens/s, the fraction of min(roofline, disk limit) and the ratio to naive.

Models: `real` = SmolLM2-135M-Instruct; random-weight `135m`, `1b`, `8b` (Llama shapes), `qwen3-30b-a3b`, `dsv3`
(DeepSeek-V3, as many layers as fit the GPU); `tiny`, `tiny-moe`, `tiny-mla` for --smoke. Commands of the current
figures: docs/benchmarks.md; of the staged MoE runs: docs/device-runs.md. E.g.

    python bench/extract_bench.py --models 135m,8b --tokens 3e6,6e5 --writers 6 --compile 135m,8b  # eager vs compiled
    python bench/extract_bench.py --models 8b --tokens 1.6e6 --writers 6 --compile 8b --no-eager --rounds 2 \
        --fresh-rounds --cold-host-buffers --matmul-seconds 8   # vs the sustained roofline, pinning afresh
    python bench/extract_bench.py --models 8b --tokens 6e5 --budget 16384 --writers 6 --compile 8b --no-eager \
        --fp8-weights 8b      # FP8 on load (torchao: `pip install -e .[fp8]`) against bf16
    python bench/extract_bench.py --models real --device cpu --dtype bfloat16 --tokens 2e4 --min-len 64 --max-len 512
    python bench/extract_bench.py --smoke     # CPU, tiny shape, every option but compilation: checks the code path
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.extract_fp8 import (fp8_experts_fit, fp8_roofline, quantize_fp8, quantize_fp8_blocks,  # noqa: E402
                               states_error)
from bench.extract_limits import (DEFAULT_BUDGET, ChunkReaper, against_sustained, build_model,  # noqa: E402
                                  disk_probe, empty_pinned_host_cache, interleaved_rounds, limits_entry,
                                  machine_limits, make_samples, matmul_sustained, model_flops_per_sample,
                                  print_summary, sync)
from bench.extract_levers import measure_moe, measure_variants_side_by_side, parse_variants  # noqa: E402
from bench.extract_moe import is_moe  # noqa: E402
from bench.extract_profile import extractor_profile, run_profile  # noqa: E402
from eagle3.extract.config import ExtractConfig, ShardPlanConfig  # noqa: E402
from eagle3.extract.extractor import BACKENDS, ShardExtractor, backend_options, resolve_for_device  # noqa: E402
from eagle3.fit import bytes_per_token  # noqa: E402
from eagle3.models import default_capture_layers  # noqa: E402
from eagle3.extract.plan import plan_shards  # noqa: E402
from eagle3.sections import TargetConfig  # noqa: E402
from tests.support.synthetic import write_merged_dataset  # noqa: E402

SMOKE = dict(models="tiny,tiny-moe,tiny-mla", device="cpu", dtype="float32", tokens="3000,900,900", min_len=64,
             max_len=400, budget="1024,512,512", writers="2", chunk_mb="1", disk_gb=0.02, naive_seconds=1.0,
             matmul_n=256, fp8="tiny", fp8_weights="tiny,tiny-moe", fp8_blocks="tiny-moe", rounds=1,
             round_probe_gb=0.02, fresh_rounds=True, pad_multiples="1,auto", skew=1.0, variant_models="tiny-moe",
             profile_batches=3, profile_extractor="tiny", warm_tokens=256,
             variants="batched:experts=batched_mm;fused:experts=triton_fused;budget256:budget=256;bad:experts=nope")


@dataclass
class Bench:
    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    dtype_name: str
    work: Path


@dataclass
class Target:
    model: torch.nn.Module
    model_path: str
    samples: list[list[int]]
    layers: list[int]
    budget: int
    chunk_mb: int


@torch.inference_mode()
def run_naive(b: Bench, t: Target) -> dict:
    """Batch 1, every hidden state, synchronous copies, one file a sample, for --naive-seconds."""
    from safetensors.torch import save_file

    out_dir = b.work / "naive"
    out_dir.mkdir(parents=True, exist_ok=True)

    def one(i, s):
        ids = torch.tensor([s], device=b.device)
        hs = t.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        aux = torch.cat([hs[j][0] for j in t.layers], dim=-1).cpu()
        save_file({"aux_hidden": aux, "final_hidden": hs[-1][0].cpu()}, str(out_dir / f"sample-{i}.safetensors"))

    one(-1, t.samples[0])  # warm-up
    sync(b.device)
    tokens, t0, i = 0, time.perf_counter(), 0
    while i < len(t.samples) and time.perf_counter() - t0 < b.args.naive_seconds:
        one(i, t.samples[i])
        tokens += len(t.samples[i])
        i += 1
    dt = time.perf_counter() - t0
    shutil.rmtree(out_dir, ignore_errors=True)
    return {"tokens": tokens, "samples": i, "seconds": round(dt, 3), "tok_per_s": tokens / dt}


def bench_config(b: Bench, t: Target, out_dir: Path, writers: int, params: dict) -> ExtractConfig:
    # states stored in the compute dtype unless a row names fp8 (--fp8): the figures since 2026-12-03 were measured
    # so, and the run's own "auto" (fp8 on a GPU since 2026-12-06) is a row of its own
    params = {"compile": False, "backend": "hf", "attention": "auto", "storage_dtype": b.dtype_name, **params}
    target = TargetConfig(model_path=t.model_path, capture_layers=t.layers, dtype=b.dtype_name)
    return ExtractConfig(target=target, extract_dir=str(out_dir), device=str(b.device),
                         token_budget=params.pop("token_budget", t.budget), chunk_mb=t.chunk_mb,
                         writer_threads=writers, log_every_s=5.0, **params)


def make_backend(cfg: ExtractConfig, model):
    return BACKENDS[cfg.backend](model=model, **backend_options(cfg))


def run_extractor(b: Bench, t: Target, samples, writers: int, model=None, **params) -> dict:
    """One shard of `samples` through the extractor as the operator runs it, timed; `params` are ExtractConfig's
    (compile, backend, attention, pad_multiple, storage_dtype, token_budget, experts_implementation, ...)."""
    model = model or t.model
    work = b.work / "ext"
    shutil.rmtree(work, ignore_errors=True)
    write_merged_dataset(work / "merge", samples, rows_per_file=512)
    spec = plan_shards(ShardPlanConfig(str(work / "merge"), 1))[0]
    c = model.config
    mc = {"num_layers": c.num_hidden_layers, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size}
    cfg = bench_config(b, t, work / "out", writers, params)
    backend = make_backend(cfg, model)
    if b.args.cold_host_buffers and b.device.type == "cuda":
        empty_pinned_host_cache(b.device)
    reaper = ChunkReaper(work / "out") if b.args.discard_chunks else contextlib.nullcontext()
    start = time.perf_counter()
    with reaper:
        out = ShardExtractor(cfg, spec, backend=backend, model_config=mc).run()
    wall = time.perf_counter() - start
    shutil.rmtree(work, ignore_errors=True)
    return {**out, "wall_s": round(wall, 3), "tok_per_s_wall": out["tokens"] / wall}


def warm_and_run(b: Bench, t: Target, writers: int, model=None, around=contextlib.nullcontext, **params) -> dict:
    """A warm-up run on a few samples (kernels, allocator, pinned buffers; it pays the compilation, as each task
    would once), then the measured run on the target's samples, inside `around()` (a profiler)."""
    torch._dynamo.reset()  # a compiled graph keeps the SDPA kernel it was traced with
    warm = make_samples(min(sum(map(len, t.samples)), b.args.warm_tokens or 4 * t.budget), b.args.min_len,
                        b.args.max_len, (model or t.model).config.vocab_size, seed=2)
    start = time.perf_counter()
    run_extractor(b, t, warm, writers, model=model, **params)
    warm_s = time.perf_counter() - start
    with around():
        run = run_extractor(b, t, t.samples, writers, model=model, **params)
    return {**run, "warmup_with_compile_s": round(warm_s, 1)}


def measure_variants(b: Bench, name: str, t: Target) -> tuple[dict, dict]:
    """The eager extractor at each writer count, then each compiled variant (compile, fused-llama) per SDPA
    kernel. Returns (every variant, the fastest in wall time with its params)."""
    a, variants, best = b.args, {}, None
    writer_counts = [int(x) for x in a.writers.split(",")]
    writers = writer_counts[0]
    if not a.no_eager:
        for w in writer_counts:
            variants[w] = warm_and_run(b, t, w)
            print(f"[{name}] writers={w}: {variants[w]['tok_per_s_wall']:.0f} tok/s wall, "
                  f"{variants[w]['steady_tok_per_s']:.0f} steady", flush=True)
        writers = max(variants, key=lambda w: variants[w]["tok_per_s_wall"])
        best = dict(variants[writers], writer_threads=writers, params={"compile": False})
    for (label, backend, wanted), attention in itertools.product(
            (("compiled", "hf", a.compile), ("fused-llama", "fused-llama", a.fused)), a.attention.split(",")):
        if name not in wanted.split(","):
            continue
        label += "" if attention == "auto" else f"-{attention}"
        params = {"compile": True, "backend": backend, "attention": attention}
        v = variants[label] = warm_and_run(b, t, writers, **params)
        print(f"[{name}] {label}: {v['tok_per_s_wall']:.0f} tok/s wall, {v['steady_tok_per_s']:.0f} between first "
              f"and last commit; setup {v.get('setup_s', 0):.1f} s, tail {v.get('tail_s', 0):.1f} s of "
              f"{v['wall_s']:.1f} s (warm-up incl. compile {v['warmup_with_compile_s']:.0f} s); compute waited for "
              f"writers {v.get('compute_waited_for_writers_s')} s, writers busy {v.get('writer_busy_fraction')}, "
              f"host buffers made in {v.get('host_buffer_alloc_s')} s (ahead, beside the load: "
              f"{v.get('host_buffers_made_ahead_s')} s)", flush=True)
        if best is None or v["tok_per_s_wall"] > best["tok_per_s_wall"]:
            best = dict(v, writer_threads=writers, params=params)
    if best is None:
        raise ValueError("--no-eager leaves nothing to measure: name this model in --compile or --fused")
    return variants, best


def measure_fp8_weights(b: Bench, name: str, t: Target, best: dict, blocks: bool = False) -> dict:
    """The same weights quantized to FP8 on load, through the fastest variant's params: rate against it, and the
    relative error of the captured states on two samples. `blocks`: in DeepSeek-V3's FP8 checkpoint layout, run
    by the project's kernels (quantize_fp8_blocks); else torchao on the linears."""
    model, _ = build_model(name, b.device, b.dtype, b.args.real_path, b.args.dsv3_layers)  # seed 0: t.model's weights
    experts = fp8_experts_fit(model)  # a MoE target's experts in FP8 too, through the fused kernels
    method = quantize_fp8_blocks(model) if blocks else quantize_fp8(model, experts=experts)
    params = {**best["params"], **({"experts_implementation": "triton_fused"} if experts else {})}
    linears = b.args.fp8_linear.split(",") if blocks else ["auto"]
    runs = {x: warm_and_run(b, t, best["writer_threads"], model=model, fp8_linear=x, **params) for x in linears}
    v = runs[linears[0]]
    for x, w in list(runs.items())[1:]:  # the other FP8 linear kernels, side by side with the first
        print(f"[{name}] fp8_linear={x}: {w['tok_per_s_wall']:.0f} tok/s wall, {w['steady_tok_per_s']:.0f} steady "
              f"({w['steady_tok_per_s'] / max(v['steady_tok_per_s'], 1e-9):.2f}x {linears[0]}'s)", flush=True)
    n = min(256, *(len(s) for s in t.samples[:2]))
    ids = torch.tensor([s[:n] for s in t.samples[:2]], device=b.device)
    rates = {x: {k: w.get(k) for k in ("tok_per_s_wall", "steady_tok_per_s")} for x, w in runs.items()}
    r = {"method": method, "extractor": v, "fp8_linear": rates,
         "wall_over_reference": v["tok_per_s_wall"] / best["tok_per_s_wall"],
         "steady_over_reference": v["steady_tok_per_s"] / max(best["steady_tok_per_s"], 1e-9),
         "state_error": states_error(t.model, model, t.layers, b.dtype_name, ids,
                                     experts=params.get("experts_implementation", "auto"))}
    print(f"[{name}] fp8 {'blocks' if blocks else 'weights'} ({method}): {v['tok_per_s_wall']:.0f} tok/s wall "
          f"({r['wall_over_reference']:.2f}x), "
          f"{v['steady_tok_per_s']:.0f} steady ({r['steady_over_reference']:.2f}x); warm-up incl. compile "
          f"{v['warmup_with_compile_s']:.0f} s", flush=True)
    for e in r["state_error"]:
        print(f"  {e['layer']:>18}: rel L2 {e['rel_l2']:.4f}, cosine {e['cosine_mean']:.4f}", flush=True)
    if blocks:  # against what FP8 GEMMs can do, not only against bf16
        lengths, cuda = np.array([len(s) for s in t.samples]), b.device.type == "cuda"
        roof = fp8_roofline(b.device, b.dtype, b.args.matmul_n or (8192 if cuda else 256),
                            b.args.matmul_seconds or (4.0 if cuda else 0.3), model.config, int(lengths.sum()),
                            model_flops_per_sample(model.config, lengths))
        r["fp8_roofline"] = {**roof, "fraction_wall": v["tok_per_s_wall"] / roof["roofline_tok_per_s"],
                             "fraction_steady": v["steady_tok_per_s"] / roof["roofline_tok_per_s"]}
        print(f"[{name}] fp8 matmul {roof['fp8_matmul']['sustained'] / 1e12:.0f} TFLOP/s sustained "
              f"({roof['fp8_over_dense']:.2f}x {b.dtype_name}): FP8 roofline {roof['roofline_tok_per_s']:.0f} tok/s "
              f"-> {100 * r['fp8_roofline']['fraction_steady']:.0f}% steady, "
              f"{100 * r['fp8_roofline']['fraction_wall']:.0f}% wall", flush=True)
    return r


def measure_rounds(b: Bench, t: Target, best: dict, probes: dict, bytes_per_token: int) -> dict:
    """--rounds more runs of the fastest variant, once per --pad-multiples value, each between two disk probes
    written the way the faster of the initial probes at its writer count was."""
    a, w, seeds = b.args, best["writer_threads"], itertools.count(100)

    def run(pad_multiple):
        mine = (make_samples(sum(map(len, t.samples)), a.min_len, a.max_len, t.model.config.vocab_size,
                             seed=next(seeds)) if a.fresh_rounds else t.samples)
        return run_extractor(b, t, mine, w, **best["params"], pad_multiple=pad_multiple)

    extracts = {f"extractor-pad{pm}": functools.partial(run, int(pm) if pm.isdigit() else pm)
                for pm in a.pad_multiples.split(",")}
    mine = {k: v for k, v in probes.items() if k.startswith(f"{w}_writers")}
    early = max(mine, key=mine.get).endswith("_early_writeback")
    probe_bytes = int((a.round_probe_gb or a.disk_gb) * 1e9)
    out = interleaved_rounds(a.rounds, lambda: disk_probe(b.work / "disk", probe_bytes, t.chunk_mb << 20, w, early),
                             extracts, bytes_per_token)
    return {**out, "probe_early_writeback": early}


def measure_model(b: Bench, name: str, n_tok: int, budget: int, chunk_mb: int, res: dict) -> None:
    a = b.args
    real_path = a.real_path
    if name == "real" and real_path is None:
        from eagle3.models import ensure_smollm2

        real_path = str(ensure_smollm2())
    start = time.perf_counter()
    model, model_path = build_model(name, b.device, b.dtype, real_path, a.dsv3_layers)
    build_s, c = time.perf_counter() - start, model.config
    t = Target(model, model_path, make_samples(n_tok, a.min_len, a.max_len, c.vocab_size, seed=1),
               default_capture_layers(c.num_hidden_layers), budget, chunk_mb)
    lengths = np.array([len(s) for s in t.samples])
    flops = model_flops_per_sample(c, lengths)
    roofline = lengths.sum() / (flops / res["matmul_flops"])
    n, sustained = res["matmul_n"], []
    if a.matmul_seconds and b.device.type == "cuda":
        sustained.append(matmul_sustained(b.device, b.dtype, n, a.matmul_seconds))
        print(f"[{name}] matmul sustained over {a.matmul_seconds:.0f} s: {sustained[-1]['sustained'] / 1e12:.0f} "
              f"TFLOP/s (first 0.1 s: {sustained[-1]['first_group'] / 1e12:.0f})", flush=True)
    disk = max(res["disk_bytes_per_s"].values())
    bpt = bytes_per_token(len(t.layers), c.hidden_size, b.dtype_name)
    naive = run_naive(b, t)
    print(f"[{name}] naive: {naive['tok_per_s']:.0f} tok/s ({naive['samples']} samples)", flush=True)
    variants, best = measure_variants(b, name, t)
    if name in a.fp8.split(","):
        v = run_extractor(b, t, t.samples, best["writer_threads"], storage_dtype="float8_e4m3fn")
        bpt8 = bytes_per_token(len(t.layers), c.hidden_size, "float8_e4m3fn")
        res["models"][name + "-fp8"] = {"storage": "float8_e4m3fn",
                                        **limits_entry(v, naive, roofline, disk / bpt8, bpt8)}
        print(f"[{name}-fp8] extractor: {v['tok_per_s_wall']:.0f} tok/s, {v['bytes'] / 1e9:.1f} GB, "
              f"{100 * res['models'][name + '-fp8']['fraction_of_limit']:.0f}% of limit", flush=True)
    r = {"model_path": model_path, "build_s": round(build_s, 1), "params": sum(p.numel() for p in model.parameters()),
         "capture_layers": t.layers, "token_budget": budget, "samples": len(t.samples), "tokens": int(lengths.sum()),
         "lengths": [a.min_len, a.max_len], "chunk_mb": chunk_mb,
         **limits_entry(best, naive, roofline, disk / bpt, bpt),
         "variants": {str(w): {k: v.get(k) for k in ("tok_per_s_wall", "steady_tok_per_s", "warmup_with_compile_s")}
                      for w, v in variants.items()}}
    if name in a.fp8_weights.split(","):
        r["fp8_weights"] = measure_fp8_weights(b, name, t, best)
    if name in a.fp8_blocks.split(","):
        r["fp8_blocks"] = measure_fp8_weights(b, name, t, best, blocks=True)
    if a.rounds:
        r["interleaved"] = measure_rounds(b, t, best, res["disk_bytes_per_s"], bpt)
    if sustained:
        sustained.append(matmul_sustained(b.device, b.dtype, n, a.matmul_seconds))
        against_sustained(name, r, sustained, int(lengths.sum()), flops)
    if is_moe(model):
        rate = statistics.mean(x["sustained"] for x in sustained) if sustained else res["matmul_flops"]
        r["moe"] = measure_moe(b, name, t, best, lengths.sum() / (flops / rate), rate, lengths, warm_and_run)
    if a.profile_batches:  # the fastest variant's kernels, compiled afresh for the profile's batches
        torch._dynamo.reset()
        cfg = bench_config(b, t, b.work / "profile", best["writer_threads"], dict(best["params"]))
        cfg = resolve_for_device(cfg)  # pad_multiple as the extractor plans on this device
        roof = r.get("matmul_sustained", {}).get("roofline_tok_per_s", roofline)
        r["forward_profile"] = run_profile(b, name, t, make_backend(cfg, t.model), cfg.pad_multiple, roof)
    if name in a.profile_extractor.split(","):
        r["extractor_profile"] = extractor_profile(b, name, lambda around: warm_and_run(
            b, t, best["writer_threads"], around=around, **best["params"]))
    if a.variants and name in a.variant_models.split(","):
        r["side_by_side"] = measure_variants_side_by_side(b, name, t, best, parse_variants(a.variants), warm_and_run)
    if b.device.type == "cuda":
        r["peak_gpu_mem_gb"] = torch.cuda.max_memory_allocated(b.device) / 1e9
        torch.cuda.reset_peak_memory_stats(b.device)
    res["models"][name] = r
    print(f"[{name}] extractor: {best['tok_per_s_wall']:.0f} tok/s ({best['tokens']} tokens, {best['bytes'] / 1e9:.1f} "
          f"GB, {best['chunks']} chunks, {best['wall_s']:.1f}s); roofline {roofline:.0f}, disk limit {disk / bpt:.0f} "
          f"-> {100 * r['fraction_of_limit']:.0f}% of {r['binding_limit']} limit, {r['ratio_to_naive']:.1f}x naive",
          flush=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="135m,1b,8b")
    ap.add_argument("--tokens", default="3e6,1e6,6e5", help="tokens extracted per model (comma list)")
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="compute dtype (default bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--budget", default=None, help="token_budget per model (comma list)")
    ap.add_argument("--warm-tokens", type=int, default=0, help="tokens of each run's warm-up, which pays the "
                    "compilation (0: four token budgets; at most the measured run's tokens)")
    ap.add_argument("--writers", default="3", help="writer threads; a comma list measures each, the best is reported")
    ap.add_argument("--chunk-mb", default="1024", help="chunk size in MB: one for all models or a comma list")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager variants (measure --compile/--fused only)")
    ap.add_argument("--naive-seconds", type=float, default=8.0)
    ap.add_argument("--disk-gb", type=float, default=6.0)
    ap.add_argument("--matmul-n", type=int, default=None)
    ap.add_argument("--matmul-seconds", type=float, default=0.0, help="also probe the sustained matmul rate for "
                    "this long, before each model and after its runs; the roofline then uses the mean of the two")
    ap.add_argument("--work-dir", default="bench_work")
    ap.add_argument("--discard-chunks", action="store_true", help="delete each chunk once committed (a shard "
                    "larger than the disk; with --work-dir on tmpfs, the extractor measured without the disk)")
    ap.add_argument("--real-path", default=None, help="HF folder of the real model (default: ensure_smollm2())")
    ap.add_argument("--fp8", default="", help="models also measured with fp8 *storage* (comma list)")
    ap.add_argument("--fp8-weights", default="", help="models also measured quantized to FP8 on load, through the "
                    "fastest variant: rate and state error against it (comma list; GPU: torchao, CPU: simulated)")
    ap.add_argument("--fp8-linear", default="auto", help="with --fp8-blocks: the FP8 linears' kernels, side by side "
                    "(extract param fp8_linear), e.g. triton,scaled_mm; the first is the row's figure")
    ap.add_argument("--fp8-blocks", default="", help="models also measured in DeepSeek-V3's FP8 checkpoint layout "
                    "(decoder linears and routed experts in float8 128 x 128 blocks, the project's kernels), through "
                    "the fastest variant: rate and state error against it (comma list)")
    ap.add_argument("--dsv3-layers", type=int, default=None, help="decoder layers of the dsv3 shape (default: as "
                    "many as fit the GPU; --fp8-weights/--fp8-blocks hold a second copy, so 5 = 3 dense + 2 MoE)")
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
    ap.add_argument("--pad-multiples", default="auto", help="in the rounds, the extractor once per value of "
                    "ExtractConfig.pad_multiple (comma list, e.g. 1,auto,64: batches padded to a bounded set of "
                    "shapes); the runs before the rounds use auto")
    ap.add_argument("--fresh-rounds", action="store_true", help="every run in the rounds extracts new samples (same "
                    "length distribution, new seed), as a production shard meets new batch shapes all the time; "
                    "without it the rounds repeat the first run's samples and shapes")
    ap.add_argument("--cold-host-buffers", action="store_true", help="empty torch's cache of pinned host memory "
                    "before every extractor run, so each pins its chunk buffers as a task in a fresh process does")
    ap.add_argument("--variants", default="", help="levers side by side on the fastest variant, one at a time: "
                    "'name:key=val,...;name2:...' (keys: budget, pad, experts, scope, compile, attention; "
                    "bench/extract_levers.py)")
    ap.add_argument("--variant-models", default="", help="models the --variants run on (comma list)")
    ap.add_argument("--skew", type=float, default=0.0, help="MoE models: also run with a Zipf-like router "
                    "(expert rows scaled by rank^-SKEW) and report its routing load and cost")
    ap.add_argument("--profile-batches", type=int, default=0, help="then the forward alone on N planned batches, "
                    "profiled: its rate, the GPU's busy share, kernel time by kind (bench/extract_profile.py)")
    ap.add_argument("--profile-extractor", default="", help="models (comma list) whose fastest variant runs once "
                    "more, warm, with the whole extractor profiled on the GPU: the compute kernels' busy share of "
                    "its wall time and their time per token against the forward alone's (bench/extract_profile.py)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, every option but compilation")
    ap.add_argument("--out", default=None)
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = torch.device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    b = Bench(args, device, getattr(torch, dtype_name), dtype_name, Path(args.work_dir).resolve())
    models = args.models.split(",")
    tokens = [int(float(x)) for x in args.tokens.split(",")]
    budgets = [int(x) for x in args.budget.split(",")] if args.budget else [DEFAULT_BUDGET[m] for m in models]
    chunk_mbs = [int(x) for x in args.chunk_mb.split(",")]
    chunk_mbs = chunk_mbs * len(models) if len(chunk_mbs) == 1 else chunk_mbs
    if len(chunk_mbs) != len(models):
        sys.exit(f"--chunk-mb: {len(chunk_mbs)} sizes for {len(models)} models")
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:] if argv is None else argv,
           "machine": platform.node(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "dtype": dtype_name, "models": {}}
    res.update(machine_limits(device, b.dtype, b.work, [int(x) for x in args.writers.split(",")], chunk_mbs,
                              args.disk_gb, args.matmul_n))
    for name, n_tok, budget, chunk_mb in zip(models, tokens, budgets, chunk_mbs):
        try:
            measure_model(b, name, n_tok, budget, chunk_mb, res)
        except Exception as e:  # one model failing must not lose the others' figures
            logging.exception("model %s failed", name)
            res["models"][name] = {"error": f"{type(e).__name__}: {e}"}
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2))
    print_summary(res)
    return 1 if any("error" in r for r in res["models"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
