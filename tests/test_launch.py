"""eagle3.launch: N gloo ranks on torch.distributed.elastic; a rank that dies, raises or hangs takes the run down
within bounded time, with its error, and leaves no process behind."""

import os
import time
from pathlib import Path

import pytest

from eagle3.errors import ConfigError
from eagle3.launch import RankFailed, run_distributed


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purpose, but run_distributed reaps its children: none should be left at all
    return True


def rank_pids(d: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(d.glob("rank*.pid"))]


def test_all_reduce_in_three_ranks():
    out = run_distributed("tests.launch_ranks:all_reduce_rank", (2.0,), nprocs=3, backend="gloo", timeout_s=60)
    assert [o["rank"] for o in out] == [0, 1, 2] and [o["local_rank"] for o in out] == [0, 1, 2]
    assert all(o["world"] == 3 and o["sum"] == 2.0 * (1 + 2 + 3) for o in out)
    assert len({o["pid"] for o in out}) == 3 and os.getpid() not in {o["pid"] for o in out}
    assert not any(alive(o["pid"]) for o in out)


@pytest.mark.parametrize("how,expect", [("kill", "killed by SIGKILL"), ("raise", "rank 1 broke at step 3"),
                                        ("hang", "stopped answering: ranks [0] waited 8 s for it")])
def test_failed_rank_takes_the_run_down(tmp_path, how, expect):
    timeout_s = 8
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_distributed("tests.launch_ranks:victim_rank", (str(tmp_path), 1, how), nprocs=2, backend="gloo",
                        timeout_s=timeout_s, grace_s=2)
    took = time.monotonic() - t0
    pids = rank_pids(tmp_path)
    assert len(pids) == 2 and not any(alive(p) for p in pids), "orphan rank processes"
    # the victim is named, with its own error (not rank 0's lost-peer error); a hung one as the rank that stopped
    # answering: rank 0's collective times out after timeout_s, which ends the run
    assert info.value.rank == 1 and expect in info.value.error, str(info.value)
    assert took < (timeout_s if how == "hang" else 0) + 60, took  # start-up of 2 spawned ranks on a loaded 2-core
    # machine dominates


def test_a_rank_that_fails_before_its_function_runs_shows_its_own_error():
    """Unpickling its arguments fails in the spawned rank: no elastic error file, so the error used to be only
    "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"."""
    from tests.launch_ranks import FailsToUnpickle

    with pytest.raises(RankFailed) as info:
        run_distributed("tests.launch_ranks:takes_an_argument", (FailsToUnpickle(),), nprocs=2, backend="gloo",
                        timeout_s=20, grace_s=2)
    assert "RuntimeError: no device cuda:7 on this host (rank set-up)" in info.value.error, str(info.value)
    assert "To enable traceback" not in str(info.value)


def test_bad_arguments():
    with pytest.raises(ConfigError, match="backend"):
        run_distributed("tests.launch_ranks:all_reduce_rank", (1.0,), nprocs=2, backend="mpi")
    with pytest.raises(ConfigError, match="fn_path"):
        run_distributed("tests.launch_ranks.all_reduce_rank", (1.0,), nprocs=2)
    with pytest.raises(AttributeError):
        run_distributed("tests.launch_ranks:no_such_fn", (), nprocs=2)
    with pytest.raises(ConfigError, match=r"nprocs=2 needs 2 GPUs, but this worker sees 0"):
        run_distributed("tests.launch_ranks:all_reduce_rank", (1.0,), nprocs=2, backend="nccl")
