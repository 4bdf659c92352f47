"""The routed experts' bf16/fp16 GEMMs restructured for Hopper: tensor descriptors (TMA) and a persistent schedule.
Selected by the extract param experts_kernel ("tma" or "tma_w"; "tiles" keeps fused_moe_kernels' kernels; "auto"
runs "tma_w" on Hopper: eagle3.extract.moe.resolve_experts_kernel), passed to fused_moe.fused_experts as `kernel`.

Why: fused_moe_kernels reads A's rows through a token-index gather (pointer loads), one program per tile; at the
Qwen3-30B-A3B widths it sits at 65-67% of a dense GEMM of the same rows however its tiles are sized. Here:
- "tma": each (token, expert) pair's row of x is gathered once (torch's index_select) into a contiguous buffer in
  the padded expert-sorted order of `align_pairs`, so every block of BLOCK_M rows is one expert's rows of a 2D
  tensor and A's tiles come through TMA like W's (W from the [E * out, in] view of the experts' weights: a tile
  never crosses an expert since out % BLOCK_N == 0). The cost: the buffer (capacity x hidden: ~1.1 GB at 32K
  tokens x top 8, hidden 2048) written once by the gather, ~0.4-0.8 ms of HBM time on an H100 against ~2.4 ms
  for gate_up's 1.65 TFLOP at 700 TFLOP/s; gate_up then reads it as it would have read x's rows;
- "tma_w": W through TMA, A still gathered by pointer loads from x (no buffer): the half-way point, to measure
  which side of the trade wins.
Both: a persistent grid (one program an SM) walks the tiles of the live blocks (their count read on the device,
from `block_expert`: no host sync), row blocks grouped by GROUP_M as in fused_moe_kernels (down's tile loop
flattened into its K loop where the autotuner finds it pays: FLATTEN below). gate_up stores
SiLU(gate) x up through a descriptor into h (sorted order; padding rows hold a clamped token's values, never read
back as results); down scales by the routing weight and scatters each live row to its pair's row (pointer store).
No atomics: the same bytes run to run.

Only builtins of triton.language, as in fused_moe_kernels (the CPU path interprets these kernels too).
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import KernelInterface
from triton.tools.tensor_descriptor import TensorDescriptor

MODES = ("tma", "tma_w")  # A through TMA from the gathered buffer / A by pointer gather from x


def gate_up_kernel(x_ptr, a_desc, w_desc, h_desc, pairs_ptr, block_expert_ptr, live_blocks_ptr, num_pairs, top_k,
                   num_tokens, N, K, stride_x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, GATHER_A: tl.constexpr,
                   EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """h[row, n] = SiLU(a[row] . w[e, n]) * (a[row] . w[e, N + n]) for row block m of expert e = block_expert[m];
    w_desc views gate_up_proj [E, 2N, K] as [E * 2N, K]. GATHER_A: a[row] is x[pairs[row] // top_k] by pointer
    loads, else the row of a_desc (the gathered buffer)."""
    num_m = tl.load(live_blocks_ptr)  # blocks past the last expert's groups: no tile
    n_tiles = N // BLOCK_N
    per_group = GROUP_M * n_tiles
    ks = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * n_tiles, NUM_SMS, flatten=FLATTEN):
        first_m = tile // per_group * GROUP_M
        rows_here = tl.minimum(num_m - first_m, GROUP_M)
        pid_m, pid_n = first_m + tile % per_group % rows_here, tile % per_group // rows_here
        e = tl.load(block_expert_ptr + pid_m)
        m0, n0 = pid_m * BLOCK_M, pid_n * BLOCK_N
        gate_row = e * 2 * N + n0
        if GATHER_A:  # padding rows read a real token's row (clamped): finite, never stored as a result
            pairs = tl.load(pairs_ptr + m0 + tl.arange(0, BLOCK_M))
            tokens = tl.minimum(pairs // top_k, num_tokens - 1).to(tl.int64)
            a_ptrs = x_ptr + tokens[:, None] * stride_x + ks[None, :]
        acc_g = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        acc_u = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if GATHER_A:
                if EVEN_K:
                    a = tl.load(a_ptrs + k0)
                else:
                    a = tl.load(a_ptrs + k0, mask=(ks < K - k0)[None, :], other=0.0)
            else:
                a = a_desc.load([m0, k0])
            g = w_desc.load([gate_row, k0])  # (past K the descriptor reads zeros)
            u = w_desc.load([gate_row + N, k0])
            if UPCAST:
                a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
            acc_g = tl.dot(a, g.T, acc_g)
            acc_u = tl.dot(a, u.T, acc_u)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # SiLU(gate) x up
        h_desc.store([m0, n0], h.to(h_desc.dtype))


def down_kernel(h_desc, w_desc, out_ptr, pairs_ptr, block_expert_ptr, live_blocks_ptr, weights_ptr, num_pairs, N, K,
                stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, UPCAST: tl.constexpr):
    """out[pair, n] = weight[pair] * (h[row] . w[e, n]) for each live row of block m (pair = pairs[row]); w_desc
    views down_proj [E, N, K] as [E * N, K]; out [S, N] in pair order."""
    num_m = tl.load(live_blocks_ptr)
    n_tiles = N // BLOCK_N
    per_group = GROUP_M * n_tiles
    for tile in tl.range(tl.program_id(0), num_m * n_tiles, NUM_SMS, flatten=FLATTEN):
        first_m = tile // per_group * GROUP_M
        rows_here = tl.minimum(num_m - first_m, GROUP_M)
        pid_m, pid_n = first_m + tile % per_group % rows_here, tile % per_group // rows_here
        e = tl.load(block_expert_ptr + pid_m)
        m0, n0 = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = h_desc.load([m0, k0])
            w = w_desc.load([e * N + n0, k0])
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w.T, acc)
        pairs = tl.load(pairs_ptr + m0 + tl.arange(0, BLOCK_M))
        live = pairs < num_pairs
        weight = tl.load(weights_ptr + pairs, mask=live, other=0.0).to(tl.float32)
        cols = n0 + tl.arange(0, BLOCK_N)
        out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_out + cols[None, :]
        tl.store(out_ptrs, (acc * weight[:, None]).to(out_ptr.dtype.element_ty), mask=live[:, None])


# (BLOCK_N, BLOCK_K, num_stages, num_warps), each at GROUP_M 1 and 8, for BLOCK_M 64 or 128 (align_pairs' block).
# Shared memory a stage: A's BLOCK_M x BLOCK_K and one (down) or two (gate_up) BLOCK_N x BLOCK_K weight tiles,
# plus gate_up's BLOCK_M x BLOCK_N staging of the TMA store; each fits sm_90's 227 KiB at BLOCK_M 128 without
# spilling (tests/test_fused_moe.py compiles every one). gate_up's two fp32 accumulators keep its BLOCK_N at 128.
TILES = {"gate_up": [(64, 64, 4, 4), (128, 64, 3, 8), (128, 64, 4, 8), (64, 128, 3, 8), (128, 128, 2, 8)],
         "down": [(128, 64, 4, 4), (128, 64, 4, 8), (128, 128, 3, 8), (256, 64, 3, 8), (256, 64, 4, 8)]}
GROUPS_M = (1, 8)
# Flattening the tile loop into the K loop (the next tile's loads under this tile's epilogue) makes ptxas serialize
# gate_up's warpgroup MMAs on sm_90 (warning C7515: its two accumulators' zeroing lands inside the pipelined loop,
# Triton 3.6 and 3.9 alike); down's stay asynchronous, so the autotuner tries down both ways.
FLATTEN = {"gate_up": (False,), "down": (True, False)}
# the interpreter: few, large tiles (its time goes by programs and ops), one program a tile (PROGRAMS 0) or fewer,
# each looping over tiles as on a GPU (the tests set these)
CPU_TILES = {"BLOCK_K": 128, "GROUP_M": 1, "PROGRAMS": 0}


def set_blocks(kernel: str):
    """The descriptors' block shapes from a launch's tiles and BLOCK_M (host-side descriptors carry their block
    shape): `BlocksSet` calls it before every launch the autotuner makes, `launch` on the CPU."""
    def hook(a):
        bm, bn, bk = a["BLOCK_M"], a["BLOCK_N"], a["BLOCK_K"]
        if kernel == "gate_up":
            a["a_desc"].block_shape, a["w_desc"].block_shape, a["h_desc"].block_shape = [bm, bk], [bn, bk], [bm, bn]
        else:
            a["h_desc"].block_shape, a["w_desc"].block_shape = [bm, bk], [bn, bk]
    return hook


def configs(kernel: str) -> list:
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "GROUP_M": g, "FLATTEN": f}, num_stages=s, num_warps=w)
            for n, k, s, w in TILES[kernel] for g in GROUPS_M for f in FLATTEN[kernel]]


class BlocksSet(KernelInterface):
    """Between the autotuner and the kernel: sets the descriptors' block shapes from the tiles of each launch, timed
    or kept. (Each config's pre_hook could do it, but Triton's autotuner keeps no disk cache of configs with a
    pre_hook: every shard task would time them all again, seconds a key at DeepSeek-V3's widths.)"""

    def __init__(self, fn, kernel: str):
        self.fn, self.arg_names, self.set = fn, fn.arg_names, set_blocks(kernel)

    def run(self, *args, **kwargs):
        self.set({**dict(zip(self.arg_names, args)), **kwargs})
        return self.fn.run(*args, **kwargs)


def whole_column_tiles(configs, named_args, **kwargs):
    """Only tiles whose BLOCK_N divides N (a tile must not cross from gate to up, nor from one expert to the next);
    `runs` guarantees at least the smallest."""
    n = named_args["N"]
    return [c for c in configs if n % c.kwargs["BLOCK_N"] == 0]


def autotuned(fn, kernel: str):
    # cache_results: as fused_moe_kernels.autotuned, the timings go to Triton's cache folder (the worker's compile
    # cache), so the next shard task on the worker times nothing (possible as no config has a pre_hook)
    keep = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    jitted, key = triton.jit(fn), ["N", "K", "BLOCK_M"]
    if "GATHER_A" in inspect.signature(fn).parameters:  # gate_up: "tma" and "tma_w" are different kernels
        jitted = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})(jitted)
        key.append("GATHER_A")
    return triton.autotune(configs(kernel), key=key, prune_configs_by={"early_config_prune": whole_column_tiles},
                           **keep)(BlocksSet(jitted, kernel))


@functools.cache
def gpu_kernels():
    return autotuned(gate_up_kernel, "gate_up"), autotuned(down_kernel, "down")


@functools.cache
def cpu_kernels():
    return InterpretedFunction(gate_up_kernel), InterpretedFunction(down_kernel)


@functools.cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def runs(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, on_gpu: bool | None = None) -> bool:
    """Can these kernels run this call? bf16/fp16 on a GPU (any float on the CPU's interpreter), one dtype, each
    GEMM's output width a whole number of its narrowest column tile (on the CPU 16) and rows 16-byte aligned (TMA's
    rule)."""
    widths = {"gate_up": gate_up_proj.shape[1] // 2, "down": down_proj.shape[1]}
    on_gpu = x.device.type == "cuda" if on_gpu is None else on_gpu
    dtypes = (torch.bfloat16, torch.float16) if on_gpu else (torch.bfloat16, torch.float16, torch.float32)
    tile = {kernel: min(t[0] for t in TILES[kernel]) if on_gpu else 16 for kernel in widths}
    return (x.dtype == gate_up_proj.dtype == down_proj.dtype and x.dtype in dtypes
            and all(w % tile[kernel] == 0 for kernel, w in widths.items())
            and all(w * x.element_size() % 16 == 0 for w in (x.shape[1], *widths.values())))


def cpu_block_n(n: int) -> int:
    return next(b for b in (128, 64, 32, 16) if n % b == 0)


def descriptor(t: torch.Tensor) -> TensorDescriptor:
    """A 2D descriptor of t; its block shape is set per launch (`BlocksSet`, or `launch` on the CPU)."""
    return TensorDescriptor.from_tensor(t, [16, 16])


def launch(kernel, fn, grid_tiles, args, descs, n, k, block_m, device, **flags):
    """One launch: on a GPU the autotuned kernel on a persistent grid; on the CPU the interpreter with fixed tiles,
    one program a tile (or CPU_TILES' PROGRAMS)."""
    if device.type == "cuda":
        sms = sm_count(device.index if device.index is not None else torch.cuda.current_device())
        launch_persistent(fn, grid_tiles, args, block_m, sms, **flags)
        return
    tiles = {"BLOCK_N": cpu_block_n(n), "BLOCK_K": CPU_TILES["BLOCK_K"], "GROUP_M": CPU_TILES["GROUP_M"],
             "FLATTEN": False}
    set_blocks(kernel)({**descs, "BLOCK_M": block_m, **tiles})
    extra = {"EVEN_K": k % tiles["BLOCK_K"] == 0} if kernel == "gate_up" else {}
    programs = min(CPU_TILES["PROGRAMS"] or grid_tiles(tiles["BLOCK_N"]), grid_tiles(tiles["BLOCK_N"]))
    fn[(programs,)](*args, BLOCK_M=block_m, NUM_SMS=programs, UPCAST=True, **tiles, **extra, **flags)


def launch_persistent(fn, grid_tiles, args, block_m: int, sms: int, upcast: bool = False, **flags):
    """The autotuned kernel (`BlocksSet` sets the descriptors' blocks) on at most one program an SM,
    never more than the tiles at the narrowest BLOCK_N (the live tiles are known only on the device)."""
    fn[(min(sms, grid_tiles(64)),)](*args, BLOCK_M=block_m, NUM_SMS=sms, UPCAST=upcast, **flags)


def plan(top_k_index: torch.Tensor, num_experts: int, block_m: int, expert_parallel: bool):
    """(pairs, block_expert, live_blocks [1] int32): align_pairs' sorted pairs and the count of blocks that
    belong to this rank's experts (they come first; the kernels run only those)."""
    from eagle3.extract.fused_moe import align_pairs

    pairs, block_expert = align_pairs(top_k_index, num_experts, block_m, elsewhere=expert_parallel)
    live_blocks = (block_expert < num_experts).sum(dtype=torch.int32).reshape(1)
    return pairs, block_expert, live_blocks


def gather_rows(x: torch.Tensor, pairs: torch.Tensor, top_k: int) -> torch.Tensor:
    """[capacity, H]: each pair's token row in the sorted order; padding rows (pair index S) take the last token's
    row (finite values whose results are never kept)."""
    tokens = torch.clamp_max(pairs // top_k, x.shape[0] - 1)
    return x.index_select(0, tokens)


def gate_up(x, pairs, block_expert, live_blocks, w1, top_k: int, block_m: int, mode: str) -> torch.Tensor:
    """h [capacity, width] = SiLU(gate) x up in the padded sorted order (rows of blocks past the live ones unset)."""
    (t, hidden), (num_experts, two_i, _) = x.shape, w1.shape
    width, capacity = two_i // 2, pairs.numel()
    device = x.device
    gathered = mode == "tma"
    a = gather_rows(x, pairs, top_k) if gathered else x
    h = (torch.empty if device.type == "cuda" else torch.zeros)(capacity, width, dtype=x.dtype, device=device)
    descs = {"a_desc": descriptor(a), "w_desc": descriptor(w1.view(num_experts * two_i, hidden)),
             "h_desc": descriptor(h)}
    fn = gpu_kernels()[0] if device.type == "cuda" else cpu_kernels()[0]
    args = (x, descs["a_desc"], descs["w_desc"], descs["h_desc"], pairs, block_expert, live_blocks, t * top_k,
            top_k, t, width, hidden, x.stride(0))
    launch("gate_up", fn, lambda bn: block_expert.numel() * (width // bn), args, descs, width, hidden, block_m,
           device, GATHER_A=not gathered)
    return h


def down(h, pairs, block_expert, live_blocks, w2, weights, num_pairs: int, block_m: int,
         expert_parallel: bool) -> torch.Tensor:
    """[S, hidden] in pair order: each pair's down projection scaled by its routing weight (rows of pairs on other
    ranks zeros)."""
    (num_experts, hidden, width), device = w2.shape, h.device
    out = (torch.zeros if expert_parallel else torch.empty)(num_pairs, hidden, dtype=h.dtype, device=device)
    descs = {"h_desc": descriptor(h), "w_desc": descriptor(w2.view(num_experts * hidden, width))}
    fn = gpu_kernels()[1] if device.type == "cuda" else cpu_kernels()[1]
    args = (descs["h_desc"], descs["w_desc"], out, pairs, block_expert, live_blocks, weights, num_pairs, hidden,
            width, out.stride(0))
    launch("down", fn, lambda bn: block_expert.numel() * (hidden // bn), args, descs, hidden, width, block_m,
           device)
    return out


def expert_pairs(x, top_k_index, top_k_weights, gate_up_proj, down_proj, expert_parallel: bool, mode: str,
                 block_m: int) -> torch.Tensor:
    """fused_moe.expert_pairs for bf16/fp16 weights through these kernels (`runs` must hold)."""
    if mode not in MODES:
        raise ValueError(f"fused_experts experts_kernel={mode!r}: use one of 'tiles', {', '.join(map(repr, MODES))}")
    top_k, num_experts = top_k_index.shape[-1], gate_up_proj.shape[0]
    s = top_k_index.numel()
    pairs, block_expert, live_blocks = plan(top_k_index, num_experts, block_m, expert_parallel)
    w1, w2 = gate_up_proj.contiguous(), down_proj.contiguous()
    h = gate_up(x, pairs, block_expert, live_blocks, w1, top_k, block_m, mode)
    out = down(h, pairs, block_expert, live_blocks, w2, top_k_weights.reshape(-1).contiguous(), s, block_m,
               expert_parallel)
    return out
