"""The on-disk format of extracted hidden states: safetensors chunks plus one manifest per shard.

A shard folder holds `chunk-000000.safetensors`, `chunk-000001.safetensors`, ... and `manifest.json`.
Each chunk holds the samples of consecutive rows, their tokens concatenated:

    input_ids      int32  [T]
    loss_mask      uint8  [T]
    aux_hidden     dtype  [T, n_capture * hidden]   capture layers, concatenated in capture order
    final_hidden   dtype  [T, hidden]               last layer after the final norm (the lm_head input)
    sample_offsets int64  [n + 1]                   sample i is tokens offsets[i]:offsets[i+1]
    sample_rows    int64  [n]                       row index of each sample in the merged dataset

A chunk is written to a temp name and renamed; the manifest (also renamed into place) is updated
after, so a chunk file not in the manifest is garbage from a killed run and is overwritten.
The manifest is the source of truth for what is committed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3.errors import PipelineError
from eagle3.io import atomic_path, atomic_write_json, read_json, sha256_file, MANIFEST_NAME

FORMAT_VERSION = 1
TENSOR_NAMES = ("input_ids", "loss_mask", "aux_hidden", "final_hidden", "sample_offsets", "sample_rows")


class CorruptChunkError(PipelineError):
    """A chunk is missing, truncated or does not match its manifest checksum; the message names the file."""


def chunk_name(index: int) -> str:
    return f"chunk-{index:06d}.safetensors"


@dataclass
class ChunkRecord:
    file: str
    sha256: str
    tokens: int
    samples: int
    first_row: int
    last_row: int
    bytes: int


@dataclass
class ShardManifest:
    shard: int
    model_path: str
    capture_layers: list[int]
    hidden_size: int
    dtype: str
    rows: list[list[int]] = field(default_factory=list)  # planned [start, end) row ranges of the merged dataset
    chunks: list[ChunkRecord] = field(default_factory=list)
    complete: bool = False
    params: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.chunks)

    @property
    def samples(self) -> int:
        return sum(c.samples for c in self.chunks)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens"] = self.tokens
        d["samples"] = self.samples
        return d

    def save(self, shard_dir: str | Path) -> None:
        atomic_write_json(Path(shard_dir) / MANIFEST_NAME, self.to_dict())

    @classmethod
    def load(cls, shard_dir: str | Path) -> "ShardManifest":
        path = Path(shard_dir) / MANIFEST_NAME
        if not path.is_file():
            raise CorruptChunkError(f"{path}: shard manifest is missing")
        d = read_json(path)
        d.pop("tokens", None)
        d.pop("samples", None)
        d["chunks"] = [ChunkRecord(**c) for c in d.get("chunks", [])]
        return cls(**d)


def write_chunk(shard_dir: str | Path, index: int, tensors: dict, metadata: dict | None = None,
                fsync: bool = True) -> ChunkRecord:
    """Write one chunk atomically and return its record (the caller appends it to the manifest and saves)."""
    from safetensors.torch import save_file

    missing = [n for n in TENSOR_NAMES if n not in tensors]
    if missing:
        raise ValueError(f"chunk {index}: missing tensors {missing}")
    path = Path(shard_dir) / chunk_name(index)
    meta = {k: json.dumps(v) for k, v in (metadata or {}).items()}
    with atomic_path(path, fsync=fsync) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
    rows = tensors["sample_rows"]
    return ChunkRecord(
        file=path.name,
        sha256=sha256_file(path),
        tokens=int(tensors["input_ids"].numel()),
        samples=int(rows.numel()),
        first_row=int(rows[0]) if rows.numel() else -1,
        last_row=int(rows[-1]) if rows.numel() else -1,
        bytes=path.stat().st_size,
    )


def load_chunk(shard_dir: str | Path, record: ChunkRecord, verify: bool = False) -> dict:
    """Load a committed chunk; with verify=True its sha256 is checked against the manifest."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(shard_dir) / record.file
    if not path.is_file():
        raise CorruptChunkError(f"{path}: chunk listed in the manifest is missing")
    if verify:
        got = sha256_file(path)
        if got != record.sha256:
            raise CorruptChunkError(f"{path}: checksum mismatch (manifest {record.sha256[:12]}..., file {got[:12]}...)")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CorruptChunkError(f"{path}: unreadable safetensors chunk: {e}") from e
    if int(tensors["input_ids"].numel()) != record.tokens:
        raise CorruptChunkError(f"{path}: holds {tensors['input_ids'].numel()} tokens, manifest says {record.tokens}")
    return tensors
