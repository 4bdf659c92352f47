"""Airflow 3's REST API (/api/v2) as a test or a user drives it: a token for a user, then trigger, unpause, pools,
watch runs and task instances, clear one map index, read an XCom. Errors raise ApiError with the status and body.

    api = AirflowClient("http://127.0.0.1:8080")  # admin:admin, the harness's user (tests/airflow_harness.py)
    run = api.trigger("eagle3_drafter", conf={...})
    api.wait_run("eagle3_drafter", run["dag_run_id"])
"""

from __future__ import annotations

import time
from typing import Any

import requests

ADMIN = ("admin", "admin")


class ApiError(RuntimeError):
    def __init__(self, response: requests.Response):
        self.status_code, self.body = response.status_code, response.text
        super().__init__(f"{response.request.method} {response.url} -> {response.status_code}: "
                         f"{response.text[:2000]}")


class AirflowClient:
    """The few REST calls a user (or a test) needs: token, trigger, unpause, watch, clear one map index."""

    def __init__(self, base_url: str, user: str = ADMIN[0], password: str = ADMIN[1]):
        self.base_url = base_url.rstrip("/")
        self.session = requests.Session()
        r = self.session.post(f"{self.base_url}/auth/token", json={"username": user, "password": password}, timeout=30)
        if not r.ok:
            raise ApiError(r)
        self.token = r.json()["access_token"]
        self.session.headers["Authorization"] = f"Bearer {self.token}"

    def request(self, method: str, path: str, **kw) -> Any:
        r = self.session.request(method, f"{self.base_url}{path}", timeout=30, **kw)
        if not r.ok:
            raise ApiError(r)
        return r.json() if r.content else None

    def get(self, path: str, **params) -> Any:
        return self.request("GET", path, params=params or None)

    def wait_dag(self, dag_id: str, timeout: float = 90) -> dict:
        """Wait until the dag-processor has parsed `dag_id` (a new DAG is unknown for a few seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.get(f"/api/v2/dags/{dag_id}")
            except ApiError as e:
                if e.status_code != 404 or time.monotonic() > deadline:
                    raise
            time.sleep(1)

    def unpause(self, dag_id: str) -> dict:
        return self.request("PATCH", f"/api/v2/dags/{dag_id}", json={"is_paused": False})

    def set_pool(self, name: str, slots: int) -> dict:
        try:
            return self.request("PATCH", f"/api/v2/pools/{name}",
                                json={"name": name, "slots": slots, "include_deferred": False})
        except ApiError as e:
            if e.status_code != 404:
                raise
        return self.request("POST", "/api/v2/pools", json={"name": name, "slots": slots, "include_deferred": False})

    def trigger(self, dag_id: str, conf: dict | None = None, run_id: str | None = None) -> dict:
        body: dict[str, Any] = {"logical_date": None, "conf": conf or {}}
        if run_id:
            body["dag_run_id"] = run_id
        return self.request("POST", f"/api/v2/dags/{dag_id}/dagRuns", json=body)

    def run(self, dag_id: str, run_id: str) -> dict:
        return self.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")

    def wait_run(self, dag_id: str, run_id: str, states=("success", "failed"), timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            run = self.run(dag_id, run_id)
            if run["state"] in states:
                return run
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id} still {run['state']} after {timeout}s: "
                                   f"{self.task_states(dag_id, run_id)}")
            time.sleep(1)

    def task_instances(self, dag_id: str, run_id: str) -> list[dict]:
        """Every task instance of the run, mapped ones one row per map_index (state, try_number, hostname,
        queue, pool, start_date, end_date, ...)."""
        out, offset = [], 0
        while True:
            page = self.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances", limit=100, offset=offset)
            out += page["task_instances"]
            offset += len(page["task_instances"])
            if not page["task_instances"] or offset >= page["total_entries"]:
                return out

    def task_states(self, dag_id: str, run_id: str) -> dict[tuple[str, int], str | None]:
        return {(t["task_id"], t["map_index"]): t["state"] for t in self.task_instances(dag_id, run_id)}

    def wait_task(self, dag_id: str, run_id: str, task_id: str, map_index: int, states, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            tis = [t for t in self.task_instances(dag_id, run_id)
                   if (t["task_id"], t["map_index"]) == (task_id, map_index)]
            if tis and tis[0]["state"] in states:
                return tis[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{task_id}[{map_index}] not in {states} after {timeout}s: "
                                   f"{self.task_states(dag_id, run_id)}")
            time.sleep(1)

    def clear_map_index(self, dag_id: str, run_id: str, task_id: str, map_index: int,
                        include_downstream: bool = True) -> dict:
        """Re-run ONE mapped task instance (one shard) and what depends on it; nothing else re-runs."""
        return self.request("POST", f"/api/v2/dags/{dag_id}/clearTaskInstances", json={
            "dag_run_id": run_id, "task_ids": [[task_id, map_index]], "include_downstream": include_downstream,
            "only_failed": False, "dry_run": False, "reset_dag_runs": True,
        })

    def xcom(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1, key: str = "return_value") -> Any:
        return self.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}",
                        map_index=map_index)["value"]
