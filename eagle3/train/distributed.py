"""Training on N ranks (GPUs with NCCL, CPU processes with gloo): which rank does what, and how a global batch
keeps its meaning at any N.

The unit of data stays the micro-batch of `batch_size` samples from eagle3.train.batches.BatchOrder (its
sequence depends on the seed only). Rank r of N trains on samples r, r+N, ... of every micro-batch; each step k
of its TTT loss is divided by the masked-slot count of the WHOLE micro-batch (every rank computes it from the
samples' masks, which it holds), so the ranks' losses sum to the one-process loss. DDP averages gradients over
the ranks, hence each rank back-propagates N x its loss: the gradient is the one-process gradient. The data
position, the checkpoints and the metrics are those of one process, so a run killed at N ranks resumes at any N.

Ranks are started by eagle3.launch.run_distributed (torch.distributed.elastic: they die with the task, a failed
rank fails the run with its error); rank 0 writes checkpoints and metrics.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch



@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def current(cls) -> "Ranks":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank())))
        return cls()

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def device(self, device: torch.device) -> torch.device:
        """The rank's device: cuda:LOCAL_RANK (one GPU per rank) when training on CUDA."""
        if device.type == "cuda" and self.distributed:
            return torch.device("cuda", self.local_rank)
        return device

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduced sum of a small tensor (metrics), on the rank's device; the tensor itself when alone."""
        if not self.distributed:
            return t
        import torch.distributed as dist

        dist.all_reduce(t)
        return t

    def share(self, samples: list[dict]) -> list[dict]:
        """This rank's samples of a micro-batch. A rank left without one (a chunk's last micro-batch can be smaller
        than N) takes the first sample with its loss mask cleared: it contributes nothing, yet joins the
        gradient all-reduce every rank must reach."""
        mine = samples[self.rank::self.world]
        if mine:
            return mine
        s = dict(samples[0])
        s["loss_mask"] = torch.zeros_like(s["loss_mask"])
        return [s]


def masked_counts(samples: list[dict], max_seq_len: int, ttt_steps: int) -> torch.Tensor:
    """[K] masked slots of step k over a whole micro-batch: slot t of step k counts the mask of token t+2+k
    (eagle3.train.trainer.ttt_loss), over each sample cut to max_seq_len; padding never counts."""
    out = torch.zeros(ttt_steps, dtype=torch.float32)
    for s in samples:
        m = s["loss_mask"][:max_seq_len].float()
        for k in range(ttt_steps):
            out[k] += m[2 + k:].sum()
    return out


def wrap(drafter: torch.nn.Module, ranks: Ranks, device: torch.device) -> torch.nn.Module:
    """The module the training loop calls: the drafter itself alone, else DistributedDataParallel around it (its
    state dict, and the optimizer's over its parameters, are then those of one process: checkpoints do not
    depend on N)."""
    if not ranks.distributed:
        return drafter
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(drafter, device_ids=[device.index] if device.type == "cuda" else None)


def check_backend(device: torch.device, ranks: int, param: str = "train_num_gpus") -> str:
    """nccl on GPUs, gloo on the CPU; a CUDA run needs as many visible GPUs as ranks (a clear error first)."""
    if device.type != "cuda":
        return "gloo"
    from eagle3.launch import check_gpus

    check_gpus(ranks, param)
    return "nccl"
