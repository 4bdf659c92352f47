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


def fsdp_save_loop(saves: int, gather: str = "full_state") -> dict:
    """FSDP2 over a small EAGLE-3 drafter: a few AdamW steps with gradient accumulation, each followed by the
    checkpoint gather (`full_state`), `saves` times in all; returns rank 0's last states' checksum."""
    from eagle3.train import distributed as d
    from eagle3.train.model import DrafterConfig, Eagle3Drafter

    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, draft_vocab_size=256, target_vocab_size=512)
    model = d.wrap(Eagle3Drafter(cfg), d.Ranks.current(), torch.device("cpu"), "fsdp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    total = 0.0
    for i in range(saves):
        for micro in range(2):  # grad_accum 2
            with d.grad_sync(model, d.Ranks.current(), last=micro == 1):
                loss = sum((p.to_local() if hasattr(p, "to_local") else p).float().pow(2).sum() for p in model.parameters())
                loss.backward()
        opt.step()
        opt.zero_grad()
        msd, osd = d.full_state(model, opt)
        # the same states as torch's own full-state gather, which maps the optimizer state by parameter name
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        ref_m, ref_o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        names = [n for n, _ in model.named_parameters()]
        assert list(msd) == list(ref_m) and all(torch.equal(msd[k], ref_m[k]) for k in msd)
        assert all(torch.equal(osd["state"][i][k], ref_o["state"][n][k]) for i, n in enumerate(names)
                   for k in ref_o["state"][n])
        assert all(v.untyped_storage().data_ptr() != p.to_local().untyped_storage().data_ptr()
                   for v, p in zip(msd.values(), model.parameters()))
        total = sum(float(v.float().sum()) for v in msd.values()) + len(osd["state"])
    return {"checksum": total}
