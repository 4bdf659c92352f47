"""The project's Triton kernels (eagle3/extract/fused_moe.py, fp8_linear.py) at the real targets' shapes, compiled:
right first, then how fast. The tests run them only in Triton's interpreter on the CPU; this runs them where they
are compiled and autotuned, against their definitions in float32 on the same device, on fresh random inputs, with
the memory their outputs land in filled with NaN first (an unwritten element shows).

Rows (each: relative L2 error against the definition and the time of one call, median of --reps):
- quantize: the activation quantization kernel against the scheme in torch's ops, byte for byte;
- experts-bf16 / experts-fp8: the fused routed experts of one batch at the Qwen3-30B-A3B and DeepSeek-V3 widths,
  as FLOP/s of their GEMMs, beside transformers' grouped_mm path on the same batch (bf16), each autotune config of
  the two kernels (the autotuner's own timings) and one dense GEMM of each kernel's rows (the rate to aim at);
  beside them the TMA / persistent kernels (eagle3/extract/fused_moe_tma.py, fused_experts experts_kernel "tma" and
  "tma_w"): `tma_*` / `tma_w_*` rows, each kernel timed alone (`*_gate_up_tflops`, `*_down_tflops`; "tma"'s
  gate_up with its row gather, timed alone too as `tma_gather_ms`), the whole step (`*_tflops`, against
  `bf16_tflops`) and their autotune configs' rates (`*_tiles`);
- combine: the experts as a compiled layer runs them, `residual + experts` under `experts_kernel="auto"`: the
  top-k sum inside the custom op (fused_moe.fused_experts: aten's reduction, then the add) against outside it
  (`expert_pairs`' rows summed by Inductor in the residual add's kernel; 0.88x / 0.96x on the H100), side by side;
- router: a softmax top-k router's routing (Qwen3-30B-A3B's 128 experts, top 8), compiled as transformers' code
  runs it (softmax in float32, torch.topk: aten's gatherTopK, then the division) against the project's one kernel
  (eagle3/extract/fused_router.py), alternated: the experts chosen (equal where no probabilities tie), the weights;
  and the routing plan of those experts (fused_moe.align_pairs) by torch's ops against the counting sort's two
  kernels (eagle3/extract/fused_moe_align.py), its bytes and its time;
- linear-fp8: one FP8 checkpoint linear (DeepSeek-V3's widths, MLA's 576-row kv_a_proj_with_mqa among them) beside
  torch._scaled_mm's FP8 GEMM (row-wise scales, all ones) and a bf16 GEMM of the same shape; its input's quantization
  and its GEMM timed apart; and torch's block-scaled FP8 GEMM on the checkpoint's own layout (the lever to try).

    python3 bench/kernels_check.py --out $OUT/kernels.json        # H200: ~1 minute, autotuning included
    python bench/kernels_check.py --smoke                          # CPU: tiny shapes, the interpreter
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.extract_moe import median_time as timed  # noqa: E402
from eagle3.extract import fp8_linear, fused_moe  # noqa: E402
from tests.support.fp8 import dequantize, quantize_groups  # noqa: E402

# (name, hidden, expert width, experts, top k)
EXPERTS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "dsv3": (7168, 2048, 256, 8)}
LINEARS = {"q_a_proj": (1536, 7168), "kv_a_proj_with_mqa": (576, 7168), "q_b_proj": (24576, 1536),
           "o_proj": (7168, 16384), "mlp.gate_up": (36864, 7168)}  # (out, in) at DeepSeek-V3's widths
SMOKE_EXPERTS, SMOKE_LINEAR = (256, 128, 16, 4), (160, 256)  # the CPU's interpreter: small, FP8 blocks whole


def poison(device: torch.device, nbytes: int) -> None:
    """NaN in the caching allocator's free blocks, so the next torch.empty of the outputs holds NaN."""
    if device.type == "cuda":
        torch.full((nbytes // 4,), float("nan"), device=device).view(-1)
        torch.cuda.synchronize(device)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def experts_reference(x, idx, w, gate_up, down, up_scale=None, down_scale=None):
    """The routed experts' sum in float32, one expert at a time; with scales the FP8 scheme (activations
    quantized per token and 128 values, weights dequantized per 128 x 128 block: tests/support/fp8.py)."""
    def deq(q, s):
        return dequantize(q, s).float()

    def act(v):
        return v.float() if up_scale is None else deq(*quantize_groups(v))

    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xa = act(x)
    for e in torch.unique(idx).tolist():
        t, j = (idx == e).nonzero(as_tuple=True)
        wu = deq(gate_up[e], up_scale[e]) if up_scale is not None else gate_up[e].float()
        wd = deq(down[e], down_scale[e]) if down_scale is not None else down[e].float()
        g, u = (xa[t] @ wu.T).chunk(2, dim=-1)
        h = (torch.nn.functional.silu(g) * u).to(x.dtype)  # the kernels store h in the run's dtype
        out.index_add_(0, t, w[t, j, None].float() * (act(h) @ wd.T))
    return out


def kernel_flops(pairs: int, hidden: int, width: int) -> tuple[float, float]:
    """The FLOPs of the experts' two GEMMs over `pairs` (token, expert) rows: (gate_up, down)."""
    return 2.0 * pairs * hidden * 2 * width, 2.0 * pairs * width * hidden


def tile_rates(fp8: bool, pairs: int, hidden: int, width: int) -> dict:
    """TFLOP/s of each autotune config of the two experts kernels, from the autotuner's own timings of the call
    just made (empty where its cache answered instead): how far the best tile sits from the dense rate, and
    whether any tile gets near it (the kernels' next work)."""
    from eagle3.extract.fused_moe_kernels import GPU

    return {name: autotune_rates(fn, flops)
            for name, fn, flops in zip(("gate_up", "down"), GPU[fp8], kernel_flops(pairs, hidden, width))}


def tma_rows(mode, x, idx, w, up, dn, want, flops, device, reps) -> dict:
    """fused_experts(experts_kernel=mode) (the TMA / persistent kernels) on the batch of the bf16 row: its error
    against the same reference, and on a GPU its rates, whole and per kernel, and its autotune configs'. An error
    is a row (the kernels' first runs on a GPU are here)."""
    from eagle3.extract import fused_moe_tma as ft

    tokens, hidden, width, k = x.shape[0], x.shape[1], dn.shape[2], idx.shape[1]
    gu_flops, down_flops = kernel_flops(tokens * k, hidden, width)
    out = {}
    try:
        if not ft.runs(x, up, dn):
            return {mode: "widths or dtype the TMA kernels do not take"}
        poison(device, x.numel() * k * 4)
        got = fused_moe.fused_experts(x, idx, w, up, dn, experts_kernel=mode)
        out[f"{mode}_rel_l2"], out[f"{mode}_nan"] = rel(got, want), bool(got.isnan().any())
        if device.type != "cuda":
            return out
        out[f"{mode}_tflops"] = flops / timed(lambda: fused_moe.fused_experts(x, idx, w, up, dn, experts_kernel=mode),
                                              device, reps) / 1e12
        block_m = fused_moe.block_m_for(idx.numel(), up.shape[0], device)
        pairs, block_expert, live = ft.plan(idx, up.shape[0], block_m, False)
        weights = w.reshape(-1).contiguous()

        def gate_up():
            return ft.gate_up(x, pairs, block_expert, live, up, k, block_m, mode)

        def down():
            return ft.down(h, pairs, block_expert, live, dn, weights, idx.numel(), block_m, False)

        h = gate_up()
        out[f"{mode}_gate_up_tflops"] = gu_flops / timed(gate_up, device, reps) / 1e12
        out[f"{mode}_down_tflops"] = down_flops / timed(down, device, reps) / 1e12
        if mode == "tma":
            out["tma_gather_ms"] = 1e3 * timed(lambda: ft.gather_rows(x, pairs, k), device, reps)
        out[f"{mode}_tiles"] = {name: config_rates(fn, fl) for name, fn, fl in
                                zip(("gate_up", "down"), ft.gpu_kernels(), (gu_flops, down_flops))}
    except Exception as e:  # noqa: BLE001 (first runs on a GPU: the row says what failed, the other rows go on)
        out[mode] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def autotune_rates(fn, flops: float, name=str, digits: int | None = None) -> dict:
    """TFLOP/s of each config an autotuner timed on its last tuning, by name(config), best first; a config that
    failed to run (inf) left out, none where no tuning ran (a cache hit)."""
    timings = getattr(fn, "configs_timings", None) or {}
    rates = {}
    for c, t in timings.items():
        t = t[0] if isinstance(t, (list, tuple)) else t
        if t and t != float("inf"):
            rate = flops / t / 1e9
            rates[name(c)] = rate if digits is None else round(rate, digits)
    return dict(sorted(rates.items(), key=lambda kv: -kv[1]))


def config_rates(fn, flops: float) -> dict:
    """The TMA kernels' autotune_rates under compact names (tiles, group, flattened, stages, warps), to 0.1."""
    def compact(c) -> str:
        kw = c.kwargs
        return (f"n{kw['BLOCK_N']}k{kw['BLOCK_K']}g{kw['GROUP_M']}{'f' if kw.get('FLATTEN') else ''}"
                f"s{c.num_stages}w{c.num_warps}")

    return autotune_rates(fn, flops, compact, 1)


def experts_batch(name, tokens, device, dtype) -> tuple:
    """(x, idx, w, up, dn): one batch of `tokens` routed uniformly at the widths of `name`, and the experts."""
    hidden, width, experts, k = EXPERTS.get(name, SMOKE_EXPERTS)
    g = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=g)
    idx = torch.rand(tokens, experts, device=device, generator=g).topk(k, dim=-1).indices
    w = torch.rand(tokens, k, device=device, generator=g).to(dtype)
    up = torch.randn(experts, 2 * width, hidden, device=device, dtype=dtype, generator=g) / hidden ** 0.5
    dn = torch.randn(experts, hidden, width, device=device, dtype=dtype, generator=g) / width ** 0.5
    return x, idx, w, up, dn


def experts_summed_outside(x, idx, w, up, dn, experts_kernel: str) -> torch.Tensor:
    """The combine row's alternative: the pairs' rows out of the opaque op, summed by the compiled code."""
    return fused_moe.expert_pairs(x, idx, w, up, dn, experts_kernel=experts_kernel).view(
        x.shape[0], idx.shape[-1], -1).sum(dim=1)


def check_combine(name, tokens, device, dtype, reps) -> dict:
    """`residual + experts`, compiled, with the top-k sum outside the custom op against inside it, alternated."""
    from types import SimpleNamespace

    from eagle3.extract.moe import resolve_experts_kernel

    x, idx, w, up, dn = experts_batch(name, tokens, device, dtype)
    residual = torch.randn_like(x)
    kernel = resolve_experts_kernel([SimpleNamespace(gate_up_proj=up, down_proj=dn)], fused_moe.NAME, "auto")
    outside = torch.compile(lambda x, r: r + experts_summed_outside(x, idx, w, up, dn, kernel))
    inside = torch.compile(lambda x, r: r + fused_moe.fused_experts(x, idx, w, up, dn, experts_kernel=kernel))
    row = {"tokens": tokens, "experts_kernel": kernel, "rel_l2_outside_vs_inside": rel(outside(x, residual),
                                                                                        inside(x, residual))}
    times = {"inside_ms": [], "outside_ms": []}
    rounds, reps = (3, reps) if device.type == "cuda" else (1, 1)  # the interpreter: the path, not its time
    for _ in range(rounds):
        for key, fn in (("inside_ms", inside), ("outside_ms", outside)):
            times[key].append(1e3 * timed(lambda fn=fn: fn(x, residual), device, reps))
    row.update({key: min(t) for key, t in times.items()})
    row["outside_over_inside"] = row["inside_ms"] / row["outside_ms"]  # > 1: the sum outside is faster
    return row


def check_router(tokens, device, dtype, reps) -> dict:
    """Qwen3-MoE's routing, compiled: transformers' softmax + topk + division against fused_router's kernel."""
    from eagle3.extract.fused_router import softmax_topk

    experts, k = EXPERTS["qwen3-30b-a3b"][2:] if device.type == "cuda" else SMOKE_EXPERTS[2:]
    g = torch.Generator(device=device).manual_seed(tokens)
    logits = (torch.randn(tokens, experts, device=device, generator=g) * 2).to(dtype)

    def transformers_routing(x):
        p = torch.nn.functional.softmax(x, dtype=torch.float, dim=-1)
        v, i = torch.topk(p, k, dim=-1)
        return (v / v.sum(dim=-1, keepdim=True)).to(x.dtype), i

    ref = torch.compile(transformers_routing)
    fused = torch.compile(lambda x: (lambda w, i: (w.to(x.dtype), i))(*softmax_topk(x, k, True)))
    (rw, ri), (fw, fi) = ref(logits), fused(logits)
    p = torch.softmax(logits, dtype=torch.float, dim=-1)
    # the routing plan of the same experts (fused_moe.align_pairs): torch's ops against the counting sort's kernels
    from eagle3.extract.fused_moe import align_pairs_torch
    from eagle3.extract.fused_moe_align import align_pairs

    block_m = fused_moe.block_m_for(fi.numel(), experts, device)
    align = {"align_bytes_equal": all(torch.equal(a, b) for a, b in zip(align_pairs(fi, experts, block_m),
                                                                          align_pairs_torch(fi, experts, block_m)))}
    row = {"tokens": tokens, "experts": experts, "top_k": k, **align,
           "experts_equal_share": float((fi == ri).float().mean()),
           "picked_probabilities_equal": bool(torch.equal(p.gather(1, fi).sort(1).values,
                                                          p.gather(1, ri).sort(1).values)),
           "weights_rel_l2": rel(fw.sort(1).values, rw.sort(1).values)}
    runs = {"transformers_ms": lambda: ref(logits), "fused_ms": lambda: fused(logits),
            "align_torch_ms": lambda: align_pairs_torch(fi, experts, block_m),
            "align_kernels_ms": lambda: align_pairs(fi, experts, block_m)}
    times = {key: [] for key in runs}
    rounds, reps = (3, reps) if device.type == "cuda" else (1, 1)
    for _ in range(rounds):
        for key, fn in runs.items():
            times[key].append(1e3 * timed(fn, device, reps))
    row.update({key: min(t) for key, t in times.items()})
    row["fused_over_transformers"] = row["transformers_ms"] / row["fused_ms"]  # > 1: the kernel is faster
    row["align_kernels_over_torch"] = row["align_torch_ms"] / row["align_kernels_ms"]
    return row


def check_experts(name, tokens, device, dtype, reps, fp8: bool = True) -> dict:
    hidden, width, experts, k = EXPERTS.get(name, SMOKE_EXPERTS)
    x, idx, w, up, dn = experts_batch(name, tokens, device, dtype)
    flops = 2.0 * tokens * k * 3 * hidden * width
    row = {"tokens": tokens, "experts": experts, "hidden": hidden, "width": width, "top_k": k}
    poison(device, x.numel() * k * 4)
    got = fused_moe.fused_experts(x, idx, w, up, dn)
    want = experts_reference(x, idx, w, up, dn)
    row["bf16_rel_l2"] = rel(got, want)
    row["bf16_nan"] = bool(got.isnan().any())
    for mode in ("tma", "tma_w"):
        row.update(tma_rows(mode, x, idx, w, up, dn, want, flops, device, reps))
    if device.type == "cuda":
        row["bf16_tiles"] = tile_rates(False, tokens * k, hidden, width)
        row["bf16_tflops"] = flops / timed(lambda: fused_moe.fused_experts(x, idx, w, up, dn), device, reps) / 1e12
        rows_x = x.repeat(k, 1)  # every pair's row, as one dense GEMM of each kernel's shape would read them
        row["dense_gate_up_tflops"] = 2.0 * rows_x.shape[0] * hidden * 2 * width / timed(
            lambda: rows_x @ up[0].T, device, reps) / 1e12
        h = rows_x[:, :width].contiguous()
        row["dense_down_tflops"] = 2.0 * h.shape[0] * width * hidden / timed(lambda: h @ dn[0].T, device, reps) / 1e12
        del rows_x, h
        try:  # transformers' own experts module of that layout, its grouped_mm path
            from transformers import Qwen3MoeConfig
            from transformers.integrations.moe import grouped_mm_experts_forward
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

            with torch.device("meta"):
                mod = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=width,
                                                     num_experts=experts, num_experts_per_tok=k))
            mod.gate_up_proj, mod.down_proj = torch.nn.Parameter(up), torch.nn.Parameter(dn)
            with torch.inference_mode():
                row["grouped_mm_rel_l2_vs_fused"] = rel(grouped_mm_experts_forward(mod, x, idx, w), got)
                row["grouped_mm_tflops"] = flops / timed(lambda: grouped_mm_experts_forward(mod, x, idx, w), device,
                                                         reps) / 1e12
            del mod
        except Exception as e:  # noqa: BLE001 (a transformers without that path: the row says why)
            row["grouped_mm"] = f"{type(e).__name__}: {str(e)[:200]}"
    if not fp8:
        return row
    up_q, up_s = fused_moe.quantize_blocks(up)
    dn_q, dn_s = fused_moe.quantize_blocks(dn)
    del up, dn
    poison(device, x.numel() * k * 4)
    got = fused_moe.fused_experts(x, idx, w, up_q, dn_q, up_s, dn_s)
    row["fp8_rel_l2"] = rel(got, experts_reference(x, idx, w, up_q, dn_q, up_s, dn_s))
    row["fp8_nan"] = bool(got.isnan().any())
    if device.type == "cuda":
        row["fp8_tiles"] = tile_rates(True, tokens * k, hidden, width)
        row["fp8_tflops"] = flops / timed(lambda: fused_moe.fused_experts(x, idx, w, up_q, dn_q, up_s, dn_s),
                                          device, reps) / 1e12
    return row


def check_linear(out_f, in_f, tokens, device, dtype, reps) -> dict:
    g = torch.Generator(device=device).manual_seed(out_f)
    weight, scale = fp8_linear.quantize_weight(torch.randn(out_f, in_f, device=device, generator=g) / in_f ** 0.5)
    x = torch.randn(tokens, in_f, device=device, dtype=dtype, generator=g)
    poison(device, tokens * out_f * 4)
    got = fp8_linear.fp8_block_linear(x, weight, scale)
    xd, wd = dequantize(*quantize_groups(x)).float(), dequantize(weight, scale).float()
    row = {"tokens": tokens, "out": out_f, "in": in_f, "rel_l2": rel(got, xd @ wd.T), "nan": bool(got.isnan().any())}
    if device.type == "cuda":
        flops = 2.0 * tokens * out_f * in_f
        row["tflops"] = flops / timed(lambda: fp8_linear.fp8_block_linear(x, weight, scale), device, reps) / 1e12
        wb = weight.to(dtype)
        row["bf16_mm_tflops"] = flops / timed(lambda: x @ wb.T, device, reps) / 1e12
        try:  # torch's FP8 GEMM with row-wise scales (all ones here: not the checkpoint's blocks)
            xq, wq = x.to(torch.float8_e4m3fn), weight
            one_x = torch.ones(tokens, 1, device=device)
            one_w = torch.ones(1, out_f, device=device)
            row["scaled_mm_tflops"] = flops / timed(lambda: torch._scaled_mm(xq, wq.T, one_x, one_w, out_dtype=dtype),
                                                    device, reps) / 1e12
        except Exception as e:  # noqa: BLE001
            row["scaled_mm"] = f"{type(e).__name__}: {str(e)[:200]}"
        # where the time goes: the input's quantization alone, the GEMM alone on an input already quantized
        xq, xs = fused_moe.quantize_groups(x)
        row["quantize_ms"] = 1e3 * timed(lambda: fused_moe.quantize_groups(x), device, reps)
        row["gemm_only_tflops"] = flops / timed(lambda: fp8_linear.fp8_block_gemm(xq, xs, weight, scale, dtype),
                                                device, reps) / 1e12
        row.update(block_scaled_mm(xq, xs, weight, scale, dtype, got, flops, device, reps))
        try:  # the project's op on it (fp8_linear="scaled_mm"), quantization included, on a row count off 16
            odd = x[:tokens - 7]
            op = fp8_linear.fp8_block_scaled_mm(odd, weight, scale)
            row["scaled_mm_op_rel_l2_vs_triton"] = rel(op, fp8_linear.fp8_block_linear(odd, weight, scale))
            row["scaled_mm_op_tflops"] = flops / timed(lambda: fp8_linear.fp8_block_scaled_mm(x, weight, scale),
                                                       device, reps) / 1e12
        except Exception as e:  # noqa: BLE001
            row["scaled_mm_op"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def block_scaled_mm(xq, xs, weight, scale, dtype, want, flops, device, reps) -> dict:
    """The lever: torch's block-scaled FP8 GEMM (cuBLASLt >= 12.9 on Hopper), activations in 1 x 128 blocks and
    weights in 128 x 128 blocks, the checkpoint's own layout (`fp8_linear.fp8_block_scaled_gemm`); its speed and its
    distance from the Triton kernel's result."""
    try:
        def run():
            return fp8_linear.fp8_block_scaled_gemm(xq, xs, weight, scale, dtype)

        got = run()
        return {"block_scaled_mm_tflops": flops / timed(run, device, reps) / 1e12,
                "block_scaled_mm_rel_l2_vs_triton": rel(got, want)}
    except Exception as e:  # noqa: BLE001 (a torch or cuBLAS without it, or another layout rule: the row says which)
        return {"block_scaled_mm": f"{type(e).__name__}: {str(e)[:300]}"}


def value_differences(q: torch.Tensor, given: torch.Tensor) -> dict:
    """How many float8 values differ between two quantizations at the same scales, and the first few (kernel,
    torch) pairs as floats: a rounding rule apart, or a different value."""
    diff = (q.view(torch.uint8) != given.view(torch.uint8)).nonzero()
    pairs = [(float(q[tuple(i)].float()), float(given[tuple(i)].float())) for i in diff[:8].tolist()]
    return {"values_differing": int(diff.shape[0]), "values_differing_first": pairs}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of one batch")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (the interpreter)")
    ap.add_argument("--rows", default="quantize,experts,combine,router,linears", help="which rows, comma-separated")
    ap.add_argument("--shapes", default=",".join(EXPERTS), help="the experts rows' widths, comma-separated "
                    f"(of {', '.join(EXPERTS)})")
    ap.add_argument("--no-fp8", action="store_true", help="the experts rows without their FP8 half")
    ap.add_argument("--out", default=None)
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16
    tokens = 40 if device.type == "cpu" else a.tokens
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "tokens": tokens,
           "quantize": {}, "experts": {}, "combine": {}, "router": {}, "linears": {}}
    wanted = a.rows.split(",")

    def save(kind, name):  # each row as it lands: a call cut short keeps what ran
        print(kind, name, json.dumps(res[kind][name]), flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1))

    for rows, cols in ((1, 2048), (37, 7168), (tokens, 7168)) if "quantize" in wanted else ():
        x = torch.randn(rows, cols, device=device, dtype=dtype) * torch.logspace(-3, 3, cols, device=device).to(dtype)
        q, s = fused_moe.quantize_groups(x)
        wq, ws = quantize_groups(x)
        # torch's ops on a GPU divide by a scalar as a product with its reciprocal, the kernel divides (as torch
        # on the CPU): the scales may differ in the last bit; the values are then compared at the kernel's scales
        given = (x.float().view(rows, -1, 128) / s[..., None]).to(torch.float8_e4m3fn).view(rows, cols)
        res["quantize"][f"{rows}x{cols}"] = {
            "bytes_equal": bool(torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s, ws)),
            "scale_max_rel_diff": float(((s - ws).abs() / ws).max()),
            "values_equal_at_kernel_scales": bool(torch.equal(q.view(torch.uint8), given.view(torch.uint8))),
            **value_differences(q, given)}
        save("quantize", f"{rows}x{cols}")
    shapes = a.shapes.split(",")
    unknown = [n for n in shapes if n not in EXPERTS]
    if unknown:
        raise SystemExit(f"--shapes {a.shapes}: unknown {', '.join(unknown)} (one of {', '.join(EXPERTS)})")
    for name in (shapes if device.type == "cuda" else ("smoke",)) if "experts" in wanted else ():
        res["experts"][name] = check_experts(name, tokens, device, dtype, a.reps, fp8=not a.no_fp8)
        save("experts", name)
    for name in (shapes if device.type == "cuda" else ("smoke",)) if "combine" in wanted else ():
        res["combine"][name] = check_combine(name, tokens, device, dtype, a.reps)
        save("combine", name)
    if "router" in wanted:
        res["router"]["qwen3-30b-a3b" if device.type == "cuda" else "smoke"] = check_router(tokens, device, dtype,
                                                                                             a.reps)
        save("router", next(iter(res["router"])))
    linears = LINEARS if device.type == "cuda" else {"smoke": SMOKE_LINEAR}
    for name, (out_f, in_f) in linears.items() if "linears" in wanted else ():
        res["linears"][name] = check_linear(out_f, in_f, tokens, device, dtype, a.reps)
        save("linears", name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
