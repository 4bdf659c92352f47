"""Training checkpoints: model, optimizer, scheduler, RNG states and data position, written atomically.

A restarted run restores the latest one and drops the metrics lines written after it (a killed run
logged steps it never checkpointed), then continues on the same batch sequence, so its loss curve is
the uninterrupted one. A checkpoint written with other training params is refused, not resumed.

With a held-out slice (eagle3.train.validation) the weights of the best validation so far are kept apart in
`best-step-NNNNNNNN.pt` (the last `keep` checkpoints may no longer hold them); each checkpoint names the best
file it goes with, and a restore drops best files a killed run wrote after its last checkpoint.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.errors import PipelineError
from eagle3.io import atomic_path

log = logging.getLogger(__name__)


@dataclass
class Position:
    """Where a run is: optimizer steps done, and the next micro-batch (epoch, batch index in that epoch)."""

    step: int = 0
    epoch: int = 0
    batch_pos: int = 0


def rng_state() -> dict:
    s = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines after `step` (written by a killed run after its last checkpoint)."""
    if not path.is_file():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    with atomic_path(path) as tmp:
        tmp.write_text("".join(ln + "\n" for ln in keep))


class Checkpoints:
    """`folder/step-NNNNNNNN.pt`, the last `keep` of them, each stamped with the params' fingerprint."""

    def __init__(self, folder: str | Path, fingerprint: str, keep: int):
        self.folder, self.fingerprint, self.keep = Path(folder), fingerprint, keep

    def latest(self) -> Path | None:
        found = sorted(self.folder.glob("step-*.pt")) if self.folder.is_dir() else []
        return found[-1] if found else None

    def save(self, pos: Position, model, optimizer, scheduler, states: tuple[dict, dict] | None = None,
             best: dict | None = None) -> Path:
        """states: (model, optimizer) state dicts gathered by the caller (FSDP2), instead of the objects' own.
        best: {"step", "sim_tau"} of the best validation so far (its weights saved by save_best first)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"step-{pos.step:08d}.pt"
        model_state, optimizer_state = states or (model.state_dict(), optimizer.state_dict())
        payload = {"model": model_state, "optimizer": optimizer_state,
                   "scheduler": scheduler.state_dict(), "rng": rng_state(), "step": pos.step, "epoch": pos.epoch,
                   "batch_pos": pos.batch_pos, "fingerprint": self.fingerprint, "best": best}
        with atomic_path(path) as tmp:
            torch.save(payload, tmp)
        for old in sorted(self.folder.glob("step-*.pt"))[:-self.keep]:
            old.unlink(missing_ok=True)
        self._drop_best_files(keep_step=best["step"] if best else None)
        return path

    def best_path(self, step: int) -> Path:
        return self.folder / f"best-step-{step:08d}.pt"

    def save_best(self, step: int, sim_tau: float, model_state: dict) -> None:
        """The weights of a new best validation (before the checkpoint of the same step names it)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.best_path(step)) as tmp:
            torch.save({"model": model_state, "step": step, "sim_tau": sim_tau, "fingerprint": self.fingerprint}, tmp)

    def _drop_best_files(self, keep_step: int | None) -> None:
        for f in self.folder.glob("best-step-*.pt"):
            if keep_step is None or f != self.best_path(keep_step):
                f.unlink(missing_ok=True)

    def load_best(self, model, best: dict) -> None:
        """Load the weights of the best validation `best` ({"step", ...}, as a checkpoint names it)."""
        path = self.best_path(best["step"])
        if not path.is_file():
            raise PipelineError(f"{path}: the best checkpoint the last checkpoint names is missing")
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=False)["model"])

    def restore(self, model, optimizer, scheduler, metrics_paths: list[Path] | None,
                load_states=None) -> tuple[Position, dict | None]:
        """Load the latest checkpoint into the objects and cut the metrics files (JSONL with a "step") back to it;
        without one, start afresh (the metrics of an earlier run in this folder are removed). metrics_paths None:
        the metrics are another process's (ranks other than 0 of a distributed run). Returns the position and the
        best validation the checkpoint names (None without one)."""
        path = self.latest()
        if path is None:
            for p in metrics_paths or []:
                p.unlink(missing_ok=True)
            if metrics_paths is not None and self.folder.is_dir():
                self._drop_best_files(keep_step=None)
            return Position(), None
        ck = torch.load(path, map_location="cpu", weights_only=False)
        if ck["fingerprint"] != self.fingerprint:
            raise PipelineError(f"{path}: written with other training params; use a new output_dir or delete "
                                f"{self.folder}")
        if load_states is not None:  # FSDP2: load_states(model, optimizer, model state, optimizer state)
            load_states(model, optimizer, ck["model"], ck["optimizer"])
        else:
            model.load_state_dict(ck["model"])
            optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        set_rng_state(ck["rng"])
        pos = Position(ck["step"], ck["epoch"], ck["batch_pos"])
        best = ck.get("best")
        if metrics_paths is not None:
            for p in metrics_paths:
                truncate_metrics(p, pos.step)
            self._drop_best_files(keep_step=best["step"] if best else None)  # written after this checkpoint
        log.info("resumed from %s at step %d (epoch %d, batch %d)", path, pos.step, pos.epoch, pos.batch_pos)
        return pos, best

    def load_model(self, model) -> int:
        """Load only the model of the latest checkpoint; returns its step."""
        path = self.latest()
        if path is None:
            raise PipelineError(f"{self.folder}: no checkpoint")
        ck = torch.load(path, map_location="cpu", weights_only=False)
        model.load_state_dict(ck["model"])
        return int(ck["step"])
