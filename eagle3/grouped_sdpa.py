"""Grouped-query attention through torch's SDPA without repeating the key/value heads.

transformers' sdpa forward repeats every key/value head for its group of query heads (`repeat_kv`) whenever an
attention mask is given, which a left-padded batch always has: in batched decoding that copies the whole KV cache
of every layer at every step (on an H100, SmolLM2-135M shape, batch 1,000, 512-token contexts: the copies were 35%
of the GPU's time; docs/benchmarks.md, "Answer generation"). Here a group's query heads are folded into the
query length instead: query [B, heads, Lq, D] becomes [B, kv heads, group x Lq, D] against the unrepeated keys and
values, and the mask is repeated along the folded length (its rows, not the cache). The sums are the same: each
query row still meets its own kv head and its own mask row. Only short queries fold (decoding steps, a speculative
step's few tokens: at most FOLD_MAX_QUERIES): a prefill's mask repeated along the folded length would take group
times its memory (1,000 rows of 2,048 tokens: 12 GB of bool where transformers' mask is 4 GB), and its repeat_kv
copy is small against its compute. Causal masking without a mask tensor cannot fold either (the causal diagonal
would be wrong for the folded rows); those cases and masks with a head dimension go to transformers' forward.
"""

from __future__ import annotations

import torch.nn.functional as F

from eagle3.models import register_sdpa_variant

# the name transformers' AttentionInterface knows it by (no "flash" and no "/": transformers would read those as
# its flash-attention packages or a hub kernel)
GROUPED_SDPA = "eagle3_grouped_sdpa"
FOLD_MAX_QUERIES = 16


def grouped_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                         **kwargs):
    """transformers' attention-function contract: query [B, heads, Lq, D], key/value [B, kv heads, Lk, D];
    returns ([B, Lq, heads, Dv], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, heads, lq, d = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    mask = attention_mask
    if group == 1 or lq > FOLD_MAX_QUERIES or (mask is None and lq > 1) or \
            (mask is not None and (mask.ndim != 4 or mask.shape[1] != 1)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if mask is not None:
        mask = mask[:, :, :, : key.shape[-2]]
        mask = mask.expand(b, 1, group, mask.shape[-1]) if lq == 1 else mask.repeat(1, 1, group, 1)
    q = query.reshape(b, kv_heads, group * lq, d)  # head kv_head * group + g -> folded row g * lq + i
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=dropout if module.training else 0.0,
                                         scale=scaling, is_causal=False)
    out = out.reshape(b, heads, lq, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model) -> str:
    """Switch `model` (a transformers model) to GROUPED_SDPA; returns the implementation it runs."""
    register_sdpa_variant(GROUPED_SDPA, grouped_sdpa_forward)
    model.set_attn_implementation(GROUPED_SDPA)
    return model.config._attn_implementation
