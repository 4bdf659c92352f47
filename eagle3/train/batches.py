"""Training batches from the extracted states: a seeded chunk order per epoch, padding, and the length cap.

Micro-batches never span chunks, so the position of a batch is computable from the manifests alone
(a resumed run skips batches without reading the chunks they came from).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from eagle3.errors import DeviceOOMError, PipelineError
from eagle3.extract.format import dequantize
from eagle3.extract.reader import HiddenStateReader

log = logging.getLogger(__name__)

# A sample's per-token tensors; fp8-stored states come with their scales (eagle3.extract.format) and stay fp8 up to
# the device, which dequantizes only the batch: on the host, the training loop dequantized each whole chunk while
# the GPU waited (1.5 s a 66K-token chunk of SmolLM2 states on 2 cores)
PER_TOKEN = ("input_ids", "loss_mask", "aux_hidden", "final_hidden", "aux_scale", "final_scale")


def held_out_samples(num_samples: int, fraction: float, seed: int) -> set[int]:
    """The held-out slice: round(fraction x samples) sample indices (in the reader's chunk order), at least one
    when fraction > 0, drawn with the seed (the merged data is shuffled already; this keeps the slice spread over
    every chunk). Empty when fraction is 0."""
    if fraction <= 0:
        return set()
    n = max(1, round(fraction * num_samples))
    if n >= num_samples:
        raise PipelineError(f"train param holdout_fraction {fraction} holds out {n} of {num_samples} samples: "
                            f"nothing left to train on; lower it")
    g = torch.Generator().manual_seed(seed * 7919 + 17)
    return set(torch.randperm(num_samples, generator=g)[:n].tolist())


class BatchOrder:
    """Micro-batches of the training samples: every sample not in `held_out` (indices in chunk order)."""

    def __init__(self, reader: HiddenStateReader, batch_size: int, seed: int, held_out: set[int] = frozenset()):
        self.reader, self.batch_size, self.seed = reader, batch_size, seed
        self.chunks = reader.chunks()
        self.held_out = held_out
        starts = [0]
        for c in self.chunks:
            starts.append(starts[-1] + c.record.samples)
        # per chunk: the local indices of its training samples (all of them without a held-out slice)
        self.kept = [[j for j in range(c.record.samples) if s + j not in held_out] for c, s in zip(self.chunks, starts)]
        self.held = [[j for j in range(c.record.samples) if s + j in held_out] for c, s in zip(self.chunks, starts)]
        self.batches_per_epoch = sum(math.ceil(len(k) / batch_size) for k in self.kept)

    def _samples(self, t: dict, rows: list[int]) -> list[dict]:
        off = t["sample_offsets"].tolist()
        keys = [k for k in PER_TOKEN if k in t]
        return [{k: t[k][off[i]:off[i + 1]] for k in keys} for i in rows]

    def epoch(self, epoch: int, skip: int = 0):
        """Yield (batch_index, [samples as dicts]) for one epoch, starting after `skip` batches."""
        g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
        order = torch.randperm(len(self.chunks), generator=g).tolist()
        index = 0
        for ci in order:
            kept = self.kept[ci]
            n = math.ceil(len(kept) / self.batch_size)
            perm = torch.randperm(len(kept), generator=g).tolist()  # drawn even when skipped: same stream
            if index + n <= skip:
                index += n
                continue
            t = self.reader.load(self.chunks[ci], dequantize=False)
            for b in range(n):
                if index >= skip:
                    yield index, self._samples(t, [kept[i] for i in perm[b * self.batch_size:(b + 1) * self.batch_size]])
                index += 1

    def held_out_batches(self):
        """The held-out samples in batches of batch_size, in chunk order (the same every call)."""
        for ci, rows in enumerate(self.held):
            if rows:
                t = self.reader.load(self.chunks[ci], dequantize=False)
                for b in range(0, len(rows), self.batch_size):
                    yield self._samples(t, rows[b:b + self.batch_size])


@dataclass
class StepInput:
    """One optimizer step's input: its micro-batches' samples (every rank's) and, collated, this rank's share of
    each in its parts (a forward and backward each); `epoch` and `batch_pos` say where the order stands after the
    step (a checkpoint there resumes there)."""

    samples: list[list[dict]]
    batches: list[dict]
    counts: torch.Tensor  # [K] the masked slots of each TTT step over all of the step's samples
    epoch: int
    batch_pos: int


def step_inputs(order: BatchOrder, epoch: int, skip: int, grad_accum: int,
                collated: Callable[[list[dict]], list[dict]],
                counted: Callable[[list[dict]], torch.Tensor]) -> Iterator[StepInput]:
    """The steps' inputs from (epoch, skip) on, grad_accum micro-batches each (a step may span two epochs);
    `collated` batches one micro-batch (this rank's share in its parts, padded, pinned), `counted` counts the whole
    step's masked slots. Pure in its arguments, so a thread can run it ahead of the training loop
    (eagle3.prefetch)."""
    def micro_batches():
        e, s = epoch, skip
        while True:
            for index, samples in order.epoch(e, skip=s):
                yield e, index + 1, samples
            e, s = e + 1, 0

    stream = micro_batches()
    while True:
        got = [next(stream) for _ in range(grad_accum)]
        samples = [g[2] for g in got]
        yield StepInput(samples, [b for m in samples for b in collated(m)], counted([s for m in samples for s in m]),
                        got[-1][0], got[-1][1])


@dataclass
class Truncation:
    """Samples longer than max_seq_len: their tokens past the cap are extracted but never trained on."""

    max_seq_len: int
    samples: int = 0
    tokens: int = 0  # tokens cut, summed over the cut samples
    longest: int = 0

    def to_dict(self) -> dict:
        return {"max_seq_len": self.max_seq_len, "truncated_samples": self.samples,
                "truncated_tokens": self.tokens, "longest_sample": self.longest}


def count_truncation(reader: HiddenStateReader, max_seq_len: int) -> Truncation:
    """Count the samples the cap cuts (from the chunks' offsets only) and warn once, naming the remedy."""
    cut = Truncation(max_seq_len)
    for chunk in reader.chunks():
        for n in reader.sample_lengths(chunk):
            cut.longest = max(cut.longest, n)
            if n > max_seq_len:
                cut.samples += 1
                cut.tokens += n - max_seq_len
    if cut.samples:
        log.warning("data param max_seq_len %d cuts %d of %d samples (%d tokens, longest sample %d): those tokens "
                    "were extracted but are not trained on (shards merged with a larger cap than this run's "
                    "max_seq_len); train with the cap they were merged with to use them",
                    max_seq_len, cut.samples, reader.num_samples, cut.tokens, cut.longest)
    return cut


def bucket_length(n: int, max_len: int, pad_multiple: int) -> int:
    """Padded batch length for a longest sample of n tokens. With pad_multiple > 1 (GPU, compiled): the
    smallest pad_multiple * 2^j >= n, so a run meets at most log2(max_len / pad_multiple) + 2 lengths,
    and a compiled loss is built once per length rather than once per distinct padded size."""
    n = min(n, max_len)
    if pad_multiple <= 1:
        return n
    T = pad_multiple
    while T < n:
        T *= 2
    return min(T, max_len)


def part_rows(samples: list[dict], tokens: int, share_rows: int, max_len: int, pad_multiple: int) -> int:
    """Rows a forward of this micro-batch takes: at most `tokens` rows x the padded length of its longest sample
    (at least 1, at most a rank's share_rows; tokens 0 = share_rows). Counted over the whole micro-batch, so
    every rank splits its share alike (Ranks.share_in_parts); its float32 [rows, tokens, draft vocab] loss terms
    are what outgrow a GPU first."""
    if not tokens:
        return share_rows
    longest = bucket_length(max(len(s["input_ids"]) for s in samples), max_len, pad_multiple)
    return min(share_rows, max(1, tokens // longest))


def collate(samples: list[dict], max_len: int, pad_multiple: int = 1, rows: int = 0) -> dict:
    """Right-pad samples (truncated to max_len) into a batch of `rows` rows (0 = as many as samples) and
    bucket_length(...) columns. Padding has loss_mask 0 and sits after every real token (or fills whole
    rows), so causal attention never lets a real token read it and the loss never counts it."""
    T = bucket_length(max(len(s["input_ids"]) for s in samples), max_len, pad_multiple)
    B = max(rows, len(samples))
    first = samples[0]
    # states keep their stored dtype (bf16 from GPU extraction, or fp8 with its scales): the least host copy;
    # to_device upcasts them on the device
    out = {
        "input_ids": torch.zeros(B, T, dtype=torch.long),
        "loss_mask": torch.zeros(B, T, dtype=torch.bool),
        "aux": torch.zeros(B, T, first["aux_hidden"].shape[-1], dtype=first["aux_hidden"].dtype),
        "final": torch.zeros(B, T, first["final_hidden"].shape[-1], dtype=first["final_hidden"].dtype),
    }
    if "aux_scale" in first:
        out["aux_scale"] = torch.zeros(B, T, first["aux_scale"].shape[-1], dtype=torch.float32)
        out["final_scale"] = torch.zeros(B, T, dtype=torch.float32)
    pairs = [("input_ids", "input_ids"), ("aux", "aux_hidden"), ("final", "final_hidden"),
             ("aux_scale", "aux_scale"), ("final_scale", "final_scale")]
    for i, s in enumerate(samples):
        n = min(T, len(s["input_ids"]))
        out["loss_mask"][i, :n] = s["loss_mask"][:n].bool()
        for dst, src in pairs:
            if dst in out:
                out[dst][i, :n] = s[src][:n]
    return out


def to_device(batch: dict, device: torch.device) -> dict:
    """Move a collated batch to the device; hidden states become fp32 there (autocast picks the matmul dtype). fp8
    states are dequantized there by the reader's own formula (eagle3.extract.format.dequantize), so training reads
    the same numbers either way."""
    out = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    if "aux_scale" in out:
        out["aux"] = dequantize(out["aux"], out.pop("aux_scale"))
        out["final"] = dequantize(out["final"], out.pop("final_scale"))
    out["aux"], out["final"] = out["aux"].float(), out["final"].float()
    return out


@contextlib.contextmanager
def out_of_memory(cfg, batch: dict, draft_vocab_size: int):
    """A forward the GPU cannot hold, said with the knobs that fit it: the loss holds several [rows, tokens,
    draft vocab] float32 terms, which outgrow the card first. Retried, as extraction's OOM in the forward is
    (another process may have held the memory); a retry resumes at the last checkpoint."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        rows, tokens = batch["input_ids"].shape
        term = rows * tokens * draft_vocab_size * 4 / 1e9
        one = " (one sample already: only a lower max_seq_len fits it)" if rows == 1 else ""
        raise DeviceOOMError(
            f"train: out of GPU memory on a forward of {rows} samples x {tokens} tokens (draft vocab "
            f"{draft_vocab_size}: each float32 term of the loss is {term:.1f} GB){one}: lower micro_batch_tokens "
            f"({cfg.micro_batch_tokens} now, rows x padded tokens a forward takes; the same samples and loss, so "
            f"the run resumes from its checkpoints), or max_seq_len ({cfg.max_seq_len}); the checkpoints written "
            f"so far are kept. ({str(e).splitlines()[0][:200]})") from None
