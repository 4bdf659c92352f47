"""MLA attention (DeepSeek-V3's DeepseekV3Attention, Kimi-K2's) with its queries and keys joined token-major: the
extract param `mla_joins`, a lever of issue 28.

transformers' forward views q's and kv_b's rows heads-major ([B, heads, L, d]) first, then splits, ropes and joins
them there. Compiled, each join is one Inductor kernel that reads the projections' token-major rows and writes
heads-major ones; on an H100 at DeepSeek-V3's width the two ran at about a third of the memory's rate and took 8% of
the forward's kernel time (bench/mla_check.py). `token_major_forward` joins the same values in the projections' own
order ([B, L, heads, d]) and hands the attention function their transposed views (SDPA reads strides; flash's own
layout is token-major). Its rope is the module's own transformers function, so the values are the same.

mla_joins: "heads-major" runs transformers' forward, "token-major" this one, "auto" heads-major. Measured (one H200,
2026-12-07, bench/mla_check.py, compiled, DeepSeek-V3's 128 heads): the token-major joins 1.09x at 32K tokens and
0.98x at 8K, at 2.2-2.4 TB/s both (a copy: 4.1); with the attention beside them 1.006x / 1.05x. Too small a share of
the forward to run the extractor's own forward by default. The extractor runs no KV cache; a cache handed here is
refused.
"""

from __future__ import annotations

import sys
import types

import torch

from eagle3.errors import ConfigError

CHOICES = ("auto", "heads-major", "token-major")
AUTO = "heads-major"
ATTENTIONS = ("DeepseekV3Attention",)  # transformers' MLA classes whose forward this one reproduces
# the attention functions that read q/k/v by stride: transformers' sdpa and eager, and the extractor's padded-v sdpa
# (eagle3.extract.attention); a flash-attention package's forward pads v itself in transformers' own MLA forward
STRIDED = ("sdpa", "eager", "eagle3_sdpa_padded_v")
PARAM = "extract param mla_joins"


def token_major_forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, **kwargs):
    """DeepseekV3Attention's forward (no cache) with q and k joined in [B, L, heads, d]."""
    for name in ("cache", "past_key_values"):
        if kwargs.pop(name, None) is not None:
            raise ValueError("mla_joins='token-major' runs without a KV cache (extraction): use 'heads-major'")
    kwargs.pop("cache_position", None)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modeling = sys.modules[type(self).__module__]  # the model's own rope and eager attention, in its version
    B, L = hidden_states.shape[:-1]
    rope = self.qk_rope_head_dim
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    kv_latent, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, rope], dim=-1)
    rotate = (modeling.apply_rotary_pos_emb_interleave if self.config.rope_interleave
              else modeling.apply_rotary_pos_emb)
    query, key, value = join_token_major(q, self.kv_b_proj(self.kv_a_layernorm(kv_latent)), k_rot,
                                         *position_embeddings, self.qk_nope_head_dim, rope, self.v_head_dim, rotate)
    impl = self.config._attn_implementation
    attend = modeling.eager_attention_forward if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]
    out, weights = attend(self, query, key, value, attention_mask,
                          dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                          **kwargs)
    return self.o_proj(out.reshape(B, L, -1).contiguous()), weights


def join_token_major(q, kv, k_rot, cos, sin, nope: int, rope: int, v: int, rotate):
    """q's rows [B, L, heads * (nope + rope)], kv_b's rows [B, L, heads * (nope + v)] and the shared rotary key
    [B, L, rope] -> query, key and value as [B, heads, L, d] views of [B, L, heads, d] tensors, q and k joined
    there. `rotate` has the signature of transformers' rope functions: (q, k, cos, sin, unsqueeze_dim=)."""
    B, L = q.shape[:2]
    q_pass, q_rot = torch.split(q.view(B, L, -1, nope + rope), [nope, rope], dim=-1)
    k_nope, value = torch.split(kv.view(B, L, -1, nope + v), [nope, v], dim=-1)
    q_rot, k_rot = rotate(q_rot, k_rot.view(B, L, 1, rope), cos, sin, unsqueeze_dim=2)
    query = torch.cat((q_pass, q_rot), dim=-1)
    key = torch.cat((k_nope, k_rot.expand(B, L, k_nope.shape[2], rope)), dim=-1)
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


def mla_modules(model) -> list:
    return [m for m in model.modules() if type(m).__name__ in ATTENTIONS]


def apply(model, joins: str) -> str | None:
    """Run each MLA attention module of `model` as `joins` says (CHOICES); what runs: None for a target without
    them, else "heads-major" (transformers' forward, given back where this module took it over) or
    "token-major". Raises ConfigError for a value outside CHOICES, or token-major on an attention function that
    does not read strides."""
    if joins not in CHOICES:
        raise ConfigError(f"{PARAM}={joins!r}: use one of {', '.join(map(repr, CHOICES))}")
    modules = mla_modules(model)
    if not modules:
        return None
    resolved = AUTO if joins == "auto" else joins
    impl = model.config._attn_implementation
    if resolved == "token-major" and impl not in STRIDED:
        raise ConfigError(f"{PARAM}='token-major' runs under the sdpa and eager attention functions, this model "
                          f"runs {impl!r}: use 'heads-major'")
    for module in modules:
        if resolved == "token-major":
            module.forward = types.MethodType(token_major_forward, module)
        elif getattr(vars(module).get("forward"), "__func__", None) is token_major_forward:
            del module.forward
    return resolved
