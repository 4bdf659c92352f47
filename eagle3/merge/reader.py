"""Read a merged dataset in global row order (contract 2): file 0's rows, then file 1's, ...

Only a complete manifest is trusted; a row range touches only the row groups that hold it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow.parquet as pq

from eagle3.errors import PipelineError
from eagle3.io import MANIFEST_NAME, read_json


@dataclass
class MergedDataset:
    folder: Path
    manifest: dict

    @property
    def rows(self) -> int:
        return self.manifest["rows"]

    @property
    def tokens(self) -> int:
        return self.manifest["tokens"]

    @property
    def files(self) -> list[dict]:
        return self.manifest["files"]

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
    folder = Path(merge_dir)
    path = folder / MANIFEST_NAME
    try:
        manifest = read_json(path)
    except FileNotFoundError:
        raise PipelineError(f"{path}: no merge manifest (has the merge phase finished?)") from None
    if not manifest.get("complete"):
        raise PipelineError(f"{path}: merge manifest is not complete")
    for f in manifest["files"]:
        if not (folder / f["path"]).is_file():
            raise PipelineError(f"{path}: lists {f['path']} but {folder / f['path']} is missing")
    return MergedDataset(folder, manifest)


def iter_rows(merge_dir: str | Path, start: int = 0, end: int | None = None):
    """Rows [start, end) of a merged dataset as (global_row, sample_id, input_ids, loss_mask)."""
    return read_merged(merge_dir).iter_rows(start, end)
