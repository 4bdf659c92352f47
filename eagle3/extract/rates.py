"""The extraction rate to expect, per target class, from what was measured: preflight's time estimate.

A measured rate is kept as the fraction of the active-parameter roofline it reached (eagle3.flops: FLOPs a token
at the sustained bf16 matmul rate), so it carries over to other targets of its class. The table and its sources
are docs/benchmarks.md, "Extraction rates by target class"; a class not measured yet borrows the nearest measured
one and the estimate says so. Torch-free.
"""

from __future__ import annotations

from eagle3.fit import fp8_checkpoint
from eagle3.flops import flops_per_token, target_class

H200_SUSTAINED_FLOPS = 664e12  # bf16 matmul held for seconds on one H200 (docs/benchmarks.md)
MEASURED = {
    "dense": {"fraction": 0.85, "figure": "36.2-36.9K tokens/s wall = 85% of the sustained roofline, random "
                                          "Llama-3.1-8B shape, compiled", "source": "docs/benchmarks.md, H200, 2026-12-03"},
    "moe": {"fraction": 0.68, "figure": "61.8K tokens/s wall = 68% of the active-parameter roofline (71% steady), "
                                        "random Qwen3-30B-A3B shape, fused experts (tma_w), compiled in "
                                        "max-autotune-no-cudagraphs (the class default), a fresh process, 2e6-token "
                                        "shard", "source": "docs/benchmarks.md, H100, 2026-12-07"},
    # 3 dense + 4 MoE layers, where the 61-layer target has 3 dense + 58 MoE. One MoE layer alone, by the difference
    # of 4 and 5 layers on an H100 (bench/layer_cost.py, 2026-12-07): its kernels at 72% of its roofline, so about
    # 0.72 at full depth there; kept at the H200's own figure until an H200 gives that difference
    "moe-mla": {"fraction": 0.68, "figure": "46.0K tokens/s wall = 68% of the active-parameter roofline (73% "
                                            "steady), random DeepSeek-V3 shape at 7 layers, fused experts "
                                            "(tma_w), compiled, 2e6-token shard (the process's second run)",
                "source": "docs/benchmarks.md, H200, 2026-12-06"},
}
BORROW = {"mla": "dense"}  # not measured yet
# An FP8 checkpoint's forward (its linears and routed experts as float8 MMAs, eagle3.extract.fp8_linear, "auto":
# torch's block-scaled GEMM on Hopper) against the same target in bf16, side by side in one process: the steady
# ratio (the wall one, 1.62x, favoured the FP8 run, which found the pinned host buffers made). Kept as a speedup
# over the class's bf16 rate: the FP8 roofline's fraction was measured at a depth where the writes bind (49% wall /
# 57% steady of it). The Triton linears (fp8_linear="triton") ran 1.09-1.26x.
MEASURED_FP8 = {
    "moe-mla": {"speedup": 1.46, "figure": "111.6K against 76.2K tokens/s steady, random DeepSeek-V3 shape at 4 "
                                          "layers in the checkpoint's 128 x 128 float8 blocks, compiled, "
                                          "fp8_linear scaled_mm",
                "source": "docs/benchmarks.md, H100, 2026-12-05"},
    # the Triton linears (the bench's fp8_linear), not scaled_mm: a lower bound for "auto" on Hopper
    "moe": {"speedup": 1.05, "figure": "60.3K against 57.2K tokens/s steady, random Qwen3-30B-A3B shape in 128 x "
                                      "128 float8 blocks, compiled, fp8_linear triton",
            "source": "docs/benchmarks.md, H200, 2026-12-06"},
}


def expected_rate(model_config: dict, mean_length: int, matmul_flops: float = H200_SUSTAINED_FLOPS) -> dict:
    """Tokens/s one GPU is expected to extract for this target: its class's measured fraction of the roofline."""
    cls = target_class(model_config)
    used = cls if cls in MEASURED else BORROW[cls]
    m = MEASURED[used]
    roofline = matmul_flops / flops_per_token(model_config, mean_length)
    note = (f"{cls} target: {m['fraction']:.0%} of the roofline, as measured for {used} targets ({m['figure']}; "
            f"{m['source']})")
    if used != cls:
        note += f"; {cls} targets are not measured yet"
    fp8 = fp8_checkpoint(model_config)
    f = MEASURED_FP8.get(cls) if fp8 else None
    speedup = f["speedup"] if f else 1.0
    if f:
        note += f"; FP8 checkpoint: {speedup:.2f}x that, as measured for {cls} targets ({f['figure']}; {f['source']})"
    elif fp8:  # its linears run as float8 MMAs (eagle3.extract.fp8_linear), up to twice bf16's rate
        note += f"; FP8 checkpoint: the FP8 forward of {cls} targets is not measured yet, so this is the bf16 rate " \
                "(likely too long)"
    return {"class": cls, "rate_class": used, "measured": used == cls and (not fp8 or f is not None),
            "fraction": m["fraction"] * speedup, "roofline_tok_per_s": roofline,
            "tok_per_s": m["fraction"] * speedup * roofline, "note": note}


def time_estimate(model_config: dict, tokens: int, mean_length: int, gpus: int, tp_size: int = 1) -> dict:
    """Hours to extract `tokens` on one H200 at the class's rate, and on `gpus` GPUs running gpus // tp_size shards
    at once (scaling assumed linear: not measured)."""
    r = expected_rate(model_config, mean_length)
    one = tokens / r["tok_per_s"] / 3600
    groups = max(1, gpus // max(1, tp_size))
    return {**r, "tokens": tokens, "mean_length": mean_length, "hours_one_gpu": one, "gpus": gpus,
            "hours": one / groups if gpus else None}
