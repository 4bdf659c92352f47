"""Datagen inputs and building blocks without a server: specs, prompt files, the resume store, backoff."""

from __future__ import annotations

import json
import random

import pytest

from dg_helpers import write_jsonl
from eagle3.datagen.client import backoff_delay
from eagle3.datagen.prompts import read_prompts, sample_id
from eagle3.datagen.server import build_command
from eagle3.datagen.config import ClientConfig, DatasetSpec
from eagle3.datagen.store import AppendWriter, repair_tail, scan_and_repair
from eagle3.errors import ConfigError


def test_spec_unknown_field_is_rejected_by_name():
    with pytest.raises(ConfigError, match=r"'max_token' was unexpected"):
        DatasetSpec.from_dict({"name": "A1", "prompt_file": "a.jsonl", "max_token": 5})


def test_spec_bad_values_name_the_field():
    with pytest.raises(ConfigError, match=r"temperature: .*greater than the maximum of 2|temperature: 5"):
        DatasetSpec.from_dict({"name": "A1", "prompt_file": "a.jsonl", "temperature": 5})
    with pytest.raises(ConfigError, match=r"name: 'bad/name' does not match"):
        DatasetSpec.from_dict({"name": "bad/name", "prompt_file": "a.jsonl"})
    with pytest.raises(ConfigError, match=r"'prompt_file' is a required property"):
        DatasetSpec.from_dict({"name": "A1"})
    spec = DatasetSpec.from_dict({"name": "A1", "prompt_file": "a.jsonl", "max_tokens": 7, "on_bad_line": "skip"})
    assert spec.max_tokens == 7 and spec.on_bad_line == "skip"


def test_client_config_rejects_unknown_and_bad_params():
    with pytest.raises(ConfigError, match=r"client: unknown param\(s\) \['concurency'\]"):
        ClientConfig.from_dict({"concurency": 4})
    with pytest.raises(ConfigError, match="max_failed_fraction"):
        ClientConfig.from_dict({"max_failed_fraction": 2})
    with pytest.raises(ConfigError, match="concurrency"):
        ClientConfig.from_dict({"concurrency": 0})


def test_three_prompt_formats(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "hello"},
        "",
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"},
                      {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "q2"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"},
                           {"from": "human", "value": "again"}], "source": "meta ignored"},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
    ])
    ps = read_prompts(f, "D")
    got = [(p.line_no, p.system, p.user_turns) for p in ps.prompts]
    # assistant turns in the file are dropped: the target regenerates them all
    assert got == [(1, None, ["hello"]), (3, "be brief", ["q1", "q2"]), (4, None, ["hi", "again"]), (5, None, ["ab"])]
    assert ps.bad_lines == 0


def test_malformed_line_fails_with_file_and_line(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"prompt": "ok2"}, '{"prompt": "cut', {"prompt": "ok3"}])
    with pytest.raises(ConfigError, match=rf"{f}:3: invalid JSON"):
        read_prompts(f, "D", on_bad_line="fail")


def test_malformed_lines_skipped_and_counted(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "ok"}, "not json", {"text": "no known key"}, {"messages": [{"role": "tool", "content": "x"}]},
        {"prompt": "ok", "messages": []}, {"messages": [{"role": "assistant", "content": "only me"}]},
        {"prompt": "fine"}])
    ps = read_prompts(f, "D", on_bad_line="skip")
    assert [p.line_no for p in ps.prompts] == [1, 7]
    assert ps.bad_lines == 5
    assert [m.split(": ", 1)[0] for m in ps.bad_line_messages] == [f"{f}:{i}" for i in range(2, 7)]
    assert "unsupported role 'tool'" in ps.bad_line_messages[2]
    assert "exactly one of" in ps.bad_line_messages[3]


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match="empty.jsonl is empty"):
        read_prompts(tmp_path / "empty.jsonl", "D")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    with pytest.raises(ConfigError, match="blank.jsonl is empty"):
        read_prompts(tmp_path / "blank.jsonl", "D")
    write_jsonl(tmp_path / "allbad.jsonl", ["nope", "[1]"])
    with pytest.raises(ConfigError, match=r"has no valid prompt \(2 bad lines\)"):
        read_prompts(tmp_path / "allbad.jsonl", "D", on_bad_line="skip")
    with pytest.raises(ConfigError, match="does not exist"):
        read_prompts(tmp_path / "nope.jsonl", "D")


def test_sample_ids_are_stable_and_unique(tmp_path):
    rows = [{"prompt": "same"}, {"prompt": "other"}, {"prompt": "same"}]
    a = read_prompts(write_jsonl(tmp_path / "a.jsonl", rows), "A1")
    b = read_prompts(write_jsonl(tmp_path / "b.jsonl", rows[1:] + rows[:1]), "A1")
    ids = [p.sample_id for p in a.prompts]
    assert len(set(ids)) == 3 and a.duplicate_lines == 1
    assert ids[0] == sample_id("A1", json.dumps(rows[0]).encode()) and ids[2] == ids[0] + "-1"
    # the id depends on the line's content, not its position
    assert {p.sample_id for p in b.prompts} >= {ids[0], ids[1]}
    assert all(i.startswith("A1-") for i in ids)


def test_resume_scan_repairs_truncated_last_line(tmp_path):
    path = tmp_path / "g.jsonl"
    with AppendWriter(path) as w:
        for i in range(5):
            w.write({"sample_id": f"s{i}", "answer": "x" * i})
    good = path.read_bytes()
    path.write_bytes(good + b'{"sample_id": "s5", "answer": "cut he')  # a SIGKILL mid-write
    res = scan_and_repair(path)
    assert res.done_ids == {f"s{i}" for i in range(5)}
    assert res.truncated_bytes == len(b'{"sample_id": "s5", "answer": "cut he')
    assert path.read_bytes() == good
    with AppendWriter(path) as w:  # appending after the repair gives clean lines
        w.write({"sample_id": "s5", "answer": "whole"})
    assert [json.loads(line)["sample_id"] for line in path.read_text().splitlines()] == [f"s{i}" for i in range(6)]


def test_resume_scan_drops_corrupt_and_duplicate_lines(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text('{"sample_id": "a", "x": 1}\n{"sample_id": "b", "x": \n{"sample_id": "a", "x": 2}\n'
                    '{"x": 3, "sample_id": "c"}\n')
    res = scan_and_repair(path)
    assert res.done_ids == {"a", "c"} and res.corrupt_lines == [2] and res.duplicates == 1
    assert [json.loads(x) for x in path.read_text().splitlines()] == [{"sample_id": "a", "x": 1},
                                                                      {"x": 3, "sample_id": "c"}]
    assert scan_and_repair(tmp_path / "missing.jsonl").done_ids == set()


def test_backoff_grows_with_jitter_and_is_capped():
    cfg = ClientConfig(backoff_base_s=1.0, backoff_max_s=8.0)
    rng = random.Random(0)
    for attempt, cap in [(0, 1), (1, 2), (2, 4), (3, 8), (6, 8)]:
        ds = [backoff_delay(attempt, cfg, rng) for _ in range(200)]
        assert cap / 2 <= min(ds) and max(ds) <= cap
        assert max(ds) - min(ds) > cap / 4  # jittered, not one fixed value


def test_server_command_template():
    argv = build_command("python -m sglang.launch_server --model-path {model_path} --port {port}", "--tp 2 --x {port}",
                         model_path="/m dir/model", port=30000, host="127.0.0.1", gguf="")
    assert argv == ["python", "-m", "sglang.launch_server", "--model-path", "/m dir/model", "--port", "30000",
                    "--tp", "2", "--x", "30000"]
    with pytest.raises(ConfigError, match=r"unknown placeholder \{modelpath\}"):
        build_command("serve {modelpath}", None, model_path="m", port=1, host="h", gguf="")


def test_drop_rules():
    import re

    from eagle3.datagen.run import drop_reason

    spec = DatasetSpec(name="D", prompt_file="x")
    pats = [re.compile(p, re.IGNORECASE) for p in spec.refusal_patterns]

    def rec(*answers, finish=("stop",)):
        msgs = []
        for a in answers:
            msgs += [{"role": "user", "content": "q"}, {"role": "assistant", "content": a}]
        return {"messages": msgs, "finish_reasons": list(finish)}

    assert drop_reason(rec("Paris."), spec, pats) is None
    assert drop_reason(rec("ok", "  \n"), spec, pats) == "empty"
    assert drop_reason(rec("I'm sorry, but I can't help with that."), spec, pats) == "refused"
    assert drop_reason(rec("I cannot assist with this request."), spec, pats) == "refused"
    assert drop_reason(rec("I'm sorry for the confusion, here it is: 4."), spec, pats) is None
    assert drop_reason(rec("cut mid", finish=("length",)), spec, pats) == "truncated"
    keep = DatasetSpec(name="D", prompt_file="x", drop_truncated=False)
    assert drop_reason(rec("cut mid", finish=("length",)), keep, pats) is None


def test_repair_tail_of_an_append_only_file(tmp_path):
    p = tmp_path / "errors.jsonl"
    p.write_bytes(b'{"a": 1}\n{"a": 2}\n{"a": 3, "cut')
    assert repair_tail(p) == len(b'{"a": 3, "cut') and p.read_bytes() == b'{"a": 1}\n{"a": 2}\n'
    assert repair_tail(p) == 0
    p.write_bytes(b"x" * 200_000)  # no newline at all: nothing complete to keep
    assert repair_tail(p) == 200_000 and p.read_bytes() == b""
    assert repair_tail(tmp_path / "missing.jsonl") == 0


def test_datagen_config_checks_and_form_params():
    from eagle3.datagen.config import DatagenConfig
    from eagle3.knobs import build, form_params

    base = {"output_dir": "/o", "target": {"model_path": "/m"}}
    cfg = build(DatagenConfig, base, "datagen")
    assert cfg.mode == "local" and cfg.client_config().concurrency == 256 and cfg.client_config().model == "auto"
    assert (cfg.server_command, cfg.gguf, cfg.served_model_name) == ("auto",) * 3  # resolved by preflight
    with pytest.raises(ConfigError, match=r"trigger-form param datagen_client.*unknown param\(s\) \['concurency'\]"):
        build(DatagenConfig, {**base, "client": {"concurency": 4}}, "datagen")
    with pytest.raises(ConfigError, match=r"'model' is set by served_model_name"):
        build(DatagenConfig, {**base, "client": {"model": "x"}}, "datagen")
    with pytest.raises(ConfigError, match=r"mode 'remote' needs conn_id \(trigger-form param datagen_conn_id\)"):
        build(DatagenConfig, {**base, "mode": "remote"}, "datagen")
    with pytest.raises(ConfigError, match=r"mode.*datagen_mode.*use one of \['local', 'remote'\]"):
        build(DatagenConfig, {**base, "mode": "cloud"}, "datagen")
    with pytest.raises(ConfigError, match=r"server_ready_timeout_s must be > 0"):
        build(DatagenConfig, {**base, "server_ready_timeout_s": 0}, "datagen")
    with pytest.raises(ConfigError, match=r"unknown param\(s\) \['conn'\]"):
        build(DatagenConfig, {**base, "conn": "x"}, "datagen")
    form = form_params(DatagenConfig)
    assert sorted(form) == ["datagen_client", "datagen_conn_id", "datagen_mode", "gguf", "served_model_name",
                            "server_command", "server_extra_args"]
    assert {p["section"] for p in form.values()} == {"Data generation"}
    assert form["datagen_client"]["default"] == {"concurrency": 256, "max_failed_fraction": 0.01}


DEEP = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # RecursionError in Python's json parser
NOT_UTF8 = b'{"prompt": "caf\xe9 \xff"}'  # latin-1 bytes


def test_deeply_nested_and_non_utf8_lines_are_bad_lines_with_file_and_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b"\n".join([b'{"prompt": "one"}', DEEP, NOT_UTF8, b'{"prompt": "two"}']) + b"\n")
    ps = read_prompts(f, "D", on_bad_line="skip")
    assert [p.user_turns for p in ps.prompts] == [["one"], ["two"]] and ps.bad_lines == 2
    assert ps.bad_line_messages[0].startswith(f"{f}:2: invalid JSON: nested deeper")
    assert ps.bad_line_messages[1].startswith(f"{f}:3: not UTF-8 text: byte 15")
    with pytest.raises(ConfigError, match=rf"bad prompt line {f}:2: invalid JSON: nested deeper"):
        read_prompts(f, "D", on_bad_line="fail")
    with pytest.raises(ConfigError, match=rf"prompt_file {tmp_path} is a directory, not a file"):
        read_prompts(tmp_path, "D")
