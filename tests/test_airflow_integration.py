"""The DAG as users run it, against a real Airflow (Postgres metadata DB; LocalExecutor, then Celery + Redis).

Until the real extraction tasks are wired into dags/eagle3_drafter.py these tests drive
tests/dags/eagle3_shard_demo.py, which has the same shape (mapped shards on queue/pool "gpu",
chunk-level resume, a downstream reader). To point them at the real DAG, set EAGLE3_IT_DAGS_FOLDER,
EAGLE3_IT_DAG_ID and EAGLE3_IT_CONF (JSON) - see docs/operations.md.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path

import pytest

from airflow_harness import AirflowCluster, ApiError, MetadataDB

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
DAGS = Path(os.environ.get("EAGLE3_IT_DAGS_FOLDER", ROOT / "tests" / "dags"))
DAG_ID = os.environ.get("EAGLE3_IT_DAG_ID", "eagle3_shard_demo")
EXTRA_CONF = json.loads(os.environ.get("EAGLE3_IT_CONF", "{}"))
SHARD_TASK = os.environ.get("EAGLE3_IT_SHARD_TASK", "extract")
ARTIFACTS = Path(os.environ.get("EAGLE3_TEST_ARTIFACTS", ROOT / "artifacts" / "tests"))


def when(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def shard_manifests(run_dir: Path) -> dict[int, dict]:
    return {int(p.name.split("-")[1]): json.loads((p / "manifest.json").read_text())
            for p in sorted((run_dir / "extract").glob("shard-*"))}


@pytest.fixture(scope="session")
def metadata_db(tmp_path_factory):
    db = MetadataDB.create(tmp_path_factory.mktemp("airflow-migrate"))
    yield db
    db.drop()


@pytest.fixture(scope="module")
def local_airflow(metadata_db, tmp_path_factory):
    work = tmp_path_factory.mktemp("af-local")
    fault_once = work / "fault-fired"
    cluster = AirflowCluster(metadata_db, work, executor="LocalExecutor", dags_folder=DAGS, pools={"gpu": 2},
                             extra_env={"EAGLE3_INJECT_FAULT": f"shard=1,after_chunks=2,once_file={fault_once}",
                                        "EAGLE3_SHARD_RETRIES": "0"})
    with cluster:
        cluster.fault_once = fault_once
        yield cluster
    for name in cluster.procs:
        (ARTIFACTS / "airflow-local").mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "airflow-local" / f"{name}.log").write_text(cluster.tail(name, 200_000))


def test_bad_param_is_rejected_at_trigger_time(local_airflow):
    api = local_airflow.client()
    api.wait_dag(DAG_ID)
    with pytest.raises(ApiError) as e:
        api.trigger(DAG_ID, conf={**EXTRA_CONF, "shards": 0})
    assert e.value.status_code == 400
    assert "0 is less than the minimum of 1" in e.value.body
    with pytest.raises(ApiError, match="does not match"):
        api.trigger(DAG_ID, conf={**EXTRA_CONF, "run_name": "../escape"})


def test_failed_shard_is_cleared_alone_and_resumes(local_airflow, tmp_path):
    api = local_airflow.client()
    api.wait_dag(DAG_ID)
    api.unpause(DAG_ID)
    conf = {**EXTRA_CONF, "output_root": str(tmp_path), "run_name": "local", "shards": 3, "rows": 18,
            "samples_per_chunk": 2, "chunk_seconds": 0.2}
    run_id = api.trigger(DAG_ID, conf=conf)["dag_run_id"]

    # shard 1 fails after 2 committed chunks (this cluster runs shards without retries, so it stays failed)
    failed = api.wait_task(DAG_ID, run_id, SHARD_TASK, 1, states=("failed",), timeout=120)
    assert failed["try_number"] == 1 and local_airflow.fault_once.exists()
    run = api.wait_run(DAG_ID, run_id, states=("failed",), timeout=120)
    states = api.task_states(DAG_ID, run_id)
    assert states[(SHARD_TASK, 0)] == states[(SHARD_TASK, 2)] == "success"
    assert states[("verify", -1)] == "upstream_failed"
    m = shard_manifests(tmp_path / "local")[1]
    assert len(m["chunks"]) == 2 and not m["complete"]

    api.clear_map_index(DAG_ID, run_id, SHARD_TASK, 1)
    run = api.wait_run(DAG_ID, run_id, timeout=150)
    assert run["state"] == "success", local_airflow.all_logs()

    tis = {(t["task_id"], t["map_index"]): t for t in api.task_instances(DAG_ID, run_id)}
    assert all(t["state"] == "success" for t in tis.values())
    # the other shards did not re-run; shard 1 ran again and resumed after its 2 committed chunks
    assert tis[(SHARD_TASK, 0)]["try_number"] == tis[(SHARD_TASK, 2)]["try_number"] == 1
    manifests = shard_manifests(tmp_path / "local")
    assert [len(m["params"]["attempts"]) for m in manifests.values()] == [1, len(manifests[1]["params"]["attempts"]), 1]
    assert manifests[1]["params"]["attempts"][-1]["resumed_chunks"] == 2
    assert all(m["complete"] for m in manifests.values())
    summary = api.xcom(DAG_ID, run_id, "verify")
    summary = json.loads(summary) if isinstance(summary, str) else summary
    assert summary["samples"] == 18 and summary["shards"] == 3
