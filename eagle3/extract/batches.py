"""The deterministic work plan of a shard: which samples go into which forward pass and which chunk file.

A pure function of the shard's sample lengths and the plan params, never of timing, so a killed and resumed
run writes byte-identical chunks: the samples sorted longest first (ties by row; an OOM shows up at once), cut
greedily into batches of at most `token_budget` padded tokens, consecutive batches grouped into chunks of at
most `chunk_tokens` real tokens (a chunk is never smaller than one batch).

A resume may change the plan params (e.g. a smaller token_budget after an out-of-memory error). The shard
manifest then records one PlanSegment per change: segment i planned the samples the segments before it left,
and its chunks are the shard's chunks from `from_chunk` on. `plan_segments` replays them, so the committed
chunks are known without reading them, and the last segment plans what is left.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

AUTO_PAD_MULTIPLE = 64


@dataclass(frozen=True)
class PlanSegment:
    from_chunk: int
    token_budget: int
    chunk_tokens: int
    pad_multiple: int | str

    def to_dict(self) -> dict:
        return asdict(self)

    def same_plan(self, other: "PlanSegment") -> bool:
        return (self.token_budget, self.chunk_tokens, self.pad_multiple) == (
            other.token_budget, other.chunk_tokens, other.pad_multiple)


def auto_pad_step(longest: int) -> int:
    """pad_multiple="auto" on GPU: AUTO_PAD_MULTIPLE, or for a batch under 16 x that the largest power of two
    <= longest / 16, so padding stays under 1/16 of the length while a shard meets few lengths (samples of
    256..8192 tokens: 145 instead of 7,937)."""
    return min(AUTO_PAD_MULTIPLE, 1 << max(0, (longest // 16).bit_length() - 1))


def padded_length(longest: int, pad_multiple: int | str) -> int:
    """The length a batch is right-padded to: its longest sample, rounded up to a multiple of pad_multiple
    (of auto_pad_step for "auto")."""
    longest = max(longest, 1)
    step = auto_pad_step(longest) if pad_multiple == "auto" else pad_multiple
    return -(-longest // step) * step


def real_token_index(lens: np.ndarray, L: int) -> np.ndarray:
    """Flat indices of the real tokens in a [len(lens), L] right-padded batch: row j's first lens[j] positions."""
    return np.concatenate([np.arange(j * L, j * L + int(n)) for j, n in enumerate(lens)])


def plan_batches(lengths: np.ndarray, rows: np.ndarray, token_budget: int, chunk_tokens: int,
                 pad_multiple: int | str = 1) -> list[list[np.ndarray]]:
    """Chunks -> batches -> local sample indices. Longest first, so an OOM shows up at once."""
    order = np.lexsort((rows, -lengths))
    batches, i, n = [], 0, len(order)
    while i < n:
        longest = padded_length(int(lengths[order[i]]), pad_multiple)
        size = max(1, token_budget // longest)  # a sample longer than the budget runs alone
        batches.append(order[i:i + size])
        i += size
    chunks, cur, cur_tokens = [], [], 0
    for b in batches:
        t = int(lengths[b].sum())
        if cur and cur_tokens + t > chunk_tokens:
            chunks.append(cur)
            cur, cur_tokens = [], 0
        cur.append(b)
        cur_tokens += t
    if cur:
        chunks.append(cur)
    return chunks


def host_buffer_rows(lengths: np.ndarray, chunks: list[list[np.ndarray]], plan: PlanSegment) -> int:
    """Rows of a host chunk buffer for `chunks` (planned by `plan`): the plan's bound on a chunk (chunk_tokens, or
    one batch's token_budget) where the chunks fill it, so that every shard of a plan asks for one size and a
    process that runs several (`airflow dags test` runs every task in one; the benches' warm-up and measured
    runs) finds the pinned blocks of the one before in torch's pinned allocator; else the largest chunk."""
    sizes = [int(lengths[np.concatenate(c)].sum()) for c in chunks]
    bound = max(plan.chunk_tokens, plan.token_budget)
    return max(sizes) if sum(sizes) <= bound else max(bound, *sizes)  # a sample over the budget: a chunk alone


def plan_segments(lengths: np.ndarray, rows: np.ndarray, segments: list[PlanSegment]) -> list[list[np.ndarray]]:
    """The shard's chunks under a list of plan segments (the first from chunk 0): segment i plans the samples
    the earlier segments left and contributes its first segments[i+1].from_chunk - from_chunk chunks; the last
    one plans everything left. Every sample lands in exactly one chunk."""
    left = np.arange(len(lengths))
    chunks: list[list[np.ndarray]] = []
    for i, seg in enumerate(segments):
        planned = plan_batches(lengths[left], rows[left], seg.token_budget, seg.chunk_tokens, seg.pad_multiple)
        planned = [[left[b] for b in c] for c in planned]
        if i + 1 < len(segments):
            take = segments[i + 1].from_chunk - seg.from_chunk
            if not 0 < take <= len(planned):
                raise ValueError(f"plan segment {i} ({seg}) gives {len(planned)} chunks, the next starts "
                                 f"{take} chunks later")
            planned = planned[:take]
        chunks += planned
        done = np.concatenate([np.concatenate(c) for c in planned]) if planned else np.zeros(0, np.int64)
        left = np.setdiff1d(left, done, assume_unique=True)
    return chunks
