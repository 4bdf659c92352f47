"""Shard plan: split the merged dataset into N shards of about equal token counts.

The merge phase writes `part-*.parquet` files and a manifest (BRIEF contract 2). A sample's
global row index is its position when the files are read in manifest order. A shard is a
contiguous range of global rows, cut where the running token count crosses k * T / N, so
shards differ by at most one sample's tokens. Contiguous ranges keep a shard cheap to read
(a few row ranges of a few files). The merge phase already shuffled the rows, so contiguous
ranges do not bias the length mix of a shard.

Each shard spec is a small JSON-able dict: it is the XCom that `ExtractShardOperator.expand`
maps over, and it is all an extraction task needs besides the model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from eagle3.errors import ConfigError, PipelineError
from eagle3.io import MANIFEST_NAME, read_json


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


def read_merge_manifest(merge_dir: str | Path) -> dict:
    merge_dir = Path(merge_dir)
    path = merge_dir / MANIFEST_NAME
    if not path.is_file():
        raise PipelineError(f"{path}: merge manifest is missing (has the merge phase finished?)")
    m = read_json(path)
    if not m.get("complete"):
        raise PipelineError(f"{path}: merge output is not complete (\"complete\" is not true)")
    files = m.get("files")
    if not isinstance(files, list) or not files:
        raise PipelineError(f"{path}: \"files\" must be a non-empty list")
    for i, f in enumerate(files):
        for key in ("path", "rows", "tokens"):
            if key not in f:
                raise PipelineError(f"{path}: files[{i}] has no {key!r}")
        if not (merge_dir / f["path"]).is_file():
            raise PipelineError(f"{path}: files[{i}] names {f['path']}, which does not exist in {merge_dir}")
    return m


def read_lengths(merge_dir: str | Path, manifest: dict) -> list[np.ndarray]:
    """The `length` column of every file, in manifest order (a cheap column read)."""
    import pyarrow.parquet as pq

    out = []
    for f in manifest["files"]:
        path = Path(merge_dir) / f["path"]
        try:
            col = pq.read_table(path, columns=["length"]).column("length")
        except (OSError, KeyError, ValueError) as e:
            raise PipelineError(f"{path}: cannot read column 'length': {e}") from e
        lengths = col.to_numpy().astype(np.int64)
        if len(lengths) != f["rows"]:
            raise PipelineError(f"{path}: {len(lengths)} rows, merge manifest says {f['rows']}")
        if int(lengths.sum()) != f["tokens"]:
            raise PipelineError(f"{path}: {int(lengths.sum())} tokens, merge manifest says {f['tokens']}")
        out.append(lengths)
    return out


def plan_shards(merge_dir: str | Path, num_shards: int) -> list[ShardSpec]:
    """N shards of contiguous global rows with about T/N tokens each (never empty)."""
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ConfigError(f"num_shards must be a positive int, got {num_shards!r}")
    merge_dir = Path(merge_dir)
    manifest = read_merge_manifest(merge_dir)
    per_file = read_lengths(merge_dir, manifest)
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
        for fi, f in enumerate(manifest["files"]):
            a, b = max(g0, int(file_starts[fi])), min(g1, int(file_starts[fi + 1]))
            if a < b:
                off = int(file_starts[fi])
                ranges.append(RowRange(file=f["path"], row_start=a - off, row_end=b - off, global_row_start=a))
        specs.append(ShardSpec(
            shard=k, num_shards=num_shards, merge_dir=str(merge_dir), ranges=ranges, rows=g1 - g0,
            tokens=int(lengths[g0:g1].sum()), merge_fingerprint=str(manifest.get("fingerprint", "")),
        ))
    return specs
