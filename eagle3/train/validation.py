"""Checkpoint selection by simulated acceptance on a held-out slice of the training data.

`holdout_fraction` of the samples (eagle3.train.batches.held_out_samples) never train. Every `validate_every`
optimizer steps (and at the last) the drafter runs its TTT chain over them, teacher-forced, with no target
forward: at slot t, step k predicts token t+2+k from the embedding of token t+1+k and its own step k-1 state.
A draft from slot t is accepted up to its first wrong token, so its accepted length is the number of leading
steps whose prediction (mapped to the target's vocabulary) equals the token in the data. Teacher forcing changes
nothing while every earlier step was right, so on the target's own greedy answers this is what speculative
decoding at depth K = ttt_steps would accept, on states the drafter never trained on. The score is
sim_tau = 1 + mean accepted length over the slots whose first drafted token is an answer token (the +1: the
target's own token every verification adds). The best score's weights are kept (Checkpoints.save_best) and are
what the export holds; validation.jsonl has one line per validation.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle3.train.batches import BatchOrder, collate, to_device

log = logging.getLogger(__name__)

VALIDATION_FILE = "validation.jsonl"


def chain_acceptance(drafter, batch: dict, embed: torch.Tensor, draft_ids: torch.Tensor,
                     ttt_steps: int) -> torch.Tensor:
    """[K + 1] sums over the batch: (slots, then for each k the drafts whose first k+1 tokens were accepted).

    draft_ids [Vd]: the target id of each draft slot. A step's token counts only when it is an answer token
    (loss_mask 1): a draft never runs past the answer it is part of."""
    from eagle3.train.trainer import shift_left

    ids, mask, aux = batch["input_ids"], batch["loss_mask"], batch["aux"]
    B, T = ids.shape
    S = T - 1
    positions = torch.arange(S, device=ids.device).expand(B, S)
    embeds = [F.embedding(shift_left(ids, 1 + k, S), embed) for k in range(ttt_steps)]
    all_logits = drafter(aux[:, :S], embeds, positions)
    alive = shift_left(mask, 2, S).bool()  # slots whose first drafted token is an answer token
    out = [alive.sum()]
    for k, logits in enumerate(all_logits):
        right = (draft_ids[logits.argmax(-1)] == shift_left(ids, 2 + k, S)) & shift_left(mask, 2 + k, S).bool()
        alive = alive & right
        out.append(alive.sum())
    return torch.stack(out).double()


class Validator:
    """Runs the validation at the steps it is due and keeps track of the best one."""

    def __init__(self, order: BatchOrder, out: Path, every: int, ttt_steps: int, max_seq_len: int,
                 draft_ids: torch.Tensor, ranks, main: bool):
        self.order, self.every, self.ttt_steps, self.max_seq_len = order, every, ttt_steps, max_seq_len
        self.draft_ids, self.ranks, self.path = draft_ids, ranks, out / VALIDATION_FILE
        self.main = main
        self.held_out = len(order.held_out)

    @property
    def enabled(self) -> bool:
        return self.held_out > 0

    def due(self, step: int, total_steps: int) -> bool:
        return self.enabled and (step % self.every == 0 or step == total_steps)

    @torch.no_grad()
    def measure(self, model, embed: torch.Tensor, device: torch.device, autocast) -> dict:
        """sim_tau and the share of drafts accepted past each depth, over every held-out sample (each rank takes a
        share of each batch; the sums are summed over the ranks)."""
        was_training = model.training
        model.eval()
        sums = torch.zeros(self.ttt_steps + 1, dtype=torch.float64, device=device)
        for samples in self.order.held_out_batches():
            # a rank left without a sample gets a masked copy (Ranks.share): it counts nothing
            batch = to_device(collate(self.ranks.share(samples), self.max_seq_len), device)
            with autocast:
                sums += chain_acceptance(model, batch, embed, self.draft_ids, self.ttt_steps)
        if self.ranks.distributed:
            sums = self.ranks.sum(sums)
        model.train(was_training)
        sums = sums.cpu()
        slots = max(float(sums[0]), 1.0)
        accepted = [float(s) / slots for s in sums[1:]]
        return {"sim_tau": 1.0 + sum(accepted), "accepted_past_depth": accepted, "slots": int(sums[0])}

    def record(self, step: int, result: dict) -> None:
        if self.main:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **result}) + "\n")
        log.info("validation at step %d: simulated tau %.3f on %d held-out samples (%d draft slots)", step,
                 result["sim_tau"], self.held_out, result["slots"])


def read_validation(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []


def selection_summary(rows: list[dict], best_step: int | None, held_out: int) -> dict:
    """What report.json says about the choice: the winner, the last validation, and the gain of one over the
    other (0 when the last was best)."""
    if not rows or best_step is None:
        return {}
    best = next(r for r in rows if r["step"] == best_step)
    last = rows[-1]
    return {"held_out_samples": held_out, "validations": len(rows), "best_step": best_step,
            "best_sim_tau": best["sim_tau"], "last_step": last["step"], "last_sim_tau": last["sim_tau"],
            "gain_over_last": best["sim_tau"] - last["sim_tau"], "exported": "best" if best_step != last["step"]
            else "last (the best)"}
