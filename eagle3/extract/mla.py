"""MLA attention (DeepSeek-V3's DeepseekV3Attention, Kimi-K2's) with its queries and keys joined token-major or in
place: the extract param `mla_joins`, a lever of issue 28.

transformers' forward views q's and kv_b's rows heads-major ([B, heads, L, d]) first, then splits, ropes and joins
them there. Compiled, each join is one Inductor kernel that reads the projections' token-major rows and writes
heads-major ones; on an H100 at DeepSeek-V3's width the two ran at about a third of the memory's rate and took 8% of
the forward's kernel time (bench/mla_check.py). `token_major_forward` joins the same values in the projections' own
order ([B, L, heads, d]) and hands the attention function their transposed views (SDPA reads strides; flash's own
layout is token-major). Its rope is the module's own transformers function, so the values are the same.

Both joins still copy all of q and all of k. `in_place_forward` copies neither: q's projected rows already hold
each head's [nope | rope], so only the rope slice is roped and written back; kv_b's weight rows are re-laid once
(`apply`) as [k_nope | rope zero rows | v] a head, so its output leaves a gap the shared roped key is written into,
and key and value are views of that one output. The price is kv_b's GEMM rope / (nope + v) wider (25% at
DeepSeek-V3's 128 + 64 + 128), a small GEMM. Only a plain, unsharded floating nn.Linear is re-laid (an FP8
checkpoint's block scales would straddle the gap): others are refused. Going back to another layout drops the gap
rows, giving the weight back bit for bit.

mla_joins: "heads-major" runs transformers' forward, "token-major" and "in-place" these, "auto" heads-major.
Measured (one H200, 2026-12-07, bench/mla_check.py, compiled, DeepSeek-V3's 128 heads): the token-major joins 1.09x
at 32K tokens and 0.98x at 8K, at 2.2-2.4 TB/s both (a copy: 4.1); with the attention beside them 1.006x / 1.05x.
Too small a share of the forward to run the extractor's own forward by default. In-place lost (one H100, 2026-12-07,
DeepSeek-V3 at 4 layers, whole extractor): 0.96x steady, 1.00x wall; its writes alone ran 0.4x the joins, cause
not profiled. The extractor runs no KV cache; a cache handed here is refused.
"""

from __future__ import annotations

import sys
import types

import torch

from eagle3.errors import ConfigError

CHOICES = ("auto", "heads-major", "token-major", "in-place")
AUTO = "heads-major"
ATTENTIONS = ("DeepseekV3Attention",)  # transformers' MLA classes whose forward this one reproduces
# the attention functions that read q/k/v by stride: transformers' sdpa and eager, and the extractor's padded-v sdpa
# (eagle3.extract.attention); a flash-attention package's forward pads v itself in transformers' own MLA forward
STRIDED = ("sdpa", "eager", "eagle3_sdpa_padded_v")
PARAM = "extract param mla_joins"
FLOATS = (torch.bfloat16, torch.float16, torch.float32)  # kv_b weights the in-place layout re-lays


def token_major_forward(self, *args, **kwargs):
    """DeepseekV3Attention's forward (no cache) with q and k joined in [B, L, heads, d]."""
    return _forward(self, "token-major", *args, **kwargs)


def in_place_forward(self, *args, **kwargs):
    """DeepseekV3Attention's forward (no cache) with q roped in its projection's rows and k's rope written into the
    gap of kv_b's rows (kv_b_proj re-laid by `apply`)."""
    return _forward(self, "in-place", *args, **kwargs)


def _forward(self, layout: str, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, **kwargs):
    for name in ("cache", "past_key_values"):
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"mla_joins={layout!r} runs without a KV cache (extraction): use 'heads-major'")
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
    join = join_in_place if layout == "in-place" else join_token_major
    query, key, value = join(q, self.kv_b_proj(self.kv_a_layernorm(kv_latent)), k_rot, *position_embeddings,
                             self.qk_nope_head_dim, rope, self.v_head_dim, rotate)
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


def join_in_place(q, kv, k_rot, cos, sin, nope: int, rope: int, v: int, rotate):
    """As join_token_major, but kv_b's rows are gapped, [B, L, heads * (nope + rope + v)] ([k_nope | gap | v] a
    head, `gap_rows`), and nothing is joined: q's rope slice and kv's gap are written in place (q and kv are
    changed), and query, key and value are [B, heads, L, d] views of q and kv."""
    B, L = q.shape[:2]
    q, kv = q.view(B, L, -1, nope + rope), kv.view(B, L, -1, nope + rope + v)
    q_rot, k_rot = rotate(q[..., nope:], k_rot.view(B, L, 1, rope), cos, sin, unsqueeze_dim=2)
    q[..., nope:] = q_rot
    kv[..., nope:nope + rope] = k_rot  # the shared key, broadcast over the heads
    return q.transpose(1, 2), kv[..., :nope + rope].transpose(1, 2), kv[..., nope + rope:].transpose(1, 2)


def gap_rows(t: torch.Tensor, heads: int, nope: int, rope: int, v: int) -> torch.Tensor:
    """kv_b's weight (or bias) rows, [k_nope | v] a head, as [k_nope | rope zero rows | v] a head."""
    t = t.view(heads, nope + v, *t.shape[1:])
    gap = t.new_zeros(heads, rope, *t.shape[2:])
    return torch.cat((t[:, :nope], gap, t[:, nope:]), dim=1).flatten(0, 1)


def drop_gap_rows(t: torch.Tensor, heads: int, nope: int, rope: int, v: int) -> torch.Tensor:
    """gap_rows undone: the same values, bit for bit."""
    t = t.view(heads, nope + rope + v, *t.shape[1:])
    return torch.cat((t[:, :nope], t[:, nope + rope:]), dim=1).flatten(0, 1)


def _relay_kv_b(module, relay) -> None:
    """kv_b_proj's weight (and bias) through `relay` (gap_rows or drop_gap_rows), its out_features kept in step."""
    linear, dims = module.kv_b_proj, (module.num_heads, module.qk_nope_head_dim, module.qk_rope_head_dim,
                                      module.v_head_dim)
    for name in ("weight", "bias"):
        p = getattr(linear, name)
        if p is not None:
            setattr(linear, name, torch.nn.Parameter(relay(p.data, *dims), requires_grad=p.requires_grad))
    linear.out_features = linear.weight.shape[0]


def _refuse_in_place(model, module) -> None:
    """ConfigError where the in-place layout cannot re-lay kv_b_proj's rows."""
    linear, why = module.kv_b_proj, None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor
        DTensor = ()
    rows = module.num_heads * (module.qk_nope_head_dim + module.v_head_dim)
    if type(linear) is not torch.nn.Linear:
        why = f"kv_b_proj is a {type(linear).__name__}, not a plain nn.Linear (a quantized or FP8 linear?)"
    elif isinstance(linear.weight, DTensor) or (getattr(model, "_tp_size", None) or 1) > 1:
        why = "kv_b_proj is sharded (tensor parallel)"
    elif linear.weight.dtype not in FLOATS or linear.weight.is_meta:
        why = f"kv_b_proj's weight is {linear.weight.dtype} on {linear.weight.device}, not bf16/fp16/fp32 in memory"
    elif linear.weight.shape[0] != rows:
        why = f"kv_b_proj has {linear.weight.shape[0]} rows, not heads * (nope + v) = {rows}"
    if why:
        raise ConfigError(f"{PARAM}='in-place' re-lays kv_b_proj's weight rows, but {why}: use 'token-major' or "
                          f"'heads-major'")


def mla_modules(model) -> list:
    return [m for m in model.modules() if type(m).__name__ in ATTENTIONS]


def running(module):
    """The forward this module took over (token_major_forward, in_place_forward), or None: transformers'."""
    return getattr(vars(module).get("forward"), "__func__", None)


FORWARDS = {"token-major": token_major_forward, "in-place": in_place_forward}


def apply(model, joins: str) -> str | None:
    """Run each MLA attention module of `model` as `joins` says (CHOICES); what runs: None for a target without
    them, else "heads-major" (transformers' forward, given back where this module took it over), "token-major" or
    "in-place" (kv_b_proj re-laid; given back bit for bit on leaving it). Raises ConfigError for a value outside
    CHOICES, token-major or in-place on an attention function that does not read strides, or in-place on a
    kv_b_proj it cannot re-lay; then the model is left as it was."""
    if joins not in CHOICES:
        raise ConfigError(f"{PARAM}={joins!r}: use one of {', '.join(map(repr, CHOICES))}")
    modules = mla_modules(model)
    if not modules:
        return None
    resolved = AUTO if joins == "auto" else joins
    impl = model.config._attn_implementation
    if resolved in FORWARDS and impl not in STRIDED:
        raise ConfigError(f"{PARAM}={resolved!r} runs under the sdpa and eager attention functions, this model "
                          f"runs {impl!r}: use 'heads-major'")
    if resolved == "in-place":
        for module in modules:
            if running(module) is not in_place_forward:
                _refuse_in_place(model, module)
    for module in modules:
        was_in_place = running(module) is in_place_forward
        if was_in_place != (resolved == "in-place"):
            _relay_kv_b(module, drop_gap_rows if was_in_place else gap_rows)
        if resolved in FORWARDS:
            module.forward = types.MethodType(FORWARDS[resolved], module)
        elif running(module) in FORWARDS.values():
            del module.forward
    return resolved
