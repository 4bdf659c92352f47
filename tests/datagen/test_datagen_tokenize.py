"""Loss masks with the real SmolLM2 tokenizer and its ChatML template (no generation tag)."""

from __future__ import annotations

import pytest

from eagle3.datagen.tokenize import MaskMismatch, masked_runs, tokenize_conversation, verify_mask

MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And times three?"},
    {"role": "assistant", "content": " 12, because 4 x 3 = 12.\n\nAnything else?"},
    {"role": "user", "content": "No."},
    {"role": "assistant", "content": "Bye! 👋"},
]


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_multi_turn_mask_marks_exactly_the_assistant_turns(smollm2_tokenizer):
    tok = smollm2_tokenizer
    t = tokenize_conversation(tok, MULTI_TURN)
    ref = tok.apply_chat_template(MULTI_TURN, tokenize=True)
    ref = ref["input_ids"] if not isinstance(ref, list) else ref
    assert t.input_ids == ref  # the template's own tokenization, unchanged
    assert len(t.loss_mask) == len(t.input_ids) and set(t.loss_mask) == {0, 1}
    runs = masked_runs(t.input_ids, t.loss_mask)
    answers = [m["content"] for m in MULTI_TURN if m["role"] == "assistant"]
    assert [_decode(tok, r) for r in runs] == [a + "<|im_end|>" for a in answers]
    # nothing of the system/user turns or the role headers is under the mask
    unmasked = _decode(tok, [i for i, m in zip(t.input_ids, t.loss_mask) if not m])
    for m in MULTI_TURN:
        if m["role"] != "assistant":
            assert m["content"] in unmasked
    assert unmasked.count("<|im_start|>assistant\n") == 3
    # each run starts right after "<|im_start|>assistant\n"
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    starts = [i for i in range(1, len(t.loss_mask)) if t.loss_mask[i] and not t.loss_mask[i - 1]]
    assert all(t.input_ids[s - len(header):s] == header for s in starts)


def test_default_system_prompt_is_not_masked(smollm2_tokenizer):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    t = tokenize_conversation(smollm2_tokenizer, msgs)
    text = _decode(smollm2_tokenizer, t.input_ids)
    assert "You are a helpful AI assistant named SmolLM" in text  # the template's default system turn
    assert [_decode(smollm2_tokenizer, r) for r in masked_runs(t.input_ids, t.loss_mask)] == ["Hello there.<|im_end|>"]


def test_verify_catches_a_shifted_mask(smollm2_tokenizer):
    t = tokenize_conversation(smollm2_tokenizer, MULTI_TURN)
    shifted = [0] + t.loss_mask[:-1]  # the classic bug: mask off by one
    with pytest.raises(MaskMismatch, match="assistant turn 0"):
        verify_mask(smollm2_tokenizer, t.input_ids, shifted, [m["content"] + "<|im_end|>" for m in MULTI_TURN
                                                                if m["role"] == "assistant"])
    with pytest.raises(MaskMismatch, match="differ in length"):
        verify_mask(smollm2_tokenizer, t.input_ids, t.loss_mask[:-1], [])
