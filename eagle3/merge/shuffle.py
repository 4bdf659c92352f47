"""External shuffle: hash each sample_id with the seed, spill rows to 2^k bucket files on disk (pass 1),
then load one bucket at a time and sort it by hash (pass 2).

A bucket is chosen by the TOP bits of the 64-bit hash, so bucket 0 sorted, then bucket 1 sorted, ... is
the whole dataset sorted by hash: the output order depends only on (seed, sample_id), never on the number
of buckets, the input order or the block size. Sorting by a keyed hash is a uniformly random permutation.
Memory is one parse block in pass 1 and one bucket in pass 2, whatever the dataset size.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from eagle3.io import names_disk_full
from eagle3.merge.validate import ROW_SCHEMA

BUCKET_SCHEMA = ROW_SCHEMA.append(pa.field("hash", pa.uint64())).append(pa.field("src", pa.int32()))
MAX_BUCKET_BITS = 9  # at most 512 bucket files open at once
SORT_KEYS = [("hash", "ascending"), ("sample_id", "ascending"), ("src", "ascending"), ("line", "ascending")]


def sample_hashes(sample_ids: list[str], seed: int) -> np.ndarray:
    """64-bit keyed BLAKE2b of each sample_id: a stable pseudo-random sort key for this seed."""
    key = int(seed).to_bytes(16, "little", signed=True)
    digests = b"".join(hashlib.blake2b(s.encode("utf-8"), digest_size=8, key=key).digest() for s in sample_ids)
    return np.frombuffer(digests, dtype="<u8").astype(np.uint64)


def bucket_bits_for(estimated_tokens: int, bucket_tokens: int) -> int:
    want = max(1, -(-estimated_tokens // bucket_tokens))
    return min(MAX_BUCKET_BITS, (want - 1).bit_length())


class BucketSpill:
    """Pass 1: append rows to bucket files (Arrow IPC streams: raw arrays, no re-parsing in pass 2)."""

    def __init__(self, folder: Path, bits: int, seed: int):
        self.folder, self.bits, self.seed = Path(folder), bits, seed
        self.folder.mkdir(parents=True, exist_ok=True)
        self._writers: dict[int, pa.ipc.RecordBatchStreamWriter] = {}
        self._sinks: dict[int, pa.OSFile] = {}

    @property
    def num_buckets(self) -> int:
        return 1 << self.bits

    def path(self, b: int) -> Path:
        return self.folder / f"bucket-{b:05d}.arrow"

    def add(self, rows: pa.Table, src: int) -> None:
        n = rows.num_rows
        if n == 0:
            return
        h = sample_hashes(rows.column("sample_id").to_pylist(), self.seed)
        rows = rows.append_column("hash", pa.array(h, pa.uint64())).append_column(
            "src", pa.array(np.full(n, src, np.int32)))
        bucket = (h >> np.uint64(64 - self.bits)).astype(np.int64) if self.bits else np.zeros(n, np.int64)
        order = np.argsort(bucket, kind="stable")
        rows = rows.take(pa.array(order))
        counts = np.bincount(bucket, minlength=self.num_buckets)
        start = 0
        for b in np.flatnonzero(counts):
            with names_disk_full(self.path(int(b))):
                self._writer(int(b)).write_table(rows.slice(start, int(counts[b])))
            start += int(counts[b])

    def _writer(self, b: int):
        w = self._writers.get(b)
        if w is None:
            self._sinks[b] = pa.OSFile(str(self.path(b)), "wb")
            w = self._writers[b] = pa.ipc.new_stream(self._sinks[b], BUCKET_SCHEMA)
        return w

    def close(self) -> None:
        for b, w in self._writers.items():
            with names_disk_full(self.path(b)):
                w.close()
                self._sinks[b].close()
        self._writers.clear()
        self._sinks.clear()


def iter_sorted_buckets(spill: BucketSpill) -> Iterator[tuple[pa.Table, pa.Table]]:
    """Pass 2: yield (unique rows, duplicate rows) per bucket in global hash order; bucket files are
    deleted once read. Among rows sharing a sample_id the first input (src, line) wins."""
    for b in range(spill.num_buckets):
        path = spill.path(b)
        if not path.exists():
            continue
        with pa.memory_map(str(path)) as src:
            table = pa.ipc.open_stream(src).read_all()
        table = table.take(pc.sort_indices(table, sort_keys=SORT_KEYS)).combine_chunks()
        path.unlink()
        sid = table.column("sample_id").to_numpy(zero_copy_only=False)
        dup = np.zeros(len(sid), bool)
        dup[1:] = sid[1:] == sid[:-1]
        if dup.any():
            yield table.filter(pa.array(~dup)), table.filter(pa.array(dup))
        else:
            yield table, table.slice(0, 0)
