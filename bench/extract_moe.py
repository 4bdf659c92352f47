"""MoE targets for bench/extract_bench.py: the shapes (random weights), the reduced depth of the DeepSeek-V3
shape that fits one GPU, a skewed router, the routing load, and the ceiling of the experts' GEMMs alone.

- `qwen3-30b-a3b`: Qwen3-30B-A3B at full depth (48 layers, hidden 2048, 128 experts of width 768, top 8).
- `dsv3`: DeepSeek-V3 (hidden 7168, MLA, 256 routed experts of width 2048, top 8 in 4 of 8 groups, one shared
  expert, the first 3 layers dense) with as many layers as fit the device's memory less `reserve` for the batch
  (fit.weight_estimate, bf16) with room for a 32768-token batch: 7 on an H200 (3 dense + 4 MoE, ~99 GB).
- `tiny-moe`, `tiny-mla`: the same two architectures at test size (--smoke).

The expert ceiling: the routed experts' GEMMs of one batch (token_budget tokens x top-k rows, gate_up then
down) timed alone with each kernel that can run them (torch's grouped_mm on the routed offsets; bmm over equal
groups), the best of them, beside one dense GEMM of the same rows; and the whole experts step (copies included)
through transformers' grouped_mm path and the project's fused Triton kernels (`blocks`). The "ceiling roofline"
is the tokens/s of the model if its experts ran at that ceiling and everything else at the dense matmul rate.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from eagle3.extract.moe import moe_blocks
from eagle3.fit import weight_estimate
from eagle3.flops import routed_expert_params, sample_flops

_DSV3 = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
             num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4, first_k_dense_replace=3,
             num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, routed_scaling_factor=2.5,
             norm_topk_prob=True, vocab_size=129280, max_position_embeddings=16384, rope_scaling=None,
             tie_word_embeddings=False)
MOE_SHAPES = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, vocab_size=151936, max_position_embeddings=16384, rope_theta=1e6,
        tie_word_embeddings=False)),
    "dsv3": ("DeepseekV3Config", _DSV3),  # num_hidden_layers: dsv3_layers()
    "tiny-moe": ("Qwen3MoeConfig", dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
        vocab_size=1024, max_position_embeddings=2048)),  # widths in whole 128-blocks: its experts can go to FP8
    "tiny-mla": ("DeepseekV3Config", dict(
        hidden_size=128, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=4,
        n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, routed_scaling_factor=1.0, norm_topk_prob=True, vocab_size=1024,
        max_position_embeddings=2048, rope_scaling=None, num_hidden_layers=8)),
}
# dsv3 at 32768: 1,024 routed rows an expert (256 experts, top 8); at 8192 the experts' GEMMs get 256 rows each
MOE_BUDGET = {"qwen3-30b-a3b": 32768, "dsv3": 32768, "tiny-moe": 1024, "tiny-mla": 1024}
H200_BYTES = 139 << 30  # what one H200 offers torch (the device tool's figure), for the CPU's dry runs
# Left beside the weights: the extractor's 10% memory headroom (14 GiB), a 32768-token batch at hidden 7168 (~14 GB
# by the extractor's own estimate), the experts' ceiling probe's rows (~4 GB), the CUDA context and slack. The H200
# showed that 24 GiB was too little (2026-12-05: 8 layers left 5.6 GB, budget 16384 refused by the memory check).
RESERVE_BYTES = 40 << 30


def dsv3_layers(device_bytes: int, reserve: int = RESERVE_BYTES) -> int:
    """The most layers of the DeepSeek-V3 shape whose bf16 weights fit device_bytes - reserve."""
    n = _DSV3["first_k_dense_replace"] + 1
    while weight_estimate({**_DSV3, "num_hidden_layers": n + 1}, 1, "bfloat16").total_bytes <= device_bytes - reserve:
        n += 1
    return n


def moe_config(name: str, device, layers: int | None = None) -> object:
    """The transformers config of a MoE shape; dsv3 gets `layers` decoder layers, or as many as fit the device."""
    import transformers

    cls_name, fields = MOE_SHAPES[name]
    fields = dict(fields)
    if name == "dsv3":
        mem = torch.cuda.mem_get_info(device)[1] if torch.device(device).type == "cuda" else H200_BYTES
        fields["num_hidden_layers"] = layers or dsv3_layers(mem)
    return getattr(transformers, cls_name)(**fields, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)


def build_moe_model(name: str, device, dtype, layers: int | None = None):
    """(model, model_path) of a random-weight MoE shape built on `device` (seed 0: rebuilt identically)."""
    from transformers import AutoModelForCausalLM

    cfg = moe_config(name, device, layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval(), f"random-{name}"


def is_moe(model) -> bool:
    return bool(moe_blocks(model.model.layers))


# -- routing ----------------------------------------------------------------------------------------

def skew_router(model, exponent: float, seed: int = 0) -> dict:
    """A Zipf-like preference over experts, set in the router weights: expert e's router row is scaled by
    rank_e^-exponent (ranks shuffled per layer, scales normalized to mean 1), so its logits spread wider and it
    wins the top-k more often. Returns the original rows, for restore_router."""
    rng = np.random.default_rng(seed)
    saved = {}
    with torch.no_grad():
        for i, block in enumerate(moe_blocks(model.model.layers)):
            w = block.gate.weight
            saved[i] = w.detach().clone()
            scale = np.arange(1, w.shape[0] + 1, dtype=np.float64) ** -exponent
            scale = rng.permutation(scale / scale.mean())
            w.mul_(torch.tensor(scale, dtype=w.dtype, device=w.device)[:, None])
    return saved


def restore_router(model, saved: dict) -> None:
    with torch.no_grad():
        for i, block in enumerate(moe_blocks(model.model.layers)):
            block.gate.weight.copy_(saved[i])


@torch.inference_mode()
def routing_load(model, ids: torch.Tensor) -> dict:
    """How the tokens of `ids` spread over the experts, per MoE layer (read from the experts' top-k indices):
    the busiest expert's load over the mean, and the share of routed rows the busiest 10% of experts get; the
    mean over layers, and the first MoE layer's counts (the skewed ceiling's shape)."""
    blocks, counts = moe_blocks(model.model.layers), []
    n = blocks[0].experts.num_experts

    def hook(module, args, kwargs):
        top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        counts.append(torch.bincount(top_k_index.flatten(), minlength=n)[:n].cpu().numpy())

    # a compiled layer runs no hook of a module inside it: the eager forwards it was compiled from run here
    compiled = [m for m in model.modules() if "_eagle3_eager_forward" in m.__dict__]
    saved = [m.forward for m in compiled]
    hooks = [b.experts.register_forward_pre_hook(hook, with_kwargs=True) for b in blocks]
    try:
        for m in compiled:
            m.forward = m.__dict__["_eagle3_eager_forward"]
        model.model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        for m, f in zip(compiled, saved):
            m.forward = f
    if len(counts) != len(blocks):
        raise RuntimeError(f"routing_load: {len(counts)} of {len(blocks)} MoE blocks reported their routing")
    top = max(1, n // 10)
    per_layer = [{"max_over_mean": float(c.max() / c.mean()),
                  "top10pct_share": float(np.sort(c)[::-1][:top].sum() / c.sum())} for c in counts]
    return {"experts": n, "layers": len(counts), "first_layer_counts": counts[0].tolist(),
            **{k: statistics.mean(p[k] for p in per_layer) for k in per_layer[0]}}


# -- the experts' GEMMs alone ---------------------------------------------------------------------------

def median_time(fn, device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def expert_gemm_ceiling(cfg, tokens: int, device, dtype, counts=None, reps: int = 10, experts=None) -> dict:
    """FLOP/s of the routed experts' gate_up + down GEMMs for one batch of `tokens` tokens, per kernel that runs
    them here, at `counts` rows per expert (default: uniform), and of one dense GEMM pair over the same rows.
    `experts`: a model's experts module whose weights to use (a target that fills the GPU leaves no room for a
    copy: DeepSeek-V3's are 14 GiB a layer); else random ones."""
    t = cfg.get_text_config()
    H, I, k = t.hidden_size, t.moe_intermediate_size, t.num_experts_per_tok
    E = getattr(t, "n_routed_experts", None) or t.num_experts
    rows = tokens * k
    counts = np.full(E, rows // E) if counts is None else np.asarray(counts, dtype=np.float64)
    counts = np.floor(counts / counts.sum() * rows).astype(np.int64)
    counts[np.argmax(counts)] += rows - counts.sum()
    flops = 2.0 * rows * (H * 2 * I + I * H)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, H, device=device, dtype=dtype, generator=g)
    w_up, w_down = (getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None))
    if not (isinstance(w_up, torch.Tensor) and tuple(w_up.shape) == (E, 2 * I, H)
            and isinstance(w_down, torch.Tensor) and tuple(w_down.shape) == (E, H, I)):
        w_up = torch.randn(E, 2 * I, H, device=device, dtype=dtype, generator=g) * 0.02  # transformers' layout
        w_down = torch.randn(E, H, I, device=device, dtype=dtype, generator=g) * 0.02
    w_up, w_down = w_up.detach(), w_down.detach()
    offs = torch.tensor(np.cumsum(counts), device=device, dtype=torch.int32)
    out = {"tokens": tokens, "rows": rows, "experts": E, "hidden": H, "width": I, "top_k": k,
           "max_rows_per_expert": int(counts.max()), "min_rows_per_expert": int(counts.min()), "kernels": {}}
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    kernels = {"grouped_mm": lambda: grouped(grouped(x, w_up.transpose(-2, -1), offs=offs)[:, :I].contiguous(),
                                             w_down.transpose(-2, -1), offs=offs)}
    if counts.min() == counts.max():  # bmm needs equal groups
        xb = x.view(E, rows // E, H)
        kernels["bmm"] = lambda: torch.bmm(torch.bmm(xb, w_up.transpose(-2, -1))[..., :I], w_down.transpose(-2, -1))
    dense_up, dense_down = w_up[0].t().contiguous(), w_down[0].t().contiguous()
    dense = lambda: (x @ dense_up)[:, :I] @ dense_down  # noqa: E731
    for name, fn in kernels.items():
        try:
            out["kernels"][name] = flops / median_time(fn, device, reps)
        except (RuntimeError, NotImplementedError, TypeError) as e:  # a kernel this device/dtype lacks
            out["kernels"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    rates = [v for v in out["kernels"].values() if isinstance(v, float)]
    out["dense_same_rows"] = flops / median_time(dense, device, reps)
    out["ceiling"] = max(rates) if rates else None
    out["ceiling_over_dense"] = out["ceiling"] / out["dense_same_rows"] if rates else None
    if experts is not None and hasattr(experts, "num_experts"):
        out["blocks"] = experts_block_rates(experts, counts, x[:tokens], flops, device, reps)
    return out


def experts_block_rates(experts, counts: np.ndarray, x: torch.Tensor, flops: float, device, reps: int) -> dict:
    """The whole routed-experts step of one batch (the pairs' copy into expert order, the GEMMs, SiLU x up, the
    routing weights, the sum over the top k) through transformers' grouped_mm path and through the project's fused
    Triton kernels, as the experts' GEMM FLOP/s it amounts to: beside the GEMMs-alone ceiling, what the copies
    cost, and what fusing them wins back. The pairs follow `counts` (a token may meet an expert twice here: the
    kernels do not mind)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    from eagle3.extract import fused_moe

    tokens, k = x.shape[0], int(counts.sum()) // x.shape[0]
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    idx = ids[torch.randperm(len(ids), generator=g)].view(tokens, k).to(device)
    w = torch.rand(tokens, k, generator=g).to(device=device, dtype=x.dtype)
    kernel = getattr(experts, fused_moe.KERNEL_ATTR, None) or "tiles"  # what the last load's experts_kernel ran
    runs = {"grouped_mm": lambda: grouped_mm_experts_forward(experts, x, idx, w),
            fused_moe.NAME: lambda: fused_moe.fused_experts(x, idx, w, experts.gate_up_proj, experts.down_proj,
                                                            experts_kernel=kernel)}
    out, results = {}, {}
    reps = reps if torch.device(device).type == "cuda" else 1  # the CPU interprets the Triton kernels: slow, no figure
    for name, fn in runs.items():
        try:
            with torch.inference_mode():
                results[name] = fn()
                out[name] = flops / median_time(fn, device, reps)
        except Exception as e:  # noqa: BLE001 (a kernel this device lacks, triton missing: the row says why)
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    if len(results) == 2:  # a fast kernel that computes something else would be no lever: its error beside
        ref, got = results["grouped_mm"].float(), results[fused_moe.NAME].float()
        out[f"{fused_moe.NAME}_rel_l2_vs_grouped_mm"] = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
    return out


def ceiling_roofline(cfg, lengths: np.ndarray, ceiling: float, matmul: float) -> dict:
    """Tokens/s over samples of `lengths` if the routed experts ran at `ceiling` and everything else at `matmul`
    FLOP/s."""
    d = cfg.to_dict()
    experts = 2.0 * routed_expert_params(d) * float(lengths.sum())
    total = sum(sample_flops(d, int(n)) for n in lengths)
    return {"expert_flops_fraction": experts / total,
            "tok_per_s": float(lengths.sum()) / (experts / ceiling + (total - experts) / matmul)}
