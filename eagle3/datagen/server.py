"""A local inference server that lives exactly as long as the task that started it.

The command is a template: `{model_path}`, `{port}`, `{host}`, `{gguf}` are filled in per token
(paths with spaces stay one argument), then the user's extra flags are appended. The server runs
in its own process group with its output logged line by line. It is stopped on every exit path:
`stop()` in a finally (SIGTERM to the group, SIGKILL after a grace period), and, for a task that
is itself SIGKILLed (no finally runs), the kernel's parent-death signal (prctl PR_SET_PDEATHSIG)
kills the server's main process. Note: PDEATHSIG fires when the THREAD that started the server
exits, so start it from the thread that lives for the whole task (Airflow's execute() does).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.datagen.redact import redact, redacting_logger
from eagle3.errors import ConfigError, PipelineError
from eagle3.procs import die_with_parent

log = redacting_logger(__name__)

DEFAULT_SERVER_COMMAND = "python -m sglang.launch_server --model-path {model_path} --host {host} --port {port}"
READY_PATHS = ("/v1/models", "/health")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def build_command(template: str, extra_args: list[str] | str | None = None, **values) -> list[str]:
    argv = []
    for tok in shlex.split(template):
        try:
            argv.append(tok.format(**values))
        except KeyError as e:
            raise ConfigError(f"server_command: unknown placeholder {{{e.args[0]}}} in {template!r}; "
                              f"known: {sorted('{' + k + '}' for k in values)}") from None
    if isinstance(extra_args, str):
        extra_args = shlex.split(extra_args)
    return argv + [str(a).format(**values) for a in (extra_args or [])]


@dataclass
class LocalServer:
    command: str = DEFAULT_SERVER_COMMAND
    extra_args: list[str] | str | None = None
    model_path: str = ""
    gguf: str = ""
    host: str = "127.0.0.1"
    port: int | None = None
    ready_timeout_s: float = 900.0
    stop_timeout_s: float = 20.0
    env: dict | None = None
    log_file: str | None = None  # the server's output goes here (appended), else into this process's log
    proc: subprocess.Popen | None = field(default=None, init=False)
    tail: deque = field(default_factory=lambda: deque(maxlen=50), init=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> "LocalServer":
        if self.port is None:
            self.port = free_port(self.host)
        argv = build_command(self.command, self.extra_args, model_path=self.model_path, gguf=self.gguf,
                             host=self.host, port=self.port)
        log.info("starting local server: %s", shlex.join(argv))
        env = {**os.environ, **(self.env or {}), "PYTHONUNBUFFERED": "1"}
        try:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True, preexec_fn=die_with_parent)
        except OSError as e:
            raise PipelineError(f"server_command {argv[0]!r} could not start: {e}") from e
        log.info("local server pid %d (process group %d) on port %d", self.proc.pid, self.proc.pid, self.port)
        if self.log_file:
            Path(self.log_file).parent.mkdir(parents=True, exist_ok=True)
            log.info("the server's output goes to %s (its last lines are shown here if it fails)", self.log_file)
        threading.Thread(target=self._pump_output, name="server-log", daemon=True).start()
        return self

    def _pump_output(self) -> None:
        # keep reading, or a chatty server blocks on a full pipe
        out = open(self.log_file, "a", encoding="utf-8") if self.log_file else None
        try:
            for raw in iter(self.proc.stdout.readline, b""):
                line = redact(raw.decode(errors="replace").rstrip())  # servers print their args, an API key too
                self.tail.append(line)
                if out is None:
                    log.info("[server] %s", line)
                else:
                    out.write(line + "\n")
                    out.flush()
        finally:
            if out is not None:
                out.close()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the log pump drain the last lines
                raise PipelineError(f"local server exited with code {self.proc.returncode} before it was ready; "
                                    f"last output:\n" + "\n".join(self.tail))
            for path in READY_PATHS:
                try:
                    with urllib.request.urlopen(f"http://{self.host}:{self.port}{path}", timeout=2) as r:
                        if r.status == 200:
                            log.info("local server ready (%s answered 200)", path)
                            return
                except (urllib.error.URLError, OSError):
                    pass
            time.sleep(0.5)
        self.stop()
        raise PipelineError(f"local server not ready after {self.ready_timeout_s:.0f}s; last output:\n" + "\n".join(self.tail))

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None and not _group_alive(self.proc.pid):
            return
        pgid = self.proc.pid
        log.info("stopping local server (process group %d)", pgid)
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("local server ignored SIGTERM for %.0fs: SIGKILL", self.stop_timeout_s)
        # children of the server (workers, schedulers) may outlive its main process: kill the group
        _signal_group(pgid, signal.SIGKILL)
        self.proc.wait(10)
        log.info("local server stopped (exit code %s)", self.proc.returncode)

    def __enter__(self) -> "LocalServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
