"""Rank functions for tests/test_launch.py (run in spawned ranks by eagle3.launch.run_distributed)."""

import os
import time

import torch
import torch.distributed as dist


def all_reduce_rank(value: float) -> dict:
    t = torch.tensor([value * (dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(), "pid": os.getpid(),
            "local_rank": int(os.environ["LOCAL_RANK"])}


def victim_rank(pid_dir: str, victim: int, how: str) -> None:
    """Every rank records its pid, then loops over all-reduces; rank `victim` SIGKILLs itself, raises or hangs."""
    rank = dist.get_rank()
    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    for step in range(10_000):
        if rank == victim and step == 3:
            if how == "kill":
                os.kill(os.getpid(), 9)
            if how == "raise":
                raise ValueError(f"rank {rank} broke at step {step}")
            if how == "hang":
                time.sleep(3600)
        dist.all_reduce(torch.ones(4))
        time.sleep(0.05)


def _refuse_in_a_rank(message: str):
    raise RuntimeError(message)


class FailsToUnpickle:
    """An argument whose unpickling fails in the spawned rank: the rank dies before its function (and the
    elastic error recording around it) runs."""

    def __reduce__(self):
        return _refuse_in_a_rank, ("no device cuda:7 on this host (rank set-up)",)


def takes_an_argument(arg) -> None:
    pass
