"""Atomic file writes, checksums and manifests shared by every phase.

Every phase writes to a temporary name in the destination folder and renames it into
place (rename is atomic on one filesystem), then records what is complete in a manifest
written last. A reader therefore never sees a half file under a final name.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any, Iterator
from contextlib import contextmanager

MANIFEST_NAME = "manifest.json"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path_for(path: Path) -> Path:
    """A unique hidden temp name beside `path` (same filesystem, so rename is atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


@contextmanager
def atomic_path(path: str | os.PathLike, fsync: bool = True) -> Iterator[Path]:
    """Yield a temp path to write; on success it is fsynced and renamed to `path`.

    On an exception the temp file is removed and `path` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(path)
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if fsync:
            _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_bytes(path: str | os.PathLike, data: bytes, fsync: bool = True) -> None:
    with atomic_path(path, fsync=fsync) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


def atomic_write_json(path: str | os.PathLike, obj: Any, fsync: bool = True) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode(), fsync=fsync)


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from e


def sha256_file(path: str | os.PathLike, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(obj: Any) -> str:
    """Stable hash of JSON-able params: a manifest records it so a re-run with other params is not skipped."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def remove_stale_temps(folder: str | os.PathLike) -> int:
    """Delete temp files a killed writer left behind (names from `temp_path_for`)."""
    n = 0
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    for p in folder.iterdir():
        if p.name.startswith(".") and ".tmp-" in p.name and p.is_file():
            p.unlink(missing_ok=True)
            n += 1
    return n
