"""Progress of a run's hidden-state extraction, read from the shard manifests on disk.

The manifests are the source of truth (see eagle3.extract.format): a shard is
  complete     - its manifest says complete=true,
  in progress  - it has a manifest (or chunk files) but is not complete,
  not started  - it is planned (a shard folder, or an index below the expected count) with nothing committed,
  damaged      - a committed chunk file is missing or has another size than its manifest records (checked with
                 one stat per chunk, no hashing: cheap enough for a page that refreshes); clearing the shard's task
                 re-extracts what is missing,
  failed       - not complete, and its last attempt failed: last_error.json in its folder (written by the
                 extraction on failure with the error's first line and the try number, removed when an
                 attempt starts), or its Airflow task failed (a killed worker writes nothing).
A rate (tokens/s) is shown only for a shard that is running.
Everything is read defensively: a manifest being replaced, half-written or from an older format
gives a row with an `error` rather than an exception, so the UI page never breaks on a live run.
No Airflow import here: the plugin (plugins/shard_view.py) only renders what this returns.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from eagle3.io import MANIFEST_NAME, atomic_write_json

SHARD_DIR_RE = re.compile(r"^shard-(\d+)$")
COMPLETE, IN_PROGRESS, NOT_STARTED, FAILED, DAMAGED = "complete", "in progress", "not started", "failed", "damaged"
STATES = (COMPLETE, IN_PROGRESS, NOT_STARTED, FAILED, DAMAGED)
FAILURE_NAME = "last_error.json"
# Airflow task states of a shard task whose last try failed (strings: no Airflow import here)
TASK_FAILED_STATES = ("failed", "up_for_retry", "upstream_failed")
TASK_ACTIVE_STATES = ("scheduled", "queued", "running", "restarting", "deferred", "up_for_reschedule")


def record_failure(shard_dir: str | Path, error: BaseException, try_number: int | None) -> None:
    """last_error.json in the shard folder: what the shard view shows for a failed shard."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    atomic_write_json(Path(shard_dir) / FAILURE_NAME, {
        "error": f"{type(error).__name__}: {first}" if first else type(error).__name__,
        "try_number": try_number, "failed_at": datetime.now(timezone.utc).isoformat(timespec="seconds")})


def clear_failure(shard_dir: str | Path) -> None:
    """An attempt starts: the last one's failure record no longer describes the shard."""
    (Path(shard_dir) / FAILURE_NAME).unlink(missing_ok=True)


@dataclass
class ShardStatus:
    shard: int
    path: str
    state: str
    chunks: int = 0
    tokens: int = 0
    samples: int = 0
    bytes_written: int = 0
    tokens_per_s: float | None = None
    started_at: str | None = None
    updated_at: str | None = None
    error: str | None = None
    failed_try: int | None = None  # the Airflow try number that failed (state "failed")


@dataclass
class RunProgress:
    extract_dir: str
    shards: list[ShardStatus]

    @property
    def totals(self) -> dict[str, Any]:
        by_state = {s: sum(1 for x in self.shards if x.state == s) for s in STATES}
        return {
            "shards": len(self.shards),
            **{k.replace(" ", "_"): v for k, v in by_state.items()},
            "chunks": sum(x.chunks for x in self.shards),
            "tokens": sum(x.tokens for x in self.shards),
            "bytes_written": sum(x.bytes_written for x in self.shards),
            "tokens_per_s": sum(x.tokens_per_s or 0.0 for x in self.shards if x.state == IN_PROGRESS),
        }

    def to_dict(self) -> dict:
        return {"extract_dir": self.extract_dir, "totals": self.totals, "shards": [asdict(s) for s in self.shards]}


def find_extract_dir(run_dir: str | Path) -> Path:
    """The folder holding shard-NNNNN folders: `<run>/extract` by the DAG's layout, or the folder itself."""
    run_dir = Path(run_dir)
    if (run_dir / "extract").is_dir():
        return run_dir / "extract"
    return run_dir


def _parse_time(value: Any) -> float | None:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()
    return None


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")


def read_shard(shard: int, shard_dir: Path, task: dict | None = None) -> ShardStatus:
    """One shard's state from its folder (and its Airflow task's {state, try_number} when known); never raises
    for a missing or unreadable manifest."""
    status = _read_manifest(shard, shard_dir)
    failure = _read_failure(shard_dir) if status.state != COMPLETE else None
    task_state = (task or {}).get("state")
    if failure is not None and task_state not in TASK_ACTIVE_STATES:  # active: a new try supersedes the record
        status.state, status.failed_try = FAILED, failure.get("try_number")
        status.error = str(failure.get("error") or "failed")
    elif task_state in TASK_FAILED_STATES and status.state != COMPLETE:
        status.state, status.failed_try = FAILED, (task or {}).get("try_number")
        status.error = f"Airflow task {task_state} (the worker wrote no error: killed?)"
    if status.state != IN_PROGRESS or (task is not None and task_state != "running"):
        status.tokens_per_s = None  # a rate only while it runs: the last attempt's would be stale
    return status


def _read_failure(shard_dir: Path) -> dict | None:
    try:
        d = json.loads((shard_dir / FAILURE_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"error": f"{shard_dir / FAILURE_NAME}: unreadable"}
    return d if isinstance(d, dict) else {"error": f"{shard_dir / FAILURE_NAME}: not an object"}


def _read_manifest(shard: int, shard_dir: Path) -> ShardStatus:
    status = ShardStatus(shard=shard, path=str(shard_dir), state=NOT_STARTED)
    manifest_path = shard_dir / MANIFEST_NAME
    if not manifest_path.is_file():
        # chunk files without a manifest: a first chunk is being written right now
        if shard_dir.is_dir() and any(p.name.startswith(("chunk-", ".chunk-")) for p in shard_dir.iterdir()):
            status.state = IN_PROGRESS
        return status
    try:
        d = json.loads(manifest_path.read_text(encoding="utf-8"))
        chunks = [c for c in d.get("chunks") or [] if isinstance(c, dict)]
        params = d.get("params") if isinstance(d.get("params"), dict) else {}
    except (OSError, ValueError, AttributeError) as e:
        status.state = IN_PROGRESS
        status.error = f"{manifest_path}: unreadable manifest: {e}"
        return status
    status.chunks = len(chunks)
    status.tokens = sum(int(c.get("tokens") or 0) for c in chunks)
    status.samples = sum(int(c.get("samples") or 0) for c in chunks)
    status.bytes_written = sum(int(c.get("bytes") or 0) for c in chunks)
    status.state = COMPLETE if d.get("complete") is True else (IN_PROGRESS if chunks else NOT_STARTED)
    damage = chunk_damage(shard_dir, chunks)
    if damage:
        status.state, status.error = DAMAGED, damage
    started = _parse_time(params.get("started_at"))
    updated = _parse_time(params.get("updated_at"))
    if updated is None and chunks:
        updated = manifest_path.stat().st_mtime  # the manifest is rewritten after every committed chunk
    status.started_at, status.updated_at = _iso(started), _iso(updated)
    rate = params.get("tokens_per_s")
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        status.tokens_per_s = float(rate)
    elif started is not None and updated is not None and updated > started:
        status.tokens_per_s = status.tokens / (updated - started)
    if status.state == NOT_STARTED and started is not None:
        status.state = IN_PROGRESS  # the task has begun (it stamped started_at) but has no chunk yet
    return status


def chunk_damage(shard_dir: Path, chunks: list[dict]) -> str | None:
    """What is wrong with the committed chunk files (missing, or another size than recorded), or None."""
    missing, resized = [], []
    for c in chunks:
        name = str(c.get("file") or "")
        try:
            size = (shard_dir / name).stat().st_size if name else None
        except OSError:
            size = None
        if size is None:
            missing.append(name or "?")
        elif c.get("bytes") is not None and size != int(c["bytes"]):
            resized.append(f"{name} ({size:,} bytes, manifest {int(c['bytes']):,})")
    if not (missing or resized):
        return None
    parts = ([f"{len(missing)} committed chunk file(s) missing: {', '.join(missing[:3])}"
              + (" ..." if len(missing) > 3 else "")] if missing else []) + (
             [f"{len(resized)} of another size: {', '.join(resized[:3])}"] if resized else [])
    return "; ".join(parts) + " (clear the shard's task to re-extract)"


def run_progress(run_dir: str | Path, expected_shards: int | None = None,
                 tasks: dict[int, dict] | None = None) -> RunProgress:
    """Every shard of a run's extraction; `expected_shards` (e.g. the mapped task count) adds the
    planned shards whose folder does not exist yet as "not started"; `tasks` ({map index: {"state",
    "try_number"}}, the shard tasks' Airflow states) marks failed tasks' shards failed and keeps rates to
    running ones."""
    extract_dir = find_extract_dir(run_dir)
    found: dict[int, Path] = {}
    if extract_dir.is_dir():
        for p in extract_dir.iterdir():
            m = SHARD_DIR_RE.match(p.name)
            if m and p.is_dir():
                found[int(m.group(1))] = p
    indices = set(found) | set(range(expected_shards or 0))
    shards = [read_shard(i, found.get(i, extract_dir / f"shard-{i:05d}"), None if tasks is None else tasks.get(i, {}))
              for i in sorted(indices)]
    return RunProgress(extract_dir=str(extract_dir), shards=shards)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"
