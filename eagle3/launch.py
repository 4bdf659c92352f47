"""Run one function in N ranks on torch.distributed.elastic, bounded in time when a rank dies or hangs.

    results = run_distributed("eagle3.extract.tp:extract_shard_rank", (cfg,), nprocs=3, backend="gloo",
                              timeout_s=300)

Each rank is a spawned child (torch.distributed.elastic.multiprocessing.start_processes) that
- asks the kernel to SIGKILL it when the launching thread's process dies (eagle3.procs: a SIGKILLed Airflow task
  leaves no rank behind);
- sees the task's GPUs (CUDA_VISIBLE_DEVICES unchanged) and uses cuda:LOCAL_RANK, the device transformers'
  tp_plan binds to (one GPU per rank);
- joins the default process group (env:// rendezvous on a free local port) with `timeout_s` as its collective
  timeout, runs fn(*args) and returns its value.
The parent polls the ranks: when one fails, the others get SIGTERM, then SIGKILL after `grace_s`, and the parent
raises RankFailed with the failed rank's error (the first lines of its traceback, from the elastic error file).
A rank that hangs outside a collective makes the others' next collective time out after `timeout_s`, which fails
them; each such rank says so (a file in the run's status folder) and the ranks that did not are named as the ones
that stopped answering. The run fails timeout_s + PEER_LOST_SETTLE_S + at most grace_s after the hang (plus the
ranks' start-up); `deadline_s` bounds the whole run besides.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
from datetime import timedelta

from eagle3.errors import ConfigError, PipelineError

BACKENDS = ("gloo", "nccl")
STATUS_DIR_VAR = "EAGLE3_RANK_STATUS_DIR"
PEER_LOST_SETTLE_S = 2.0  # ranks waiting in one collective time out within this of each other
# errors a rank raises because ANOTHER rank went away: reported only when no rank has a better cause
_PEER_LOST = ("DistBackendError", "Connection closed by peer", "Connection reset by peer", "ProcessGroupGloo",
              "Broken pipe", "NCCL communicator was aborted", "Timed out waiting", "timed out", "Socket Timeout")


class RankFailed(PipelineError):
    """A rank of run_distributed failed; `rank` is the one whose error explains the failure."""

    def __init__(self, rank: int, error: str, failures: dict[int, str]):
        self.rank, self.error, self.failures = rank, error, failures
        others = sorted(r for r in failures if r != rank)
        also = f" (ranks {others} failed after it)" if others else ""
        super().__init__(f"rank {rank} of the distributed run failed{also}: {error}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def visible_gpus() -> int:
    """GPUs this process may use (CUDA_VISIBLE_DEVICES honoured), without creating a CUDA context."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus(nprocs: int, param: str) -> None:
    """nccl needs one GPU per rank: a clear error before anything starts."""
    gpus = visible_gpus()
    if nprocs > gpus:
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f"CUDA_VISIBLE_DEVICES={cvd!r}" if cvd is not None else "CUDA_VISIBLE_DEVICES unset"
        raise ConfigError(f"{param}={nprocs} needs {nprocs} GPUs, but this worker sees {gpus} ({seen}); lower "
                          f"{param} or give the task more GPUs (docs/operations.md: the gpu pool and worker pinning)")


def backend_for(device, nprocs: int, param: str) -> str:
    """nccl on GPUs (one visible GPU per rank: a clear error naming `param` first), gloo on the CPU."""
    if not str(device).startswith("cuda"):
        return "gloo"
    check_gpus(nprocs, param)
    return "nccl"


def resolve(fn_path: str):
    module, _, name = fn_path.partition(":")
    if not module or not name:
        raise ConfigError(f"fn_path must be 'package.module:function', got {fn_path!r}")
    return getattr(importlib.import_module(module), name)


def _rank_main(fn_path: str, pickled_args: bytes, backend: str, timeout_s: float, parent_pid: int, threads: int,
               name: str = "eagle3"):
    """The body of one rank (in the spawned child). The arguments come pickled and are unpickled here, inside
    elastic's error recording: unpickled by the spawn bootstrap, a failure (a class that does not import in the
    child) left no error file and the parent saw only "To enable traceback see ...", not the rank's error."""
    from eagle3.procs import die_with_parent_now

    die_with_parent_now(parent_pid)
    # a spawned rank starts with no logging set up: its INFO lines (progress, ETA, "resumed from ...") go to the
    # stdout it shares with the task, which Airflow's task log records as INFO (stderr would read as ERROR)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                        format=f"[{name} rank {os.environ.get('RANK', '?')}] %(levelname)s %(name)s: %(message)s")
    args = pickle.loads(pickled_args)
    import torch
    import torch.distributed as dist

    if threads:
        torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    try:
        return resolve(fn_path)(*args)
    except Exception as e:
        if any(s in f"{type(e).__name__}: {e}" for s in _PEER_LOST):
            # say so, then give the other waiting ranks the time to fail the same way and say so too: the launcher
            # stops every rank at the first exit, and the ranks that said nothing are the ones that stopped answering
            open(os.path.join(os.environ[STATUS_DIR_VAR], f"rank-{dist.get_rank()}.lost-peer"), "w").close()
            time.sleep(PEER_LOST_SETTLE_S)
        raise
    finally:
        dist.destroy_process_group()


def _first_lines(text: str, n: int = 12) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return "\n".join(lines[:n] + (["..."] if len(lines) > n else []))


def _failure_text(failure) -> str:
    data = failure.error_file_data or {}
    msg = data.get("message") if isinstance(data, dict) else None
    if isinstance(msg, dict):  # elastic's error file: {"message": ..., "extraInfo": {"py_callstack": ...}}
        tb = (msg.get("extraInfo") or {}).get("py_callstack") or ""
        text = f"{msg.get('message', '')}\n{_last_frames(tb)}".strip()
    elif failure.signal_name() not in ("", "<N/A>", None) and failure.exitcode < 0:
        text = f"killed by {failure.signal_name()} (exit code {failure.exitcode})"
    else:  # no error file: the rank died before its body ran (its traceback went to the task log's stderr)
        text = (f"exit code {failure.exitcode} before the rank's code ran (no error recorded; its traceback, if any, "
                f"is in the task log above)")
    return _first_lines(text)


def _other_errors(ctx, known: dict[int, str]) -> dict[int, str]:
    """Errors the other ranks wrote before they were stopped (elastic's per-rank error files)."""
    from torch.distributed.elastic.multiprocessing.api import ProcessFailure

    out = {}
    for r, path in ctx.error_files.items():
        if r not in known and os.path.isfile(path) and os.path.getsize(path):
            out[r] = _failure_text(ProcessFailure(local_rank=r, pid=0, exitcode=1, error_file=path))
    return out


def _last_frames(tb: str, n: int = 8) -> str:
    lines = [ln for ln in tb.strip().splitlines() if ln.strip()]
    return "\n".join(lines[-n:])


def _root_cause(failures: dict[int, str]) -> int:
    """The rank whose error explains the run: a rank killed by a signal or with its own error beats one that only
    lost its peers; among equals the lowest rank."""
    def lost_peer(text: str) -> bool:
        return any(s in text for s in _PEER_LOST)
    killed = [r for r, t in failures.items() if t.startswith("killed by")]
    own = [r for r, t in failures.items() if not lost_peer(t)]
    return min(killed or own or failures)


def _stopped_answering(failures: dict[int, str], status_dir: str, nprocs: int) -> list[int]:
    """The ranks the others were waiting for: when every failed rank only lost its peers (a collective timed out,
    a connection closed), the ranks that did not say so (`<status_dir>/rank-<r>.lost-peer`) nor failed otherwise
    never reached the collective: they stopped answering (a hang). Empty when any rank has an error of its own."""
    if not failures or any(not any(s in t for s in _PEER_LOST) for t in failures.values()):
        return []
    said = {r for r in range(nprocs) if os.path.exists(os.path.join(status_dir, f"rank-{r}.lost-peer"))}
    return [r for r in range(nprocs) if r not in said and r not in failures]


def run_distributed(fn_path: str, args: tuple = (), nprocs: int = 2, backend: str = "gloo",
                    timeout_s: float = 600.0, grace_s: float = 10.0, deadline_s: float | None = None,
                    threads_per_rank: int | None = None, env: dict[str, str] | None = None,
                    name: str = "eagle3") -> list:
    """Run fn_path ('package.module:function') as fn(*args) in `nprocs` ranks; returns the ranks' return values
    (index = rank). Raises RankFailed (a rank failed, died or the deadline passed) after every rank is gone."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if nprocs < 1:
        raise ConfigError(f"nprocs must be >= 1, got {nprocs}")
    if backend == "nccl":
        check_gpus(nprocs, "nprocs")
    resolve(fn_path)  # a typo fails here, not in N children
    if threads_per_rank is None and backend == "gloo":  # N ranks on the CPU share its cores
        threads_per_rank = max(1, (os.cpu_count() or 1) // nprocs)
    port, parent = free_port(), os.getpid()
    call = (fn_path, pickle.dumps(tuple(args)), backend, float(timeout_s), parent, int(threads_per_rank or 0), name)
    with tempfile.TemporaryDirectory(prefix=f"{name}-ranks-") as logs:
        common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nprocs),
                  "LOCAL_WORLD_SIZE": str(nprocs), STATUS_DIR_VAR: logs, **(env or {})}
        envs = {r: {**common, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(nprocs)}
        ctx = start_processes(name=name, entrypoint=_rank_main, args={r: call for r in range(nprocs)}, envs=envs,
                              logs_specs=DefaultLogsSpecs(log_dir=logs), start_method="spawn")
        end = None if deadline_s is None else time.monotonic() + deadline_s
        try:
            while True:
                result = ctx.wait(timeout=0.5, period=0.1)
                if result is not None:
                    break
                if end is not None and time.monotonic() > end:
                    raise RankFailed(0, f"the run passed its deadline of {deadline_s:g} s (ranks killed)",
                                     {r: "deadline" for r in range(nprocs)})
        finally:
            ctx.close(death_sig=signal.SIGTERM, timeout=int(max(1, grace_s)))
        if result.is_failed():
            failures = {r: _failure_text(f) for r, f in result.failures.items()}
            failures.update(_other_errors(ctx, failures))
            hung = _stopped_answering(failures, logs, nprocs)
    if result.is_failed() and hung:
        waited = sorted(r for r in failures if r not in hung)
        for r in hung:
            failures[r] = (f"stopped answering: ranks {waited} waited {timeout_s:g} s for it in a collective "
                           f"(the collective timeout: dist_timeout_s in training, rank_timeout_s in extraction and evaluation) and failed; it was then stopped")
        raise RankFailed(hung[0], failures[hung[0]], failures)
    if result.is_failed():
        rank = _root_cause(failures)
        raise RankFailed(rank, failures[rank], failures)
    return [result.return_values[r] for r in range(nprocs)]
