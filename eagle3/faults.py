"""Fault injection for drills and tests: make one extraction shard fail after k committed chunks.

    EAGLE3_INJECT_FAULT="shard=<i>,after_chunks=<k>,once_file=<path>"

A shard task calls `maybe_inject_fault(shard, committed_chunks)` after each committed chunk (and before
the first). Shard i raises InjectedFault once it has k committed chunks, unless `once_file` exists; it
creates `once_file` first, so the fault fires once and the re-run (retry or a user's clear) succeeds.
Unset variable = no-op.

    EAGLE3_INJECT_FAULT="shard=<i>,after_chunks=<k>,once_file=<path>,rank=<r>"

For a tensor-parallel shard (eagle3.extract.tp): instead of raising, rank 0 SIGKILLs rank r's process once k
chunks are committed (a rank dying mid-shard); rank 0 learns the ranks' pids through `set_rank_pids`.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from eagle3.errors import ConfigError, PipelineError

ENV_VAR = "EAGLE3_INJECT_FAULT"


class InjectedFault(PipelineError):
    """Raised on purpose by EAGLE3_INJECT_FAULT."""


@dataclass(frozen=True)
class FaultSpec:
    shard: int
    after_chunks: int
    once_file: Path
    rank: int | None = None


_RANK_PIDS: list[int] = []


def set_rank_pids(pids: list[int]) -> None:
    """The pids of a tensor-parallel shard's ranks (index = rank), for the `rank=` fault."""
    _RANK_PIDS[:] = pids


def parse_fault(spec: str) -> FaultSpec:
    try:
        fields = dict(kv.strip().split("=", 1) for kv in spec.split(",") if kv.strip())
        rank = int(fields["rank"]) if "rank" in fields else None
        return FaultSpec(int(fields["shard"]), int(fields["after_chunks"]), Path(fields["once_file"]), rank)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{ENV_VAR}={spec!r}: expected 'shard=<i>,after_chunks=<k>,once_file=<path>' ({e})") from e


def maybe_inject_fault(shard: int, committed_chunks: int, env: dict[str, str] | None = None) -> None:
    spec = (os.environ if env is None else env).get(ENV_VAR)
    if not spec:
        return
    fault = parse_fault(spec)
    if fault.shard != shard or committed_chunks < fault.after_chunks or fault.once_file.exists():
        return
    if fault.rank is not None and fault.rank >= len(_RANK_PIDS):
        return  # not a tensor-parallel run (or no such rank): nothing to kill
    fault.once_file.parent.mkdir(parents=True, exist_ok=True)
    fault.once_file.touch()
    if fault.rank is not None:
        os.kill(_RANK_PIDS[fault.rank], signal.SIGKILL)
        return
    raise InjectedFault(f"injected fault ({ENV_VAR}): shard {shard} after {committed_chunks} committed chunks")


# -- training ranks ------------------------------------------------------------------------------
# EAGLE3_KILL_RANK="rank=<r>,after_steps=<k>,once_file=<path>": the training rank r SIGKILLs itself right after
# optimizer step k (before that step's checkpoint), once (once_file, as above): a rank dying mid-run.
KILL_RANK_VAR = "EAGLE3_KILL_RANK"


def maybe_kill_rank(rank: int, step: int, env: dict[str, str] | None = None) -> None:
    spec = (os.environ if env is None else env).get(KILL_RANK_VAR)
    if not spec:
        return
    try:
        fields = dict(kv.strip().split("=", 1) for kv in spec.split(",") if kv.strip())
        victim, after, once = int(fields["rank"]), int(fields["after_steps"]), Path(fields["once_file"])
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{KILL_RANK_VAR}={spec!r}: expected 'rank=<r>,after_steps=<k>,once_file=<path>' ({e})") from e
    if rank != victim or step != after or once.exists():
        return
    once.parent.mkdir(parents=True, exist_ok=True)
    once.touch()
    os.kill(os.getpid(), signal.SIGKILL)
