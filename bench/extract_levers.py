"""The levers bench/extract_bench.py compares side by side (`--variants`), and its MoE rows (`--moe`): the
experts' GEMM ceiling beside the active-parameter roofline, and the cost of a skewed router (`--skew`).

A variant is a set of ExtractConfig values run through the same warm-up and measured run as the fastest
variant; one lever a variant, so each row reads against the base:

    --variants "grouped:experts=grouped_mm;batched:experts=batched_mm;eager-experts:experts=eager;
                blocks:scope=moe-blocks;budget64k:budget=65536;pad64:pad=64;eager:compile=false;
                autotune:mode=max-autotune-no-cudagraphs;flash:attention=flash;tiles:kernel=tiles;tma_w:kernel=tma_w;
                tokmajor:mla=token-major;inplace:mla=in-place"
"""

from __future__ import annotations

import numpy as np
import torch

from bench.extract_moe import ceiling_roofline, expert_gemm_ceiling, restore_router, routing_load, skew_router
from eagle3.extract.moe import experts_modules

KEYS = {"budget": "token_budget", "token_budget": "token_budget", "pad": "pad_multiple",
        "pad_multiple": "pad_multiple", "experts": "experts_implementation",
        "experts_implementation": "experts_implementation", "scope": "compile_scope",
        "compile_scope": "compile_scope", "compile": "compile", "attention": "attention", "backend": "backend",
        "mode": "compile_mode", "compile_mode": "compile_mode", "kernel": "experts_kernel",
        "experts_kernel": "experts_kernel", "mla": "mla_joins", "mla_joins": "mla_joins"}


def _value(text: str):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    return int(low) if low.isdigit() else text.strip()


def parse_variants(spec: str) -> dict[str, dict]:
    """"name:key=val,key=val;name2:..." -> {name: {ExtractConfig field: value}}; a bad key fails naming it."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, body = part.partition(":")
        params = {}
        for kv in filter(None, (x.strip() for x in body.split(","))):
            key, eq, val = kv.partition("=")
            if not eq or key.strip() not in KEYS:
                raise SystemExit(f"--variants {part!r}: {kv!r} is not key=value with a key of {sorted(KEYS)}")
            params[KEYS[key.strip()]] = _value(val)
        out[name.strip()] = params
    return out


def measure_variants_side_by_side(b, name: str, t, best: dict, variants: dict, warm_and_run) -> dict:
    """The base (the fastest variant's params) run again, then each variant on those params with its own values
    over them, warm-up (compile) apart. Each reads against the base's second run ("base-again"), which finds the
    process as warm as the variants do: the first run of a process also makes the pinned host buffers and meets
    its kernels cold (on the H200 a Qwen3-30B-A3B base ran 10% under the same params as a later variant)."""
    out, ref = {}, best
    for label, over in {"base-again": {}, **variants}.items():
        params = {**best["params"], **over}
        try:
            v = warm_and_run(b, t, best["writer_threads"], **params)
        except (RuntimeError, ValueError) as e:  # an OOM or an unsupported lever costs its row, not the call
            out[label] = {"params": params, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            print(f"[{name}] variant {label} {over}: failed: {out[label]['error']}", flush=True)
            if b.device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        out[label] = {"params": params, **{k: v.get(k) for k in ("tok_per_s_wall", "steady_tok_per_s", "wall_s",
                                                                  "setup_s", "warmup_with_compile_s")}}
        against = "the base's first run" if ref is best else "the base run again"
        out[label]["over_base"] = {"wall": v["tok_per_s_wall"] / ref["tok_per_s_wall"],
                                   "steady": v["steady_tok_per_s"] / max(ref["steady_tok_per_s"], 1e-9),
                                   "against": against}
        print(f"[{name}] variant {label} {over}: {v['tok_per_s_wall']:.0f} tok/s wall, {v['steady_tok_per_s']:.0f} "
              f"steady ({out[label]['over_base']['wall']:.2f}x / {out[label]['over_base']['steady']:.2f}x "
              f"{against}); warm-up incl. compile {v['warmup_with_compile_s']:.0f} s", flush=True)
        if label == "base-again":
            ref = v
    return out


def flops_text(x: float) -> str:
    return f"{x / 1e12:.0f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.1f} GFLOP/s"


def routing_ids(t, device) -> torch.Tensor:
    n = min(512, *(len(s) for s in t.samples[:4]))
    return torch.tensor([s[:n] for s in t.samples[:4]], device=device)


def measure_moe(b, name: str, t, best: dict, roofline: float, matmul: float, lengths: np.ndarray,
                warm_and_run) -> dict:
    """The experts' GEMM ceiling at the routed shapes, the ceiling roofline, both ratios, and (--skew) the same
    model with a Zipf-like router: its routing load, its ceiling at that load and its rate through `best`."""
    cfg = t.model.config
    experts = experts_modules(t.model)[0]
    ceiling = expert_gemm_ceiling(cfg, t.budget, b.device, b.dtype, experts=experts)
    out = {"expert_ceiling": ceiling, "routing_uniform": routing_load(t.model, routing_ids(t, b.device))}
    if ceiling["ceiling"]:
        roof = ceiling_roofline(cfg, lengths, ceiling["ceiling"], matmul)
        out.update(ceiling_roofline=roof, fraction_of_ceiling_roofline=best["tok_per_s_wall"] / roof["tok_per_s"],
                   steady_fraction_of_ceiling_roofline=best["steady_tok_per_s"] / roof["tok_per_s"])
    out.update(fraction_of_active_roofline=best["tok_per_s_wall"] / roofline,
               steady_fraction_of_active_roofline=best["steady_tok_per_s"] / roofline)
    print(f"[{name}] experts' GEMMs alone at {ceiling['rows']} routed rows: "
          + ", ".join(f"{k} {flops_text(v)}" if isinstance(v, float) else f"{k} {v}"
                      for k, v in ceiling["kernels"].items())
          + f"; one dense GEMM of the same rows {flops_text(ceiling['dense_same_rows'])} (ceiling/dense "
          f"{ceiling['ceiling_over_dense'] or 0:.2f}); the whole experts step, copies included: "
          + ", ".join(f"{k} {flops_text(v)}" if isinstance(v, float) and not k.endswith("_rel_l2_vs_grouped_mm")
                      else f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}"
                      for k, v in ceiling.get("blocks", {}).items()), flush=True)
    print(f"[{name}] active-parameter roofline {roofline:.0f} tok/s: {100 * out['fraction_of_active_roofline']:.0f}% "
          f"wall, {100 * out['steady_fraction_of_active_roofline']:.0f}% steady; ceiling roofline "
          f"{out.get('ceiling_roofline', {}).get('tok_per_s', 0):.0f} tok/s: "
          f"{100 * out.get('fraction_of_ceiling_roofline', 0):.0f}% wall, "
          f"{100 * out.get('steady_fraction_of_ceiling_roofline', 0):.0f}% steady", flush=True)
    if b.args.skew:
        saved = skew_router(t.model, b.args.skew)
        try:
            load = routing_load(t.model, routing_ids(t, b.device))
            skew_ceiling = expert_gemm_ceiling(cfg, t.budget, b.device, b.dtype, counts=load["first_layer_counts"],
                                               experts=experts)
            v = warm_and_run(b, t, best["writer_threads"], **best["params"])
        except (RuntimeError, ValueError) as e:  # an OOM costs the row, not the figures above it
            out["skewed"] = {"exponent": b.args.skew, "error": f"{type(e).__name__}: {e}"}
            print(f"[{name}] skewed router: failed: {out['skewed']['error'][:300]}", flush=True)
            return out
        finally:
            restore_router(t.model, saved)
        out["skewed"] = {"exponent": b.args.skew, "routing": load, "expert_ceiling": skew_ceiling,
                         **{k: v.get(k) for k in ("tok_per_s_wall", "steady_tok_per_s", "warmup_with_compile_s")},
                         "wall_cost": 1 - v["tok_per_s_wall"] / best["tok_per_s_wall"],
                         "steady_cost": 1 - v["steady_tok_per_s"] / max(best["steady_tok_per_s"], 1e-9)}
        print(f"[{name}] skewed router (rank^-{b.args.skew}): busiest expert {load['max_over_mean']:.1f}x the mean "
              f"(uniform {out['routing_uniform']['max_over_mean']:.1f}x), busiest 10% take "
              f"{100 * load['top10pct_share']:.0f}%; {v['tok_per_s_wall']:.0f} tok/s wall, "
              f"{v['steady_tok_per_s']:.0f} steady: costs {100 * out['skewed']['wall_cost']:.0f}% wall, "
              f"{100 * out['skewed']['steady_cost']:.0f}% steady; ceiling at that load "
              f"{flops_text(skew_ceiling['ceiling'] or 0)}", flush=True)
    return out
