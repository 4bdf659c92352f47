"""Can this Airflow run the DAG's tasks at all? Pools that exist, Celery queues that a worker listens on.

A task on a pool that does not exist (or has fewer slots than the task takes) stays "scheduled" forever, and
one on a Celery queue no worker listens on stays "queued": both silently, with an empty log. Preflight runs
`deployment_problems(dag)` first, so the run fails in seconds with the reason and the fix instead.

Task code cannot read the metadata DB in Airflow 3 (the ORM is blocked in task processes), so the pools come
from the REST API (`GET /api/v2/pools`) through the Connection `eagle3_airflow_api` (eagle3_airflow.hooks.
AirflowApiHook: host = the API's base URL, login, password; scripts/airflow.sh and the compose stack set it).
Without that Connection the pool check is skipped with a warning. The queues come from the Celery workers
themselves (`inspect().active_queues()`), only under the CeleryExecutor (other executors ignore queues).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import requests

log = logging.getLogger(__name__)


def task_needs(tasks: Iterable[Any]) -> tuple[dict[str, dict[str, int]], dict[str, list[str]]]:
    """({pool: {task_id: slots}}, {queue: [task_id, ...]}) of the DAG's tasks."""
    pools: dict[str, dict[str, int]] = {}
    queues: dict[str, list[str]] = {}
    for t in tasks:
        pools.setdefault(t.pool, {})[t.task_id] = int(getattr(t, "pool_slots", 1) or 1)
        queues.setdefault(t.queue, []).append(t.task_id)
    return pools, queues


def pool_problems(needed: dict[str, dict[str, int]], slots: dict[str, int]) -> list[str]:
    """Why tasks would wait forever, given {pool: its slots} as Airflow has them."""
    out = []
    for pool, tasks in sorted(needed.items()):
        if pool not in slots:
            out.append(f"pool {pool!r} does not exist, so task(s) {sorted(tasks)} would stay 'scheduled' forever: "
                       f"create it with `airflow pools set {pool} <slots> \"one slot per GPU\"` (one slot per GPU; "
                       f"scripts/airflow.sh does it) or in the UI under Admin > Pools")
            continue
        short = {t: n for t, n in tasks.items() if n > slots[pool] >= 0}
        if short:
            out.append(f"pool {pool!r} has {slots[pool]} slot(s) but task(s) {sorted(short)} need "
                       f"{max(short.values())}: they would never start; raise its slots (Admin > Pools)")
    return out


def queue_problems(needed: dict[str, list[str]], active: dict[str, list[dict]]) -> list[str]:
    """Queues no Celery worker listens on, given `inspect().active_queues()` ({worker: [{"name": q}, ...]})."""
    listening = {q["name"] for qs in active.values() for q in qs}
    workers = {w: sorted(q["name"] for q in qs) for w, qs in sorted(active.items())}
    return [f"Celery queue {queue!r}, which task(s) {sorted(tasks)} go to, has no worker listening (workers now: "
            f"{workers or 'none answered'}), so they would stay 'queued': start one with "
            f"`airflow celery worker --queues {queue}` (a GPU host for the gpu queue)"
            for queue, tasks in sorted(needed.items()) if queue not in listening]


def pool_slots_from_api(conn_id: str | None = None, timeout_s: float = 15.0) -> dict[str, int] | None:
    """{pool: slots} through the REST API (AirflowApiHook); None (and a warning) when unavailable."""
    from airflow.sdk.exceptions import AirflowNotFoundException

    from eagle3_airflow.hooks import AirflowApiHook

    hook = AirflowApiHook(conn_id or AirflowApiHook.default_conn_name, timeout_s=timeout_s)
    try:
        slots, offset = {}, 0
        while True:
            body = hook.get_json("/api/v2/pools", limit=100, offset=offset)
            slots.update({p["name"]: p["slots"] for p in body["pools"]})
            offset += len(body["pools"])
            if not body["pools"] or offset >= body["total_entries"]:
                return slots
    except AirflowNotFoundException:
        log.warning("pool check skipped: no Connection %r (type airflow_api: host = the API's base URL, login, "
                    "password)", hook.conn_id)
    except (requests.RequestException, KeyError, ValueError) as e:
        log.warning("pool check skipped: the REST API at %s did not answer as expected (%s)", hook.base_url,
                    f"{type(e).__name__}: {e}"[:300])
    return None


def active_celery_queues(timeout_s: float = 5.0) -> dict[str, list[dict]] | None:
    """`inspect().active_queues()` under the CeleryExecutor; None under any other executor."""
    from airflow.sdk.configuration import conf

    if "CeleryExecutor" not in conf.get("core", "executor", fallback=""):
        return None
    from airflow.providers.celery.executors.celery_executor_utils import app

    return app.control.inspect(timeout=timeout_s).active_queues() or {}


def deployment_problems(tasks: Iterable[Any]) -> list[str]:
    """Every reason a task of `tasks` could never start here (empty = none found)."""
    pools, queues = task_needs(tasks)
    problems = []
    slots = pool_slots_from_api()
    if slots is not None:
        problems += pool_problems(pools, slots)
        log.info("pools: %s", {p: slots.get(p) for p in sorted(pools)})
    active = active_celery_queues()
    if active is not None:
        problems += queue_problems(queues, active)
        log.info("Celery queues needed: %s; workers: %s", sorted(queues),
                 {w: [q["name"] for q in qs] for w, qs in active.items()})
    return problems


RUN_NOTE_PREFIX = "eagle3 run "


def name_the_run(dag_id: str, run_id: str, name: str, folder: str, conn_id: str | None = None) -> str | None:
    """Set the run's note (what the run page shows beside its id) to the run's name and folder, through the REST
    API (AirflowApiHook), unless someone wrote another note; what it set, or None (and a warning) when it could not.
    """
    from urllib.parse import quote

    from airflow.sdk.exceptions import AirflowNotFoundException

    from eagle3_airflow.hooks import AirflowApiHook

    hook = AirflowApiHook(conn_id or AirflowApiHook.default_conn_name)
    path = f"/api/v2/dags/{quote(dag_id, safe='')}/dagRuns/{quote(run_id, safe='')}"
    note = f"{RUN_NOTE_PREFIX}{name}\nfolder: {folder}"
    try:
        current = hook.get_json(path).get("note") or ""
        if current and not current.startswith(RUN_NOTE_PREFIX):
            return None  # a person's note stays
        hook.patch_json(path, {"note": note}, update_mask="note")
        return note
    except AirflowNotFoundException:
        log.warning("run note not set: no Connection %r (type airflow_api)", hook.conn_id)
    except (requests.RequestException, KeyError, ValueError) as e:
        log.warning("run note not set: the REST API at %s did not answer as expected (%s)", hook.base_url,
                    f"{type(e).__name__}: {e}"[:300])
    return None
