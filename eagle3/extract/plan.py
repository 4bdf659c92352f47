"""Shard plan: split the merged dataset into N shards of about equal token counts.

The merge phase writes `part-*.parquet` files and a manifest (contract 2, read only through
eagle3.merge.dataset). A sample's global row index is its position when the files are read in manifest
order. A shard is a contiguous range of global rows, cut where the running token count crosses k * T / N, so
shards differ by at most one sample's tokens. Contiguous ranges keep a shard cheap to read
(a few row ranges of a few files). The merge phase already shuffled the rows, so contiguous
ranges do not bias the length mix of a shard.

Each shard spec is a small JSON-able dict: it is the XCom that the extraction task is mapped over,
and it is all an extraction task needs besides the model; `load_shard_data` reads its rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from eagle3.errors import ConfigError
from eagle3.extract.config import ShardPlanConfig
from eagle3.merge.dataset import read_merged


@dataclass
class RowRange:
    file: str  # parquet file name inside merge_dir
    row_start: int  # [row_start, row_end) rows of that file
    row_end: int
    global_row_start: int  # global row index of row_start


@dataclass
class ShardSpec:
    shard: int
    num_shards: int
    merge_dir: str
    ranges: list[RowRange] = field(default_factory=list)
    rows: int = 0
    tokens: int = 0
    merge_fingerprint: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ShardSpec":
        try:
            d = dict(d)
            d["ranges"] = [RowRange(**r) for r in d.get("ranges", [])]
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"shard spec is malformed ({e}): {d!r}") from e

    @property
    def global_ranges(self) -> list[list[int]]:
        """The [start, end) global row ranges, as ShardManifest.rows records them."""
        return [[r.global_row_start, r.global_row_start + r.row_end - r.row_start] for r in self.ranges]


@dataclass
class ShardData:
    """A shard's samples in memory: flat token arrays plus offsets (int32 ids are 4 bytes a token)."""

    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    offsets: np.ndarray  # int64 [n + 1]
    rows: np.ndarray  # int64 [n] global row
    lengths: np.ndarray  # int64 [n]

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.input_ids[a:b], self.loss_mask[a:b]


def load_shard_data(spec: ShardSpec) -> ShardData:
    """The shard's rows, read through the merged dataset's contract (eagle3.merge.dataset)."""
    dataset = read_merged(spec.merge_dir)
    parts = [dataset.token_rows(r.file, r.row_start, r.row_end) for r in spec.ranges]
    lengths = np.concatenate([p.lengths for p in parts]) if parts else np.zeros(0, np.int64)
    return ShardData(
        input_ids=np.concatenate([p.input_ids for p in parts]) if parts else np.zeros(0, np.int32),
        loss_mask=np.concatenate([p.loss_mask for p in parts]) if parts else np.zeros(0, np.uint8),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        rows=np.concatenate([np.arange(r.global_row_start, r.global_row_start + r.row_end - r.row_start)
                             for r in spec.ranges]).astype(np.int64) if parts else np.zeros(0, np.int64),
        lengths=lengths,
    )


def plan_shards(cfg: ShardPlanConfig) -> list[ShardSpec]:
    """N shards of contiguous global rows with about T/N tokens each (never empty)."""
    merge_dir, num_shards = Path(cfg.merge_dir), cfg.num_shards
    dataset = read_merged(merge_dir)
    per_file = dataset.lengths()
    lengths = np.concatenate(per_file)
    n_rows = len(lengths)
    if num_shards > n_rows:
        raise ConfigError(f"num_shards={num_shards} is more than the {n_rows} rows in {merge_dir}")

    # Cut after the row whose running total first reaches k*T/N: each shard is within one
    # sample of T/N tokens. Cuts are forced strictly increasing so no shard is empty.
    cum = np.cumsum(lengths)
    total = int(cum[-1])
    cuts = [0]
    for k in range(1, num_shards):
        c = int(np.searchsorted(cum, total * k / num_shards, side="left")) + 1
        c = max(c, cuts[-1] + 1)
        c = min(c, n_rows - (num_shards - k))
        cuts.append(c)
    cuts.append(n_rows)

    file_starts = np.concatenate([[0], np.cumsum([len(x) for x in per_file])])
    specs = []
    for k in range(num_shards):
        g0, g1 = cuts[k], cuts[k + 1]
        ranges = []
        for fi, f in enumerate(dataset.files):
            a, b = max(g0, int(file_starts[fi])), min(g1, int(file_starts[fi + 1]))
            if a < b:
                off = int(file_starts[fi])
                ranges.append(RowRange(file=f["path"], row_start=a - off, row_end=b - off, global_row_start=a))
        specs.append(ShardSpec(
            shard=k, num_shards=num_shards, merge_dir=str(merge_dir), ranges=ranges, rows=g1 - g0,
            tokens=int(lengths[g0:g1].sum()), merge_fingerprint=dataset.fingerprint,
        ))
    return specs
