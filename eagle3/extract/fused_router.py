"""A softmax top-k router's routing as one Triton kernel, for the targets whose experts run `fused_moe`.

transformers' softmax routers (Qwen3-MoE's and the same code in Qwen2-MoE, OLMoE, Qwen3-Next: ROUTERS) compute
softmax over the experts in float32, torch.topk, then divide the k weights by their sum. Compiled, Inductor fuses
the softmax, but top-k stays aten's `gatherTopK`, a radix select per token: 2.4% of the Qwen3-30B-A3B forward's
kernel time on the H200 (docs/benchmarks.md), about 220 us a layer at 32K tokens for a [32K, 128] float32 input
read in a few us. Here one program holds BLOCK_T tokens' logits in registers: softmax, k rounds of (max, its first
index, masked out), the division. The same weights and experts as transformers' code (within float32 rounding of
the softmax's sum; equal probabilities go to the lower expert, where torch.topk leaves the order unspecified).

On the CPU the kernel runs in Triton's interpreter (the tests); the custom op keeps it opaque to torch.compile.
"""

from __future__ import annotations

import types

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# transformers' router classes whose forward is Qwen3-MoE's: linear, softmax in float32, topk, optional division
# by the k weights' sum (norm_topk_prob), weights cast to the logits' dtype
ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter", "Qwen3NextTopKRouter")
NAME = "softmax_topk"  # the manifest's kernel record names the router that ran (its ties differ from torch.topk's)


def softmax_topk_kernel(logits_ptr, weights_ptr, ids_ptr, T, E, stride, K: tl.constexpr, NORM: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    ok = rows < T
    inside = ok[:, None] & (cols < E)[None, :]
    x = tl.load(logits_ptr + rows[:, None] * stride + cols[None, :], mask=inside, other=0.0)
    x = tl.where(inside, x.to(tl.float32), -3.0e38)  # finite: a row past T gives no NaN (and is never stored)
    # reductions spelt as the ones they call: the interpreter maps these combine functions to numpy's
    x = x - tl.reduce(x, 1, tl.standard._elementwise_max)[:, None]
    p = tl.where(inside, tl.exp(x), 0.0)
    total = tl.maximum(tl.reduce(p, 1, tl.standard._sum_combine), 1e-30)
    p = tl.div_rn(p, total[:, None])  # IEEE division, as torch's softmax (Triton's "/" is approximate on a GPU)
    slots = tl.arange(0, BLOCK_K)
    top = tl.full((BLOCK_T, BLOCK_K), 0.0, tl.float32)  # (tl.full, not tl.zeros: the interpreter calls no @jit)
    ids = tl.full((BLOCK_T, BLOCK_K), 0, tl.int64)
    p = tl.where(inside, p, -1.0)  # below every probability: never picked
    for j in tl.static_range(K):
        v = tl.reduce(p, 1, tl.standard._elementwise_max)
        first = tl.reduce(tl.where(p == v[:, None], cols[None, :], BLOCK_E), 1, tl.standard._elementwise_min)
        top = tl.where(slots[None, :] == j, v[:, None], top)
        ids = tl.where(slots[None, :] == j, first[:, None].to(tl.int64), ids)
        p = tl.where(cols[None, :] == first[:, None], -1.0, p)
    if NORM:
        top = tl.div_rn(top, tl.reduce(top, 1, tl.standard._sum_combine)[:, None])
    out = ok[:, None] & (slots < K)[None, :]
    tl.store(weights_ptr + rows[:, None] * K + slots[None, :], top, mask=out)
    tl.store(ids_ptr + rows[:, None] * K + slots[None, :], ids, mask=out)


GPU_KERNEL = triton.jit(softmax_topk_kernel)
CPU_KERNEL = InterpretedFunction(softmax_topk_kernel)


@torch.library.custom_op("eagle3::softmax_topk", mutates_args=())
def softmax_topk(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) of router logits [T, E]: the k largest of softmax(logits)
    in float32, largest first, divided by their sum where `norm`."""
    logits = logits.contiguous()
    t, e = logits.shape
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    block_e, block_t = triton.next_power_of_2(e), block_tokens(e, logits.device.type)
    if t:
        kernel = GPU_KERNEL if logits.device.type == "cuda" else CPU_KERNEL
        kernel[(triton.cdiv(t, block_t),)](logits, weights, ids, t, e, logits.stride(0), K=k, NORM=norm,
                                          BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(k))
    return weights, ids


def block_tokens(experts: int, device_type: str) -> int:
    """Tokens a program: on a GPU few enough that its tile of logits stays in registers (16 at 128 experts: 162
    registers a thread, no spill on sm_90), on the CPU many (the interpreter's time goes by programs)."""
    return max(1, min(16, 4096 // triton.next_power_of_2(experts))) if device_type == "cuda" else 1024


@softmax_topk.register_fake
def _(logits, k, norm):
    t = logits.shape[0]
    return logits.new_empty(t, k, dtype=torch.float32), logits.new_empty(t, k, dtype=torch.int64)


def router_forward(self, hidden_states: torch.Tensor):
    """ROUTERS' forward, its softmax and top-k one kernel (returns what theirs returns)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    weights, ids = softmax_topk(router_logits, self.top_k, bool(self.norm_topk_prob))
    return router_logits, weights.to(router_logits.dtype), ids


def apply(model) -> int:
    """Swap the forward of each router of ROUTERS in `model` for `router_forward`; how many run it."""
    routers = [m for m in model.modules() if type(m).__name__ in ROUTERS]
    for module in routers:
        module.forward = types.MethodType(router_forward, module)
    return len(routers)


def restore(model) -> None:
    """Give each router `apply` took over its class's forward back."""
    for module in model.modules():
        if getattr(vars(module).get("forward"), "__func__", None) is router_forward:
            del module.forward
