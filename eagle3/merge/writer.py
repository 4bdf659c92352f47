"""Write rows, in the order given, into parquet parts of about `tokens_per_file` tokens each (the schema and
part names of contract 2: eagle3.merge.dataset).

Writer settings are fixed here so the same rows always give the same bytes. Row groups hold about
`row_group_tokens` tokens so a reader can seek to a row range without reading a whole part.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagle3.io import names_disk_full, sha256_file
from eagle3.merge.dataset import PART_SCHEMA, part_name

PARQUET_OPTIONS = dict(compression="zstd", compression_level=1, use_dictionary=["dataset"], write_statistics=False,
                       version="2.6", data_page_version="1.0")


class PartWriter:
    def __init__(self, folder: Path, tokens_per_file: int, row_group_tokens: int):
        self.folder = Path(folder)
        self.tokens_per_file, self.row_group_tokens = tokens_per_file, row_group_tokens
        self.files: list[dict] = []  # manifest entries of closed parts
        self._writer: pq.ParquetWriter | None = None
        self._file_rows = self._file_tokens = 0
        self._pending: list[pa.Table] = []
        self._pending_tokens = 0

    def add(self, rows: pa.Table) -> None:
        rows = rows.select(PART_SCHEMA.names).cast(PART_SCHEMA)
        while rows.num_rows:
            cum = np.cumsum(rows.column("length").to_numpy())
            # tokens until the row group or the file is full (pending rows count toward both)
            need = min(self.row_group_tokens, self.tokens_per_file - self._file_tokens) - self._pending_tokens
            k = int(np.searchsorted(cum, need))  # first row at which the group (or file) is full
            if k >= rows.num_rows:
                self._pending.append(rows)
                self._pending_tokens += int(cum[-1])
                return
            self._pending.append(rows.slice(0, k + 1))
            self._pending_tokens += int(cum[k])
            rows = rows.slice(k + 1)
            self._flush_group()
            if self._file_tokens >= self.tokens_per_file:
                self._close_file()

    def _flush_group(self) -> None:
        if not self._pending:
            return
        group = pa.concat_tables(self._pending).combine_chunks()
        path = self.folder / part_name(len(self.files))
        with names_disk_full(path):
            if self._writer is None:
                self._writer = pq.ParquetWriter(str(path), PART_SCHEMA, **PARQUET_OPTIONS)
            self._writer.write_table(group, row_group_size=group.num_rows)
        self._file_rows += group.num_rows
        self._file_tokens += self._pending_tokens
        self._pending, self._pending_tokens = [], 0

    def _close_file(self) -> None:
        if self._writer is None:
            return
        name = part_name(len(self.files))
        with names_disk_full(self.folder / name):
            self._writer.close()
        self._writer = None
        self.files.append({"path": name, "rows": self._file_rows, "tokens": self._file_tokens,
                           "sha256": sha256_file(self.folder / name)})
        self._file_rows = self._file_tokens = 0

    def close(self) -> list[dict]:
        self._flush_group()
        self._close_file()
        return self.files
