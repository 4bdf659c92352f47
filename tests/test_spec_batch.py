"""The batched speculative decoder: token-identical to HF greedy generate, per-row acceptance like the
one-prompt decoder, and a teacher-forced check that catches what is not greedy.

Uses the real SmolLM2 target and the drafter trained in tests/conftest.py (`trained`)."""

from __future__ import annotations

import pytest
import torch

from tests.train_helpers import CAPTURE

EOS = 2


def chat(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   return_dict=True)["input_ids"]


@pytest.fixture(scope="module")
def drafter(trained):
    from eagle3.train.export import load_exported

    d, vocab, config = load_exported(trained[1]["export_dir"])
    assert config["eagle3_pipeline"]["capture_layers"] == CAPTURE
    return d, vocab


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    """Training prompts (the drafter accepts often), a new one, and a one-word answer (eos early: the row
    leaves the batch while the others go on); lengths differ, so rows are left-padded."""
    from tests.support import selfdistill as sd

    texts = sd.make_prompts(24)[:2] + ["Write a short poem about rain on a tin roof.",
                                       "Answer with one word: what color is the sky on a clear day?"]
    return [chat(smollm2_tokenizer, t) for t in texts]


@pytest.mark.slow
def test_batched_speculation_is_token_identical_to_hf_greedy(smollm2_model, drafter, prompts):
    from eagle3.evaluate.spec_batch import BatchedSpeculativeDecoder
    from eagle3.evaluate.speculative import SpeculativeDecoder

    d, vocab = drafter
    one = SpeculativeDecoder(smollm2_model, d, vocab, CAPTURE, EOS)
    n = 20
    greedy = [one.greedy(p, n) for p in prompts]
    assert len(greedy[3]) < n and greedy[3][-1] == EOS and all(len(g) == n for g in greedy[:3])
    budget = 2 * (max(map(len, prompts)) + n)
    # batch_size 3, or a token budget of two prompts: two batches, order restored
    for k, batch_size, batch_tokens in ((3, 8, 1 << 17), (1, 8, 1 << 17), (4, 3, 1 << 17), (3, 8, budget)):
        dec = BatchedSpeculativeDecoder(smollm2_model, d, vocab, CAPTURE, EOS, batch_size=batch_size,
                                        batch_tokens=batch_tokens)
        out = dec.generate(prompts, n, k)
        assert [tokens for tokens, _ in out] == greedy, f"k={k}"
        hist = [h for _, h in out]
        assert all(sum(a + 1 for a in h) + 1 >= len(g) for h, g in zip(hist, greedy))  # rounds made every token
        if k == 3 and batch_tokens > budget:
            seq = [one.generate(p, n, k)[1].history for p in prompts[:2]]
            assert hist[:2] == seq  # the same acceptance per round as the one-prompt decoder
            assert len({tuple(h) for h in hist}) > 1 and max(max(h) for h in hist) >= 1  # rows accept differently
            assert dec.packs > 0  # rejected slots were dropped from the caches along the way


@pytest.mark.slow
def test_teacher_forced_check_accepts_greedy_and_names_what_is_not(smollm2_model, drafter, prompts):
    from eagle3.evaluate.spec_batch import BatchedSpeculativeDecoder, check_summary, teacher_forced_check

    d, vocab = drafter
    n = 12
    answers = [t for t, _ in BatchedSpeculativeDecoder(smollm2_model, d, vocab, CAPTURE, EOS).generate(prompts, n, 3)]
    assert check_summary(teacher_forced_check(smollm2_model, prompts, answers, n, EOS, token_budget=64)) == ([], 0)
    wrong = answers[0][:4] + [answers[0][4] + 1] + answers[0][5:]
    r = teacher_forced_check(smollm2_model, prompts, [wrong, answers[1][:-3], answers[2][:3] + [EOS, 5], answers[3]],
                             n, EOS)
    assert r[0]["first_difference"] == 4 and r[0]["reason"] == "not the target's argmax" and r[0]["margin"] > 0
    assert r[0]["argmax"] == answers[0][4]
    assert "without eos" in r[1]["reason"] and r[1]["first_difference"] == n - 3
    assert r[2] == {"first_difference": 4, "reason": "tokens after eos"}
    assert r[3] is None
    assert check_summary(r)[0] == [0, 1, 2]


@pytest.mark.slow
def test_batched_decoder_greedy_is_verified_and_falls_back_to_hf_generate(smollm2_model, drafter, prompts,
                                                                         monkeypatch):
    """The evaluation's reference comes from speculation checked by teacher forcing; a decoder that goes wrong
    is caught there and its reference replaced by HF generate's, which the evaluation then compares."""
    from eagle3.evaluate import spec_batch
    from eagle3.evaluate.speculative import SpeculativeDecoder

    d, vocab = drafter
    n = 10
    dec = spec_batch.BatchedDecoder(smollm2_model, d, vocab, CAPTURE, EOS, reference_k=3)
    ref = dec.greedy(prompts[:2], n)
    assert dec.check == {"answers": 2, "not_greedy": 0, "tie_tokens": 0}
    assert [a.tokens for a in dec.speculate(prompts[:2], n, 3)] == ref  # the verified answers, reused
    real = spec_batch.BatchedSpeculativeDecoder.generate

    def off_by_one(self, prompts, max_new_tokens, k):
        return [([t[0] + 1] + t[1:], h) for t, h in real(self, prompts, max_new_tokens, k)]

    monkeypatch.setattr(spec_batch.BatchedSpeculativeDecoder, "generate", off_by_one)
    broken = spec_batch.BatchedDecoder(smollm2_model, d, vocab, CAPTURE, EOS, reference_k=3)
    hf = [SpeculativeDecoder(smollm2_model, d, vocab, CAPTURE, EOS).greedy(p, n) for p in prompts[:2]]
    assert broken.greedy(prompts[:2], n) == hf == ref
    assert broken.check["not_greedy"] == 2
    assert all(a.tokens != r for a, r in zip(broken.speculate(prompts[:2], n, 3), ref))


def test_length_batches_cut_by_rows_and_by_rows_times_the_longest():
    from eagle3.evaluate.spec_batch import length_batches

    lengths = [50, 10, 30, 10, 200, 20]
    assert length_batches(lengths, 1000) == [[1, 3, 5, 2, 0], [4]]  # shortest first; 6 x 200 passes 1000
    assert length_batches(lengths, 100) == [[1, 3, 5], [2, 0], [4]]  # 3 x 20 fits, 4 x 30 does not
    assert length_batches(lengths, 10 ** 6, max_rows=4) == [[1, 3, 5, 2], [0, 4]]
    assert length_batches([], 100) == []


def test_pack_index_keeps_valid_slots_in_order_right_aligned():
    from eagle3.evaluate.spec_batch import _pack_index

    valid = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 0, 0, 0, 1, 0]])
    idx, new = _pack_index(valid)
    assert idx[0].tolist() == [1, 2, 4] and new[0].tolist() == [1, 1, 1]
    assert idx[1, 1:].tolist() == [0, 4] and new[1].tolist() == [0, 1, 1]
