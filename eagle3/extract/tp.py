"""Tensor-parallel extraction of one shard: tp_size ranks (eagle3.launch), transformers' tp_plan="auto".

    eagle3.extract.run.extract_shard(ExtractConfig(target=TargetConfig(..., tp_size=3).resolved(), ...), spec)
    # dispatches here when target.tp_size > 1

Each rank loads its slice of the target (`from_pretrained(..., tp_plan="auto")`: attention heads, kv heads and
MLP columns/rows split, experts spread; one all-reduce per attention and MLP block). After each all-reduce the
residual stream is replicated, so the decoder layers' outputs and the final norm's output (what the hooks
capture) are whole on every rank: rank 0 alone runs the shard extractor (eagle3.extract.extractor: plan, capture,
copies, chunk files, manifest, resume), unchanged. The other ranks follow: rank 0 broadcasts each command
(load, forward a [B, L] batch, stop) and the batch's ids, and every rank runs the same forward.

A rank that dies or hangs: the others' next collective fails (or times out after rank_timeout_s), eagle3.launch
stops every rank and raises RankFailed with that rank's error; the committed chunks stay, a re-run resumes.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.distributed as dist

from eagle3.errors import ConfigError
from eagle3.extract.backend import HFBackend
from eagle3.extract.config import ExtractConfig
from eagle3.extract.extractor import ShardExtractor, backend_options, resolve_for_device
from eagle3.fit import check_tp_divides, load_config
from eagle3.launch import backend_for, run_distributed

log = logging.getLogger(__name__)

PARAM = "extract_tp_size"
STOP, LOAD, CAPTURE = 0, 1, 2


def comm_device() -> torch.device:
    """Where collectives' tensors live: this rank's GPU under NCCL, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


class LeaderBackend(HFBackend):
    """Rank 0's backend: every load and forward is announced to the follower ranks first."""

    def __init__(self, **kwargs):
        super().__init__(tp_plan="auto", **kwargs)
        self.comm = comm_device()

    def _announce(self, cmd: int, rows: int = 0, length: int = 0) -> None:
        dist.broadcast(torch.tensor([cmd, rows, length], dtype=torch.int64, device=self.comm), src=0)

    def load(self, model_path: str, dtype: str, device: str, capture_layers: list[int]) -> None:
        self._announce(LOAD)
        super().load(model_path, dtype, device, capture_layers)

    @torch.inference_mode()
    def capture(self, input_ids: torch.Tensor):
        self._announce(CAPTURE, *input_ids.shape)
        dist.broadcast(input_ids.to(self.comm).contiguous(), src=0)
        return super().capture(input_ids)

    def stop(self) -> None:
        self._announce(STOP)


@torch.inference_mode()
def follow(cfg: ExtractConfig) -> int:
    """A follower rank: run what rank 0 announces until it says stop; returns the forwards run."""
    comm, backend, forwards = comm_device(), None, 0
    while True:
        head = torch.empty(3, dtype=torch.int64, device=comm)
        dist.broadcast(head, src=0)
        cmd, rows, length = head.tolist()
        if cmd == STOP:
            return forwards
        if cmd == LOAD:
            backend = HFBackend(tp_plan="auto", **backend_options(cfg))
            backend.load(cfg.target.model_path, cfg.target.dtype, cfg.device, cfg.target.capture_layers)
        elif cmd == CAPTURE:
            ids = torch.empty((rows, length), dtype=torch.int64, device=comm)
            dist.broadcast(ids, src=0)
            backend.capture(ids.to(backend.device))
            forwards += 1


def extract_shard_rank(cfg: ExtractConfig, spec: dict) -> dict | None:
    """The body of each rank (run by eagle3.launch.run_distributed): rank 0 extracts, the others follow."""
    from eagle3.faults import set_rank_pids

    rank = dist.get_rank()
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    if rank:
        follow(cfg)
        return None
    set_rank_pids(pids)
    backend = LeaderBackend(**backend_options(cfg))
    out = ShardExtractor(cfg, spec, backend=backend).run()
    backend.stop()  # not on an error: then the followers are stopped by the launcher
    return out


def check_tp(cfg: ExtractConfig) -> ExtractConfig:
    """The checks a tensor-parallel shard passes before any rank starts; returns the config the ranks run:
    the device resolved (every rank must agree), compile "auto" = off (tp_plan's hooks and
    torch.compile are not measured together yet)."""
    if cfg.backend != "hf":
        raise ConfigError(f"{PARAM}={cfg.target.tp_size} needs extract_backend='hf' (transformers' tensor parallelism), "
                          f"got extract_backend={cfg.backend!r}")
    check_tp_divides(load_config(cfg.target.model_path), cfg.target.tp_size, PARAM, where=str(cfg.target.model_path))
    if cfg.compile == "auto":
        cfg = dataclasses.replace(cfg, compile=False)
    cfg = resolve_for_device(cfg)
    if cfg.device.startswith("cuda:"):
        raise ConfigError(f"{PARAM}={cfg.target.tp_size}: device={cfg.device!r} names one GPU; use device='cuda' "
                          f"(rank r runs on GPU r of the task's CUDA_VISIBLE_DEVICES)")
    cfg.target.require_resolved("extract")
    return cfg


def extract_shard_tp(cfg: ExtractConfig, spec) -> dict:
    cfg = check_tp(cfg)
    backend = backend_for(cfg.device, cfg.target.tp_size, PARAM)  # nccl needs one GPU per rank: checked here
    spec_dict = spec if isinstance(spec, dict) else spec.to_dict()
    done = ShardExtractor(cfg, spec_dict).completed_summary()  # a complete shard starts no rank
    if done is not None:
        return done
    log.info("shard %s: extracting in %d %s ranks", spec_dict.get("shard"), cfg.target.tp_size, backend)
    results = run_distributed("eagle3.extract.tp:extract_shard_rank", (cfg, spec_dict), nprocs=cfg.target.tp_size,
                              backend=backend, timeout_s=cfg.rank_timeout_s, name="eagle3-extract")
    return results[0]
