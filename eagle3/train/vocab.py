"""The draft vocabulary: the drafter predicts only the most frequent target tokens of its training data.

Two tensors map between the vocabularies, in the convention SGLang's EAGLE-3 loader reads:

    d2t  int64 [draft_vocab]   offsets: target_id = draft_id + d2t[draft_id]
    t2d  bool  [target_vocab]  True where the target token is in the draft vocabulary

The mapping is built once per training folder and reused on every warm start: regenerating it from
other data would silently reassign the slots of a trained lm_head (a bug users hit in the anchors).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.errors import PipelineError
from eagle3.io import atomic_path

log = logging.getLogger(__name__)

VOCAB_FILE = "draft_vocab.safetensors"


@dataclass
class DraftVocab:
    draft_ids: torch.Tensor  # int64 [draft_vocab]: target id of each draft slot, ascending
    target_vocab: int

    @property
    def size(self) -> int:
        return int(self.draft_ids.numel())

    @property
    def is_full(self) -> bool:
        """Every target token is a draft token: serving engines then expect no d2t/t2d (see export.py)."""
        return self.size == self.target_vocab

    @classmethod
    def full(cls, target_vocab: int) -> "DraftVocab":
        return cls(torch.arange(target_vocab, dtype=torch.int64), target_vocab)

    @property
    def d2t(self) -> torch.Tensor:
        return self.draft_ids - torch.arange(self.size, dtype=torch.int64)

    @property
    def t2d(self) -> torch.Tensor:
        t2d = torch.zeros(self.target_vocab, dtype=torch.bool)
        t2d[self.draft_ids] = True
        return t2d

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, t2d: torch.Tensor) -> "DraftVocab":
        draft_ids = d2t.to(torch.int64) + torch.arange(d2t.numel(), dtype=torch.int64)
        vocab = cls(draft_ids, int(t2d.numel()))
        if not torch.equal(vocab.t2d, t2d.to(torch.bool)):
            raise PipelineError("d2t and t2d disagree: t2d is not True exactly at the target ids d2t maps to")
        return vocab

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        with atomic_path(path) as tmp:
            save_file({"d2t": self.d2t, "t2d": self.t2d}, str(tmp))

    @classmethod
    def load(cls, path: str | Path) -> "DraftVocab":
        from safetensors.torch import load_file

        t = load_file(str(path))
        return cls.from_d2t(t["d2t"], t["t2d"])


def count_tokens(token_batches, target_vocab: int) -> torch.Tensor:
    """Frequency of every target token id over an iterable of int tensors (only loss-masked tokens count)."""
    counts = torch.zeros(target_vocab, dtype=torch.int64)
    for ids in token_batches:
        ids = ids.to(torch.int64).flatten()
        if ids.numel() and (int(ids.max()) >= target_vocab or int(ids.min()) < 0):
            raise PipelineError(f"token id {int(ids.max())} is outside the target vocabulary of {target_vocab}")
        counts += torch.bincount(ids, minlength=target_vocab)
    return counts


def build_draft_vocab(counts: torch.Tensor, size: int) -> DraftVocab:
    """The `size` most frequent tokens (ties by lower id), capped at the number of distinct tokens seen.

    A draft vocabulary larger than the distinct tokens seen would hold slots that never occur in
    training; the anchors crash on it, so we shrink instead and say so.
    """
    distinct = int((counts > 0).sum())
    if distinct == 0:
        raise PipelineError("cannot build a draft vocabulary: the training data holds no tokens")
    if size > distinct:
        log.info("draft_vocab_size %d > %d distinct tokens in the data: using %d", size, distinct, distinct)
        size = distinct
    # Stable sort on -count gives ties to the lower id, so the result is deterministic.
    order = torch.sort(-counts, stable=True).indices[:size]
    draft_ids = torch.sort(order).values.to(torch.int64)  # ascending, so d2t offsets are non-decreasing
    return DraftVocab(draft_ids, int(counts.numel()))


def load_or_build_vocab(path: str | Path, counts_fn, size: int, target_vocab: int) -> DraftVocab:
    """Load the saved vocabulary if there is one (warm start), else count, build and save it."""
    path = Path(path)
    if path.is_file():
        vocab = DraftVocab.load(path)
        if vocab.target_vocab != target_vocab:
            raise PipelineError(f"{path}: built for a target vocabulary of {vocab.target_vocab}, model has {target_vocab}")
        log.info("reusing draft vocabulary %s (%d tokens)", path, vocab.size)
        return vocab
    vocab = build_draft_vocab(counts_fn(), size)
    vocab.save(path)
    return vocab
