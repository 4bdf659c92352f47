"""Every bad-input reason is counted with file:line examples; above the threshold the merge fails clearly and
keeps the last good output; no bad sample is ever written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eagle3.merge import BadInputError, MergeConfig, read_merged, run_merge
from tests.merge_helpers import read_all, sample, write_dataset
from tests.support.configs import phase

VOCAB = 49152


def bad_inputs(root):
    # S: structural problems -> the block is parsed line by line
    s = write_dataset(root, "S", [
        sample("S", 0, [1, 2, 3]),                                                       # 1 good
        '{"sample_id": "S-x", "dataset": "S"',                                           # 2 malformed_json
        "",                                                                              # 3 malformed_json (blank)
        "[1, 2]",                                                                        # 4 malformed_json (not object)
        '{"sample_id": "S-4", "dataset": "S", "input_ids": [1, 2]}',                     # 5 missing_field
        '{"sample_id": "S-5", "dataset": "S", "input_ids": "abc", "loss_mask": [1]}',   # 6 bad_type
        sample("S", 6, [4, 5, 6]),                                                       # 7 good
        json.dumps(sample("S", 7, [1, 2**40])),                                          # 8 id_out_of_vocab
        json.dumps(sample("S", 8, [1, 2], [1, 300])),                                    # 9 bad_loss_mask
    ])
    # F: every line is well-formed JSON of the right shape -> the vectorized checks find these
    f = write_dataset(root, "F", [
        sample("F", 0, [1, 2, 3]),                                                       # 1 good
        {**sample("F", 1, [1, 2]), "dataset": "Other"},                                  # 2 dataset_mismatch
        sample("F", 2, [1, 2, 3], [1, 1]),                                               # 3 length_mismatch
        sample("F", 3, [], []),                                                          # 4 empty_sample
        sample("F", 4, [1, VOCAB]),                                                      # 5 id_out_of_vocab
        sample("F", 5, [1, 2], [1, 2]),                                                  # 6 bad_loss_mask
        '{"sample_id": "F-6", "dataset": "F", "input_ids": [1, null], "loss_mask": [1, 1]}',  # 7 bad_type
        sample("F", 7, [1, 2]) | {"sample_id": ""},                                      # 8 missing_field
        sample("F", 0, [7, 7, 7]),                                                       # 9 duplicate_sample_id
        {**sample("F", 9, [8, 8]), "sample_id": "S-0"},                                  # 10 duplicate (of S:1)
        sample("F", 10, [9, 9, 9]),                                                      # 11 good
    ])
    write_dataset(root, "E", [])                                                         # empty_dataset
    return s / "tokenized.jsonl", f / "tokenized.jsonl"


EXPECTED = {"malformed_json": 3, "missing_field": 2, "bad_type": 2, "id_out_of_vocab": 2, "bad_loss_mask": 2,
            "dataset_mismatch": 1, "length_mismatch": 1, "empty_sample": 1, "duplicate_sample_id": 2,
            "empty_dataset": 1}


def test_every_bad_input_reason_is_counted_with_file_and_line(tmp_path):
    s_path, f_path = bad_inputs(tmp_path / "in")
    out = tmp_path / "out"
    summary = run_merge(phase(MergeConfig, inputs=[str(tmp_path / "in")], output_dir=str(out), vocab_size=VOCAB,
                                    max_bad_fraction=1.0))
    st = json.loads((out / "stats.json").read_text())
    by = st["bad_input"]["by_reason"]
    assert {k: v["count"] for k, v in by.items()} == EXPECTED
    assert summary["bad_input"] == sum(EXPECTED.values()) == st["bad_input"]["total"]
    assert st["lines"] == 20
    ex = {k: v["examples"] for k, v in by.items()}
    assert [e.split(": ")[0] for e in ex["malformed_json"]] == [f"{s_path}:2", f"{s_path}:3", f"{s_path}:4"]
    assert ex["missing_field"][0].startswith(f"{f_path}:8:") and ex["missing_field"][1].startswith(f"{s_path}:5:")
    assert ex["dataset_mismatch"] == [f"{f_path}:2: dataset 'Other' but the file is in dataset folder 'F'"]
    assert ex["length_mismatch"] == [f"{f_path}:3: input_ids has 3 tokens but loss_mask 2"]
    assert ex["empty_sample"][0].startswith(f"{f_path}:4:")
    assert {e.split(": ")[0] for e in ex["id_out_of_vocab"]} == {f"{f_path}:5", f"{s_path}:8"}
    assert f"token id {VOCAB} outside [0, {VOCAB})" in " ".join(ex["id_out_of_vocab"])
    assert {e.split(": ")[0] for e in ex["bad_loss_mask"]} == {f"{f_path}:6", f"{s_path}:9"}
    assert {e.split(": ")[0] for e in ex["bad_type"]} == {f"{f_path}:7", f"{s_path}:6"}
    # duplicates name both places; the first input (datasets sorted by name, then line) wins
    assert f"{f_path}:9: sample_id 'F-0' already at {f_path}:1" in ex["duplicate_sample_id"]
    assert f"{s_path}:1: sample_id 'S-0' already at {f_path}:10" in ex["duplicate_sample_id"]
    assert ex["empty_dataset"][0].startswith(str(tmp_path / "in" / "E" / "tokenized.jsonl"))
    # only the good samples were written, each intact
    rows = read_all(out)
    assert sorted((r["sample_id"], r["dataset"], tuple(r["input_ids"])) for r in rows) == [
        ("F-0", "F", (1, 2, 3)), ("F-10", "F", (9, 9, 9)), ("S-0", "F", (8, 8)), ("S-6", "S", (4, 5, 6))]
    for r in rows:
        assert len(r["input_ids"]) == len(r["loss_mask"]) == r["length"] > 0
        assert 0 <= min(r["input_ids"]) and max(r["input_ids"]) < VOCAB and set(r["loss_mask"]) <= {0, 1}


def test_above_threshold_fails_clearly_and_keeps_the_last_good_output(tmp_path):
    bad_inputs(tmp_path / "in")
    out = tmp_path / "out"
    good = run_merge(phase(MergeConfig, inputs=[str(tmp_path / "in")], output_dir=str(out), vocab_size=VOCAB,
                                 max_bad_fraction=1.0))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(BadInputError) as e:
        run_merge(phase(MergeConfig, inputs=[str(tmp_path / "in")], output_dir=str(out), vocab_size=VOCAB,
                              max_bad_fraction=0.05, seed=3))
    msg = str(e.value)
    assert "above max_bad_fraction 5.00%" in msg and "of 20 line(s) + 1 empty dataset(s)" in msg
    assert f"malformed_json 3 (e.g. {tmp_path / 'in' / 'S' / 'tokenized.jsonl'}:2: invalid JSON" in msg
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.name != "stats.failed.json"}
    assert after == before and read_merged(out).rows == good["rows"]
    failed = json.loads((out / "stats.failed.json").read_text())
    assert failed["bad_input"]["by_reason"]["malformed_json"]["count"] == 3
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_nothing_but_empty_datasets_fails(tmp_path):
    write_dataset(tmp_path / "in", "E1", [])
    write_dataset(tmp_path / "in", "E2", [])
    with pytest.raises(BadInputError, match="every input item is bad .*2 empty dataset") as e:
        run_merge(phase(MergeConfig, inputs=[str(tmp_path / "in")], output_dir=str(tmp_path / "out"), max_bad_fraction=1.0))
    assert "above max_bad_fraction" not in str(e.value)  # 100% is not above 100%
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_long_lines_and_a_missing_final_newline(tmp_path):
    """Lines longer than a read block and pyarrow's block, and a last line without newline, parse fine."""
    rng = np.random.default_rng(0)
    long_ids = rng.integers(0, VOCAB, 300_000).tolist()
    folder = write_dataset(tmp_path / "in", "L", [sample("L", 0, long_ids), sample("L", 1, [1, 2])])
    with open(folder / "tokenized.jsonl", "a") as f:
        f.write(json.dumps(sample("L", 2, [3, 4])))  # no trailing newline
    s = run_merge(phase(MergeConfig, inputs=[str(folder)], output_dir=str(tmp_path / "out"), vocab_size=VOCAB,
                              max_seq_len=400_000, read_block_bytes=4096))
    assert s["rows"] == 3 and s["bad_input"] == 0
    rows = {r["sample_id"]: r for r in read_all(tmp_path / "out")}
    assert rows["L-0"]["input_ids"] == long_ids and rows["L-2"]["input_ids"] == [3, 4]


@pytest.mark.parametrize("where", ["spill", "parts"])
def test_a_full_disk_names_the_file_and_keeps_the_last_good_output(tmp_path, monkeypatch, where):
    """The shuffle spill (pass 1) and the Parquet writer (pass 2) on a full disk (writes go to /dev/full, which
    answers ENOSPC): DiskFullError names the file being written; the last good output is untouched."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3.io import DiskFullError
    from tests.merge_helpers import random_datasets

    random_datasets(tmp_path / "in", n=20)
    out = tmp_path / "out"
    cfg = dict(inputs=[str(tmp_path / "in")], output_dir=str(out), vocab_size=VOCAB)
    run_merge(phase(MergeConfig, **cfg))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    if where == "spill":
        real = pa.OSFile
        monkeypatch.setattr(pa, "OSFile", lambda path, mode="r": real("/dev/full", mode) if "w" in mode
                            else real(path, mode))
        named = r"\.merge-tmp-[^ ]*/buckets/bucket-\d{5}\.arrow"
    else:
        real = pq.ParquetWriter
        monkeypatch.setattr(pq, "ParquetWriter", lambda path, *a, **kw: real("/dev/full", *a, **kw))
        named = r"\.merge-tmp-[^ ]*/part-00000\.parquet"
    with pytest.raises(DiskFullError, match=rf"^merge: disk full writing {out}/{named}: .*No space left"):
        run_merge(phase(MergeConfig, **cfg, seed=7))
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_nested_and_non_utf8_lines_are_counted_as_malformed_with_file_and_line(tmp_path):
    """Thousands of nested brackets (RecursionError in Python's parser) and bytes that are not UTF-8 (which
    pyarrow's reader would take into a string as they are) are bad lines like any other."""
    folder = write_dataset(tmp_path / "in", "A", [])
    path = folder / "tokenized.jsonl"
    lines = [json.dumps(sample("A", 0, [1, 2, 3])).encode(),
             b'{"sample_id": "A-\xff", "dataset": "A", "input_ids": [1, 2], "loss_mask": [0, 1]}',
             json.dumps(sample("A", 2, [4, 5])).encode()]
    path.write_bytes(b"\n".join(lines) + b"\n")
    out = run_merge(phase(MergeConfig, inputs=[str(tmp_path / "in")], output_dir=str(tmp_path / "o1"),
                          vocab_size=VOCAB, max_bad_fraction=1.0))
    assert out["rows"] == 2 and out["bad_input"] == 1
    bad = json.loads((tmp_path / "o1" / "stats.json").read_text())["bad_input"]["by_reason"]["malformed_json"]
    assert bad["examples"] == [f"{path}:2: not UTF-8 text: byte 17 of the line (invalid start byte)"]
    lines[1] = b'{"sample_id": "A-1", "dataset": "A", "input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path.write_bytes(b"\n".join(lines) + b"\n")
    out = run_merge(phase(MergeConfig, inputs=[str(tmp_path / "in")], output_dir=str(tmp_path / "o2"),
                          vocab_size=VOCAB, max_bad_fraction=1.0))
    assert out["rows"] == 2 and out["bad_input"] == 1
    bad = json.loads((tmp_path / "o2" / "stats.json").read_text())["bad_input"]["by_reason"]["malformed_json"]
    assert bad["examples"][0].startswith(f"{path}:2: invalid JSON: nested deeper")
