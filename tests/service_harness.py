"""Private PostgreSQL and Redis servers for the deployment-fault tests, which restart them mid-run.

The machine's shared servers (5432, 6379) serve other runs and are never restarted; these run on free ports
from a throw-away folder and are stopped at teardown:

    with PrivatePostgres() as pg, PrivateRedis() as rd:
        db = MetadataDB.create(home, port=pg.port)
        AirflowCluster(db, work, executor="CeleryExecutor", redis_url=rd.url, redis_db=0, ...)
        pg.restart(down_s=3)      # fast shutdown (connections cut), a pause, start again on the same port
        rd.restart(down_s=3)      # kill, a pause, a fresh empty server on the same port (nothing persisted)

initdb refuses to run as root: as root the Postgres commands run as the `postgres` user (runuser).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from airflow_harness import PG_HOST, PG_USER, free_port

START_TIMEOUT_S = 30


def _as_postgres(args: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *args] if os.geteuid() == 0 else args


class _Server:
    """A server the test owns: `with` starts it, and closes it (stopped, its files removed) however the test ends."""

    def start(self):
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()


class PrivatePostgres(_Server):
    """A PostgreSQL cluster of its own (trust auth, user `postgres`) in a temp folder, on a free port."""

    def __init__(self):
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="eagle3-pg-"))  # not under pytest's root-only tmp: postgres reads it
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        try:
            self._ctl("-D", str(self.data), "-U", PG_USER, "--auth=trust", "--no-sync", timeout=120, bin_="initdb")
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def _ctl(self, *args: str, timeout: float, bin_: str = "pg_ctl") -> None:
        out = subprocess.run(_as_postgres([bin_, *args]), capture_output=True, text=True, timeout=timeout)
        if out.returncode:
            raise RuntimeError(f"{bin_} {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-2000:]}"
                               f"\n{out.stderr[-2000:]}\n{self.tail()}")

    def _options(self) -> str:
        return f"-p {self.port} -k {self.dir} -c listen_addresses={PG_HOST} -c fsync=off"

    def start(self) -> "PrivatePostgres":
        self._ctl("-D", str(self.data), "-l", str(self.log), "-o", self._options(), "-w", "-t", str(START_TIMEOUT_S),
                  "start", timeout=START_TIMEOUT_S + 10)
        return self

    def stop(self, mode: str = "fast") -> None:
        self._ctl("-D", str(self.data), "-m", mode, "-w", "-t", str(START_TIMEOUT_S), "stop",
                  timeout=START_TIMEOUT_S + 10)

    def restart(self, down_s: float = 3) -> None:
        """A fast shutdown (every client connection is cut, as a DB host reboot or failover does), a pause
        while clients find no server, then the same server back on the same port."""
        self.stop()
        time.sleep(down_s)
        self.start()

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def close(self) -> None:
        if (self.data / "postmaster.pid").exists():
            try:
                self.stop(mode="immediate")
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


class PrivateRedis(_Server):
    """A redis-server child on a free port with no persistence: a restart loses whatever the broker held."""

    def __init__(self):
        self.port = free_port()
        self.url = f"redis://{PG_HOST}:{self.port}"
        self.log = Path(tempfile.mkdtemp(prefix="eagle3-redis-")) / "server.log"
        self.popen: subprocess.Popen | None = None

    def start(self) -> "PrivateRedis":
        import redis

        with open(self.log, "ab") as f:
            self.popen = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", PG_HOST, "--save", "",
                                           "--appendonly", "no", "--daemonize", "no"],
                                          stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if redis.Redis.from_url(self.url, socket_timeout=1).ping():
                    return self
            except redis.RedisError:
                pass
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on {self.port} did not start:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.popen and self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)

    def restart(self, down_s: float = 3) -> None:
        """SIGKILL (as a crashed or rebooted broker host), a pause, a fresh empty server on the same port."""
        self.stop()
        time.sleep(down_s)
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.log.parent, ignore_errors=True)
