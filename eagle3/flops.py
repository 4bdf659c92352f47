"""What a target's forward costs a token, from its config.json alone (torch-free): the extraction roofline's
denominator, the benchmark's and preflight's time estimate's.

Active FLOPs a token = 2 x the linear weights the token passes through + causal attention:
- attention projections: GQA (q, k, v, o) or multi-head latent attention (DeepSeek-V2/V3: q LoRA down/up,
  kv_a with the shared rope key, kv_b expanding k_nope and v per head, o), as transformers runs them (no weight
  absorption);
- MLP: dense (gate, up, down), or MoE: the router (hidden x experts) + top-k routed experts + the shared experts;
  dense layers where the config says so (first_k_dense_replace, mlp_only_layers, decoder_sparse_step);
- attention scores and weighted values: 2 x heads x (qk head dim + v head dim) x context, context = position + 1
  (causal);
- no lm_head (extraction never runs it), no embeddings, norms, rope or softmax (not matmuls).
"""

from __future__ import annotations

from eagle3.fit import _attention_params, _layer_kinds, _text, num_experts

CLASSES = ("dense", "moe", "mla", "moe-mla")


def target_class(cfg: dict) -> str:
    """dense, moe (routed experts), mla (multi-head latent attention) or moe-mla (both: DeepSeek-V3)."""
    t = _text(cfg)
    moe, mla = bool(num_experts(cfg)), bool(t.get("kv_lora_rank"))
    return {(False, False): "dense", (True, False): "moe", (False, True): "mla", (True, True): "moe-mla"}[(moe, mla)]


def _mlp_widths(t: dict) -> tuple[int, int, int, int]:
    """(dense width, expert width, experts a token runs through, shared-expert width in total)."""
    H = int(t["hidden_size"])
    inter = int(t.get("intermediate_size") or 4 * H)
    moe_inter = int(t.get("moe_intermediate_size") or inter)
    top_k = int(t.get("num_experts_per_tok") or 0)
    shared = int(t.get("n_shared_experts") or 0) * moe_inter + int(t.get("shared_expert_intermediate_size") or 0)
    return inter, moe_inter, top_k, shared


def active_linear_params(cfg: dict) -> int:
    """Linear weights one token passes through in the decoder (lm_head excluded)."""
    t = _text(cfg)
    H = int(t["hidden_size"])
    inter, moe_inter, top_k, shared = _mlp_widths(t)
    total = 0
    for moe in _layer_kinds(t):
        total += _attention_params(t)
        total += (H * num_experts(cfg) + top_k * 3 * H * moe_inter + 3 * H * shared) if moe else 3 * H * inter
    return total


def routed_expert_params(cfg: dict) -> int:
    """Of active_linear_params: the routed experts' weights a token passes through (what a grouped GEMM runs)."""
    t = _text(cfg)
    _, moe_inter, top_k, _ = _mlp_widths(t)
    return sum(top_k * 3 * int(t["hidden_size"]) * moe_inter for moe in _layer_kinds(t) if moe)


def attention_dims(cfg: dict) -> tuple[int, int, int]:
    """(heads, qk head dim, v head dim)."""
    t = _text(cfg)
    heads = int(t["num_attention_heads"])
    if t.get("kv_lora_rank"):
        return heads, int(t["qk_nope_head_dim"]) + int(t["qk_rope_head_dim"]), int(t["v_head_dim"])
    hd = int(t.get("head_dim") or int(t["hidden_size"]) // heads)
    return heads, hd, hd


def sample_flops(cfg: dict, length: int) -> float:
    """Forward FLOPs of one sample of `length` tokens (lm_head excluded)."""
    heads, qk, v = attention_dims(cfg)
    layers = int(_text(cfg)["num_hidden_layers"])
    n = float(length)
    return 2.0 * active_linear_params(cfg) * n + 2.0 * layers * heads * (qk + v) * n * (n + 1) / 2


def flops_per_token(cfg: dict, length: int) -> float:
    """Mean forward FLOPs a token over a sample of `length` tokens."""
    return sample_flops(cfg, length) / length
