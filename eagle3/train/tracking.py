"""Training metrics for the tools users watch runs with: TensorBoard event files, and MLflow when a tracking
URI is set (the Airflow operator reads it from a Connection: eagle3_airflow.hooks.MLflowTrackingHook).

metrics.jsonl stays the phase's own record (plots, report.json); these follow it step by step. A resumed
run continues them: a session-start marker at the resumed step makes TensorBoard drop the steps a killed
attempt logged after its last checkpoint, and MLflow goes on in the same run (its id in mlflow_run.json),
where a step logged again is a newer point. A fresh start (no checkpoint) removes an earlier attempt's event files, as it removes
metrics.jsonl.
"""

from __future__ import annotations

import logging
import shutil
import struct
import time
from pathlib import Path
from typing import Any

from eagle3.errors import ConfigError, PipelineError
from eagle3.io import atomic_write_json, read_json

TB_DIR = "tensorboard"
MLFLOW_RUN_FILE = "mlflow_run.json"

log = logging.getLogger(__name__)


def scalars(rec: dict) -> dict[str, float]:
    """The scalars of one metrics.jsonl record, by TensorBoard/MLflow name."""
    out = {"train/loss": rec["loss"], "train/lr": rec["lr"], "train/grad_norm": rec["grad_norm"],
           "train/tokens_per_s": rec["tokens_per_s"]}
    for k, (loss, acc) in enumerate(zip(rec["loss_k"], rec["acc_k"])):
        out[f"ttt_loss/step{k}"], out[f"ttt_acc/step{k}"] = loss, acc
    return {k: float(v) for k, v in out.items()}


class MetricsTracker:
    """TensorBoard event files under <output_dir>/tensorboard, plus an MLflow run when `mlflow_uri` is set."""

    def __init__(self, output_dir: str | Path, resume_step: int, *, mlflow_uri: str = "",
                 mlflow_experiment: str = "eagle3", run_name: str = "", params: dict | None = None):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        out = Path(output_dir)
        self.tb_dir = out / TB_DIR
        if resume_step == 0:
            shutil.rmtree(self.tb_dir, ignore_errors=True)
        self.tb_dir.mkdir(parents=True, exist_ok=True)
        # Written synchronously (SummaryWriter queues events for a thread): a step is on disk before its
        # checkpoint, as its metrics.jsonl line is. The suffix keeps two attempts' files apart when they start
        # within one second (same time stamp in the name).
        self.tb = EventsWriter(str(self.tb_dir / "events"), f".from-step-{resume_step:09d}")
        if resume_step:  # TensorBoard (and read_scalars) drop the killed attempt's steps after the checkpoint
            self.tb.write_event(Event(wall_time=time.time(), step=resume_step + 1,
                                      session_log=SessionLog(status=SessionLog.START)))
        self.tb.flush()
        self.mlflow = MLflowRun(out / MLFLOW_RUN_FILE, mlflow_uri, mlflow_experiment, run_name or out.parent.name,
                                params or {}, resume=resume_step > 0) if mlflow_uri else None

    def log(self, rec: dict) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        values = scalars(rec)
        self.tb.write_event(Event(wall_time=time.time(), step=rec["step"], summary=Summary(
            value=[Summary.Value(tag=name, simple_value=value) for name, value in values.items()])))
        self.tb.flush()  # a live view: TensorBoard reads what is on disk
        if self.mlflow is not None:
            self.mlflow.log(values, rec["step"])

    def close(self, ok: bool) -> None:
        self.tb.close()
        if self.mlflow is not None:
            self.mlflow.close(ok)

    def __enter__(self) -> "MetricsTracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)


class MLflowRun:
    """One MLflow run per training folder, through MlflowClient (no process-global active run)."""

    def __init__(self, record: Path, uri: str, experiment: str, run_name: str, params: dict, resume: bool):
        try:
            from mlflow import MlflowClient
        except ImportError as e:
            raise ConfigError(f"an MLflow tracking URI is set ({uri}) but mlflow is not installed: "
                              "pip install 'eagle3-pipeline[mlflow]'") from e
        self.uri, self.client, self.failed = uri, MlflowClient(tracking_uri=uri), False
        try:
            known = read_json(record) if resume and record.is_file() else {}
            if known.get("tracking_uri") == uri and known.get("run_id"):  # a resumed run: the same MLflow run
                self.run_id = known["run_id"]
                self.client.update_run(self.run_id, status="RUNNING")
                log.info("MLflow: continuing run %s at %s", self.run_id, uri)
                return
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment)
            self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            self._log_params(params)
        except Exception as e:  # an unreachable server: training is retried, not run without its tracking
            raise PipelineError(f"MLflow at {uri}: {type(e).__name__}: {e}") from e
        atomic_write_json(record, {"tracking_uri": uri, "run_id": self.run_id, "experiment": experiment})
        log.info("MLflow: run %s in experiment %r at %s", self.run_id, experiment, uri)

    def _log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log(self, values: dict[str, float], step: int) -> None:
        if self.failed:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        try:
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])
        except Exception as e:  # noqa: BLE001 - a tracking outage mid-run must not end hours of training
            self.failed = True
            log.warning("MLflow at %s: %s: %s; metrics go on to metrics.jsonl and TensorBoard only",
                        self.uri, type(e).__name__, e)

    def close(self, ok: bool) -> None:
        try:
            self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")
        except Exception as e:  # noqa: BLE001
            log.warning("MLflow at %s: could not close run %s: %s", self.uri, self.run_id, e)


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from the event files of `log_dir`, in file order, applying purge markers
    (a session start at step P drops the earlier files' points at steps >= P) as TensorBoard does."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    out: dict[str, list[tuple[int, float]]] = {}
    files = Path(log_dir).glob("events.out.tfevents.*")
    for path in sorted(files, key=lambda p: (int(p.name.split(".")[3]), p.name)):  # by start second, then step
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (n,) = struct.unpack_from("<Q", data, pos)
            ev = Event.FromString(data[pos + 12:pos + 12 + n])  # length, its crc, the record, its crc
            pos += 12 + n + 4
            if ev.HasField("session_log") and ev.session_log.status == SessionLog.START:
                out = {t: [p for p in pts if p[0] < ev.step] for t, pts in out.items()}
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append((ev.step, float(v.simple_value)))
    return out


def tracking_params(cfg: Any) -> dict:
    """The config as MLflow params (the shard list is long and in report.json)."""
    from dataclasses import asdict

    return {k: v for k, v in asdict(cfg).items() if k not in ("shard_dirs", "mlflow_tracking_uri")}
