"""Where an extraction forward pass spends its GPU time: GEMMs, attention, the rest.

For one Llama shape (random weights, built on the device) and a few batch shapes of one token budget, in one
process, against the machine's own 8192^3 bf16 matmul rate:
  - the decoder's GEMMs alone (each projection at M = batch tokens, as HF runs them, and fused q/k/v, gate/up),
  - causal attention alone, per SDPA kernel (flash, cudnn, efficient), at the model's head layout,
  - the whole capture forward (`HFBackend.capture`: hooks, no lm_head), eager and compiled, per SDPA kernel,
  - a torch.profiler table of one compiled forward, kernels grouped into GEMM / attention / Triton / other.
It prints a table and writes JSON; it changes nothing. The figures decide `ExtractConfig.attention`'s default
(docs/benchmarks.md).

    python3 bench/extract_profile_gpu.py --model 8b --shapes 4x8192,8x4096,32x1024,128x256 --out prof.json
    python3 bench/extract_profile_gpu.py --model 8b --shapes 8x4096,1x8192 --attention auto --no-eager \
        --inductor default,max-autotune,default   # Inductor's GEMM autotuning against its defaults (run 8)
    python3 bench/extract_profile_gpu.py --model 135m --sweep-tokens 4e6 --budget 32768 \
        --attention auto,flash,cudnn --pad-multiples 1,auto   # what a batch shape seen for the first time costs

--sweep-tokens replaces the tables above with the shape sweep: the extractor's own batch plan (length-sorted under
the token budget, padded to `pad_multiple`) over fresh random lengths, each batch run as the compute thread runs it
(capture forward + gather of the real tokens), timed batch by batch with a sync; once over shapes this process has
not seen, then again over the same shapes. The difference is what new shapes cost a production shard.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extract_bench import build_model, matmul_probe, model_flops_per_sample  # noqa: E402

from eagle3.extract.backend import HFBackend, sdpa_context  # noqa: E402
from eagle3.extract.extractor import padded_length, plan_batches, real_token_index  # noqa: E402


def gpu_time(fn, reps: int) -> float:
    """Median seconds of `fn` over `reps` runs after one warm-up, timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def gemm_table(model, tokens: int, reps: int) -> dict:
    """Seconds and TFLOP/s of each decoder-layer projection at M = tokens, and the whole stack's GEMM time."""
    layer = model.model.layers[0]
    att, mlp = layer.self_attn, layer.mlp
    weights = {"q": att.q_proj.weight, "k": att.k_proj.weight, "v": att.v_proj.weight, "o": att.o_proj.weight,
               "gate": mlp.gate_proj.weight, "up": mlp.up_proj.weight, "down": mlp.down_proj.weight}
    weights["qkv_fused"] = torch.cat([weights["q"], weights["k"], weights["v"]])
    weights["gate_up_fused"] = torch.cat([weights["gate"], weights["up"]])
    out = {}
    for name, w in weights.items():
        x = torch.randn(tokens, w.shape[1], device=w.device, dtype=w.dtype)
        s = gpu_time(lambda: F.linear(x, w), reps)
        out[name] = {"shape": [tokens, w.shape[1], w.shape[0]], "s": s, "tflops": 2 * tokens * w.numel() / s / 1e12}
    n = model.config.num_hidden_layers
    out["stack_s"] = n * sum(out[k]["s"] for k in ("q", "k", "v", "o", "gate", "up", "down"))
    out["stack_fused_s"] = n * sum(out[k]["s"] for k in ("qkv_fused", "o", "gate_up_fused", "down"))
    return out


def attention_table(cfg, B: int, L: int, reps: int, device, dtype) -> dict:
    """Causal SDPA at the model's head layout, per kernel; TFLOP/s counts the causal half only."""
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    q = torch.randn(B, h, L, hd, device=device, dtype=dtype)
    k = torch.randn(B, kv, L, hd, device=device, dtype=dtype)
    v = torch.randn(B, kv, L, hd, device=device, dtype=dtype)
    flops = 4.0 * B * h * hd * L * (L + 1) / 2
    out = {}
    for name in ("flash", "cudnn", "efficient"):
        for gqa in (True, False):
            kk, vv = (k, v) if gqa else (k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1))
            key = f"{name}{'' if gqa else '_repeat_kv'}"
            try:
                with sdpa_context(name):
                    s = gpu_time(lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa), reps)
                out[key] = {"s_per_layer": s, "tflops": flops / s / 1e12}
            except RuntimeError as e:
                out[key] = {"error": str(e).splitlines()[0][:200]}
    return out


def forward_time(backend, B: int, L: int, vocab: int, reps: int, device) -> float:
    ids = torch.randint(3, vocab, (B, L), device=device)
    return gpu_time(lambda: backend.capture(ids), reps)


def profile_table(backend, B: int, L: int, vocab: int, device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(3, vocab, (B, L), device=device)
    backend.capture(ids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        backend.capture(ids)
        torch.cuda.synchronize()
    groups, kernels = {"gemm": 0.0, "attention": 0.0, "triton": 0.0, "copy/other": 0.0}, []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t <= 0:
            continue
        n = e.key.lower()
        # Triton first: Inductor names its fused RoPE kernels after the SDPA op they feed; cuDNN's attention
        # kernel is named "..._sdpa_sm90_flash_fprop_wgmma...", so attention before GEMM
        if n.startswith("triton") and ("_tem_" in n or "mm" in n.split("_")):
            g = "gemm"  # an Inductor GEMM template (max-autotune), with whatever it fused into its epilogue
        elif n.startswith("triton"):
            g = "triton"
        elif any(s in n for s in ("flash", "fmha", "sdpa", "attention")):
            g = "attention"
        elif any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "sm90_")):
            g = "gemm"
        else:
            g = "copy/other"
        groups[g] += t / 1e6
        kernels.append((t / 1e6, g, e.key[:120], e.count))
    kernels.sort(reverse=True)
    return {"groups_s": groups, "top": [{"s": k[0], "group": k[1], "name": k[2], "count": k[3]} for k in kernels[:25]]}


def planned_batches(n_tokens: int, budget: int, pad_multiple: int | str, seed: int, lo: int = 256,
                    hi: int = 8192) -> list[tuple[int, np.ndarray]]:
    """(padded length, sample lengths) of every batch the extractor would run over fresh random lengths."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, int(n_tokens / ((lo + hi) / 2)) + 1)
    chunks = plan_batches(lengths, np.arange(len(lengths)), budget, chunk_tokens=1 << 40, pad_multiple=pad_multiple)
    return [(padded_length(int(lengths[b].max()), pad_multiple), lengths[b]) for c in chunks for b in c]


def _counters() -> dict:
    """Dynamo's and Inductor's event counters (graphs compiled, recompiles, cache hits), flattened."""
    from torch._dynamo.utils import counters

    return {f"{g}.{k}": v for g in ("stats", "inductor", "aot_autograd") for k, v in counters[g].items()}


def sweep_pass(backend, batches, vocab: int, device, profile_batches: int = 0) -> dict:
    """Run each batch as the extractor's compute thread does (forward, then gather the real tokens of every
    captured state); seconds per batch with a sync after each, the part of it before the sync (host side: launches,
    and whatever the host builds for a new shape), the allocator's device mallocs and the compiler's counters.
    With profile_batches, the first that many batches run under torch.profiler (host and device)."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    stats = (lambda: torch.cuda.memory_stats(device)) if cuda else dict
    sync()
    before, counts = stats(), _counters()
    times, host, shapes, prof = [], [], set(), None
    for i, (L, lens) in enumerate(batches):
        ids = torch.randint(3, vocab, (len(lens), L), device=device)
        real = torch.from_numpy(real_token_index(lens, L))
        sync()
        if i == 0 and profile_batches:
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            prof.__enter__()
        t = time.perf_counter()
        aux, final = backend.capture(ids)
        real = real.to(device, non_blocking=True)
        for a in (*aux, final):
            a.reshape(-1, a.shape[-1]).index_select(0, real)
        host.append(time.perf_counter() - t)
        sync()
        times.append(time.perf_counter() - t)
        shapes.add((len(lens), L))
        if prof is not None and i + 1 == profile_batches:
            prof.__exit__(None, None, None)
    after, counts_after = stats(), _counters()
    times, host = np.array(times), np.array(host)
    out = {"batches": len(batches), "distinct_shapes": len(shapes), "tokens": int(sum(x.sum() for _, x in batches)),
           "s": float(times.sum()), "host_s": float(host.sum()), "median_batch_s": float(np.median(times)),
           "median_host_s": float(np.median(host)), "max_batch_s": float(times.max()),
           "slowest": [round(float(x), 4) for x in np.sort(times)[-5:]],
           "device_mallocs": after.get("num_device_alloc", 0) - before.get("num_device_alloc", 0),
           "alloc_retries": after.get("num_alloc_retries", 0) - before.get("num_alloc_retries", 0),
           "compiler_counters": {k: v - counts.get(k, 0) for k, v in counts_after.items() if v != counts.get(k, 0)}}
    if prof is not None:
        ev = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        ev.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
        out["profile_host_top"] = [{"name": e.key[:140], "self_cpu_ms": e.self_cpu_time_total / 1e3,
                                    "count": e.count} for e in ev[:20]]
        dev = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
        dev.sort(key=lambda e: e.self_device_time_total, reverse=True)
        out["profile_device_top"] = [{"name": e.key[:140], "self_device_ms": e.self_device_time_total / 1e3,
                                      "count": e.count} for e in dev[:12]]
    return out


def shape_sweep(model, args, device, peak: float, res: dict, save) -> None:
    """For each SDPA kernel and pad multiple: a warm-up pass (compilation included), then a pass over fresh
    shapes and the same pass again. Each (kernel, pad multiple) draws its own lengths, so no variant finds the
    shapes an earlier one left in a cache."""
    cfg = model.config
    n = cfg.num_hidden_layers
    seeds = iter(range(1000, 10**6))
    out = res["sweep"] = {"tokens": args.sweep_tokens, "budget": args.budget, "variants": {}}
    for att in args.attention.split(","):
        torch._dynamo.reset()
        backend = HFBackend(model=model, compile=True, attention=att)
        backend.load("random", "bfloat16" if device.type == "cuda" else "float32", str(device), [2, n // 2, n - 3])
        for pm in (int(x) if x.isdigit() else x for x in args.pad_multiples.split(",")):
            label = f"{att}-pad{pm}"
            try:
                t = time.perf_counter()
                sweep_pass(backend, planned_batches(4 * args.budget, args.budget, pm, next(seeds)), cfg.vocab_size,
                           device)
                warm_s = time.perf_counter() - t
                batches = planned_batches(args.sweep_tokens, args.budget, pm, next(seeds))
                flops = sum(model_flops_per_sample(cfg, np.full(len(x), L)) for L, x in batches)
                first = sweep_pass(backend, batches, cfg.vocab_size, device, args.sweep_profile)
                again = sweep_pass(backend, batches, cfg.vocab_size, device, args.sweep_profile)
                v = {"warmup_s": round(warm_s, 1), "first": first, "again": again, "roofline_s": flops / peak,
                     "new_shape_cost_s": (first["s"] - again["s"]) / max(first["distinct_shapes"], 1)}
                out["variants"][label] = v
                for k in first.get("profile_host_top", [])[:10]:
                    print(f"   new shapes, host {k['self_cpu_ms']:8.1f} ms {k['count']:5d}x {k['name']}", flush=True)
                for k in again.get("profile_host_top", [])[:5]:
                    print(f"   same shapes, host {k['self_cpu_ms']:8.1f} ms {k['count']:5d}x {k['name']}", flush=True)
                print(f"[sweep {label}] {first['batches']} batches, {first['distinct_shapes']} shapes, "
                      f"{first['tokens']} tokens: new shapes {first['s']:.2f} s ({first['tokens'] / first['s']:.0f} "
                      f"tok/s), same shapes again {again['s']:.2f} s ({again['tokens'] / again['s']:.0f} tok/s); "
                      f"{1e3 * v['new_shape_cost_s']:.1f} ms a new shape; slowest first {first['slowest']}; "
                      f"host side {first['host_s']:.2f} / {again['host_s']:.2f} s; "
                      f"device mallocs {first['device_mallocs']} / {again['device_mallocs']}; "
                      f"compiler {first['compiler_counters']} / {again['compiler_counters']}; "
                      f"roofline {flops / peak:.2f} s (padded tokens)", flush=True)
            except Exception as e:  # a kernel this build lacks must not lose the other figures
                out["variants"][label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                print(f"[sweep {label}] {out['variants'][label]['error']}", flush=True)
            save()
        backend.close()


# Inductor settings for the compiled forward: torch's default, and max-autotune, which times Triton GEMM templates
# (with the elementwise work after a GEMM fused into its epilogue) against cuBLAS for each projection
INDUCTOR_PRESETS = {
    "default": {},
    "max-autotune": {"max_autotune": True, "coordinate_descent_tuning": True},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="8b")
    ap.add_argument("--shapes", default="4x8192,8x4096,32x1024,128x256", help="BxL batch shapes (comma list)")
    ap.add_argument("--attention", default="auto,flash,cudnn", help="SDPA kernels for the whole forward")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile-shape", default="8x4096")
    ap.add_argument("--inductor", default="default", help="Inductor settings the compiled forward is measured with "
                    f"(comma list of {', '.join(INDUCTOR_PRESETS)}); each compiles afresh")
    ap.add_argument("--no-eager", action="store_true", help="measure the compiled forward only")
    ap.add_argument("--sweep-tokens", type=float, default=0, help="run the shape sweep over this many tokens "
                    "instead of the tables (see above)")
    ap.add_argument("--budget", type=int, default=32768, help="token budget of the sweep's batches")
    ap.add_argument("--sweep-profile", type=int, default=0, help="profile the first N batches of each sweep pass "
                    "(host and device time by op)")
    ap.add_argument("--pad-multiples", default="1,auto", help="ExtractConfig.pad_multiple values the sweep runs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device, dtype = torch.device("cuda"), torch.bfloat16
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:], "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "device": torch.cuda.get_device_name(device)}
    res["matmul_flops"] = peak = matmul_probe(device, dtype, 8192, reps=20)
    print(f"matmul bf16 8192^3: {peak / 1e12:.0f} TFLOP/s", flush=True)

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2))

    model, _ = build_model(args.model, device, dtype, None)
    if args.sweep_tokens:
        shape_sweep(model, args, device, peak, res, save)
        save()
        return 0
    cfg, L_layers = model.config, model.config.num_hidden_layers
    layers = [2, L_layers // 2, L_layers - 3]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    tokens = shapes[0][0] * shapes[0][1]
    res["gemm"] = g = gemm_table(model, tokens, reps=10)
    print(f"GEMMs at M={tokens}: " + ", ".join(f"{k} {v['tflops']:.0f}" for k, v in g.items() if isinstance(v, dict))
          + f" TFLOP/s; the stack {g['stack_s'] * 1e3:.0f} ms ({g['stack_fused_s'] * 1e3:.0f} ms fused)", flush=True)
    res["shapes"] = {}
    for B, L in shapes:
        key = f"{B}x{L}"
        flops = model_flops_per_sample(cfg, np.full(B, L))
        a = attention_table(cfg, B, L, args.reps, device, dtype)
        res["shapes"][key] = {"tokens": B * L, "model_flops": flops, "roofline_s": flops / peak, "attention": a}
        print(f"[{key}] roofline {flops / peak * 1e3:.0f} ms; attention per layer: " + ", ".join(
            f"{k} {v['tflops']:.0f} TFLOP/s" if "tflops" in v else f"{k} n/a" for k, v in a.items()), flush=True)
        save()
    import torch._inductor.config as inductor_config

    variants = [] if args.no_eager else [(False, att, "default") for att in args.attention.split(",")]
    variants += [(True, att, preset) for preset in args.inductor.split(",") for att in args.attention.split(",")]
    done = set()
    for compile, att, preset in variants:
        try:
            with inductor_config.patch(INDUCTOR_PRESETS[preset]):
                pass
        except AttributeError as e:  # a setting this torch build does not have
            print(f"inductor preset {preset}: {e}", flush=True)
            continue
        torch._dynamo.reset()  # a compiled graph keeps the SDPA kernel and settings it was traced with
        backend = HFBackend(model=model, compile=compile, attention=att)
        backend.load("random", "bfloat16", "cuda", layers)
        label = f"{'compiled' if compile else 'eager'}-{att}" + ("" if preset == "default" else f"-{preset}")
        while label in done:  # a preset named twice (default,max-autotune,default): clocks drift, so measure again
            label += "-again"
        done.add(label)
        with inductor_config.patch(INDUCTOR_PRESETS[preset]):  # graphs compile at their first call, in here
            for B, L in shapes:
                r = res["shapes"][f"{B}x{L}"]
                try:
                    t = time.perf_counter()
                    s = forward_time(backend, B, L, cfg.vocab_size, args.reps, device)
                    r[label] = {"s": s, "tok_per_s": B * L / s, "fraction_of_roofline": r["roofline_s"] / s,
                                "first_call_s": round(time.perf_counter() - t - (args.reps + 1) * s, 1)}
                    print(f"[{B}x{L}] {label}: {s * 1e3:.0f} ms, {B * L / s:.0f} tok/s, "
                          f"{100 * r['roofline_s'] / s:.0f}% of roofline", flush=True)
                except Exception as e:  # one kernel missing must not lose the other figures
                    r[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                    print(f"[{B}x{L}] {label}: {r[label]['error']}", flush=True)
            if compile and args.profile_shape:
                B, L = (int(v) for v in args.profile_shape.split("x"))
                try:
                    p = profile_table(backend, B, L, cfg.vocab_size, device)
                    res.setdefault("profile", {})[label] = p
                    print(f"profile {label} {args.profile_shape}: " + ", ".join(
                        f"{k} {v * 1e3:.0f} ms" for k, v in p["groups_s"].items()), flush=True)
                    for k in p["top"][:12]:
                        print(f"   {k['s'] * 1e3:7.1f} ms  {k['count']:4d}x  {k['group']:10s} {k['name']}", flush=True)
                except Exception as e:
                    res.setdefault("profile", {})[label] = {"error": f"{type(e).__name__}: {e}"}
            backend.close()
            save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
