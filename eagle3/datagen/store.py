"""Append-only JSONL of finished samples, and the resume scan over it.

One writer appends one complete line per finished sample with a single write() and flushes it,
so a SIGKILL can only cut the LAST line short. Every line starts with `{"sample_id": "<id>"`,
so the resume scan reads ids by slicing bytes instead of parsing every (possibly large) answer.
A truncated last line is cut off (the sample is simply generated again); a corrupt line in the
middle (not produced by this writer, but possible after a crash of the filesystem) is dropped
by rewriting the file atomically. The file stays the single source of truth for what is done.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.io import atomic_path, names_disk_full

log = logging.getLogger(__name__)

ID_PREFIX = b'{"sample_id": "'


@dataclass
class ScanResult:
    done_ids: set[str] = field(default_factory=set)
    lines: int = 0
    duplicates: int = 0
    truncated_bytes: int = 0  # bytes of a cut last line removed
    corrupt_lines: list[int] = field(default_factory=list)  # 1-based line numbers dropped


def _line_id(line: bytes) -> str | None:
    """The sample id of one complete line, or None when the line is not valid JSON with an id."""
    if line.startswith(ID_PREFIX):
        end = line.find(b'"', len(ID_PREFIX))
        # the fast path trusts the prefix only for a line that also ends like a JSON object
        if end > 0 and line.rstrip().endswith(b"}"):
            return line[len(ID_PREFIX):end].decode()
    try:
        obj = json.loads(line)
        sid = obj.get("sample_id") if isinstance(obj, dict) else None
        return sid if isinstance(sid, str) else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def _fast_id(buf, start: int, nl: int) -> str | None:
    """The id of buf[start:nl] without copying the line (lines are KBs; 100K of them must scan in ~1 s)."""
    if buf[start:start + len(ID_PREFIX)] != ID_PREFIX or buf[nl - 1] != 0x7D:  # "}" closes a whole object
        return None
    end = buf.find(b'"', start + len(ID_PREFIX), nl)
    return buf[start + len(ID_PREFIX):end].decode() if end > 0 else None


def scan_and_repair(path: str | Path) -> ScanResult:
    """Ids already done in `path`; repairs a cut last line (truncate) and drops corrupt lines."""
    path = Path(path)
    res = ScanResult()
    if not path.exists():
        return res
    size = path.stat().st_size
    good_end = 0  # byte offset just past the last complete line
    if size:
        # mmap: the lines are searched in place, never copied (the file can be GBs)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            start, line_no = 0, 0
            while (nl := buf.find(b"\n", start)) >= 0:
                line_no += 1
                sid = _fast_id(buf, start, nl)
                if sid is None and nl > start:  # slow path: copy the line only when it is unusual
                    line = buf[start:nl]
                    sid = _line_id(line) if line.strip() else ""
                    if sid is None:
                        res.corrupt_lines.append(line_no)
                if sid:
                    if sid in res.done_ids:
                        res.duplicates += 1
                    else:
                        res.done_ids.add(sid)
                        res.lines += 1
                start = nl + 1
            good_end = start
    if good_end < size:
        # the writer died mid-line: that sample was never "done"; cut it so appends start clean
        res.truncated_bytes = size - good_end
        with open(path, "rb+") as f:
            f.truncate(good_end)
            os.fsync(f.fileno())
        log.warning("%s: removed a truncated last line (%d bytes) left by a killed writer", path, res.truncated_bytes)
    if res.corrupt_lines or res.duplicates:
        _rewrite_clean(path)
        log.warning("%s: dropped %d corrupt line(s) %s and %d duplicate(s)", path, len(res.corrupt_lines),
                    res.corrupt_lines[:10], res.duplicates)
    return res


def repair_tail(path: str | Path) -> int:
    """Cut a partial last line (no trailing newline) off an append-only file; returns the bytes removed."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return 0
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        pos, tail = size, b""
        while pos > 0 and b"\n" not in tail:
            step = min(65536, pos)
            pos -= step
            f.seek(pos)
            tail = f.read(step) + tail
        keep = pos + tail.rfind(b"\n") + 1 if b"\n" in tail else 0
        if keep < size:
            f.truncate(keep)
            os.fsync(f.fileno())
        return size - keep


def _rewrite_clean(path: Path) -> None:
    seen = set()
    with atomic_path(path) as tmp, open(path, "rb") as src, open(tmp, "wb") as dst:
        for line in src:
            sid = _line_id(line.rstrip(b"\n")) if line.strip() else None
            if sid is not None and sid not in seen:
                seen.add(sid)
                dst.write(line if line.endswith(b"\n") else line + b"\n")


def iter_records(path: str | Path):
    """Parsed records of a scanned (repaired) file, first occurrence of each id."""
    seen = set()
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec["sample_id"] not in seen:
                seen.add(rec["sample_id"])
                yield rec


class AppendWriter:
    """Appends one JSON line per record; flushed to the OS per record, fsynced every `fsync_every_s`."""

    def __init__(self, path: str | Path, fsync_every_s: float = 5.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._fsync_every_s = fsync_every_s
        self._last_sync = time.monotonic()

    def write(self, record: dict) -> None:
        assert next(iter(record)) == "sample_id", "sample_id must be the first key (resume scan relies on it)"
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        with names_disk_full(self.path):
            # one write() per line on an O_APPEND fd: a kill (or a full disk) leaves at most the last line
            # partial, which the resume scan cuts
            n = os.write(self._fd, data)
            while n < len(data):  # short writes are rare but legal
                n += os.write(self._fd, data[n:])
            now = time.monotonic()
            if now - self._last_sync >= self._fsync_every_s:
                os.fsync(self._fd)
                self._last_sync = now

    def close(self) -> None:
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        try:
            with names_disk_full(self.path):
                os.fsync(fd)
        finally:
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
