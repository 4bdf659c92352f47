"""Merge on real SmolLM2 token ids, read back with the reader helper; the operator called directly."""

from __future__ import annotations

import json

from eagle3.merge import iter_rows
from tests.merge_helpers import write_dataset
from tests.support.configs import phase

CHATS = {
    "chat": [("What is the capital of France?", "The capital of France is Paris."),
             ("Name a prime number.", "Seven is a prime number."),
             ("Say hi.", "Hi! How can I help you today?")],
    "code": [("Write a Python expression for 2 + 2.", "`2 + 2` evaluates to 4."),
             ("What does len([1, 2]) return?", "It returns 2, the number of items in the list. " * 6)],
}


def tokenize(tok, user: str, answer: str) -> tuple[list[int], list[int]]:
    msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(msgs, tokenize=False)
    assert full.startswith(prompt)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    ids = tok(full, add_special_tokens=False)["input_ids"]
    assert ids[:len(p_ids)] == p_ids
    return ids, [0] * len(p_ids) + [1] * (len(ids) - len(p_ids))


def test_real_token_ids_round_trip_through_merge(smollm2_tokenizer, tmp_path):
    tok = smollm2_tokenizer
    originals = {}
    for name, chats in CHATS.items():
        rows = []
        for i, (user, answer) in enumerate(chats):
            ids, mask = tokenize(tok, user, answer)
            rows.append({"sample_id": f"{name}-{i}", "dataset": name, "input_ids": ids, "loss_mask": mask})
            originals[f"{name}-{i}"] = (ids, mask, answer)
        write_dataset(tmp_path / "datagen", name, rows)
    cap = 60
    assert max(len(v[0]) for v in originals.values()) > cap  # one sample is truncated
    from eagle3.merge import MergeConfig, run_merge

    s = run_merge(phase(MergeConfig, inputs=[str(tmp_path / "datagen")], output_dir=str(tmp_path / "merge"),
                              vocab_size=len(tok), max_seq_len=cap))
    assert s["rows"] == 5 and s["truncated"] == 1
    seen = set()
    for g, sid, ids, mask in iter_rows(tmp_path / "merge"):
        o_ids, o_mask, answer = originals[sid]
        assert ids.tolist() == o_ids[:cap] and mask.tolist() == o_mask[:cap]
        answer_tokens = [t for t, m in zip(ids.tolist(), mask.tolist()) if m]
        if len(o_ids) <= cap:  # the tokens under the mask are the assistant's answer (+ end of turn)
            assert tok.decode(answer_tokens).strip().removesuffix("<|im_end|>").strip() == answer.strip()
        else:
            assert answer.startswith(tok.decode(answer_tokens)[:20])
        seen.add(sid)
    assert seen == set(originals)


def test_operator_execute_returns_the_summary(tmp_path):
    from eagle3_airflow.operators.merge import MergeOperator

    for name in ("A", "B"):
        write_dataset(tmp_path / "datagen", name, [
            {"sample_id": f"{name}-{i}", "dataset": name, "input_ids": [1, 2, 3, i], "loss_mask": [0, 1, 1, 1]}
            for i in range(10)])
    # the DAG hands the operator its part of the run configuration, rendered natively: a dict whose shared
    # sections are objects
    op = MergeOperator(task_id="merge", config={
        "inputs": [str(tmp_path / "datagen")], "output_dir": str(tmp_path / "merge"), "exclude": ["B"], "seed": 3,
        "target": {"capture_layers": [2, 15, 27], "vocab_size": 49152, "hidden_size": 576},
        "extraction_tokens_per_s": 100})
    out = op.execute({})
    assert out == {"merge_dir": str(tmp_path / "merge"), "manifest": str(tmp_path / "merge" / "manifest.json"),
                   "files": 1, "rows": 10, "tokens": 40, "skipped": False, "bad_input": 0, "dropped": 0,
                   "truncated": 0, "extraction_estimate": "93.0 KB / 0.4 s"}  # 40 tokens of fp8 states
    json.dumps(out)  # small and JSON-able (XCom)
    assert op.execute({})["skipped"] is True
    assert json.loads((tmp_path / "merge" / "manifest.json").read_text())["seed"] == 3
