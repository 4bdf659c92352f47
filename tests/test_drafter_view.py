"""The run page's "Drafter" tab (plugins/drafter_view.py over eagle3.results): what a run's phases wrote, rendered;
"not run yet" for a phase without its files; plots served only by name; reads cached while a file is unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3.results import NOT_RUN, drafter_results, evaluation_table, metrics_tail, read_report, text_table
from tests.test_train_config import tiny, tiny_config  # noqa: F401  (the tiny target and shard fixture)

EVAL_REPORT = {  # the headline fields eagle3.evaluate.run writes (k keys are strings in JSON)
    "params": {"max_new_tokens": 64, "prompts_file": "mtbench"}, "device": "cpu", "conversations": 2, "answers": 4,
    "ks": [5, 7], "tau": {"5": 2.345, "7": 2.5}, "tau_ended_with_eos": {"5": 2.1, "7": None},
    "share_hit_cap": {"5": 0.25, "7": 0.5}, "tau_random_init": {"5": 1.02},
    "tau_per_turn": {"5": {"1": 2.4, "2": 2.2}, "7": {"1": 2.6, "2": 2.3}},
    "tau_per_category": {"5": {"coding": 2.9, "writing": 1.8}, "7": {"coding": 3.1, "writing": 1.9}},
    "identical_to_greedy": True, "results": {"trained": {"by_k": {}}}, "complete": True, "fingerprint": "f"}


def test_a_run_without_training_says_not_run_yet(tmp_path):
    r = drafter_results(tmp_path / "run")
    assert (r["train"]["state"], r["evaluate"]["state"], r["export"]["state"]) == (NOT_RUN, NOT_RUN, NOT_RUN)
    assert "commands" not in r["export"]


def test_training_evaluation_and_export_as_the_phases_wrote_them(tiny):  # noqa: F811
    from eagle3.train.run import train_phase

    run = tiny  # the tiny config trains into <tmp>/train, the layout of a run folder
    report = train_phase(tiny_config(tiny))
    r = drafter_results(run)
    assert r["train"]["state"] == "complete" and r["train"]["steps"] == report["steps"] == 3
    assert r["train"]["plot"] == "training" and r["evaluate"]["state"] == NOT_RUN
    x = r["export"]
    assert x["state"] == "complete" and "config.json" in {f["name"] for f in x["files"]}
    assert f"--speculative-draft-model-path {run / 'train' / 'export'}" in x["commands"]["SGLang"]
    assert f"--speculative-num-steps 2 " in x["commands"]["SGLang"]  # the TTT depth trained (tiny_config: 2)
    assert json.loads(x["commands"]["vLLM"].split("'")[1]) == {
        "method": "eagle3", "model": str(run / "train" / "export"), "num_speculative_tokens": 2}

    (run / "evaluate").mkdir()
    (run / "evaluate" / "report.json").write_text(json.dumps(EVAL_REPORT))
    v = drafter_results(run)["evaluate"]
    assert v["state"] == "complete" and v["identical_to_greedy"] is True and v["turns_past_context"] is None
    assert v["tables"]["by_k"] == [
        ["k", "tau", "tau (answers ended by eos)", "share at max_new_tokens", "tau, random drafter", "tau turn 1",
         "tau turn 2"],
        ["5", "2.35", "2.10", "25%", "1.02", "2.40", "2.20"], ["7", "2.50", "-", "50%", "-", "2.60", "2.30"]]
    assert v["tables"]["by_category"][1] == ["coding", "2.90", "3.10"]
    assert text_table(v["tables"]["by_k"]).splitlines()[1].startswith("5  ")


def test_reports_are_cached_while_unchanged_and_bounded(tmp_path, monkeypatch):
    import eagle3.results as results

    path = tmp_path / "report.json"
    path.write_text(json.dumps(EVAL_REPORT))
    first = read_report(path)
    assert "results" not in first  # every answer's rounds stay on disk
    assert read_report(path) is first  # unchanged: not parsed again
    path.write_text(json.dumps({**EVAL_REPORT, "answers": 6}))
    assert read_report(path)["answers"] == 6
    monkeypatch.setattr(results, "MAX_JSON_BYTES", 100)
    path.write_text(json.dumps({**EVAL_REPORT, "answers": 8}))
    assert "over the" in read_report(path)["error"]
    path.write_text("{not json")
    assert "unreadable" in read_report(path)["error"]
    # the metrics tail: the last whole line, read from the end only
    m = tmp_path / "metrics.jsonl"
    m.write_text("".join(json.dumps({"step": i, "loss": 1.0 / i}) + "\n" for i in range(1, 5000)) + '{"step": 50')
    assert metrics_tail(m, max_bytes=4096)["step"] == 4999


def test_the_page_renders_the_tables_plots_and_commands(tiny, monkeypatch):  # noqa: F811
    from fastapi.testclient import TestClient

    from airflow.api_fastapi.core_api.security import get_user
    from eagle3.train.run import train_phase
    import eagle3_airflow.plugins.drafter_view as view
    from eagle3_airflow.plugins.shard_view import app

    train_phase(tiny_config(tiny))
    monkeypatch.setattr(view, "run_folder", lambda dag_id, run_id, session: (Path(tiny), SimpleNamespace(conf={})))
    app.dependency_overrides[get_user] = lambda: object()
    try:
        client = TestClient(app)
        q = {"dag_id": "eagle3_drafter", "run_id": "manual__1"}
        page = client.get("/drafter", params=q).text
        assert "Evaluation <span class='state not-run-yet'>not run yet</span>" in page
        assert "http-equiv=\"refresh\"" in page  # until the evaluation has run
        assert "python -m sglang.launch_server" in page and "vllm serve" in page
        (tiny / "evaluate").mkdir()
        (tiny / "evaluate" / "report.json").write_text(json.dumps(EVAL_REPORT))
        page = client.get("/drafter", params=q).text
        assert "<td>2.35</td>" in page and "identical to greedy decoding (lossless)" in page
        assert "http-equiv=\"refresh\"" not in page and "past-context" not in page
        (tiny / "evaluate" / "report.json").write_text(json.dumps({**EVAL_REPORT, "turns_past_context": 3}))
        page = client.get("/drafter", params=q).text
        assert "<p class='err' id='past-context'>3 turns not asked: prompt + 64 new tokens past the target's" in page
        img = client.get("/drafter/plot", params={**q, "name": "training"})
        assert img.status_code == 200 and img.content[:4] == b"\x89PNG"
        assert client.get("/drafter/plot", params={**q, "name": "../train/report.json"}).status_code == 404
        assert client.get("/drafter/plot", params={**q, "name": "acceptance"}).status_code == 404  # not written
    finally:
        app.dependency_overrides.clear()
