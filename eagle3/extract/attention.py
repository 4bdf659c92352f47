"""The extractor's attention around transformers': attention="flash" on targets whose value heads are narrower than
their query/key heads, and a forward without the packed-sequence check (`rows_not_packed`, below).

torch's flash SDPA kernel (CUDA and CPU) needs q, k and v of one head dim. Multi-head latent attention (MLA:
DeepSeek-V2/V3, Kimi-K2) hands SDPA q/k of head dim qk_nope + qk_rope (192 in DeepSeek-V3) and v of v_head_dim
(128), so a pinned flash kernel finds no kernel, and "auto" falls to the slower memory-efficient one. Here v is
zero-padded to q's head dim, transformers' own SDPA forward runs (flash now applies), and the output is sliced
back to v's head dim: a zero column of v gives a zero output column, so the kept columns are the same sums.
The padded columns add (192 - 128) / (192 + 128) = 20% to attention's FLOPs (P @ V runs 192 wide); whether
flash then beats the memory-efficient kernel is what the device runs measure (issue 28).
"""

from __future__ import annotations

import contextlib

import torch.nn.functional as F

from eagle3.flops import attention_dims
from eagle3.models import register_sdpa_variant

# the name the model's attention is switched to (transformers' AttentionInterface); no "flash" and no "/" in it,
# which transformers would read as its own flash-attention packages or a hub kernel
PADDED_V_SDPA = "eagle3_sdpa_padded_v"


def padded_v_sdpa_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention forward with v zero-padded to q's head dim, the output sliced back."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    v_dim = value.shape[-1]
    if v_dim < query.shape[-1]:
        value = F.pad(value, (0, query.shape[-1] - v_dim))
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return out[..., :v_dim], weights  # [B, L, heads, head dim]


def register() -> None:
    """Make PADDED_V_SDPA a name transformers accepts, with sdpa's masks (idempotent)."""
    register_sdpa_variant(PADDED_V_SDPA, padded_v_sdpa_forward)


def narrower_v(config) -> bool:
    """Are the target's value heads narrower than its query/key heads (from its config: MLA's v_head_dim)?"""
    _, qk, v = attention_dims(config.get_text_config().to_dict())
    return v < qk


def apply_attention(model, attention: str) -> str:
    """Run `model`'s attention through PADDED_V_SDPA when flash is pinned and its v heads are narrower, else
    through transformers' sdpa (a preloaded model switched before, e.g. by another benchmark variant, goes back).
    Returns the implementation the model runs."""
    want = PADDED_V_SDPA if attention == "flash" and narrower_v(model.config) else "sdpa"
    current = model.config._attn_implementation
    if want == PADDED_V_SDPA:
        register()
        if current != want:
            model.set_attn_implementation(want)
    elif current == PADDED_V_SDPA:
        model.set_attn_implementation("sdpa")
    return model.config._attn_implementation


@contextlib.contextmanager
def rows_not_packed():
    """A forward of the extractor's batches without transformers' packed-sequence check.

    With no attention mask, transformers' mask preparation looks for several sequences packed in one row: it
    reads the position ids back to the host each forward (masking_utils.find_packed_sequence_indices, `.all()`
    under an `if`, in the eager model forward outside the compiled layers). The extractor's rows hold one sample
    each at positions 0..L-1, for which the check returns None; here it returns None without the readback. That
    one-byte readback queued on the copy engine behind the previous batch's copy-out (1.9 GB at DeepSeek-V3's
    width): the compute stream idled ~33 ms a batch until it came back; without it, no gap over 1 ms (H100,
    2026-12-07, bench/extract_profile.py; docs/benchmarks.md).
    """
    from transformers import masking_utils

    check = getattr(masking_utils, "find_packed_sequence_indices", None)
    if check is None:  # a transformers without the check
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = check
