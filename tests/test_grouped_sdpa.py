"""eagle3.grouped_sdpa: grouped-query attention without repeating the kv heads equals transformers' sdpa forward."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from eagle3.grouped_sdpa import grouped_sdpa_forward

MODULE = SimpleNamespace(training=False, is_causal=True, num_key_value_groups=3)


def left_padded_mask(lengths: list[int], lq: int, lk: int) -> torch.Tensor:
    """A bool mask [B, 1, lq, lk] (True = attend): row b's first lk - lengths[b] keys are padding; the last lq
    queries see every real key up to their own position."""
    keys = torch.arange(lk)
    rows = []
    for n in lengths:
        pos = torch.arange(lk - lq, lk)[:, None]
        rows.append((keys[None, :] >= lk - n) & (keys[None, :] <= pos))
    return torch.stack(rows)[:, None]


@pytest.mark.parametrize("lq", [1, 5])
def test_folded_query_heads_equal_repeated_kv_heads(lq):
    torch.manual_seed(0)
    b, heads, kv_heads, lk, d = 3, 9, 3, 11, 16
    q = torch.randn(b, heads, lq, d)
    k, v = torch.randn(b, kv_heads, lk, d), torch.randn(b, kv_heads, lk, d)
    mask = left_padded_mask([11, 7, 9], lq, lk)
    want, _ = sdpa_attention_forward(MODULE, q, k, v, mask, scaling=d ** -0.5)
    got, weights = grouped_sdpa_forward(MODULE, q, k, v, mask, scaling=d ** -0.5)
    assert weights is None and got.shape == want.shape == (b, lq, heads, d)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # a query head meets its own kv head: shuffling the kv heads changes the result
    shuffled, _ = grouped_sdpa_forward(MODULE, q, k.flip(1), v.flip(1), mask, scaling=d ** -0.5)
    assert not torch.allclose(shuffled, want)


def test_a_prefill_goes_to_transformers_forward(monkeypatch):
    """A query longer than FOLD_MAX_QUERIES (a prefill) is not folded: its mask repeated along the folded length
    would take group times the memory; transformers' forward runs it, with the same result."""
    from transformers.integrations import sdpa_attention

    from eagle3 import grouped_sdpa

    calls = []
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward",
                        lambda *a, **kw: calls.append(a[1].shape[2]) or sdpa_attention_forward(*a, **kw))
    torch.manual_seed(2)
    for lq in (grouped_sdpa.FOLD_MAX_QUERIES, grouped_sdpa.FOLD_MAX_QUERIES + 1):
        q, k, v = torch.randn(2, 9, lq, 8), torch.randn(2, 3, 20, 8), torch.randn(2, 3, 20, 8)
        mask = left_padded_mask([20, 18], lq, 20)
        want, _ = sdpa_attention_forward(MODULE, q, k, v, mask, scaling=0.3)
        got, _ = grouped_sdpa_forward(MODULE, q, k, v, mask, scaling=0.3)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert calls == [grouped_sdpa.FOLD_MAX_QUERIES + 1]  # only the longer one went to transformers' forward


@pytest.mark.parametrize("lq", [1, 6])
def test_without_a_mask(lq):
    """No mask: one query (a decoding step of an unpadded batch) folds, every key visible; several queries are the
    causal prefill, where folding would break the diagonal, so they go to transformers' forward."""
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 9, lq, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
    want, _ = sdpa_attention_forward(MODULE, q, k, v, None, scaling=0.3)
    got, _ = grouped_sdpa_forward(MODULE, q, k, v, None, scaling=0.3)
    torch.testing.assert_close(got, want)
