"""The softmax top-k router as one Triton kernel (eagle3.extract.fused_router), on the CPU in Triton's interpreter:
its weights and experts against softmax + torch.topk (+ the division), ties, the routers it takes over in a model,
and the kernel as Hopper compiles it (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from eagle3.extract import fused_router  # noqa: E402
from eagle3.extract.fused_router import softmax_topk  # noqa: E402
from tests.support.tiny_targets import _COMMON, TARGETS  # noqa: E402


def reference(logits: torch.Tensor, k: int, norm: bool):
    p = torch.softmax(logits, dtype=torch.float, dim=-1)
    v, i = torch.topk(p, k, dim=-1)
    return (v / v.sum(-1, keepdim=True) if norm else v), i


@pytest.mark.parametrize("tokens, experts, k, norm", [(1100, 128, 8, True), (37, 60, 4, False), (5, 256, 8, True),
                                                      (3, 8, 1, True), (0, 16, 2, True)])
def test_weights_and_experts_equal_softmax_and_topk(tokens, experts, k, norm):
    """float32 logits (no ties): the same experts in the same order, the weights within float32 rounding;
    token counts off the kernel's block and expert counts off a power of two."""
    g = torch.Generator().manual_seed(tokens + experts)
    logits = torch.randn(tokens, experts, generator=g) * 4
    w, i = softmax_topk(logits, k, norm)
    rw, ri = reference(logits, k, norm)
    assert w.dtype == torch.float32 and i.dtype == torch.int64 and w.shape == i.shape == (tokens, k)
    assert torch.equal(i, ri)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)


def test_equal_probabilities_go_to_the_lower_expert():
    """Ties (frequent in bf16 logits): the values picked are torch's, the experts among equals lowest first."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 1.0], [3.0, 3.0, 3.0, 3.0, 0.0, 3.0]], dtype=torch.bfloat16)
    w, i = softmax_topk(logits, 3, False)
    rw, _ = reference(logits, 3, False)
    assert i.tolist() == [[1, 3, 2], [0, 1, 2]]
    torch.testing.assert_close(w, rw)


def tiny_model(model_type: str):
    import transformers
    from transformers import AutoModelForCausalLM

    cls_name, fields = TARGETS[model_type]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**{**_COMMON, **fields}),
                                            dtype=torch.float32).eval()


def test_the_fused_experts_take_over_softmax_routers_only():
    """Switching a Qwen3-MoE target to the fused experts swaps each router's forward, and to another experts
    kernel swaps it back; a router returns what transformers' returns (logits, weights in the logits' dtype,
    experts); DeepSeek-V3's own routing (sigmoid, groups) is left alone."""
    from eagle3.extract import moe

    model = tiny_model("qwen3_moe")
    routers = [m for m in model.modules() if type(m).__name__ in fused_router.ROUTERS]
    assert routers and all("forward" not in vars(r) for r in routers)
    x = torch.randn(50, model.config.hidden_size)
    before = [r(x) for r in routers]
    assert moe.apply_experts_implementation(model, "triton_fused") == fused_router.NAME  # the manifest's record
    assert all(vars(r)["forward"].__func__ is fused_router.router_forward for r in routers)
    for r, (logits, weights, ids) in zip(routers, before):
        got_logits, got_weights, got_ids = r(x)
        assert torch.equal(got_logits, logits) and torch.equal(got_ids, ids) and got_weights.dtype == weights.dtype
        torch.testing.assert_close(got_weights, weights, rtol=1e-6, atol=1e-7)
    assert moe.apply_experts_implementation(model, "grouped_mm") is None  # transformers' routers again
    assert all("forward" not in vars(r) for r in routers) and torch.equal(routers[0](x)[2], before[0][2])
    assert fused_router.apply(tiny_model("deepseek_v3")) == 0
    assert moe.apply_experts_implementation(tiny_model("deepseek_v3"), "triton_fused") is None


def test_the_kernel_compiles_for_hopper_without_spilling(tmp_path):
    """At Qwen3-30B-A3B's 128 experts and top 8 (and at 256), a program's tile stays in registers: ptxas for
    sm_90 reports no spill stores (64 tokens a program would spill)."""
    from tests.support.hopper import spill_report

    kinds = {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i64"}

    def report(experts: int, block_t: int) -> str:
        constants = {"K": 8, "NORM": True, "BLOCK_T": block_t, "BLOCK_E": experts, "BLOCK_K": 8}
        return spill_report(fused_router.GPU_KERNEL, constants, kinds, tmp_path)

    for experts in (128, 256):
        assert " 0 bytes spill stores" in report(experts, fused_router.block_tokens(experts, "cuda")), experts
    assert " 0 bytes spill stores" not in report(128, 64)
