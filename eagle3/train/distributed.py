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

import contextlib
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
        return samples[self.rank::self.world] or [without_loss(samples[0])]

    def share_in_parts(self, samples: list[dict], rows: int) -> list[list[dict]]:
        """This rank's share of a micro-batch in parts of at most `rows` samples (eagle3.train.batches.part_rows),
        as many parts on every rank: ceil(the largest share / rows). Under FSDP2 every forward gathers the
        parameters from all ranks, so no rank may run one fewer; a part left empty takes a masked sample, as
        `share` does."""
        mine, largest = self.share(samples), -(-len(samples) // self.world)
        return [mine[i:i + rows] or [without_loss(samples[0])] for i in range(0, largest, rows)]


def without_loss(sample: dict) -> dict:
    """The sample with its loss mask cleared: it runs the forward and adds nothing to the loss."""
    return {**sample, "loss_mask": torch.zeros_like(sample["loss_mask"])}


def masked_counts(samples: list[dict], max_seq_len: int, ttt_steps: int) -> torch.Tensor:
    """[K] masked slots of step k over a whole micro-batch: slot t of step k counts the mask of token t+2+k
    (eagle3.train.trainer.ttt_loss), over each sample cut to max_seq_len; padding never counts."""
    out = torch.zeros(ttt_steps, dtype=torch.float32)
    for s in samples:
        m = s["loss_mask"][:max_seq_len].float()
        for k in range(ttt_steps):
            out[k] += m[2 + k:].sum()
    return out


def wrap(drafter: torch.nn.Module, ranks: Ranks, device: torch.device, parallel: str = "ddp") -> torch.nn.Module:
    """The module the training loop calls: the drafter itself alone; else DistributedDataParallel around it (its
    state dict, and the optimizer's, stay those of one process), or with parallel="fsdp" the drafter itself,
    sharded in place by FSDP2 (the lm_head, the largest matrix, a unit of its own; fc, the decoder layer and the
    norm in the root unit, since the TTT unroll calls the layer's parts, not its forward, and FSDP2 gathers a unit
    around forward calls): create the optimizer after this, checkpoint through full_state / load_full_state."""
    if not ranks.distributed:
        return drafter
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(drafter.lm_head)
        return fully_shard(drafter)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(drafter, device_ids=[device.index] if device.type == "cuda" else None)


def grad_sync(model: torch.nn.Module, ranks: Ranks, last: bool):
    """Gradients are reduced over the ranks at a step's last micro-batch only (grad accumulation)."""
    if not ranks.distributed or last:
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(True)
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    model.set_requires_gradient_sync(False)  # FSDP2
    return contextlib.nullcontext()


def local_value(t):
    """A DTensor's full value (FSDP2's grad norm), a tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# FSDP2 checkpoints hold what one process would write: the model's full state dict and the optimizer's state
# in torch's own format (parameters numbered in named_parameters order), so a run resumes at any N and either way.
def _full_copy(value):
    """A state value as one process holds it, in memory of its own: a DTensor gathered from the shards
    (synchronously: the all-gather is waited for), every tensor copied to the CPU."""
    if isinstance(value, torch.Tensor):
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            value = value.full_tensor()
        if isinstance(value, AsyncCollectiveTensor):
            value = value.wait()
        return value.detach().to("cpu", copy=True)
    return value


def full_state(model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """(model state, optimizer state) gathered from the shards; every rank must call it (in the same order: one
    all-gather per sharded tensor) and gets them.

    Gathered tensor by tensor into copies the checkpoint owns, instead of torch's get_state_dict(full_state_dict,
    cpu_offload): on the CPU that returns the gathered buffers and the optimizer's live step tensors themselves
    (its "offload" to the CPU is no copy there), and one FSDP2 run in 14 died with SIGSEGV inside it while a
    checkpoint was gathered (torch 2.13, CPU, gloo); the cause was not pinned down, nothing here shares memory
    with a collective or the optimizer (tests/test_train_ddp.py gathers in a loop of saves)."""
    msd = {name: _full_copy(v) for name, v in model.state_dict().items()}
    osd = optimizer.state_dict()  # parameters numbered in param-group order: model.parameters() order
    native = {"state": {i: {k: _full_copy(v) for k, v in s.items()} for i, s in osd["state"].items()},
              "param_groups": osd["param_groups"]}
    return msd, native


def load_full_state(model: torch.nn.Module, optimizer, model_state: dict, optimizer_state: dict) -> None:
    """Scatter a checkpoint's full states into the shards (every rank passes the whole checkpoint)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = [n for n, _ in model.named_parameters()]
    osd = {"state": {names[i]: v for i, v in optimizer_state["state"].items()},
           "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optimizer_state["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True))
