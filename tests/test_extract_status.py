import json

import torch

from eagle3.extract.format import ShardManifest, write_chunk
from eagle3.config import run_dir
from eagle3.extract.status import (COMPLETE, DAMAGED, FAILED, IN_PROGRESS, NOT_STARTED, clear_failure, human_bytes, record_failure,
                            run_progress)


def chunk(rows, n_tok=3):
    t = n_tok * len(rows)
    return {"input_ids": torch.arange(t, dtype=torch.int32), "loss_mask": torch.ones(t, dtype=torch.uint8),
            "aux_hidden": torch.zeros(t, 6, dtype=torch.bfloat16), "final_hidden": torch.zeros(t, 2, dtype=torch.bfloat16),
            "sample_offsets": torch.arange(0, t + 1, n_tok, dtype=torch.int64),
            "sample_rows": torch.tensor(rows, dtype=torch.int64)}


def test_states_counts_and_rates_from_real_manifests(tmp_path):
    ext = tmp_path / "run" / "extract"
    # shard 0 complete, 2 chunks; shard 1 in progress with the rate fields the task adds; shard 2 folder only
    m0 = ShardManifest(shard=0, model_path="m", capture_layers=[1, 2, 3], hidden_size=2, dtype="bfloat16")
    d0 = ext / "shard-00000"
    m0.chunks += [write_chunk(d0, 0, chunk([0, 1])), write_chunk(d0, 1, chunk([2]))]
    m0.complete = True
    m0.params.update(started_at="2026-12-03T01:00:00+00:00", updated_at="2026-12-03T01:00:03+00:00")
    m0.save(d0)
    d1 = ext / "shard-00001"
    m1 = ShardManifest(shard=1, model_path="m", capture_layers=[1, 2, 3], hidden_size=2, dtype="bfloat16")
    m1.chunks.append(write_chunk(d1, 0, chunk([3, 4, 5])))
    m1.params.update(started_at="2026-12-03T01:00:00Z", tokens_per_s=1234.5)
    m1.save(d1)
    (ext / "shard-00002").mkdir()

    p = run_progress(tmp_path / "run", expected_shards=5)
    by = {s.shard: s for s in p.shards}
    assert [s.state for s in p.shards] == [COMPLETE, IN_PROGRESS, NOT_STARTED, NOT_STARTED, NOT_STARTED]
    assert (by[0].chunks, by[0].tokens, by[0].samples) == (2, 9, 3)
    assert by[0].bytes_written == sum(c.bytes for c in m0.chunks) > 0
    assert by[0].tokens_per_s is None  # not running: no rate
    assert by[1].tokens_per_s == 1234.5 and by[1].tokens == 9
    t = p.totals
    assert (t["complete"], t["in_progress"], t["not_started"], t["chunks"], t["tokens"]) == (1, 1, 3, 3, 18)
    assert t["tokens_per_s"] == 1234.5
    json.dumps(p.to_dict())

    # shard 1 fails (the extraction records it); shard 1's task is then known: failed on try 2
    try:
        raise RuntimeError("CUDA error: an illegal memory access\nstack line 2")
    except RuntimeError as e:
        record_failure(d1, e, try_number=2)
    s1 = run_progress(tmp_path / "run").shards[1]
    assert (s1.state, s1.error, s1.failed_try, s1.tokens_per_s, s1.chunks) == (
        FAILED, "RuntimeError: CUDA error: an illegal memory access", 2, None, 1)
    assert run_progress(tmp_path / "run").totals["failed"] == 1
    # cleared in Airflow and queued again: the record is the last try's, the shard is not shown failed
    s1 = run_progress(tmp_path / "run", tasks={1: {"state": "queued", "try_number": 3}}).shards[1]
    assert s1.state == IN_PROGRESS and s1.tokens_per_s is None
    clear_failure(d1)  # the new attempt starts
    s1 = run_progress(tmp_path / "run", tasks={1: {"state": "running", "try_number": 3}}).shards[1]
    assert (s1.state, s1.error, s1.tokens_per_s) == (IN_PROGRESS, None, 1234.5)


def test_a_killed_shard_is_failed_by_its_task_state_and_shows_no_stale_rate(tmp_path):
    """A SIGKILLed worker writes nothing: its shard's manifest still says "in progress" with the last rate;
    the Airflow task state (failed, up for retry) says otherwise."""
    d = tmp_path / "extract" / "shard-00000"
    m = ShardManifest(shard=0, model_path="m", capture_layers=[1, 2, 3], hidden_size=2, dtype="bfloat16")
    m.chunks.append(write_chunk(d, 0, chunk([0, 1])))
    m.params.update(started_at="2026-12-03T01:00:00Z", tokens_per_s=99.0)
    m.save(d)
    for state, want in (("up_for_retry", FAILED), ("failed", FAILED), ("scheduled", IN_PROGRESS)):
        s = run_progress(tmp_path, tasks={0: {"state": state, "try_number": 1}}).shards[0]
        assert (s.state, s.tokens_per_s) == (want, None), state
        assert (s.failed_try, "Airflow task " + state in (s.error or "")) == ((1, True) if want == FAILED else
                                                                              (None, False))
    assert run_progress(tmp_path, tasks={0: {"state": "running", "try_number": 1}}).shards[0].tokens_per_s == 99.0
    assert run_progress(tmp_path, tasks={0: {"state": "running"}}).totals["tokens_per_s"] == 99.0
    assert run_progress(tmp_path, tasks={0: {"state": "failed"}}).totals["tokens_per_s"] == 0


def test_unreadable_and_odd_manifests_do_not_raise(tmp_path):
    ext = tmp_path / "extract"
    (ext / "shard-00000").mkdir(parents=True)
    (ext / "shard-00000" / "manifest.json").write_text('{"chunks": [{"tok')  # mid-write by a foreign tool
    (ext / "shard-00001").mkdir()
    (ext / "shard-00001" / "manifest.json").write_text(json.dumps({"chunks": "nonsense", "params": [1], "complete": "yes"}))
    (ext / "shard-00002").mkdir()
    (ext / "shard-00002" / ".chunk-000000.safetensors.tmp-1-ab").write_bytes(b"x")
    (ext / "not-a-shard").mkdir()
    s = run_progress(tmp_path).shards
    assert [x.shard for x in s] == [0, 1, 2]
    assert s[0].state == IN_PROGRESS and "unreadable manifest" in s[0].error
    assert s[1].state == NOT_STARTED and s[1].chunks == 0
    assert s[2].state == IN_PROGRESS
    assert run_progress(tmp_path / "missing").shards == []


def test_a_committed_chunk_missing_or_resized_shows_the_shard_damaged(tmp_path):
    """The manifest says complete, but a chunk file was deleted or cut: the view says so (one stat per chunk)."""
    d = tmp_path / "run" / "extract" / "shard-00000"
    m = ShardManifest(shard=0, model_path="m", capture_layers=[1, 2, 3], hidden_size=2, dtype="bfloat16")
    m.chunks += [write_chunk(d, 0, chunk([0])), write_chunk(d, 1, chunk([1])), write_chunk(d, 2, chunk([2]))]
    m.complete = True
    m.save(d)
    assert run_progress(tmp_path / "run").shards[0].state == COMPLETE
    (d / m.chunks[1].file).unlink()
    s = run_progress(tmp_path / "run").shards[0]
    assert s.state == DAMAGED and s.chunks == 3
    assert s.error.startswith("1 committed chunk file(s) missing: chunk-000001.safetensors")
    with open(d / m.chunks[2].file, "r+b") as f:
        f.truncate(10)
    s = run_progress(tmp_path / "run").shards[0]
    assert "1 of another size: chunk-000002.safetensors (10 bytes" in s.error
    assert run_progress(tmp_path / "run").totals["damaged"] == 1


def test_run_dir_matches_the_dag_layout(tmp_path):
    assert run_dir({"output_root": "/o", "run_name": ""}, "manual__2026-12-03T01:00:00+00:00") == \
        "/o/manual__2026-12-03T01-00-00-00-00"
    assert run_dir({"output_root": "/o", "run_name": "exp1"}, "x") == "/o/exp1"
    assert human_bytes(999) == "999 B" and human_bytes(1_500_000) == "1.50 MB"


def test_plugin_loads_in_airflow():
    from airflow import plugins_manager

    plugins, errors = plugins_manager._get_plugins()
    assert not errors, errors
    p = next(p for p in plugins if p.name == "eagle3")
    apps, _ = plugins_manager.get_fastapi_plugins()
    assert any(a["url_prefix"] == "/eagle3" for a in apps)
    views, _ = plugins_manager._get_ui_plugins()
    assert {v["url_route"] for v in views} >= {"eagle3-shards", "eagle3-drafter", "eagle3-runs"}
    assert "{RUN_ID}" in p.external_views[0]["href"] and p.external_views[0]["destination"] == "dag_run"
