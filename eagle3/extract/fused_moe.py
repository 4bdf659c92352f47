"""The routed experts of a MoE target as two fused Triton kernels: experts_implementation="triton_fused".

transformers' grouped_mm path (transformers/integrations/moe.py) runs the routed experts as separate passes: copy
each (token, expert) pair's row into expert order, grouped GEMM (gate and up), SiLU(gate) x up, grouped GEMM
(down), scale by the routing weight, copy back into pair order, sum over the top k. Each pass writes and re-reads an
[S, width] tensor (S = tokens x top_k); at the Qwen3-30B-A3B shape (hidden 2048, expert width 768) that traffic
is about a quarter of the experts' GEMM time. Here there are two kernels and one reduction:
- gate_up: A's rows are read straight from the tokens' hidden states through the expert-sorted pair list (no
  gathered copy); each program holds the gate and the up tile of the same columns and writes SiLU(gate) x up;
- down: its epilogue scales by the routing weight and writes each pair's row in pair order; the top-k sum is one
  torch reduction (no atomics, so a re-run writes the same bytes).
Pairs are grouped per expert in blocks of BLOCK_M rows, each expert's group padded to whole blocks
(`align_pairs`, on the device: no host sync). The kernels sit behind a torch custom op, opaque to torch.compile.

On the CPU the same kernels run in Triton's interpreter (the tests, and the CPU path of the extractor). Its dot of
bf16 tiles is wrong (triton 3.9 holds bf16 as uint16 in numpy), so there the tiles go to fp32 first (UPCAST).
"""

from __future__ import annotations

import torch

from eagle3.errors import ConfigError

NAME = "triton_fused"
PARAM = f"extract param experts_implementation={NAME!r}"
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kernels(device: torch.device):
    """(gate_up, down, fixed tiles) for `device`: on CUDA compiled and autotuned, elsewhere interpreted.
    ConfigError when Triton is not installed."""
    try:
        from eagle3.extract import fused_moe_kernels
    except ImportError as e:
        raise ConfigError(f"{PARAM} needs the triton package ({e}); use 'grouped_mm'") from e
    if device.type == "cuda":
        return (*fused_moe_kernels.GPU, {})
    return (*fused_moe_kernels.CPU, fused_moe_kernels.CPU_TILES)


def block_m_for(num_pairs: int, num_experts: int, device: torch.device) -> int:
    """Rows a block: on a GPU 128 where experts get many rows each, else 64 (a group pads to it); on the CPU 64
    (the interpreter's time goes by programs, not by their size)."""
    return 128 if device.type == "cuda" and num_pairs >= 1024 * num_experts else 64


def align_pairs(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [capacity] int32, block_expert [capacity // block_m] int32): the (token, expert) pairs (index
    token * top_k + j) sorted by expert, each expert's group padded with the sentinel S to whole blocks, and the
    expert of each block (num_experts past the last group). capacity is the bound S + E (block_m - 1), so every
    shape is known without reading the counts back to the host."""
    ids = top_k_index.reshape(-1).long()
    s, device = ids.numel(), ids.device
    sorted_experts, order = torch.sort(ids, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    group_start = torch.cumsum(counts, 0) - counts
    dest = (padded_end - padded)[sorted_experts] + torch.arange(s, device=device) - group_start[sorted_experts]
    capacity = -(-(s + min(num_experts, s) * (block_m - 1)) // block_m) * block_m
    pairs = torch.full((capacity,), s, dtype=torch.int32, device=device)
    pairs[dest] = order.to(torch.int32)  # each dest once: deterministic
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return pairs, block_expert


@torch.library.custom_op("eagle3::triton_fused_experts", mutates_args=())
def fused_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                  down_proj: torch.Tensor) -> torch.Tensor:
    """The routed experts' sum for tokens x [T, H]: sum_j weight[t, j] * down(SiLU(gate) * up)(x[t]) through expert
    top_k_index[t, j]; gate_up_proj [E, 2I, H], down_proj [E, H, I] (transformers' layout)."""
    x = x.contiguous()
    t, hidden = x.shape
    top_k, (num_experts, two_i, _) = top_k_index.shape[-1], gate_up_proj.shape
    width, s = two_i // 2, t * top_k
    block_m = block_m_for(s, num_experts, x.device)
    pairs, block_expert = align_pairs(top_k_index, num_experts, block_m)
    num_blocks = block_expert.numel()
    gate_up, down, tiles = kernels(x.device)
    upcast = x.device.type != "cuda"
    w1, w2 = gate_up_proj.contiguous(), down_proj.contiguous()
    h = torch.empty(pairs.numel(), width, dtype=x.dtype, device=x.device)
    gate_up[lambda meta: (-(-width // meta["BLOCK_N"]), num_blocks)](
        x, w1, h, pairs, block_expert, s, top_k, num_experts, width, hidden,
        x.stride(0), w1.stride(0), w1.stride(1), h.stride(0), BLOCK_M=block_m, UPCAST=upcast, **tiles)
    out = torch.empty(s, hidden, dtype=x.dtype, device=x.device)
    weights = top_k_weights.reshape(-1).contiguous()
    down[lambda meta: (-(-hidden // meta["BLOCK_N"]), num_blocks)](
        h, w2, out, pairs, block_expert, weights, s, num_experts, hidden, width,
        h.stride(0), w2.stride(0), w2.stride(1), out.stride(0), BLOCK_M=block_m, UPCAST=upcast, **tiles)
    return out.view(t, top_k, hidden).sum(dim=1).to(x.dtype)


@fused_experts.register_fake
def _(x, top_k_index, top_k_weights, gate_up_proj, down_proj):
    return torch.empty_like(x)


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface: the module's own weights through `fused_experts`."""
    return fused_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj,
                         self.down_proj)


def check_experts(module) -> None:
    """The layouts the kernels read: gated SiLU experts, gate and up concatenated, untransposed, no bias."""
    checks = {"a gate (gate_up_proj)": getattr(module, "has_gate", False),
              "gate and up concatenated": getattr(module, "is_concatenated", False),
              "untransposed weights": not getattr(module, "is_transposed", True),
              "no bias": not getattr(module, "has_bias", True),
              "no post-expert norm": not getattr(module, "has_post_expert_norm", True),
              "the SiLU activation": isinstance(getattr(module, "act_fn", None), torch.nn.SiLU)
              or type(getattr(module, "act_fn", None)).__name__ == "SiLUActivation",
              "no expert parallelism": not getattr(module, "_is_expert_parallel", False),
              # an FP8 checkpoint's experts hold float8 weights and block scales (transformers' FP8Experts)
              "bf16/fp16/fp32 weights": all(getattr(getattr(module, w, None), "dtype", None) in WEIGHT_DTYPES
                                            for w in ("gate_up_proj", "down_proj"))}
    missing = [k for k, ok in checks.items() if not ok]
    if missing:
        raise ConfigError(f"{PARAM}: {type(module).__name__} lacks what the kernels read: {', '.join(missing)}; "
                          f"use 'grouped_mm'")


def register(experts_modules) -> None:
    """Check each experts module and make NAME one of transformers' experts implementations."""
    from transformers.integrations.moe import ExpertsInterface

    for module in experts_modules:
        check_experts(module)
    kernels(torch.device("cpu"))  # triton is there
    ExpertsInterface.register(NAME, experts_forward)
