"""Atomic file writes, checksums and manifests shared by every phase.

Every phase writes to a temporary name in the destination folder and renames it into
place (rename is atomic on one filesystem), then records what is complete in a manifest
written last. A reader therefore never sees a half file under a final name.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from eagle3.errors import ConfigError, PipelineError

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


class DiskFullError(PipelineError):
    """No space left (or quota exceeded) while writing a file; the message names the file and the free space.
    Not retried: space must be freed first (then clear the task: it resumes)."""

    retried = False
    kind = "a full disk"


def disk_full_error(path: str | os.PathLike, e: OSError) -> DiskFullError:
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free if where.exists() else 0
    return DiskFullError(f"disk full writing {path}: {e.strerror} ({free / 1e9:.2f} GB free on the filesystem of "
                         f"{where}); free space or point the run at another folder, then re-run: what is committed "
                         f"is kept")


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


@contextmanager
def names_disk_full(path: str | os.PathLike) -> Iterator[None]:
    """A full disk inside the block (os, open, pyarrow: all raise OSError with errno 28/122) raises
    DiskFullError naming `path`; other errors pass unchanged."""
    try:
        yield
    except OSError as e:
        if is_disk_full(e):
            raise disk_full_error(path, e) from e
        raise


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def output_file(path: str | os.PathLike) -> Path:
    """Where an output named `path` is written: a symlink's target (the link stays a link, as with `>`), else
    `path`. Something there that is not a regular file (a directory, a device such as /dev/full, a FIFO, a
    socket) is refused: the rename that makes a write atomic would replace it with a regular file."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return path
    if not stat.S_ISREG(mode):
        raise ConfigError(f"output {path} is a {_kind(mode)}, not a regular file: refusing to replace it; give the "
                          f"path of a file (a new one, or one to overwrite)")
    return path


@contextmanager
def atomic_path(path: str | os.PathLike, fsync: bool = True) -> Iterator[Path]:
    """Yield a temp path to write; on success it is fsynced and renamed to `path` (to a symlink's target; what
    is not a regular file is refused: output_file).

    On an exception the temp file is removed and `path` is left as it was; a full disk raises DiskFullError
    naming `path`.
    """
    path = output_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(path)
    try:
        with names_disk_full(path):
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


def not_a_file(path: Path) -> str:
    """Why an input file that must be a regular file is not one, for a message: "<path> " + this."""
    if path.is_dir():
        return "is a directory, not a file"
    if path.exists():
        return "is not a regular file"
    return "does not exist"


class BadJSONLine(ValueError):
    """A JSONL line that is not JSON: malformed, not UTF-8, or nested deeper than the parser follows."""


def json_line(raw: bytes | str):
    """The value of one JSONL line, or BadJSONLine saying why not (the caller adds file:line).

    Bytes must be UTF-8 (a BOM is allowed). Thousands of nested brackets make Python's parser raise
    RecursionError, which is no bad-line error of its own: it is one here like any other malformed line.
    """
    try:
        text = raw.decode("utf-8-sig") if isinstance(raw, (bytes, bytearray)) else raw
        return json.loads(text)
    except UnicodeDecodeError as e:
        raise BadJSONLine(f"not UTF-8 text: byte {e.start} of the line ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise BadJSONLine(f"invalid JSON: {e}") from None
    except RecursionError:
        raise BadJSONLine("invalid JSON: nested deeper than the parser follows (thousands of brackets)") from None


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


class PhaseOutput:
    """A phase's output folder and the record that vouches for it: the one "fingerprint, skip if complete,
    write to temp, commit" rule every phase follows.

        out = PhaseOutput(folder, fingerprint(params))
        if (done := out.completed()) is not None:
            return done                      # complete with these params: skip
        out.invalidate()                     # stale or other params: it must not vouch for what follows
        ... write every file with atomic_path / atomic_write_json ...
        out.commit({"rows": n, ...})         # written last: the record says complete + fingerprint

    `verify(record)` may check the files against the record (checksums) before a skip is allowed.
    """

    def __init__(self, folder: str | os.PathLike, fingerprint: str, record: str = MANIFEST_NAME):
        self.folder = Path(folder)
        self.fingerprint = fingerprint
        self.path = self.folder / record

    def read(self) -> dict | None:
        try:
            return read_json(self.path) if self.path.is_file() else None
        except ValueError:
            return None  # a record that does not parse vouches for nothing

    def completed(self, verify: Callable[[dict], bool] | None = None) -> dict | None:
        rec = self.read()
        if rec is None or not rec.get("complete") or rec.get("fingerprint") != self.fingerprint:
            return None
        return rec if verify is None or verify(rec) else None

    def invalidate(self) -> None:
        self.path.unlink(missing_ok=True)

    def commit(self, record: dict) -> dict:
        rec = {**record, "complete": True, "fingerprint": self.fingerprint}
        atomic_write_json(self.path, rec)
        return rec
