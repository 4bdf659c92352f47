"""The routed experts of a MoE target as two fused Triton kernels: experts_implementation="triton_fused".

transformers' grouped_mm path (transformers/integrations/moe.py) runs the routed experts as separate passes: copy
each (token, expert) pair's row into expert order, grouped GEMM (gate and up), SiLU(gate) x up, grouped GEMM
(down), scale by the routing weight, copy back into pair order, sum over the top k. Each pass writes and re-reads an
[S, width] tensor (S = tokens x top_k); at the Qwen3-30B-A3B shape (hidden 2048, expert width 768) that traffic
is about a quarter of the experts' GEMM time. Here there are two kernels and one reduction:
- gate_up: A's rows are read straight from the tokens' hidden states through the expert-sorted pair list (no
  gathered copy); each program holds the gate and the up tile of the same columns and writes SiLU(gate) x up;
- down: its epilogue scales by the routing weight and writes each pair's row in pair order (`expert_pairs`); the
  top-k sum is one torch reduction (no atomics, so a re-run writes the same bytes), inside the custom op
  (`fused_experts`): compiled, the sum outside it, which Inductor fuses with the residual add after it, ran
  slower, 0.88x / 0.96x at the Qwen3-30B-A3B / DeepSeek-V3 widths (kernels_check's combine row, H100, 2026-12-06).
Pairs are grouped per expert in blocks of BLOCK_M rows, each expert's group padded to whole blocks
(`align_pairs`, on the device: no host sync). The kernels sit behind a torch custom op, opaque to torch.compile.
A softmax top-k router's routing is one kernel too where these experts run (eagle3.extract.fused_router).
FP8 weights in 128 x 128 blocks (DeepSeek-V3's FP8 checkpoint) run as float8 MMAs, each GEMM's input quantized per
token and 128 values first (`quantize_groups`).

`experts_kernel` picks the bf16/fp16 GEMMs' structure: "tiles" (fused_moe_kernels, one program a tile, A's rows
gathered by pointer loads), "tma" or "tma_w" (eagle3.extract.fused_moe_tma: tensor descriptors and a persistent
schedule, for Hopper; "tma" gathers A's rows once into a contiguous buffer first). The extract param of that name
chooses it (eagle3.extract.moe.apply_experts_kernel sets it on each experts module, KERNEL_ATTR); FP8 weights, and
widths the TMA kernels cannot tile, stay on "tiles". bench/kernels_check.py --rows experts measures them side by side.

On the CPU the same kernels run in Triton's interpreter (the tests, and the CPU path of the extractor). Its dot of
bf16 tiles is wrong (triton 3.9 holds bf16 as uint16 in numpy), so there the tiles go to fp32 first (UPCAST).
"""

from __future__ import annotations

import torch

from eagle3.errors import ConfigError

NAME = "triton_fused"
PARAM = f"extract param experts_implementation={NAME!r}"
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_BLOCK = 128  # DeepSeek-V3's FP8 checkpoint: 128 x 128 weight blocks
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
KERNELS = ("tiles", "tma", "tma_w")  # the bf16/fp16 GEMMs' structures (the docstring above)
KERNEL_ATTR = "_eagle3_experts_kernel"  # on an experts module: the one its calls run (default "tiles")
# on an experts module: the tokens of the run's planned batch (its token_budget), which choose BLOCK_M once a run
# (block_m_for); 0: each call's own tokens
PLANNED_TOKENS_ATTR = "_eagle3_planned_tokens"


def kernels(device: torch.device, fp8: bool = False):
    """(gate_up, down, tiles) for `device`: on CUDA compiled and autotuned (tiles per dtype), elsewhere
    interpreted; tiles(n, k) gives a launch at widths n x k its tile arguments (none where autotuned).
    ConfigError when Triton is not installed."""
    try:
        from eagle3.extract import fused_moe_kernels as fk
    except ImportError as e:
        raise ConfigError(f"{PARAM} needs the triton package ({e}); use 'grouped_mm'") from e
    if device.type == "cuda":
        return (*fk.GPU[fp8], lambda n, k: {})
    return (*fk.CPU, lambda n, k: fk.fixed_tiles(fk.CPU_TILES, n, k))


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q float8_e4m3fn [R, K], scale float32 [R, K / 128]): each row's groups of FP8_BLOCK values scaled by
    amax / 448, the dynamic activation scheme of DeepSeek-V3's FP8 checkpoint (transformers' act_quant). One Triton
    kernel (fused_moe_kernels.quantize_kernel), interpreted on the CPU."""
    from eagle3.extract.fused_moe_kernels import QUANTIZE

    x = x.contiguous()
    (r, k), device = x.shape, x.device
    kernel, block_r = QUANTIZE["cuda" if device.type == "cuda" else "cpu"]
    q = torch.empty(r, k, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(r, k // FP8_BLOCK, dtype=torch.float32, device=device)
    if r:
        kernel[(-(-r // block_r), k // FP8_BLOCK)](x, q, scale, r, k, x.stride(0), q.stride(0), scale.stride(0),
                                                   BLOCK_R=block_r, GROUP=FP8_BLOCK)
    return q, scale


def block_m_for(num_pairs: int, num_experts: int, device: torch.device) -> int:
    """Rows a block: on a GPU 128 where experts get many rows each, else 64 (a group pads to it); on the CPU 256
    (the interpreter's time goes by programs and ops, hardly by their size). The extractor passes its planned
    batch's pairs, not each batch's (PLANNED_TOKENS_ATTR): BLOCK_M is in the autotuners' keys, so a value first met
    mid-run times every config there (about 19 s on the H100 at DeepSeek-V3's widths, where 256 experts x 1,024
    pairs sit exactly at a full 32,768-token batch and 2 of 68 batches crossed over, 2026-12-07)."""
    if device.type != "cuda":
        return 256
    return 128 if num_pairs >= 1024 * num_experts else 64


def align_pairs(top_k_index: torch.Tensor, num_experts: int, block_m: int,
                elsewhere: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [capacity] int32, block_expert [capacity // block_m] int32): the (token, expert) pairs (index
    token * top_k + j) sorted by expert, each expert's group padded with the sentinel S to whole blocks, and the
    expert of each block (num_experts or more past the experts' groups: no kernel runs those blocks). capacity is
    the bound S + E (block_m - 1), so every shape is known without reading the counts back to the host.
    `elsewhere` (expert parallelism): ids >= num_experts name experts on other ranks; their pairs form one group
    after the last expert's. On a GPU two Triton kernels do it (eagle3.extract.fused_moe_align: the same bytes),
    elsewhere torch's ops (`align_pairs_torch`)."""
    if top_k_index.device.type == "cuda":
        from eagle3.extract import fused_moe_align

        return fused_moe_align.align_pairs(top_k_index, num_experts, block_m, elsewhere)
    return align_pairs_torch(top_k_index, num_experts, block_m, elsewhere)


def align_pairs_torch(top_k_index: torch.Tensor, num_experts: int, block_m: int,
                      elsewhere: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_pairs` by torch's ops: a stable sort of the expert ids, then the groups' padded slots."""
    groups = num_experts + elsewhere
    ids = top_k_index.reshape(-1).long()
    ids = ids.clamp(max=num_experts) if elsewhere else ids
    s, device = ids.numel(), ids.device
    sorted_experts, order = torch.sort(ids, stable=True)
    counts = torch.zeros(groups, dtype=torch.long, device=device).scatter_add_(0, ids, torch.ones_like(ids))
    capacity = pair_capacity(s, groups, block_m)
    padded_start, block_expert = padded_groups(counts, block_m, capacity)
    group_start = torch.cumsum(counts, 0) - counts
    dest = padded_start[sorted_experts] + torch.arange(s, device=device) - group_start[sorted_experts]
    pairs = torch.full((capacity,), s, dtype=torch.int32, device=device)
    pairs[dest] = order.to(torch.int32)  # each dest once: deterministic
    return pairs, block_expert


def pair_capacity(num_pairs: int, groups: int, block_m: int) -> int:
    """Slots of the padded pair list: the bound num_pairs + groups (block_m - 1), in whole blocks (`align_pairs`)."""
    return -(-(num_pairs + min(groups, num_pairs) * (block_m - 1)) // block_m) * block_m


def padded_groups(counts: torch.Tensor, block_m: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(padded_start int64 [groups], block_expert int32 [capacity // block_m]) for pair counts per group: each
    group's first slot, its size padded to whole blocks, and the group of each block (`align_pairs`)."""
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    block_starts = torch.arange(0, capacity, block_m, device=counts.device)
    return padded_end - padded, torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_q float8_e4m3fn [E, out, in], scale float32 [E, out / 128, in / 128]) with w ~ w_q * scale per 128 x 128
    block: the layout of DeepSeek-V3's FP8 checkpoint, which the kernels read."""
    e, o, i = w.shape
    q = torch.empty(e, o, i, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(e, o // FP8_BLOCK, i // FP8_BLOCK, dtype=torch.float32, device=w.device)
    for j in range(e):  # one at a time: float32 copies of a whole experts tensor (30 GB at DeepSeek-V3) would not fit
        blocks = w[j].float().view(o // FP8_BLOCK, FP8_BLOCK, i // FP8_BLOCK, FP8_BLOCK)
        scale[j] = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX
        q[j] = (blocks / scale[j][:, None, :, None]).to(torch.float8_e4m3fn).view(o, i)
    return q, scale


def quantize_experts(module) -> None:
    """A bf16 experts module's weights to FP8 in 128 x 128 blocks, in place, as an FP8 checkpoint would load them
    (FP8 on load of a bf16 target, for this kernel only: transformers' own experts paths do not read them)."""
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            q, scale = quantize_blocks(getattr(module, name))
            setattr(module, name, torch.nn.Parameter(q, requires_grad=False))
            setattr(module, f"{name}_scale_inv", torch.nn.Parameter(scale, requires_grad=False))
    module.block_size, module.activation_scheme = (FP8_BLOCK, FP8_BLOCK), "dynamic"


@torch.library.custom_op("eagle3::triton_fused_experts", mutates_args=())
def fused_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                  down_proj: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
                  down_scale: torch.Tensor | None = None, expert_parallel: bool = False,
                  experts_kernel: str = "tiles", planned_tokens: int = 0) -> torch.Tensor:
    """The routed experts' sum for tokens x [T, H]: `expert_pairs` summed over each token's top k."""
    pairs = expert_pairs(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_scale, down_scale,
                         expert_parallel, experts_kernel, planned_tokens)
    return pairs.view(x.shape[0], top_k_index.shape[-1], -1).sum(dim=1)


@fused_experts.register_fake
def _(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_scale=None, down_scale=None,
      expert_parallel=False, experts_kernel="tiles", planned_tokens=0):
    return torch.empty_like(x)


@torch.library.custom_op("eagle3::triton_fused_expert_pairs", mutates_args=())
def expert_pairs(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                 down_proj: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
                 down_scale: torch.Tensor | None = None, expert_parallel: bool = False,
                 experts_kernel: str = "tiles", planned_tokens: int = 0) -> torch.Tensor:
    """[T * top_k, H] in pair order (row t * top_k + j): weight[t, j] * down(SiLU(gate) * up)(x[t]) through expert
    top_k_index[t, j] for tokens x [T, H]; gate_up_proj [E, 2I, H], down_proj [E, H, I] (transformers' layout).
    With scales the weights are float8 in 128 x 128 blocks (w = w_q * scale, scale [E, out / 128, in / 128]) and
    the GEMMs run in FP8, their inputs quantized per token and 128 values (`quantize_groups`). `expert_parallel`:
    this rank holds experts 0..E-1 of its share, an id >= E is an expert of another rank (transformers' EP
    sentinel), whose pair's row is zeros here (the ranks' sums are all-reduced after). `experts_kernel`: one of
    KERNELS, for bf16/fp16 weights (not named `kernel`: Inductor's fallback for custom ops takes that name).
    `planned_tokens`: the run's planned batch, which sets BLOCK_M (`block_m_for`; 0: these T tokens)."""
    x = x.contiguous()
    t, hidden = x.shape
    top_k, (num_experts, two_i, _) = top_k_index.shape[-1], gate_up_proj.shape
    width, s = two_i // 2, t * top_k
    fp8 = gate_up_scale is not None
    block_m = block_m_for((planned_tokens or t) * top_k, num_experts, x.device)
    if experts_kernel != "tiles" and not fp8:
        from eagle3.extract import fused_moe_tma

        if fused_moe_tma.runs(x, gate_up_proj, down_proj):
            return fused_moe_tma.expert_pairs(x, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                              expert_parallel, experts_kernel, block_m)
    pairs, block_expert = align_pairs(top_k_index, num_experts, block_m, elsewhere=expert_parallel)
    num_blocks = block_expert.numel()
    gate_up, down, tiles = kernels(x.device, fp8)
    upcast = x.device.type != "cuda"
    w1, w2 = gate_up_proj.contiguous(), down_proj.contiguous()
    s1 = gate_up_scale.contiguous() if fp8 else w1  # (unread without FP8)
    s2 = down_scale.contiguous() if fp8 else w2
    xq, xs = quantize_groups(x) if fp8 else (x, x)
    # rows of padding and of blocks no kernel runs stay unwritten; FP8 quantizes them too (their scales are never
    # read): zeros on the CPU, where numpy would warn of NaN in the memory left there, at every op
    h = (torch.empty if x.device.type == "cuda" else torch.zeros)(pairs.numel(), width, dtype=x.dtype,
                                                                   device=x.device)
    gate_up[lambda meta: (-(-width // meta["BLOCK_N"]) * num_blocks,)](
        xq, w1, h, pairs, block_expert, xs, s1, s, top_k, num_experts, num_blocks, width, hidden,
        xq.stride(0), w1.stride(0), w1.stride(1), h.stride(0), xs.stride(0), s1.stride(0), s1.stride(1),
        BLOCK_M=block_m, UPCAST=upcast, FP8=fp8, **tiles(width, hidden))
    hq, hs = quantize_groups(h) if fp8 else (h, h)
    # (under expert parallelism the other ranks' pairs are never written: zeros, not garbage times a zero weight)
    out = (torch.zeros if expert_parallel else torch.empty)(s, hidden, dtype=x.dtype, device=x.device)
    weights = top_k_weights.reshape(-1).contiguous()
    down[lambda meta: (-(-hidden // meta["BLOCK_N"]) * num_blocks,)](
        hq, w2, out, pairs, block_expert, weights, hs, s2, s, num_experts, num_blocks, hidden, width,
        hq.stride(0), w2.stride(0), w2.stride(1), out.stride(0), hs.stride(0), s2.stride(0), s2.stride(1),
        BLOCK_M=block_m, UPCAST=upcast, FP8=fp8, **tiles(hidden, width))
    return out


@expert_pairs.register_fake
def _(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_scale=None, down_scale=None,
      expert_parallel=False, experts_kernel="tiles", planned_tokens=0):
    return x.new_empty(top_k_index.numel(), x.shape[1])


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface: the module's own weights (and an FP8 checkpoint's block scales) through
    `fused_experts`, through the kernel set on the module (KERNEL_ATTR), BLOCK_M by its planned batch
    (PLANNED_TOKENS_ATTR)."""
    fp8 = self.gate_up_proj.dtype == torch.float8_e4m3fn
    return fused_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                         self.gate_up_proj_scale_inv if fp8 else None, self.down_proj_scale_inv if fp8 else None,
                         getattr(self, "_is_expert_parallel", False), getattr(self, KERNEL_ATTR, "tiles"),
                         getattr(self, PLANNED_TOKENS_ATTR, 0))


def weights_ok(module) -> bool:
    """Plain weights, or an FP8 checkpoint's (transformers' FP8Experts): float8 e4m3 with float32 scales per
    128 x 128 block, activations quantized as they come (the dynamic scheme), widths in whole blocks."""
    w1, w2 = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(w1, torch.Tensor) and isinstance(w2, torch.Tensor)):
        return False
    if w1.dtype in WEIGHT_DTYPES and w2.dtype in WEIGHT_DTYPES:
        return True
    scales = [getattr(module, f"{w}_scale_inv", None) for w in ("gate_up_proj", "down_proj")]
    return (w1.dtype == w2.dtype == torch.float8_e4m3fn and tuple(getattr(module, "block_size", None) or ()) ==
            (FP8_BLOCK, FP8_BLOCK) and getattr(module, "activation_scheme", None) == "dynamic"
            and all(isinstance(sc, torch.Tensor) and sc.dtype == torch.float32 for sc in scales)
            and whole_fp8_blocks(module))


def whole_fp8_blocks(module) -> bool:
    """Are the experts' hidden size and width whole FP8 blocks (so their weights can be, or are, in 128 x 128
    blocks, and each GEMM input in groups of 128)?"""
    return all(d % FP8_BLOCK == 0 for d in module.down_proj.shape[1:])


def check_experts(module) -> None:
    """The layouts the kernels read: gated SiLU experts, gate and up concatenated, untransposed, no bias."""
    checks = {"a gate (gate_up_proj)": getattr(module, "has_gate", False),
              "gate and up concatenated": getattr(module, "is_concatenated", False),
              "untransposed weights": not getattr(module, "is_transposed", True),
              "no bias": not getattr(module, "has_bias", True),
              # (a transformers before post-expert norms has no such attribute, nor any such norm)
              "no post-expert norm": not getattr(module, "has_post_expert_norm", False),
              "the SiLU activation": isinstance(getattr(module, "act_fn", None), torch.nn.SiLU)
              or type(getattr(module, "act_fn", None)).__name__ == "SiLUActivation",
              "a plain SwiGLU (no clamp, softcap or alpha)": all(getattr(module, a, None) is None for a in
                                                                 ("limit", "gate_softcap", "up_softcap",
                                                                  "swiglu_alpha")),
              "bf16/fp16/fp32 weights, or float8 in 128 x 128 blocks": weights_ok(module)}
    missing = [k for k, ok in checks.items() if not ok]
    if missing:
        raise ConfigError(f"{PARAM}: {type(module).__name__} lacks what the kernels read: {', '.join(missing)}; "
                          f"use 'grouped_mm'")


def check_runnable(modules) -> None:
    """ConfigError, naming the param, unless the kernels read every module's layout and triton is installed."""
    for module in modules:
        check_experts(module)
    kernels(torch.device("cpu"))


def reads(modules) -> bool:
    """Can the kernels run these experts modules (`check_runnable` without the error)?"""
    try:
        check_runnable(modules)
    except ConfigError:
        return False
    return True


def register(experts_modules) -> None:
    """Check each experts module and make NAME one of transformers' experts implementations (an FP8 checkpoint's
    experts dispatch through transformers' FP8 interface: there too)."""
    from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    from transformers.integrations.moe import ExpertsInterface

    check_runnable(experts_modules)
    ExpertsInterface.register(NAME, experts_forward)
    FP8ExpertsInterface.register(NAME, experts_forward)
