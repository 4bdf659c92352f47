"""The Triton kernels of eagle3.extract.fused_moe (imported only where triton is installed): two GEMMs and the
activation quantization of their FP8 path.

The GEMMs run over blocks of BLOCK_M (token, expert) pairs that share one expert: a program computes the BLOCK_N
output columns n of pair block m. Programs go column tile first within groups of GROUP_M row blocks: at
GROUP_M 1 the programs in flight work on a few row blocks at once, each block's rows read from HBM once (then from
L2 for every column tile); at 8 the weight tiles are shared by 8 row blocks too, which pays where one weight matrix
meets many row blocks (an FP8 linear, `eagle3.extract.fp8_linear`, or an expert with many tokens). The autotuner
picks.

Only builtins of triton.language (tl.full, tl.exp, tl.dot, ...): its library functions (tl.zeros, tl.sigmoid) are
@jit functions that Triton's interpreter can call only when the whole of triton was imported in interpreter mode,
and the CPU path interprets these kernels in a process whose triton is not (torch's Inductor imports it first).
"""

from __future__ import annotations

import inspect

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


def gate_up_kernel(x_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, x_scale_ptr, w_scale_ptr, num_pairs, top_k,
                   num_experts, num_m, N, K, stride_x, stride_we, stride_wn, stride_out, stride_xs, stride_se,
                   stride_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr, EVEN_N: tl.constexpr,
                   EVEN_K: tl.constexpr):
    """out[row, n] = SiLU(x[token] . w[e, n]) * (x[token] . w[e, N + n]) for the block's expert e; x is [T, K]
    (K = hidden), w is gate_up_proj [E, 2N, K] (N = expert width), out's rows in the padded sorted order.
    FP8: x and w are float8 with scales per 128 (x_scale [T, K / 128], w_scale [E, 2N / 128, K / 128]) and
    BLOCK_K is 128, so each K step is one scale block of both."""
    # column tile first within groups of GROUP_M row blocks (inline: the interpreter calls no @jit helper)
    pid, per_group = tl.program_id(0), GROUP_M * ((N + BLOCK_N - 1) // BLOCK_N)
    first_m = pid // per_group * GROUP_M
    rows_here = tl.minimum(num_m - first_m, GROUP_M)  # the last group may be short
    pid_m, pid_n = first_m + pid % per_group % rows_here, pid % per_group // rows_here
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e >= num_experts:  # past the last expert's blocks
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + rows)
    live = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_x + ks[None, :]
    g_ptrs = w_ptr + e * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    u_ptrs = g_ptrs + N * stride_wn
    col_ok = cols < N
    acc_g = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_u = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:  # whole K steps: the loads keep only masks that do not change along the loop
            a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
            if EVEN_N:
                g = tl.load(g_ptrs)
                u = tl.load(u_ptrs)
            else:
                g = tl.load(g_ptrs, mask=col_ok[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        if FP8:
            kb = k0 // BLOCK_K
            sa = tl.load(x_scale_ptr + tokens * stride_xs + kb, mask=live, other=0.0)
            sw = w_scale_ptr + e * stride_se + kb
            sg = tl.load(sw + (cols // 128) * stride_sn, mask=col_ok, other=0.0)
            su = tl.load(sw + ((N + cols) // 128) * stride_sn, mask=col_ok, other=0.0)
            acc_g += tl.dot(a, g) * sa[:, None] * sg[None, :]
            acc_u += tl.dot(a, u) * sa[:, None] * su[None, :]
        else:
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # SiLU(gate) x up
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=live[:, None] & col_ok[None, :])


def down_kernel(h_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, weights_ptr, h_scale_ptr, w_scale_ptr,
                num_pairs, num_experts, num_m, N, K, stride_h, stride_we, stride_wn, stride_out, stride_hs, stride_se,
                stride_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr, EVEN_N: tl.constexpr,
                EVEN_K: tl.constexpr):
    """out[pair, n] = weight[pair] * (h[row] . w[e, n]); h is gate_up's output [rows, K] (K = expert width), w is
    down_proj [E, N, K] (N = hidden), out is [S, N] in pair order. FP8: as gate_up's, h_scale [rows, K / 128]."""
    # column tile first within groups of GROUP_M row blocks (inline: the interpreter calls no @jit helper)
    pid, per_group = tl.program_id(0), GROUP_M * ((N + BLOCK_N - 1) // BLOCK_N)
    first_m = pid // per_group * GROUP_M
    rows_here = tl.minimum(num_m - first_m, GROUP_M)  # the last group may be short
    pid_m, pid_n = first_m + pid % per_group % rows_here, pid % per_group // rows_here
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e >= num_experts:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + rows)
    live = pairs < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_h + ks[None, :]
    w_ptrs = w_ptr + e * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    col_ok = cols < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:  # as gate_up's
            a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
            w = tl.load(w_ptrs) if EVEN_N else tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        if FP8:
            kb = k0 // BLOCK_K
            sa = tl.load(h_scale_ptr + rows.to(tl.int64) * stride_hs + kb, mask=live, other=0.0)
            sw = tl.load(w_scale_ptr + e * stride_se + (cols // 128) * stride_sn + kb, mask=col_ok, other=0.0)
            acc += tl.dot(a, w) * sa[:, None] * sw[None, :]
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    weight = tl.load(weights_ptr + pairs, mask=live, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & col_ok[None, :])


def quantize_kernel(x_ptr, q_ptr, scale_ptr, R, K, stride_x, stride_q, stride_s, BLOCK_R: tl.constexpr,
                    GROUP: tl.constexpr):
    """q[r, k] = x[r, k] / scale[r, k // GROUP] in float8, scale = amax of the row's group / 448 (at least 1e-12 /
    448): one read of x, where torch's ops pass over float32 copies of it five times. Program (r, g) does BLOCK_R
    rows of group g."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    ok = rows < R
    rows = rows.to(tl.int64)
    in_x = ok[:, None] & (cols < K)[None, :]  # full-shape: under a [BLOCK_R, 1] mask the interpreter read NaN rows
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=in_x, other=0.0).to(tl.float32)
    # tl.max spelt as the reduction it calls: the interpreter maps this combine function to numpy's max
    amax = tl.reduce(tl.abs(x), 1, tl.standard._elementwise_max)
    # IEEE division, as torch's (Triton's "/" is the approximate one on a GPU)
    scale = tl.div_rn(tl.maximum(amax, 1e-12), tl.full((BLOCK_R,), 448.0, tl.float32))
    v = tl.div_rn(x, scale[:, None])
    # rounded to e4m3's grid (3 mantissa bits, subnormal below 2^-6) to the nearest even here, so the cast is exact:
    # Triton 3.9's interpreter rounds float32 -> float8 wrongly where rounding up reaches the next power of two
    # (7.92 -> 4), and torch rounds to the nearest even
    exponent = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3)
    per_step = ((3 - exponent + 127) << 23).to(tl.float32, bitcast=True)  # its inverse, exactly
    rounded = ((tl.abs(v) * per_step + 12582912.0) - 12582912.0) * step  # + 1.5 x 2^23: to an integer, to the even
    v = tl.where(v < 0, -rounded, rounded)  # (-0 where a small negative value rounds to 0, as torch's cast)
    tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], v.to(q_ptr.dtype.element_ty), mask=in_x)
    tl.store(scale_ptr + rows * stride_s + group, scale, mask=ok)


# (BLOCK_N, BLOCK_K, num_stages, num_warps) the autotuner tries per (N, K, BLOCK_M), each at GROUP_M 1 and 8.
# gate_up holds two accumulators and two weight tiles a stage, so its column tiles are the narrower. Each fits
# Hopper's 227 KiB of shared memory at BLOCK_M 128 (tests/test_fused_moe.py compiles every one for sm_90 and checks
# it pipelines into wgmma).
# FP8 (one byte a value): BLOCK_K is the scale block, 128.
TILES = {"gate_up": [(64, 64, 4, 4), (64, 64, 4, 8), (64, 128, 3, 8), (128, 64, 3, 8), (128, 64, 4, 8)],
         "down": [(128, 64, 4, 4), (128, 64, 4, 8), (128, 128, 3, 8), (256, 64, 3, 8), (256, 64, 4, 8)],
         "gate_up_fp8": [(64, 128, 4, 4), (64, 128, 4, 8), (128, 128, 3, 8), (128, 128, 4, 8)],
         "down_fp8": [(128, 128, 4, 4), (128, 128, 4, 8), (256, 128, 3, 8), (256, 128, 4, 8)]}


GROUPS_M = (1, 8)


def configs(kernel: str) -> list:
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "GROUP_M": g}, num_stages=s, num_warps=w)
            for n, k, s, w in TILES[kernel] for g in GROUPS_M]


def even(n: int, k: int, block_n: int, block_k: int) -> dict:
    """EVEN_N / EVEN_K: the widths are whole tiles, so the K loop's loads drop the masks that change each step."""
    return {"EVEN_N": n % block_n == 0, "EVEN_K": k % block_k == 0}


def autotuned(fn, kernel: str):
    # cache_results (Triton >= 3.2): the timings land in Triton's cache folder, which Inductor points into the
    # worker's compile cache (eagle3.extract.compile_cache), so the next shard task on the worker skips them
    keep = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    flags = {f: lambda a, f=f: even(a["N"], a["K"], a["BLOCK_N"], a["BLOCK_K"])[f] for f in ("EVEN_N", "EVEN_K")}
    return triton.autotune(configs(kernel), key=["N", "K", "BLOCK_M"], **keep)(
        triton.heuristics(flags)(triton.jit(fn)))


GPU = {False: (autotuned(gate_up_kernel, "gate_up"), autotuned(down_kernel, "down")),
       True: (autotuned(gate_up_kernel, "gate_up_fp8"), autotuned(down_kernel, "down_fp8"))}  # by FP8
CPU = (InterpretedFunction(gate_up_kernel), InterpretedFunction(down_kernel))
# (kernel, rows a program): on the CPU few programs (the interpreter's time goes by programs)
QUANTIZE = {"cuda": (triton.jit(quantize_kernel), 32), "cpu": (InterpretedFunction(quantize_kernel), 1024)}
CPU_TILES = {"BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 1}  # the interpreter: no autotuning; few programs


def fixed_tiles(tiles: dict, n: int, k: int) -> dict:
    """The interpreter's fixed tiles with their EVEN flags at widths n x k (on a GPU the autotuner and the
    heuristics set them per config)."""
    return {**tiles, **even(n, k, tiles["BLOCK_N"], tiles["BLOCK_K"])}
