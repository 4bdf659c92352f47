"""The merged dataset (contract 2): what the merge phase writes and the extraction phase reads, in one place.

A merged dataset is a folder of parquet parts (`part-00000.parquet`, ...) with the columns of PART_SCHEMA,
`stats.json`, and `manifest.json`, written last:

    {"complete": true, "fingerprint": ..., "files": [{"path", "rows", "tokens", "sha256"}, ...],
     "rows": ..., "tokens": ..., "seed": ..., "params": {...}}

A sample's global row index is its position when the files are read in manifest order. Only a complete
manifest is trusted; a row range touches only the row groups that hold it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle3.errors import PipelineError
from eagle3.io import MANIFEST_NAME, read_json

PART_SCHEMA = pa.schema([("sample_id", pa.string()), ("dataset", pa.string()), ("input_ids", pa.list_(pa.int32())),
                         ("loss_mask", pa.list_(pa.int8())), ("length", pa.int32())])
STATS_NAME = "stats.json"
FILE_KEYS = ("path", "rows", "tokens")  # what a reader needs of each file entry


def part_name(i: int) -> str:
    return f"part-{i:05d}.parquet"


def manifest_record(files: list[dict], seed: int, params: dict) -> dict:
    """The manifest of a merged dataset, before PhaseOutput.commit adds "complete" and "fingerprint"."""
    return {"files": files, "rows": sum(f["rows"] for f in files), "tokens": sum(f["tokens"] for f in files),
            "seed": seed, "params": params}


@dataclass
class TokenRows:
    """Rows [row_start, row_end) of one part as flat arrays: row i's tokens are ids[offsets[i]:offsets[i+1]]."""

    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    lengths: np.ndarray  # int64 [n]


@dataclass
class MergedDataset:
    folder: Path
    manifest: dict

    @property
    def path(self) -> Path:
        return self.folder / MANIFEST_NAME

    @property
    def rows(self) -> int:
        return self.manifest["rows"]

    @property
    def tokens(self) -> int:
        return self.manifest["tokens"]

    @property
    def files(self) -> list[dict]:
        return self.manifest["files"]

    @property
    def fingerprint(self) -> str:
        return str(self.manifest.get("fingerprint", ""))

    def lengths(self) -> list[np.ndarray]:
        """The `length` column of every part, in manifest order (a cheap column read), checked against the
        manifest's row and token counts."""
        out = []
        for f in self.files:
            path = self.folder / f["path"]
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

    def token_rows(self, file: str, row_start: int, row_end: int) -> TokenRows:
        """Rows [row_start, row_end) of part `file`, checked: length == len(input_ids) == len(loss_mask) > 0."""
        path = self.folder / file
        try:
            table = pq.read_table(path, columns=["input_ids", "loss_mask", "length"])
        except (OSError, KeyError, ValueError) as e:
            raise PipelineError(f"{path}: cannot read input_ids/loss_mask/length: {e}") from e
        if row_end > table.num_rows:
            raise PipelineError(f"{path}: rows up to {row_end} wanted, the file has {table.num_rows}")
        t = table.slice(row_start, row_end - row_start)
        ids, mask = t.column("input_ids").combine_chunks(), t.column("loss_mask").combine_chunks()
        length = t.column("length").to_numpy().astype(np.int64)
        n_ids = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
        n_mask = pc.list_value_length(mask).to_numpy(zero_copy_only=False).astype(np.int64)
        bad = np.nonzero((n_ids != length) | (n_mask != length) | (length < 1))[0]
        if len(bad):
            j = int(bad[0])
            raise PipelineError(f"{path}: row {row_start + j}: length={int(length[j])}, len(input_ids)="
                                f"{int(n_ids[j])}, len(loss_mask)={int(n_mask[j])} (must be equal and > 0)")
        return TokenRows(ids.flatten().to_numpy(zero_copy_only=False).astype(np.int32),
                         mask.flatten().to_numpy(zero_copy_only=False).astype(np.uint8), length)

    def iter_rows(self, start: int = 0, end: int | None = None) -> Iterator[tuple[int, str, np.ndarray, np.ndarray]]:
        """Yield (global_row, sample_id, input_ids int32[n], loss_mask int8[n]) for rows [start, end)."""
        end = self.rows if end is None else min(end, self.rows)
        first = 0  # global row of the current file's row 0
        for f in self.files:
            if first >= end:
                break
            if first + f["rows"] > start:
                yield from self._iter_file(self.folder / f["path"], first, max(start, first), end)
            first += f["rows"]

    @staticmethod
    def _iter_file(path: Path, first: int, start: int, end: int):
        pf = pq.ParquetFile(path)
        g0 = first
        for g in range(pf.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if g0 + n > start and g0 < end:
                t = pf.read_row_group(g, columns=["sample_id", "input_ids", "loss_mask"])
                lo, hi = max(start, g0) - g0, min(end, g0 + n) - g0
                t = t.slice(lo, hi - lo)
                ids, mask = t.column("input_ids").combine_chunks(), t.column("loss_mask").combine_chunks()
                ids_v = ids.flatten().to_numpy()
                mask_v = mask.flatten().to_numpy()
                offs = np.concatenate([[0], np.cumsum(ids.value_lengths().to_numpy())])
                for i, sid in enumerate(t.column("sample_id").to_pylist()):
                    yield g0 + lo + i, sid, ids_v[offs[i]:offs[i + 1]], mask_v[offs[i]:offs[i + 1]]
            g0 += n
            if g0 >= end:
                break


def read_merged(merge_dir: str | Path) -> MergedDataset:
    """The merged dataset in `merge_dir`, if its manifest is complete, lists its files and they exist."""
    folder = Path(merge_dir)
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise PipelineError(f"{path}: merge manifest is missing (has the merge phase finished?)")
    m = read_json(path)
    if not isinstance(m, dict) or m.get("complete") is not True:
        raise PipelineError(f"{path}: merge output is not complete (\"complete\" is not true)")
    files = m.get("files")
    if not isinstance(files, list) or not files:
        raise PipelineError(f"{path}: \"files\" must be a non-empty list")
    for i, f in enumerate(files):
        for key in FILE_KEYS:
            if key not in f:
                raise PipelineError(f"{path}: files[{i}] has no {key!r}")
        if not (folder / f["path"]).is_file():
            raise PipelineError(f"{path}: files[{i}] names {f['path']}, which does not exist in {folder}")
    return MergedDataset(folder, m)


def iter_rows(merge_dir: str | Path, start: int = 0, end: int | None = None):
    """Rows [start, end) of a merged dataset as (global_row, sample_id, input_ids, loss_mask)."""
    return read_merged(merge_dir).iter_rows(start, end)
