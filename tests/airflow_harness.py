"""A real Airflow for tests: api-server, scheduler, dag-processor (+ Celery workers) as subprocesses.

    db = MetadataDB.create(tmp)                   # fresh Postgres database on 127.0.0.1:5432, migrated once
    with AirflowCluster(db.clone(), tmp, executor="CeleryExecutor", dags_folder=ROOT / "dags") as af:
        af.start_worker("gpu", queues="gpu", concurrency=2)
        api = af.client()                         # tests/airflow_client.py, logged in as admin:admin
        run = api.trigger("eagle3_drafter", conf={...})
        api.wait_run("eagle3_drafter", run["dag_run_id"])
    db.drop()

Every process leads its own session, which holds everything it forks, task processes included (Airflow
gives each task a process group of its own, so the harness kills by session, group by group): a test can
SIGKILL "the machine" of one Celery worker with its running tasks, and stop() kills every session and checks
/proc that nothing is left. Point it at another DAG folder with `dags_folder` (the real dags/ is the default).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import requests

from airflow_client import ADMIN, AirflowClient

ROOT = Path(__file__).resolve().parents[1]
PG_HOST, PG_PORT, PG_USER = "127.0.0.1", 5432, "postgres"
REDIS_URL = "redis://127.0.0.1:6379"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def airflow_bin() -> str:
    return str(Path(sys.executable).with_name("airflow"))


def _psql(sql: str, db: str = "postgres", port: int = PG_PORT) -> None:
    import psycopg

    with psycopg.connect(host=PG_HOST, port=port, user=PG_USER, dbname=db, autocommit=True) as conn:
        conn.execute(sql)


@dataclass
class MetadataDB:
    """One throw-away Postgres database for a test session; `airflow db migrate` runs once on it."""

    name: str
    home: Path
    port: int = PG_PORT  # another Postgres server than the shared one: tests/service_harness.py

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://{PG_USER}@{PG_HOST}:{self.port}/{self.name}"

    @classmethod
    def create(cls, home: Path, port: int = PG_PORT) -> "MetadataDB":
        db = cls(name=f"eagle3_test_{uuid.uuid4().hex[:10]}", home=Path(home), port=port)
        _psql(f'CREATE DATABASE "{db.name}"', port=port)
        env = base_env(db.home, db.url)
        out = subprocess.run([airflow_bin(), "db", "migrate"], env=env, capture_output=True, text=True, timeout=300)
        if out.returncode:
            db.drop()
            raise RuntimeError(f"airflow db migrate failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return db

    def clone(self) -> "MetadataDB":
        """A fresh copy of this migrated database (Postgres TEMPLATE copy, ~1 s instead of a migrate):
        each cluster of a session gets its own, so DAG versions and runs of one never leak into another."""
        db = MetadataDB(name=f"{self.name}_{uuid.uuid4().hex[:6]}", home=self.home, port=self.port)
        _psql(f'CREATE DATABASE "{db.name}" TEMPLATE "{self.name}"', port=self.port)
        return db

    def drop(self) -> None:
        _psql(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)', port=self.port)


def base_env(home: Path, db_url: str) -> dict[str, str]:
    """The environment every Airflow process of one cluster shares."""
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db_url,
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
        "PYTHONPATH": f"{ROOT}{os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else ''}",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    })
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None

    @property
    def pgid(self) -> int:
        return self.popen.pid  # started as its own session and group leader (see _spawn)

    @property
    def sid(self) -> int:
        return self.popen.pid


class AirflowCluster:
    def __init__(self, db: MetadataDB, workdir: Path, executor: str = "LocalExecutor",
                 dags_folder: Path = ROOT / "dags", plugins_folder: Path = ROOT / "plugins",
                 redis_db: int | None = None, triggerer: bool = False, extra_env: dict[str, str] | None = None,
                 pools: dict[str, int] | None = None, redis_url: str = REDIS_URL):
        self.db, self.workdir, self.executor = db, Path(workdir), executor
        self.home = self.workdir / "airflow-home"
        self.logs = self.workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.triggerer = triggerer
        self.pools = pools or {}
        self.groups: dict[str, int] = {}  # process name -> its session id (= its pid)
        self.procs: dict[str, Proc] = {}
        self.env = base_env(self.home, db.url)
        self.env.update({
            "AIRFLOW__CORE__EXECUTOR": executor,
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(plugins_folder),
            "AIRFLOW__CORE__PARALLELISM": "16",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base_url}/execution/",
            "AIRFLOW__CORE__HOSTNAME_CALLABLE": "eagle3_airflow.worker.worker_hostname",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN[0]}:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.home / "passwords.json"),
            "AIRFLOW__API__BASE_URL": self.base_url,
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(16),
            "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),  # other Airflows may hold 8793
            # fast reaction: the tests wait on state changes
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "20",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "3",
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "30",
            "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "2",
        })
        if executor == "CeleryExecutor":
            rdb = redis_db if redis_db is not None else _empty_redis_db(redis_url)
            self.env.update({
                "AIRFLOW__CELERY__BROKER_URL": f"{redis_url}/{rdb}",
                "AIRFLOW__CELERY__RESULT_BACKEND": f"db+{db.url.replace('+psycopg2', '')}",
                "AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS": "eagle3_airflow.celery_config.CELERY_CONFIG",
                "AIRFLOW__CELERY__WORKER_CONCURRENCY": "2",
                "AIRFLOW__CELERY__OPERATION_TIMEOUT": "10",
            })
            self.redis_db = rdb
        self.env.update(extra_env or {})
        (self.home / "passwords.json").write_text(json.dumps({ADMIN[0]: ADMIN[1]}))

    # -- processes ------------------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        # Each process leads its own session: everything it forks (uvicorn workers, executor workers,
        # task supervisors and the tasks in their own process groups) stays in that session.
        log = self.logs / f"{name}.log"
        with open(log, "ab") as f:
            popen = subprocess.Popen([airflow_bin(), *args], env=env or self.env, stdout=f, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=self.workdir, start_new_session=True)
        self.groups[name] = popen.pid
        proc = Proc(name, popen, log, args, env)
        self.procs[name] = proc
        return proc

    def start(self, timeout: float = 150) -> "AirflowCluster":
        self._spawn("api-server", ["api-server", "--port", str(self.port), "--workers", "1"])
        self._spawn("scheduler", ["scheduler"])
        self._spawn("dag-processor", ["dag-processor"])
        if self.triggerer:
            self._spawn("triggerer", ["triggerer"])
        self.wait_healthy(timeout)
        api = self.client()
        for pool, slots in self.pools.items():
            api.set_pool(pool, slots)
        return self

    def start_worker(self, name: str, queues: str, concurrency: int = 2,
                     extra_env: dict[str, str] | None = None) -> Proc:
        """A Celery worker in its own session (kill_worker() takes it down like a lost machine)."""
        env = dict(self.env, EAGLE3_WORKER_NAME=name, **(extra_env or {}))
        env["AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT"] = str(free_port())
        return self._spawn(name, ["celery", "worker", "-q", queues, "-c", str(concurrency),
                                  "-H", f"{name}@%h", "--without-mingle", "--without-gossip"], env=env)

    def kill_worker(self, name: str) -> None:
        """SIGKILL the worker and every process of its session: Celery children, task supervisors and the
        task processes (Airflow puts each task in a process group of its own, so a group kill would miss
        them), as when the worker's machine dies."""
        sid = self.groups.pop(name)
        _kill_session(sid, signal.SIGKILL)
        self.procs[name].popen.wait(timeout=10)
        left = _wait_session_gone(sid, 10)
        assert not left, f"{name}: processes survived SIGKILL: {left}"

    def revive(self) -> list[str]:
        """Start again every owned process that has exited, with its own arguments, as a supervisor's restart
        policy does (compose: `restart: unless-stopped`); returns their names."""
        dead = [p for n, p in self.procs.items() if n in self.groups and p.popen.poll() is not None]
        for p in dead:
            _wait_session_gone(self.groups[p.name], 10)
            self._spawn(p.name, p.args, p.env)
        return [p.name for p in dead]

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            for p in self.procs.values():
                if p.popen.poll() is not None:
                    raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{self.tail(p.name)}")
            try:
                r = requests.get(f"{self.base_url}/api/v2/monitor/health", timeout=3)
                last = r.json()
                if r.ok and last.get("scheduler", {}).get("status") == "healthy" and \
                        last.get("dag_processor", {}).get("status") == "healthy":
                    return
            except (requests.RequestException, ValueError):
                pass
            time.sleep(1)
        raise TimeoutError(f"Airflow not healthy after {timeout}s (last: {last})\n{self.tail('api-server')}")

    def tail(self, name: str, chars: int = 4000) -> str:
        try:
            return self.procs[name].log.read_text(errors="replace")[-chars:]
        except (KeyError, OSError):
            return ""

    def all_logs(self, chars: int = 3000) -> str:
        return "\n".join(f"===== {n} =====\n{self.tail(n, chars)}" for n in self.procs)

    def client(self) -> AirflowClient:
        return AirflowClient(self.base_url)

    def stop(self) -> None:
        """SIGTERM every owned session's leader group, SIGKILL all that is left of the sessions after a grace
        period (tasks included), then verify through /proc that no process of any session survives."""
        sessions = list(self.groups.values())
        for sid in sessions:
            _killpg(sid, signal.SIGTERM)
        deadline = time.monotonic() + 6  # a grace period for clean shutdowns, then SIGKILL
        while time.monotonic() < deadline and any(_session_members(s) for s in sessions):
            time.sleep(0.3)
        for sid in sessions:
            _kill_session(sid, signal.SIGKILL)
        for p in self.procs.values():
            try:
                p.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        left = {sid: m for sid in sessions if (m := _wait_session_gone(sid, 10))}
        self.groups.clear()
        if left:
            raise RuntimeError(f"processes left after stop: {left}")

    def __enter__(self) -> "AirflowCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def _empty_redis_db(redis_url: str = REDIS_URL) -> int:
    """A Redis database number nobody uses now (dbsize 0), so two test sessions never share a broker."""
    import random

    import redis

    for n in random.sample(range(1, 16), 15):
        if redis.Redis.from_url(f"{redis_url}/{n}").dbsize() == 0:
            return n
    raise RuntimeError(f"no empty Redis database on {redis_url}")


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _session_members(sid: int) -> dict[int, int]:
    """{pid: pgid} of the live processes of session `sid` (from /proc; zombies are already dead)."""
    members = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            members[int(stat.parent.name)] = int(fields[2])
    return members


def _kill_session(sid: int, sig: int) -> None:
    for pgid in set(_session_members(sid).values()):
        _killpg(pgid, sig)


def _wait_session_gone(sid: int, timeout: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    while (left := _session_members(sid)) and time.monotonic() < deadline:
        _kill_session(sid, signal.SIGKILL)
        time.sleep(0.2)
    return left
