"""Preflight's deployment check as pure functions: a pool that does not exist or is too small, a Celery queue no
worker listens on; each message names the pool/queue, the tasks and the fix. The pools as read through the
Airflow API Connection's hook, against a stand-in API server. (The check against a real Airflow:
tests/test_airflow_first_hour.py::test_missing_pool_fails_preflight_with_the_reason.)"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from eagle3_airflow.deployment import pool_problems, pool_slots_from_api, queue_problems, task_needs
from eagle3_airflow.hooks import AirflowApiHook


@dataclass
class Task:
    task_id: str
    pool: str = "default_pool"
    queue: str = "default"
    pool_slots: int = 1


def test_needs_group_tasks_by_pool_and_queue():
    pools, queues = task_needs([Task("merge"), Task("extract", "gpu", "gpu"), Task("train", "gpu", "gpu", 2)])
    assert pools == {"default_pool": {"merge": 1}, "gpu": {"extract": 1, "train": 2}}
    assert queues == {"default": ["merge"], "gpu": ["extract", "train"]}


def test_missing_and_small_pools():
    needed = {"default_pool": {"merge": 1}, "gpu": {"extract": 1, "train": 2}}
    assert pool_problems(needed, {"default_pool": 128, "gpu": 2}) == []
    [missing] = pool_problems(needed, {"default_pool": 128})
    assert "pool 'gpu' does not exist" in missing and "['extract', 'train']" in missing
    assert "airflow pools set gpu" in missing
    [small] = pool_problems(needed, {"default_pool": 128, "gpu": 1})
    assert "pool 'gpu' has 1 slot(s) but task(s) ['train'] need 2" in small


def test_queue_without_a_worker():
    needed = {"default": ["merge"], "gpu": ["extract"]}
    assert queue_problems(needed, {"w1": [{"name": "default"}], "w2": [{"name": "gpu"}]}) == []
    [p] = queue_problems(needed, {"w1": [{"name": "default"}]})
    assert "Celery queue 'gpu'" in p and "['extract']" in p and "{'w1': ['default']}" in p
    assert "airflow celery worker --queues gpu" in p
    assert len(queue_problems(needed, {})) == 2  # no worker answered at all


POOLS = {"default_pool": 128, "gpu": 8, "cpu": 4}
NOTES: dict[str, str] = {}  # a run's note by its API path


class FakeApi(BaseHTTPRequestHandler):
    """Airflow's /auth/token (login admin / pw) and /api/v2/pools, two pools a page whatever the limit asked."""

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        login = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if login == {"username": "admin", "password": "pw"}:
            self._send(201, {"access_token": "tok"})
        else:
            self._send(401, {"detail": "Invalid credentials"})

    def do_GET(self):
        if self.headers.get("Authorization") != "Bearer tok":
            return self._send(401, {"detail": "Not authenticated"})
        url = urlsplit(self.path)
        if url.path == "/api/v2/version":
            return self._send(200, {"version": "3.3.2"})
        if url.path.startswith("/api/v2/dags/"):
            return self._send(200, {"note": NOTES.get(unquote(url.path))})
        offset = int(parse_qs(url.query)["offset"][0])
        names = sorted(POOLS)[offset:offset + 2]
        self._send(200, {"pools": [{"name": n, "slots": POOLS[n]} for n in names], "total_entries": len(POOLS)})

    def do_PATCH(self):
        if self.headers.get("Authorization") != "Bearer tok":
            return self._send(401, {"detail": "Not authenticated"})
        url = urlsplit(self.path)
        assert parse_qs(url.query)["update_mask"] == ["note"]
        NOTES[unquote(url.path)] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["note"]
        self._send(200, {"note": NOTES[unquote(url.path)]})

    def log_message(self, *args):
        pass


@pytest.fixture
def api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_pools_through_the_api_connection(api, monkeypatch, caplog):
    def conn(**c):
        monkeypatch.setenv("AIRFLOW_CONN_EAGLE3_AIRFLOW_API", json.dumps({"conn_type": "airflow_api", **c}))

    monkeypatch.delenv("AIRFLOW_CONN_EAGLE3_AIRFLOW_API", raising=False)
    assert pool_slots_from_api() is None and "no Connection 'eagle3_airflow_api'" in caplog.text
    conn(host="127.0.0.1", port=api, login="admin", password="pw")  # host + port: http://127.0.0.1:<port>
    assert pool_slots_from_api() == POOLS  # two pages
    ok, message = AirflowApiHook().test_connection()
    assert ok and message == f"http://127.0.0.1:{api} answered: Airflow 3.3.2"
    conn(host=f"http://127.0.0.1:{api}/", login="admin", password="wrong")  # a full URL
    assert pool_slots_from_api() is None
    assert f"the REST API at http://127.0.0.1:{api} did not answer as expected (HTTPError: 401" in caplog.text
    ok, message = AirflowApiHook().test_connection()
    assert not ok and message.startswith("HTTPError: 401"), message


def test_preflight_names_the_run_in_its_note_and_keeps_a_persons_note(api, monkeypatch, caplog):
    from eagle3_airflow.deployment import name_the_run

    monkeypatch.setenv("AIRFLOW_CONN_EAGLE3_AIRFLOW_API", json.dumps(
        {"conn_type": "airflow_api", "host": f"http://127.0.0.1:{api}", "login": "admin", "password": "pw"}))
    run_id = "manual__2026-12-04T21:38:51+00:00"
    note = name_the_run("eagle3_drafter", run_id, "exp1", "/runs/exp1")
    assert note == "eagle3 run exp1\nfolder: /runs/exp1"
    assert NOTES["/api/v2/dags/eagle3_drafter/dagRuns/manual__2026-12-04T21:38:51+00:00"] == note
    assert name_the_run("eagle3_drafter", run_id, "exp2", "/runs/exp2").startswith("eagle3 run exp2")  # ours: renamed
    NOTES["/api/v2/dags/eagle3_drafter/dagRuns/manual__2026-12-04T21:38:51+00:00"] = "a person's note"
    assert name_the_run("eagle3_drafter", run_id, "exp3", "/runs/exp3") is None
    assert NOTES["/api/v2/dags/eagle3_drafter/dagRuns/manual__2026-12-04T21:38:51+00:00"] == "a person's note"
    monkeypatch.delenv("AIRFLOW_CONN_EAGLE3_AIRFLOW_API")
    assert name_the_run("eagle3_drafter", run_id, "x", "/x") is None and "run note not set" in caplog.text
