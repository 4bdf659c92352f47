"""Turn a finished conversation into input_ids + loss_mask with the target's chat template.

The SmolLM2 template (ChatML) has no `{% generation %}` tag, so the tokenizer cannot tell us
which tokens are the assistant's. We render the whole conversation once, find each assistant
turn's character span by rendering the conversation up to that turn (with the generation
prompt) as a prefix, tokenize the full text with offsets, and set the mask on tokens that lie
inside an assistant span. The span covers the answer text plus the end-of-turn token right
after it (the drafter must learn to predict the stop). The mask is then checked: the masked
tokens, decoded run by run, must equal the assistant texts (+ end token) exactly.
"""

from __future__ import annotations

from dataclasses import dataclass


class MaskMismatch(ValueError):
    pass


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the [start, end) character span of every assistant turn (+ end token)."""
    text = _render(tokenizer, messages)
    end_token = tokenizer.eos_token or ""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], add_generation_prompt=True)
        if not text.startswith(prefix) or not text.startswith(m["content"], len(prefix)):
            raise MaskMismatch(f"turn {i}: the chat template does not render the conversation as a prefix + answer")
        start = len(prefix)
        end = start + len(m["content"])
        if end_token and text.startswith(end_token, end):
            end += len(end_token)
        spans.append((start, end))
    return text, spans


def tokenize_conversation(tokenizer, messages: list[dict], verify: bool = True) -> Tokenized:
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    si = 0
    for t, (a, b) in enumerate(offsets):
        while si < len(spans) and spans[si][1] <= a:
            si += 1
        if si < len(spans) and b > a and a >= spans[si][0] and b <= spans[si][1]:
            mask[t] = 1
    if verify:
        verify_mask(tokenizer, ids, mask, [text[a:b] for a, b in spans])
    return Tokenized(ids, mask)


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def verify_mask(tokenizer, ids, mask, expected_texts: list[str]) -> None:
    """Masked tokens must decode, run by run, to exactly the assistant texts (a token straddling
    a span boundary, or a template that renders content differently, fails here)."""
    if len(ids) != len(mask):
        raise MaskMismatch(f"input_ids ({len(ids)}) and loss_mask ({len(mask)}) differ in length")
    runs = masked_runs(ids, mask)
    got = [tokenizer.decode(r, skip_special_tokens=False, clean_up_tokenization_spaces=False) for r in runs]
    if got != expected_texts:
        for k, (g, e) in enumerate(zip(got + [""] * len(expected_texts), expected_texts)):
            if g != e:
                raise MaskMismatch(f"assistant turn {k}: masked tokens decode to {g[:80]!r}, expected {e[:80]!r}")
        raise MaskMismatch(f"{len(got)} masked runs for {len(expected_texts)} assistant turns")
