"""Faults of the deployment with the real services: the metadata DB (PostgreSQL) and the Celery broker (Redis)
restarted while the shard demo runs under CeleryExecutor (issue 29). The run completes, or completes after the
user clears its failed tasks once; either way every shard holds its planned rows exactly once.

The servers are private to this module (tests/service_harness.py), never the machine's shared 5432/6379.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import pytest

from airflow_harness import AirflowCluster, MetadataDB
from service_harness import PrivatePostgres, PrivateRedis
from test_airflow_integration import (ARTIFACTS, DEMO_DAG_ID, DEMO_DAGS, GPU_WORKER_ENV, SHARD_TASK, busy_shards,
                                      shard_manifests, start_demo_run)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RESTART_DOWN_S = 3  # how long each server stays down
# A task sent to a broker that then lost it (a restart without persistence) stays "queued" until the
# scheduler's task_queued_timeout re-queues it (default 600 s); the module's cluster shortens it to fit the test.
QUEUED_TIMEOUT_S = 30
# The scheduler and the dag-processor exit when the metadata DB goes away ("Exception when executing
# SchedulerJob._run_scheduler_loop ... Connection refused"); a deployment runs them under a restart policy
# (docker-compose.yml: restart: unless-stopped), which this module's supervisor thread stands in for.
SUPERVISOR_EVERY_S = 2


@contextmanager
def supervised(af):
    """Restart every exited Airflow process of `af` every SUPERVISOR_EVERY_S; yields the names restarted."""
    revived, stop = [], threading.Event()

    def loop():
        while not stop.wait(SUPERVISOR_EVERY_S):
            revived.extend(af.revive())

    thread = threading.Thread(target=loop, name="airflow-supervisor", daemon=True)
    thread.start()
    try:
        yield revived
    finally:
        stop.set()
        thread.join()


@pytest.fixture(scope="module")
def services_airflow(tmp_path_factory):
    work = tmp_path_factory.mktemp("af-services")
    with PrivatePostgres() as pg, PrivateRedis() as broker:
        db = MetadataDB.create(work / "migrate", port=pg.port)
        cluster = AirflowCluster(db, work, executor="CeleryExecutor", dags_folder=DEMO_DAGS, pools={"gpu": 2},
                                 redis_url=broker.url, redis_db=0,
                                 extra_env={"EAGLE3_SHARD_RETRIES": "2",
                                            "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": str(QUEUED_TIMEOUT_S),
                                            "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT_CHECK_INTERVAL": "5"})
        cluster.pg, cluster.broker = pg, broker
        try:
            with cluster:
                cluster.start_worker("default-worker", queues="default", concurrency=2)
                cluster.start_worker("gpu-worker", queues="gpu", concurrency=2, extra_env=GPU_WORKER_ENV)
                with supervised(cluster) as cluster.revived:
                    yield cluster
        finally:
            (ARTIFACTS / "airflow-services").mkdir(parents=True, exist_ok=True)
            for name in cluster.procs:
                (ARTIFACTS / "airflow-services" / f"{name}.log").write_text(cluster.tail(name, 200_000))
            (ARTIFACTS / "airflow-services" / "postgres.log").write_text(pg.tail(200_000))


def finish_run(af, api, run_id: str, timeout_s: float) -> list[str]:
    """Wait for the run; if it failed, clear its failed tasks once (what a user does) and wait again.
    Returns the task ids cleared (empty when the run completed by itself)."""
    run = api.wait_run(DEMO_DAG_ID, run_id, timeout=timeout_s)
    cleared = []
    if run["state"] == "failed":
        failed = [t for t in api.task_instances(DEMO_DAG_ID, run_id) if t["state"] in ("failed", "upstream_failed")]
        cleared = sorted({f"{t['task_id']}[{t['map_index']}]" for t in failed})
        api.request("POST", f"/api/v2/dags/{DEMO_DAG_ID}/clearTaskInstances", json={
            "dag_run_id": run_id, "only_failed": True, "include_downstream": True, "dry_run": False,
            "reset_dag_runs": True})
        time.sleep(2)
        run = api.wait_run(DEMO_DAG_ID, run_id, timeout=timeout_s)
    assert run["state"] == "success", (cleared, api.task_states(DEMO_DAG_ID, run_id), af.all_logs())
    return cleared


def assert_every_row_once(api, run_id: str, run_dir: Path, shards: int, rows: int) -> None:
    per = rows // shards
    for i, m in shard_manifests(run_dir).items():
        got = [r for c in m["chunks"] for r in range(c["first_row"], c["last_row"] + 1)]
        assert m["complete"] and got == list(range(per * i, per * i + per)), (i, got)
        files = sorted(f.name for f in (run_dir / "extract" / f"shard-{i:05d}").glob("chunk-*.safetensors"))
        assert files == [c["file"] for c in m["chunks"]], (i, files)  # no orphan chunk from a lost attempt
    assert sorted(shard_manifests(run_dir)) == list(range(shards))
    summary = api.xcom(DEMO_DAG_ID, run_id, "verify")
    summary = json.loads(summary) if isinstance(summary, str) else summary
    assert summary["samples"] == rows, summary


def test_metadata_db_restarted_mid_run(services_airflow, tmp_path):
    """PostgreSQL goes down (fast shutdown: every connection of scheduler, api-server, dag-processor and the
    Celery result backend is cut) while shards are writing chunks, and comes back RESTART_DOWN_S later."""
    af = services_airflow
    af.revived.clear()
    api, run_id, run_dir = start_demo_run(af, tmp_path, "pg-restart", shards=2, rows=16)
    busy_shards(af, run_dir, 180)
    af.pg.restart(down_s=RESTART_DOWN_S)
    api = af.client()  # a fresh session: the old one may hold a connection that the api-server dropped

    cleared = finish_run(af, api, run_id, timeout_s=300)
    print("cleared after the DB restart:", cleared, "restarted by the supervisor:", af.revived)
    assert_every_row_once(api, run_id, run_dir, shards=2, rows=16)
    # the Celery workers ride it out by themselves (their tasks talk to the api-server, not the DB)
    assert set(af.revived) <= {"scheduler", "dag-processor", "api-server"}, af.revived


def test_broker_restarted_while_shard_task_queued(services_airflow, tmp_path):
    """With the gpu worker down, the shard tasks are sent to the broker and wait there (state "queued");
    Redis is then restarted without persistence, so the queued messages are gone. The gpu worker comes back:
    the scheduler re-queues what the broker lost (task_queued_timeout) and the run completes."""
    af = services_airflow
    af.revived.clear()
    af.kill_worker("gpu-worker")
    api, run_id, run_dir = start_demo_run(af, tmp_path, "redis-restart", shards=2, rows=16)
    for shard in range(2):
        api.wait_task(DEMO_DAG_ID, run_id, SHARD_TASK, shard, states=("queued",), timeout=180)
    restarted_at = datetime.now(timezone.utc)
    af.broker.restart(down_s=RESTART_DOWN_S)
    af.start_worker("gpu-worker", queues="gpu", concurrency=2, extra_env=GPU_WORKER_ENV)

    cleared = finish_run(af, api, run_id, timeout_s=300)
    print("cleared after the broker restart:", cleared, "restarted by the supervisor:", af.revived)
    assert_every_row_once(api, run_id, run_dir, shards=2, rows=16)
    # the messages were lost with the broker, not delivered late: no shard ran before the restart, each ran once
    # from its start (the scheduler re-sent it after task_queued_timeout)
    for i, m in shard_manifests(run_dir).items():
        attempts = m["params"]["attempts"]
        assert [a["resumed_chunks"] for a in attempts] == [0], (i, attempts)
        assert datetime.fromisoformat(attempts[0]["at"]) > restarted_at, (i, attempts, restarted_at)
    assert not af.revived, af.revived  # a broker restart takes no Airflow process down
