"""Merge + shuffle phase: cap/truncate, include/exclude, determinism, uniform shuffle, idempotence, stats."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from eagle3.errors import ConfigError
from eagle3.merge import MergeConfig, iter_rows, read_merged, run_merge
from eagle3.sections import TargetConfig
from tests.support.configs import phase
from tests.merge_helpers import part_bytes, random_datasets, read_all, sample, write_dataset


def merge(inputs, out, **kw) -> dict:
    return run_merge(phase(MergeConfig, inputs=[str(p) for p in inputs], output_dir=str(out), **kw))


def test_truncate_keeps_input_ids_and_loss_mask_aligned(tmp_path):
    ids = list(range(100, 120))
    mask = [0] * 5 + [1] * 15
    write_dataset(tmp_path / "in", "A", [sample("A", 0, ids, mask), sample("A", 1, [7, 8, 9], [0, 1, 1])])
    s = merge([tmp_path / "in"], tmp_path / "out", max_seq_len=8)
    assert (s["rows"], s["tokens"], s["truncated"]) == (2, 8 + 3, 1)
    rows = {r["sample_id"]: r for r in read_all(tmp_path / "out")}
    assert rows["A-0"]["input_ids"] == ids[:8] and rows["A-0"]["loss_mask"] == mask[:8]
    assert rows["A-0"]["length"] == 8
    assert rows["A-1"]["input_ids"] == [7, 8, 9] and rows["A-1"]["loss_mask"] == [0, 1, 1]
    # policy "drop": the long sample is dropped, counted, and the short one kept whole
    s = merge([tmp_path / "in"], tmp_path / "out_drop", max_seq_len=8, cap_policy="drop")
    assert (s["rows"], s["dropped"], s["truncated"]) == (1, 1, 0)
    st = json.loads((tmp_path / "out_drop" / "stats.json").read_text())
    assert st["dropped"]["too_long"]["count"] == 1 and st["dropped"]["too_long"]["tokens"] == 20
    assert "tokenized.jsonl:1:" in st["dropped"]["too_long"]["examples"][0]
    # a sample whose loss tokens all lie past the cap has no assistant token left: dropped
    write_dataset(tmp_path / "in2", "B", [sample("B", 0, list(range(10)), [0] * 8 + [1, 1])])
    with pytest.raises(Exception, match="no sample left"):
        merge([tmp_path / "in2"], tmp_path / "out2", max_seq_len=8)
    st = json.loads((tmp_path / "out2" / "stats.failed.json").read_text())
    assert st["dropped"]["too_few_assistant_tokens"]["count"] == 1


def test_include_exclude_and_discovery(tmp_path):
    a, b, c = random_datasets(tmp_path / "in", n=5)
    by_parent = merge([tmp_path / "in"], tmp_path / "o1")
    assert by_parent["rows"] == 15
    only = merge([tmp_path / "in"], tmp_path / "o2", include=["A", "C"])
    assert {r["dataset"] for r in read_all(tmp_path / "o2")} == {"A", "C"} and only["rows"] == 10
    merge([tmp_path / "in"], tmp_path / "o3", exclude=["A"])
    assert {r["dataset"] for r in read_all(tmp_path / "o3")} == {"B", "C"}
    merge([c, a], tmp_path / "o4")  # a list of dataset folders
    assert {r["dataset"] for r in read_all(tmp_path / "o4")} == {"A", "C"}
    with pytest.raises(ConfigError, match=r"include: no dataset named \['Z'\]"):
        merge([tmp_path / "in"], tmp_path / "o5", include=["Z"])
    write_dataset(tmp_path / "other", "A", [sample("A", 0, [1, 2])])
    with pytest.raises(ConfigError, match="dataset name 'A' appears twice"):
        merge([tmp_path / "in", tmp_path / "other" / "A"], tmp_path / "o6")
    with pytest.raises(ConfigError, match="cap_policy"):
        MergeConfig(inputs=[str(tmp_path)], output_dir=str(tmp_path / "x"), cap_policy="cut")


def test_byte_identical_whatever_the_input_order(tmp_path):
    dirs = random_datasets(tmp_path / "in", names=("A", "B", "C", "D"), n=80)
    kw = dict(seed=7, tokens_per_file=1500, row_group_tokens=300)
    merge(dirs, tmp_path / "o1", **kw)
    # other order, and other tuning knobs (buckets, block size) that must not change a byte
    merge(list(reversed(dirs))[1:] + dirs[-1:], tmp_path / "o2", bucket_tokens=50, read_block_bytes=1024,
          tmp_dir=str(tmp_path / "scratch"), **kw)
    assert not list((tmp_path / "scratch").iterdir())  # its temp folder is removed
    p1, p2 = part_bytes(tmp_path / "o1"), part_bytes(tmp_path / "o2")
    assert len(p1) > 2 and p1 == p2
    m1, m2 = (json.loads((tmp_path / o / "manifest.json").read_text()) for o in ("o1", "o2"))
    assert m1["files"] == m2["files"] and m1["fingerprint"] == m2["fingerprint"]
    # another seed gives another order of the same rows
    merge(dirs, tmp_path / "o3", **{**kw, "seed": 8})
    r1, r3 = read_all(tmp_path / "o1"), read_all(tmp_path / "o3")
    assert [r["sample_id"] for r in r1] != [r["sample_id"] for r in r3]
    assert sorted(r["sample_id"] for r in r1) == sorted(r["sample_id"] for r in r3)
    # the reader helper gives global row order across part files, and any row range
    got = [(g, s, list(ids), list(m)) for g, s, ids, m in iter_rows(tmp_path / "o1")]
    assert [(g, r["sample_id"], r["input_ids"], r["loss_mask"]) for g, r in enumerate(r1)] == got
    start, end = m1["files"][0]["rows"] - 3, m1["files"][0]["rows"] + m1["files"][1]["rows"] + 2
    assert [x[0] for x in iter_rows(tmp_path / "o1", start, end)] == list(range(start, end))
    assert [x[1] for x in read_merged(tmp_path / "o1").iter_rows(start, end)] == [r["sample_id"] for r in r1[start:end]]


def test_shuffle_is_uniform(tmp_path):
    """Input order (dataset A rows, then B rows) vs output position: a 10x10 decile contingency table.

    Deterministic (fixed seeds), so it cannot flake. For a uniform permutation the chi-square statistic has
    81 degrees of freedom (mean 81, sd 12.7); the threshold 160 is > 6 sd above the mean, and a shuffle that
    kept datasets in blocks or kept the input order would score in the thousands."""
    n = 2000
    for name in ("A", "B"):
        write_dataset(tmp_path / "in", name, [sample(name, i, [1, 2, 3]) for i in range(n)])
    for seed in (0, 1, 2):
        merge([tmp_path / "in"], tmp_path / f"o{seed}", seed=seed)
        out = [r["sample_id"] for r in read_all(tmp_path / f"o{seed}")]
        in_rank = np.array([(0 if s[0] == "A" else n) + int(s[2:]) for s in out])
        table = np.zeros((10, 10))
        np.add.at(table, (in_rank * 10 // (2 * n), np.arange(2 * n) * 10 // (2 * n)), 1)
        expected = 2 * n / 100
        chi2 = ((table - expected) ** 2 / expected).sum()
        assert chi2 < 160, (seed, chi2)
        rho = np.corrcoef(in_rank, np.arange(2 * n))[0, 1]
        assert abs(rho) < 0.1, (seed, rho)
    # the statistic does detect a non-shuffle: the input order itself scores far above the threshold
    ident = np.zeros((10, 10))
    np.add.at(ident, (np.arange(2 * n) * 10 // (2 * n), np.arange(2 * n) * 10 // (2 * n)), 1)
    assert ((ident - expected) ** 2 / expected).sum() > 10_000


def test_rerun_is_a_noop_and_param_change_redoes(tmp_path):
    dirs = random_datasets(tmp_path / "in", n=50)
    s1 = merge(dirs, tmp_path / "out", tokens_per_file=800)
    out = tmp_path / "out"
    files = sorted(out.glob("*"))
    mtimes = {p.name: p.stat().st_mtime_ns for p in files}
    s2 = merge(list(reversed(dirs)), out, tokens_per_file=800)
    assert s2["skipped"] is True and s1["skipped"] is False
    assert {p.name: p.stat().st_mtime_ns for p in sorted(out.glob("*"))} == mtimes
    # another param: merged again; parts of the old run that the new one does not have are removed
    s3 = merge(dirs, out, tokens_per_file=10**9)
    assert s3["skipped"] is False and s3["files"] == 1
    assert sorted(p.name for p in out.glob("part-*")) == ["part-00000.parquet"]
    # an input file that changed (size/mtime) is merged again
    with open(dirs[0] / "tokenized.jsonl", "a") as f:
        f.write(json.dumps(sample("A", 999, [5, 6])) + "\n")
    s4 = merge(dirs, out, tokens_per_file=10**9)
    assert s4["skipped"] is False and s4["rows"] == s3["rows"] + 1
    # a part damaged on disk is detected (sha256) and the merge redone
    part = out / "part-00000.parquet"
    part.write_bytes(part.read_bytes()[:-10])
    assert merge(dirs, out, tokens_per_file=10**9)["skipped"] is False
    assert pq.read_table(part).num_rows == s4["rows"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp left


def test_stats_match_a_hand_computed_case(tmp_path):
    write_dataset(tmp_path / "in", "A", [
        sample("A", 0, [1, 2, 3, 4, 5], [0, 0, 1, 1, 1]),               # kept: 5 tokens, 3 loss
        sample("A", 1, list(range(12)), [0] * 6 + [1] * 6),            # truncated 12 -> 8 (4 cut), 2 loss left
        sample("A", 2, [9, 9, 9], [0, 0, 0]),                          # dropped: no loss token
    ])
    write_dataset(tmp_path / "in", "B", [
        sample("B", 0, [1] * 7, [1] * 7),                              # kept: 7 tokens, 7 loss
        '{"sample_id": "B-1", "dataset": "B", "input_ids": [1, 2], "loss_mask": [1]}',  # length mismatch
        sample("B", 2, list(range(9)), [1] * 9),                       # truncated 9 -> 8 (1 cut), 8 loss
    ])
    s = merge([tmp_path / "in"], tmp_path / "out", max_seq_len=8, hidden_size=576, capture_layers=[2, 15, 27],
              extraction_tokens_per_s=28 / 60, max_bad_fraction=0.5)
    st = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert (st["lines"], st["samples_in"], st["tokens_in"]) == (6, 5, 5 + 12 + 3 + 7 + 9)
    assert (st["samples_out"], st["tokens_out"], st["assistant_tokens_out"]) == (4, 5 + 8 + 7 + 8, 3 + 2 + 7 + 8)
    assert st["truncated"] == {"samples": 2, "tokens_removed": 5}
    assert st["dropped"]["too_few_assistant_tokens"]["count"] == 1
    assert st["dropped"]["too_few_assistant_tokens"]["tokens"] == 3
    assert st["bad_input"]["total"] == 1 and st["bad_input"]["fraction"] == pytest.approx(1 / 6)
    assert st["bad_input"]["by_reason"]["length_mismatch"]["examples"] == [
        f"{tmp_path / 'in' / 'B' / 'tokenized.jsonl'}:2: input_ids has 2 tokens but loss_mask 1"]
    assert st["per_dataset"]["A"] == {"lines": 3, "bad": 0, "samples_in": 3, "tokens_in": 20, "truncated": 1,
                                      "dropped": 1, "duplicates": 0, "samples_out": 2, "tokens_out": 13}
    assert st["per_dataset"]["B"] == {"lines": 3, "bad": 1, "samples_in": 2, "tokens_in": 16, "truncated": 1,
                                      "dropped": 0, "duplicates": 0, "samples_out": 2, "tokens_out": 15}
    assert st["length_histogram"]["samples_in"][0] == 5 and sum(st["length_histogram"]["samples_in"]) == 5
    assert st["length_histogram"]["samples_out"][0] == 4
    est = st["extraction_estimate"]
    # "auto" storage of a GPU run: 4 fp8 states of 576 values with an fp32 scale each, an int32 id and a uint8 mask
    # a token (eagle3.fit.bytes_per_token)
    assert est["storage_dtype"] == "float8_e4m3fn"
    assert est["bytes"] == 28 * ((3 + 1) * (576 + 4) + 5) and est["hours"] == pytest.approx(1 / 60)
    assert s["extraction_estimate"] == est["text"] == "65.1 KB / 1 min"
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["complete"] is True and m["rows"] == 4 and m["tokens"] == 28 and m["seed"] == 0
    assert set(m) == {"complete", "files", "rows", "tokens", "seed", "params", "fingerprint"}
    assert set(m["files"][0]) == {"path", "rows", "tokens", "sha256"}


def test_extraction_estimate_reads_like_the_reference_run():
    from eagle3.merge.stats import extraction_estimate

    # 138.4M tokens, 3 layers of hidden 7168 + final, bf16, at 420 tokens/s
    e = extraction_estimate(138_400_000, TargetConfig(capture_layers=[2, 30, 58], hidden_size=7168), "bfloat16",
                            420.0)
    assert e["text"] == "7.9 TB / 92 h"


def test_parquet_schema_is_contract_2(tmp_path):
    random_datasets(tmp_path / "in", n=5)
    merge([tmp_path / "in"], tmp_path / "out")
    schema = pq.read_schema(tmp_path / "out" / "part-00000.parquet")
    assert [(f.name, str(f.type)) for f in schema] == [
        ("sample_id", "string"), ("dataset", "string"), ("input_ids", "list<element: int32>"),
        ("loss_mask", "list<element: int8>"), ("length", "int32")]
