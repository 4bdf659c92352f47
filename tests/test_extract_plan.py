import json

import numpy as np
import pytest

from eagle3.errors import ConfigError, PipelineError
from eagle3.extract.config import ShardPlanConfig
from eagle3.extract.plan import ShardSpec, load_shard_data, plan_shards
from tests.support.synthetic import write_merged_dataset
from tests.support.configs import phase


def plan(merge_dir, num_shards: int):
    return plan_shards(ShardPlanConfig(str(merge_dir), num_shards))


def test_plan_balances_tokens_and_covers_every_row_once(tmp_path):
    rng = np.random.default_rng(3)
    # skewed lengths: a few long samples among many short ones, over several files
    lengths = np.where(rng.random(500) < 0.05, rng.integers(500, 2000, 500), rng.integers(5, 60, 500))
    samples = [list(range(int(n))) for n in lengths]
    m = write_merged_dataset(tmp_path, samples, rows_per_file=77)
    specs = plan(tmp_path, 7)
    assert len(specs) == 7
    json.dumps([s.to_dict() for s in specs])  # a valid XCom
    assert sum(s.tokens for s in specs) == m["tokens"]
    # each shard within one (longest) sample of T/N tokens
    target = m["tokens"] / 7
    assert max(abs(s.tokens - target) for s in specs) <= lengths.max()
    # rows: contiguous, disjoint, complete, and file ranges agree with the global indices
    covered = []
    starts = np.concatenate([[0], np.cumsum([f["rows"] for f in m["files"]])])
    names = [f["path"] for f in m["files"]]
    for s in specs:
        assert s.rows == sum(r.row_end - r.row_start for r in s.ranges)
        for r in s.ranges:
            assert r.global_row_start == starts[names.index(r.file)] + r.row_start
            covered.extend(range(r.global_row_start, r.global_row_start + r.row_end - r.row_start))
        assert s.tokens == int(sum(lengths[a:b].sum() for a, b in s.global_ranges))
    assert covered == list(range(500))
    assert ShardSpec.from_dict(specs[3].to_dict()) == specs[3]


def test_plan_beats_row_balancing(tmp_path):
    # the long samples sit at the start: equal row counts would give shard 0 most of the tokens
    samples = [[1] * 1000] * 10 + [[1] * 10] * 990
    write_merged_dataset(tmp_path, samples, rows_per_file=300)
    specs = plan(tmp_path, 4)
    toks = [s.tokens for s in specs]
    assert max(toks) - min(toks) <= 1000
    assert specs[0].rows < 20 < specs[-1].rows


def test_plan_errors_name_the_problem(tmp_path):
    with pytest.raises(PipelineError, match="merge manifest is missing"):
        plan(tmp_path, 2)
    write_merged_dataset(tmp_path, [[1, 2, 3]] * 3)
    with pytest.raises(ConfigError, match="num_shards=4 is more than the 3 rows"):
        plan(tmp_path, 4)
    with pytest.raises(ConfigError, match="plan_shards param num_shards must be >= 1 and <= 4096, got 0"):
        plan(tmp_path, 0)
    m = json.loads((tmp_path / "manifest.json").read_text())
    m["files"][0]["tokens"] = 10
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PipelineError, match="part-00000.parquet: 9 tokens, merge manifest says 10"):
        plan(tmp_path, 2)
    m["complete"] = False
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PipelineError, match="not complete"):
        plan(tmp_path, 2)


def test_plan_and_loader_read_the_real_merge_output(tmp_path):
    """Contract 2 end to end: datagen-style JSONL -> the real merge phase -> shard plan -> shard data."""
    import pyarrow.parquet as pq

    from eagle3.merge.config import MergeConfig
    from eagle3.merge.dataset import PART_SCHEMA
    from eagle3.merge.run import run_merge

    rng = np.random.default_rng(5)
    for ds in ("A1", "B2"):
        d = tmp_path / "datagen" / ds
        d.mkdir(parents=True)
        with open(d / "tokenized.jsonl", "w") as f:
            for i in range(40):
                n = int(rng.integers(4, 50))
                ids = rng.integers(3, 49000, n).tolist()
                mask = [0] * (n // 2) + [1] * (n - n // 2)
                f.write(json.dumps({"sample_id": f"{ds}-{i}", "dataset": ds, "input_ids": ids, "loss_mask": mask}) + "\n")
    run_merge(phase(MergeConfig, inputs=[str(tmp_path / "datagen")], output_dir=str(tmp_path / "merged"), num_files=3))
    manifest = json.loads((tmp_path / "merged" / "manifest.json").read_text())
    # one schema: what merge writes, what the test fixture writes and what the readers expect
    write_merged_dataset(tmp_path / "synthetic", [[1, 2, 3]])
    for part in [*(tmp_path / "merged").glob("part-*.parquet"), tmp_path / "synthetic" / "part-00000.parquet"]:
        assert pq.read_schema(part).remove_metadata() == PART_SCHEMA
    specs = plan(tmp_path / "merged", 3)
    assert sum(s.tokens for s in specs) == manifest["tokens"] and sum(s.rows for s in specs) == manifest["rows"]
    rows = []
    for s in specs:
        data = load_shard_data(s)
        assert len(data.input_ids) == s.tokens == int(data.lengths.sum())
        assert data.loss_mask.max() == 1 and len(data.rows) == s.rows
        rows.extend(data.rows.tolist())
    assert rows == list(range(manifest["rows"]))
