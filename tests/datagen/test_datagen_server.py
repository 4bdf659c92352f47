"""Datagen against a REAL OpenAI-compatible server (llama.cpp on the real SmolLM2), over real HTTP.

Faults are injected by a proxy between client and server; the server behind it stays real.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from dg_helpers import llama_server_command, write_jsonl
from eagle3.datagen import ClientConfig, DatasetSpec, Endpoint, FailureBudgetExceeded, LocalServer, run_dataset
from eagle3.datagen.prompts import read_prompts
from eagle3.datagen.tokenize import masked_runs
from eagle3.errors import PipelineError
from fault_proxy import FaultProxy

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "data" / "demo"


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _client(**kw) -> ClientConfig:
    return ClientConfig(**{"model": "smollm2", "concurrency": 2, "request_timeout_s": 60, "backoff_base_s": 0.05,
                           "backoff_max_s": 0.5, "log_every_s": 1.0, **kw})


def _proc_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie has stopped running; only its exit status is left to reap


@pytest.mark.slow
def test_two_demo_datasets_end_to_end(llama_server, smollm2_path, smollm2_tokenizer, tmp_path):
    cfg = _client(price_prompt_per_m=0.5, price_completion_per_m=1.5)
    tok = smollm2_tokenizer
    full_multi_turn = 0
    for name in ("A1", "B1"):
        spec = DatasetSpec.from_dict({"name": name, "prompt_file": str(DEMO / f"{name}.jsonl"), "max_tokens": 40})
        rep = run_dataset(spec, cfg, Endpoint(llama_server["url"]), smollm2_path, tmp_path, tokenizer=tok)
        folder = tmp_path / name
        prompts = read_prompts(spec.prompt_file, name).prompts
        gens = _lines(folder / "generations.jsonl")
        # every prompt exactly once, nothing missing
        assert Counter(g["sample_id"] for g in gens) == Counter(p.sample_id for p in prompts)
        assert rep["missing"] == 0 and rep["this_run"]["failed"] == 0
        truncated = sum("length" in g["finish_reasons"] for g in gens)
        assert rep["dropped"]["truncated"] == truncated
        assert rep["rows"] + sum(rep["dropped"].values()) == len(prompts) and rep["rows"] > 0
        # multi-turn prompts got one answer per user turn, each seeing the model's own previous answer
        turns = {p.sample_id: len(p.user_turns) for p in prompts}
        multi = [g for g in gens if turns[g["sample_id"]] == 2]
        assert multi and all(g["finish_reasons"][0] == "length" or len(g["finish_reasons"]) == 2 for g in multi)
        full_multi_turn += sum(len(g["finish_reasons"]) == 2 and "length" not in g["finish_reasons"] for g in multi)
        # accounting: usage from the server, summed; cost from the per-million prices
        p_tok = sum(g["usage"]["prompt_tokens"] for g in gens)
        c_tok = sum(g["usage"]["completion_tokens"] for g in gens)
        assert rep["usage"] == {"prompt_tokens": p_tok, "completion_tokens": c_tok} and c_tok > 0
        assert rep["cost_usd"] == pytest.approx((p_tok * 0.5 + c_tok * 1.5) / 1e6, abs=1e-6)
        assert rep["this_run"]["requests"] >= len(prompts) and rep["this_run"]["tokens_per_s"] > 0
        assert json.loads((folder / "report.json").read_text())["rows"] == rep["rows"]
        # tokenized rows: the merge contract, masks that decode to the model's answers
        by_id = {g["sample_id"]: g for g in gens}
        rows = _lines(folder / "tokenized.jsonl")
        assert len(rows) == rep["rows"]
        assert [r["sample_id"] for r in rows] == [p.sample_id for p in prompts if p.sample_id in {r["sample_id"] for r in rows}]
        for r in rows:
            assert set(r) == {"sample_id", "dataset", "input_ids", "loss_mask"} and r["dataset"] == name
            assert len(r["input_ids"]) == len(r["loss_mask"])
            answers = [m["content"] + "<|im_end|>" for m in by_id[r["sample_id"]]["messages"] if m["role"] == "assistant"]
            got = [tok.decode(x, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                   for x in masked_runs(r["input_ids"], r["loss_mask"])]
            assert got == answers
        man = json.loads((folder / "manifest.json").read_text())
        assert man["complete"] and man["rows"] == rep["rows"] and man["tokens"] == rep["tokens"]
        # a re-run finds the manifest valid and does nothing (no endpoint needed)
        before = (folder / "tokenized.jsonl").stat().st_mtime_ns
        again = run_dataset(spec, cfg, None, smollm2_path, tmp_path, tokenizer=tok)
        assert again["skipped"] and (folder / "tokenized.jsonl").stat().st_mtime_ns == before
    assert full_multi_turn >= 1  # at least one two-turn chat went through tokenization and the mask check


@pytest.mark.parametrize("http_client", ["aiohttp", "openai"])
def test_retries_on_429_500_dropped_connection_and_stall(llama_server, smollm2_path, smollm2_tokenizer, tmp_path,
                                                         http_client):
    faults = ["429", "500", "drop", "stall"]
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Say hi."}, {"prompt": "Say bye."}, {"prompt": "Count to 3."}])
    spec = DatasetSpec(name="F", prompt_file=str(f), max_tokens=8, drop_truncated=False)
    with FaultProxy(llama_server["port"], lambda i, body: faults[i] if i < len(faults) else "ok", stall_s=60) as px:
        # the timeout must be far above a real answer's latency on a loaded 2-core machine (8 tokens: ~0.5 s alone,
        # over 6 s seen beside the other test worker's torch)
        rep = run_dataset(spec, _client(concurrency=1, request_timeout_s=20, max_retries=5, http_client=http_client),
                          Endpoint(px.base_url),
                          smollm2_path, tmp_path, tokenizer=smollm2_tokenizer)
        actions = list(px.actions)
    assert rep["this_run"]["retries_by_reason"] == {"429": 1, "500": 1, "connection": 1, "timeout": 1}
    assert rep["this_run"]["generated"] == 3 and rep["missing"] == 0
    assert actions == faults + ["ok"] * 3
    assert (tmp_path / "F" / "errors.jsonl").read_text() == ""


def test_failure_budget(llama_server, smollm2_path, smollm2_tokenizer, tmp_path):
    """Samples that keep failing are recorded; over the budget the task fails, under it the run completes."""
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Say hi."}, {"prompt": "Say yes."},
                                           {"prompt": "POISON"}, {"prompt": "BADREQ"}, '{"prompt": "cut'])
    spec = DatasetSpec(name="B", prompt_file=str(f), max_tokens=6, on_bad_line="skip", drop_truncated=False)

    def policy(i, body):
        return "500" if b"POISON" in body else "400" if b"BADREQ" in body else "ok"

    with FaultProxy(llama_server["port"], policy) as px:
        with pytest.raises(FailureBudgetExceeded, match=r"B: 2 samples failed, more than the failure budget allows "
                                                        r".*by reason: HTTP 500: 1, HTTP 400: 1") as e:
            run_dataset(spec, _client(concurrency=1, max_retries=2, max_failed_fraction=0.25), Endpoint(px.base_url),
                        smollm2_path, tmp_path, tokenizer=smollm2_tokenizer)
        assert e.value.retried  # a 5xx may pass on a later try of the task
        assert Counter(px.actions) == {"ok": 2, "500": 3, "400": 1}  # 400 is not retried; 500 is, twice
        folder = tmp_path / "B"
        assert not (folder / "manifest.json").exists()
        assert json.loads((folder / "report.json").read_text())["status"] == "failed"
        errs = _lines(folder / "errors.jsonl")
        assert [(e["line"], e["reason"], e["attempts"]) for e in errs] == [(3, "500", 3), (4, "400", 1)]
        assert len(_lines(folder / "generations.jsonl")) == 2  # the good answers are kept
        # a wider budget: the re-run only retries the two failed prompts and completes without them
        rep = run_dataset(spec, _client(concurrency=1, max_retries=0, max_failed_fraction=0.5),
                          Endpoint(px.base_url), smollm2_path, tmp_path, tokenizer=smollm2_tokenizer)
        assert Counter(px.actions[6:]) == {"500": 1, "400": 1}
    assert rep["resumed_done"] == 2 and rep["missing"] == 2 and rep["this_run"]["failed"] == 2
    assert rep["prompts"] == 4 and rep["bad_lines"] == 1 and rep["bad_line_messages"][0].startswith(f"{f}:5: invalid JSON")
    assert json.loads((folder / "manifest.json").read_text())["complete"]


@pytest.mark.slow
def test_resume_after_sigkill_has_every_prompt_once(llama_server, smollm2_path, smollm2_tokenizer, tmp_path):
    n = 8
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Write one short sentence about the number {i}."}
                                           for i in range(n)])
    spec = {"name": "R", "prompt_file": str(f), "max_tokens": 12, "drop_truncated": False}
    client = {"concurrency": 2, "log_every_s": 1.0}
    gen = tmp_path / "R" / "generations.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "eagle3.datagen", "--spec", json.dumps(spec), "--out", str(tmp_path),
                             "--tokenizer", str(smollm2_path), "--model", "smollm2", "--client", json.dumps(client),
                             "--base-url", llama_server["url"]], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    while not (gen.exists() and gen.read_bytes().count(b"\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, "generation did not progress"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with open(gen, "ab") as fh:  # what a kill in the middle of a write leaves behind
        fh.write(b'{"sample_id": "R-cut-mid-line", "messages": [{"role": "user", "con')
    done_before = gen.read_bytes().count(b"\n")
    assert 3 <= done_before < n

    # the retry (here in-process, as an Airflow retry would run it)
    rep = run_dataset(DatasetSpec.from_dict(spec), ClientConfig.from_dict({**client, "model": "smollm2"}),
                      Endpoint(llama_server["url"]),
                      smollm2_path, tmp_path, tokenizer=smollm2_tokenizer)
    ids = Counter(json.loads(x)["sample_id"] for x in gen.read_text().splitlines())
    expected = {p.sample_id for p in read_prompts(f, "R").prompts}
    assert set(ids) == expected and set(ids.values()) == {1}
    assert rep["resumed_done"] == done_before and rep["this_run"]["attempted"] == n - done_before
    assert rep["resume_repaired_bytes"] > 0 and rep["missing"] == 0
    assert rep["rows"] + sum(rep["dropped"].values()) == n


def test_local_server_lifecycle(smollm2_gguf, tmp_path):
    srv = LocalServer(llama_server_command(), gguf=str(smollm2_gguf), ready_timeout_s=60)
    with srv:
        with urllib.request.urlopen(f"{srv.base_url}/models", timeout=5) as r:
            assert json.load(r)["data"][0]["id"] == "smollm2"
        pid = srv.proc.pid
    assert srv.proc.returncode is not None and _proc_gone(pid)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{srv.base_url}/models", timeout=2)
    # a server that dies at start: the error carries its output
    bad = LocalServer(f"{sys.executable} -c \"import sys; print('boom on port {{port}}'); sys.exit(3)\"",
                      ready_timeout_s=30)
    with pytest.raises(PipelineError, match=r"(?s)exited with code 3 before it was ready.*boom on port \d+"):
        with bad:
            pass


def test_local_server_output_goes_to_its_own_file_named_in_the_log(tmp_path, caplog):
    """A server prints thousands of lines: they go to their own file, the task log names it; a failure still shows
    the last lines."""
    caplog.set_level(logging.INFO, logger="eagle3.datagen.server")
    chatty = (f"{sys.executable} -c \"import sys; [print('load line', i) for i in range(2000)]; "
              f"print('last'); sys.exit(3)\"")
    log_file = tmp_path / "A" / "server.log"
    with pytest.raises(PipelineError, match=r"(?s)exited with code 3.*load line 1999"):
        with LocalServer(chatty, ready_timeout_s=30, log_file=str(log_file)):
            pass
    lines = log_file.read_text().splitlines()
    assert len(lines) == 2001 and lines[0] == "load line 0"
    assert f"the server's output goes to {log_file}" in caplog.text
    assert "load line 5" not in caplog.text  # (the command line itself is logged)


def test_local_server_dies_with_a_sigkilled_task(smollm2_path, smollm2_gguf, tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Tell a long story number {i}."} for i in range(20)])
    spec = {"name": "K", "prompt_file": str(f), "max_tokens": 200}
    log = tmp_path / "task.log"
    with open(log, "wb") as lf:
        task = subprocess.Popen([sys.executable, "-m", "eagle3.datagen", "--spec", json.dumps(spec), "--out",
                                 str(tmp_path), "--tokenizer", str(smollm2_path), "--model", "smollm2",
                                 "--server-command", llama_server_command(), "--gguf", str(smollm2_gguf)],
                                cwd=ROOT, stdout=lf, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while "local server ready" not in log.read_text():
        assert task.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.1)
    import re

    server_pid = int(re.search(r"local server pid (\d+)", log.read_text()).group(1))
    assert not _proc_gone(server_pid)
    time.sleep(1.0)  # mid-run: requests in flight
    task.send_signal(signal.SIGKILL)  # no finally, no atexit: only the kernel's parent-death signal is left
    task.wait()
    deadline = time.monotonic() + 10
    while not _proc_gone(server_pid):
        assert time.monotonic() < deadline, f"server {server_pid} outlived the SIGKILLed task"
        time.sleep(0.1)


def test_operator_remote_mode_key_from_connection(llama_server, smollm2_path, tmp_path, monkeypatch, caplog):
    from airflow.sdk._shared.secrets_masker.secrets_masker import redact

    from eagle3_airflow.operators.datagen import DatagenOperator

    key = "sk-eagle3-test-9f8e7d6c5b4a"
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Say hi."}, {"conversations": [{"from": "human", "value": "Yes?"}]}])
    with FaultProxy(llama_server["port"], lambda i, body: "ok") as px:
        monkeypatch.setenv("AIRFLOW_CONN_EAGLE3_DG_TEST",
                           json.dumps({"conn_type": "openai", "host": px.base_url, "password": key}))
        op = DatagenOperator(task_id="datagen", dataset={"name": "OP", "prompt_file": str(f), "max_tokens": 8, "drop_truncated": False},
                             config={"output_dir": str(tmp_path / "out"), "target": {"model_path": str(smollm2_path)},
                                     "mode": "remote", "conn_id": "eagle3_dg_test", "served_model_name": "smollm2",
                                     "client": {"concurrency": 2, "log_every_s": 1}})
        caplog.set_level("DEBUG")
        result = op.execute({})
        auth = set(px.auth_headers)
    assert auth == {f"Bearer {key}"}  # the key reached the endpoint ...
    assert result["rows"] + sum(result["dropped"].values()) == 2 and result["missing"] == 0
    assert key not in json.dumps(result) and key not in caplog.text  # ... and nowhere else
    for p in (tmp_path / "out").rglob("*"):
        if p.is_file():
            assert key.encode() not in p.read_bytes(), p
    assert key not in str(redact(f"Authorization: Bearer {key}"))
    # and it maps over datasets
    from airflow.sdk import DAG

    with DAG("dg_map_test", schedule=None):
        mapped = DatagenOperator.partial(task_id="datagen", config={"output_dir": "/o", "target": {"model_path": "/m"}}).expand(
            dataset=[{"name": "A1", "prompt_file": "a"}, {"name": "B1", "prompt_file": "b"}])
    assert mapped.expand_input.value["dataset"][1]["name"] == "B1"


def test_operator_local_mode_starts_and_stops_the_server(smollm2_path, smollm2_gguf, tmp_path, caplog):
    from eagle3_airflow.operators.datagen import DatagenOperator

    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Say hi."}, {"prompt": "Say yes."}])
    op = DatagenOperator(task_id="datagen", dataset={"name": "L", "prompt_file": str(f), "max_tokens": 8, "drop_truncated": False},
                         config={"output_dir": str(tmp_path), "target": {"model_path": str(smollm2_path)}, "mode": "local",
                                 "served_model_name": "smollm2", "server_command": llama_server_command(),
                                 "gguf": str(smollm2_gguf), "server_ready_timeout_s": 60})
    import logging
    import re

    class Lines(logging.Handler):  # on datagen's own logger: importing Airflow drops caplog's root handler
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines: list[str] = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    seen, logger = Lines(), logging.getLogger("eagle3.datagen")
    logger.addHandler(seen)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        result = op.execute({})
        assert result["rows"] + sum(result["dropped"].values()) == 2 and not result["skipped"]
        text = "\n".join(seen.lines)
        pid = int(re.search(r"local server pid (\d+)", text).group(1))
        server_log = tmp_path / "L" / "server.log"
        assert _proc_gone(pid) and str(server_log) in text  # stopped; its output went to its own file, named
        assert server_log.read_text().strip()
        again = op.execute({})  # complete: no server is started at all
        assert again["skipped"] and "\n".join(seen.lines).count("starting local server") == 1
    finally:
        logger.removeHandler(seen)
        logger.setLevel(old_level)
