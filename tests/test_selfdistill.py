"""The quality benchmark's answer generation (tests/support/selfdistill.py) on the real SmolLM2 target: every turn of
a conversation is answered after the target's own earlier answers, and the sample is the one the datagen's
tokenizer (eagle3.datagen.tokenize) builds for the same conversation."""

from __future__ import annotations

import copy
import json
import logging

import pytest

from eagle3.datagen.tokenize import tokenize_conversation
from tests.support import selfdistill as sd

TWO_TURNS = ["What is the capital of France? Answer in one word.", "And of Italy? One word."]
ONE_TURN = "Name a primary color. One word."


def answers_of(tokenizer, sample: dict) -> list[str]:
    from eagle3.datagen.tokenize import masked_runs

    eos = tokenizer.eos_token_id
    return [tokenizer.decode(run[:-1] if run[-1] == eos else run) for run in
            masked_runs(sample["input_ids"], sample["loss_mask"])]


def test_each_turn_is_answered_after_the_targets_own_answers(smollm2_model, smollm2_tokenizer):
    tok = smollm2_tokenizer
    multi, single = sd.generate_answers(smollm2_model, tok, [TWO_TURNS, ONE_TURN], max_new_tokens=16, batch_size=4)
    assert (multi["turns"], single["turns"]) == (2, 1)
    first, second = answers_of(tok, multi)
    assert first and second and answers_of(tok, single)[0]
    # the datagen's sample of the same conversation (rendered by the chat template, mask by character spans)
    messages = [{"role": "user", "content": TWO_TURNS[0]}, {"role": "assistant", "content": first},
                {"role": "user", "content": TWO_TURNS[1]}, {"role": "assistant", "content": second}]
    datagen = tokenize_conversation(tok, messages)
    n = len(multi["input_ids"])  # the datagen's rendering also has the template's newline after the last eos
    assert multi["input_ids"] == datagen.input_ids[:n] and datagen.loss_mask[n:] == [0] * (len(datagen.input_ids) - n)
    assert multi["loss_mask"] == datagen.loss_mask[:n]
    # turn 2 is the greedy answer to the whole conversation so far: its context is the template's rendering
    context = tok.apply_chat_template(messages[:3], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert multi["input_ids"][:len(context)] == context
    assert multi["loss_mask"][:len(context)].count(1) == len(tok(first, add_special_tokens=False)["input_ids"]) + 1
    # a one-turn prompt is the prompt's tokens then the answer's
    prompt = sd.prompt_ids(tok, ONE_TURN)
    assert single["input_ids"][:len(prompt)] == prompt and single["loss_mask"] == \
        [0] * len(prompt) + [1] * (len(single["input_ids"]) - len(prompt))

    # a turn whose context reaches max_context is not answered (training would cut it anyway)
    cut, = sd.generate_answers(smollm2_model, tok, [TWO_TURNS], max_new_tokens=16, max_context=len(context))
    assert cut["turns"] == 1 and answers_of(tok, cut) == [first]
    none, = sd.generate_answers(smollm2_model, tok, [TWO_TURNS], max_new_tokens=16, max_context=len(prompt) // 2)
    assert none == {"input_ids": [], "loss_mask": [], "turns": 0}


def test_a_tokenizer_whose_eos_is_not_the_end_of_turn_is_said_to_stop_every_conversation(
        smollm2_model, smollm2_tokenizer, caplog):
    """transformers 5.17 built SmolLM2's GGUF tokenizer with eos = <|im_start|> (eagle3.models now takes the GGUF's
    own): each answer then ends one token past <|im_end|> and no conversation reaches turn 2. The run says so."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.eos_token = tok.bos_token
    with caplog.at_level(logging.INFO, logger=sd.log.name):
        multi, = sd.generate_answers(smollm2_model, tok, [TWO_TURNS], max_new_tokens=48, batch_size=4)
    assert multi["turns"] == 1 and multi["input_ids"][-1] == tok.bos_token_id  # ran on to <|im_start|>
    assert "turn 2: 1 conversations stopped: the chat template does not render the conversation so far (answers " \
           "through eos '<|im_start|>')" in caplog.text
    with caplog.at_level(logging.INFO, logger=sd.log.name):
        caplog.clear()
        fixed, = sd.generate_answers(smollm2_model, smollm2_tokenizer, [TWO_TURNS], max_new_tokens=48, batch_size=4)
    assert fixed["turns"] == 2 and "does not render" not in caplog.text


@pytest.mark.parametrize("cache", ["static", "static-eager"])
def test_a_static_kv_cache_gives_the_same_answers(smollm2_model, smollm2_tokenizer, cache):
    """--gen-cache static / static-eager (the quality bench's options to try on the GPU) change the cache, not the
    answers; generate takes each one's arguments."""
    from bench.quality_prompts import GEN_CACHES

    prompts = [ONE_TURN, TWO_TURNS[0]]  # two lengths: left padding in one batch
    dynamic = sd.generate_answers(smollm2_model, smollm2_tokenizer, prompts, max_new_tokens=10)
    assert sd.generate_answers(smollm2_model, smollm2_tokenizer, prompts, max_new_tokens=10,
                               **GEN_CACHES[cache]) == dynamic


def test_a_static_cache_is_sized_for_each_batch_not_the_longest_the_model_ever_saw(smollm2_model,
                                                                                   smollm2_tokenizer):
    """A short batch after a long one attends over its own length (HF generate would keep the longest cache yet: a
    group's turn 1 ran 3x slower after another group's long turns), and answers as it does first."""
    from bench.quality_prompts import GEN_CACHES

    tok, model, lengths = smollm2_tokenizer, copy.deepcopy(smollm2_model), []

    def cache_length(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and kwargs["input_ids"].shape[1] > 1:  # the prefill: one call's cache
            lengths.append(cache.get_max_length())

    model.register_forward_pre_hook(cache_length, with_kwargs=True)
    short = sd.prompt_ids(tok, ONE_TURN)
    alone = sd.generate_batch(model, [short], 6, tok.eos_token_id, 4, 0.0, 1, **GEN_CACHES["static-eager"])
    sd.generate_batch(model, [short * 8], 6, tok.eos_token_id, 4, 0.0, 1, **GEN_CACHES["static-eager"])
    after = sd.generate_batch(model, [short], 6, tok.eos_token_id, 4, 0.0, 1, **GEN_CACHES["static-eager"])
    assert lengths[1] > 4 * lengths[0] and lengths[2] == lengths[0] and after == alone


def test_batches_are_bounded_by_their_kv_tokens_and_answer_as_one_batch_does(smollm2_model, smollm2_tokenizer):
    """max_batch_tokens: rows x (longest context + max_new_tokens) per batch (1,000 rows of turn-2 contexts ran out
    of an H100's memory); greedy answers do not depend on how the rows were batched."""
    from eagle3.evaluate.spec_batch import length_batches  # generate_batch's batches: contexts + max_new_tokens

    lengths = [5, 40, 7, 12, 3, 100]
    batches = length_batches([n + 10 for n in lengths], token_budget=60, max_rows=4)
    assert sorted(i for b in batches for i in b) == list(range(6))  # every row once, shortest first
    assert [[lengths[i] for i in b] for b in batches] == [[3, 5, 7], [12], [40], [100]]  # 100 + 10 alone, over it
    assert length_batches([n + 10 for n in lengths], 0, 4) == [[4, 0, 2, 3], [1, 5]]  # no budget: rows only

    tok = smollm2_tokenizer
    prompts = [ONE_TURN, TWO_TURNS, "Write one sentence about the sea."]
    one = sd.generate_answers(smollm2_model, tok, prompts, max_new_tokens=12, batch_size=8)
    firsts = [len(sd.prompt_ids(tok, p if isinstance(p, str) else p[0])) for p in prompts]
    assert len(length_batches([n + 12 for n in firsts], max(firsts) + 12, 8)) == 3  # turn 1: one row a batch
    assert sd.generate_answers(smollm2_model, tok, prompts, max_new_tokens=12, batch_size=8,
                               max_batch_tokens=max(firsts) + 12) == one


def test_grouped_attention_gives_the_same_answers(smollm2_path, smollm2_tokenizer):
    """--gen-attention grouped (eagle3.grouped_sdpa: SmolLM2's 9 query heads folded onto its 3 kv heads, no
    repeated cache): the same greedy tokens as transformers' sdpa, left padding and every turn included, with
    either cache."""
    from bench.quality_prompts import GEN_CACHES
    from eagle3.grouped_sdpa import GROUPED_SDPA, use_grouped_sdpa
    from eagle3.models import load_model

    model = load_model(smollm2_path)
    prompts = [ONE_TURN, TWO_TURNS]
    want = {c: sd.generate_answers(model, smollm2_tokenizer, prompts, max_new_tokens=10, **GEN_CACHES[c])
            for c in ("dynamic", "static-eager")}
    assert use_grouped_sdpa(model) == GROUPED_SDPA
    for cache, answers in want.items():
        assert sd.generate_answers(model, smollm2_tokenizer, prompts, max_new_tokens=10,
                                   **GEN_CACHES[cache]) == answers, cache
    assert [s["turns"] for s in want["dynamic"]] == [1, 2]


def test_parts_answered_in_one_group_are_the_parts_answered_apart(smollm2_path, tmp_path):
    """--gen-group: parts answered by one call, turn by turn together, are written as the same parts (the same
    samples, in order) as parts answered one at a time; a finished part is not answered again."""
    import time
    from types import SimpleNamespace

    from bench import quality_prompts as qp
    from bench.quality_plan import Clock

    prompts = [[ONE_TURN], TWO_TURNS, [TWO_TURNS[0]]]
    clock = Clock(time.time() + 600, tmp_path / "clock.json")

    def answered(root: Path, group: int) -> dict:
        args = SimpleNamespace(part_size=1, new_tokens=8, gen_batch=4, gen_batch_tokens=0, all_turns_seq_len=0,
                               gen_engine="generate", gen_cache="dynamic", gen_attention="sdpa", gen_group=group)
        assert qp.generate(args, prompts, smollm2_path, root, 0.0, clock, "cpu") == 3
        return {p.parent.name: p.read_text() for p in sorted(root.glob("P*/tokenized.jsonl"))}

    apart = answered(tmp_path / "apart" / "greedy", 1)
    grouped = answered(tmp_path / "grouped" / "greedy", 2)
    assert list(apart) == ["P000", "P001", "P002"] and grouped == apart
    assert [json.loads(apart[p])["turns"] for p in apart] == [1, 2, 1]
    (tmp_path / "grouped" / "greedy" / "P001" / "tokenized.jsonl").unlink()
    assert answered(tmp_path / "grouped" / "greedy", 2) == apart  # only P001 answered again


def test_continuous_batching_gives_the_same_answers(smollm2_model, smollm2_tokenizer):
    """--gen-engine continuous (transformers' continuous batching, paged KV cache): the same greedy tokens as HF
    generate, every turn of a conversation included (its later turn is asked after the target's own answer)."""
    prompts = [ONE_TURN, TWO_TURNS]
    batched = sd.generate_answers(smollm2_model, smollm2_tokenizer, prompts, max_new_tokens=10)
    continuous = sd.generate_answers(smollm2_model, smollm2_tokenizer, prompts, max_new_tokens=10,
                                     engine="continuous")
    assert continuous == batched and [s["turns"] for s in continuous] == [1, 2]
    with pytest.raises(ValueError, match="engine='paged'"):
        sd.generate_answers(smollm2_model, smollm2_tokenizer, prompts, max_new_tokens=10, engine="paged")


def test_a_generation_option_that_fails_falls_back_to_hf_generate_and_answers_the_part(smollm2_path, tmp_path,
                                                                                         monkeypatch, caplog):
    """--gen-cache / --gen-engine options not yet run on a GPU must not cost a session's answers: a part whose
    option fails is answered by HF generate with the dynamic cache, and so are the later parts."""
    import time
    from types import SimpleNamespace

    from bench import quality_prompts as qp
    from bench.quality_plan import Clock

    monkeypatch.setitem(qp.GEN_CACHES, "static-eager", {"cache_implementation": "static", "no_such_argument": 1})
    args = SimpleNamespace(part_size=1, new_tokens=8, gen_batch=4, gen_batch_tokens=0, all_turns_seq_len=0,
                           gen_engine="generate", gen_cache="static-eager", gen_attention="grouped", gen_group=1)
    clock = Clock(time.time() + 600, tmp_path / "clock.json")
    with caplog.at_level(logging.INFO, logger="quality"):
        answered = qp.generate(args, [[ONE_TURN], TWO_TURNS], smollm2_path, tmp_path / "greedy", 0.0, clock, "cpu")
    assert answered == 2 and (args.gen_engine, args.gen_cache, args.gen_attention) == ("generate", "dynamic", "sdpa")
    assert "P000: --gen-engine generate --gen-cache static-eager --gen-attention grouped failed; this and later " \
           "parts use HF generate with the dynamic cache and sdpa" in caplog.text
    files = [tmp_path / "greedy" / part / "tokenized.jsonl" for part in ("P000", "P001")]
    parts = [json.loads(line) for f in files for line in f.open()]
    assert [s["turns"] for s in parts] == [1, 2]
    args.gen_cache = "dynamic"  # the measured path fails loudly
    monkeypatch.setitem(qp.GEN_CACHES, "dynamic", {"no_such_argument": 1})
    with pytest.raises(ValueError, match="no_such_argument"):
        qp.generate(args, [[ONE_TURN]], smollm2_path, tmp_path / "again", 0.0, clock, "cpu")
