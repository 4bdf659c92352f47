"""The on-disk format of extracted hidden states: safetensors chunks plus one manifest per shard.

A shard folder holds `chunk-000000.safetensors`, `chunk-000001.safetensors`, ... and `manifest.json`.
Each chunk holds whole samples, their tokens concatenated. The extractor (eagle3.extract.extractor)
processes a shard's samples longest first, so a chunk holds samples of similar length in that
order; `sample_rows` gives each sample's global row in the merged dataset (not necessarily ascending):

    input_ids      int32  [T]
    loss_mask      uint8  [T]
    aux_hidden     dtype  [T, n_capture * hidden]   capture layers, concatenated in capture order
    final_hidden   dtype  [T, hidden]               last layer after the final norm (the lm_head input)
    sample_offsets int64  [n + 1]                   sample i is tokens offsets[i]:offsets[i+1]
    sample_rows    int64  [n]                       row index of each sample in the merged dataset

fp8 storage (dtype "float8_e4m3fn", half the bytes of bf16; the default on a GPU): aux_hidden/final_hidden are
e4m3 values and two more tensors hold one fp32 scale per token and layer (value = q * scale):
    aux_scale      float32 [T, n_capture]
    final_scale    float32 [T]
`load_chunk` dequantizes them to bfloat16 unless asked not to, so readers see the same tensors.

A chunk is written to a temp name and renamed; the manifest (also renamed into place) is updated
after, so a chunk file not in the manifest is garbage from a killed run and is overwritten.
The manifest is the source of truth for what is committed.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3.errors import PipelineError
from eagle3.io import MANIFEST_NAME, atomic_path, atomic_write_json, read_json, sha256_file

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
    fingerprint: str = ""  # of the params that define the stored states (io.PhaseOutput's skip rule)
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


# safetensors dtype codes of the tensors a chunk may hold
_ST_DTYPES = {
    "float32": "F32", "bfloat16": "BF16", "float16": "F16", "float8_e4m3fn": "F8_E4M3",
    "int64": "I64", "int32": "I32", "uint8": "U8",
}
_WRITE_PIECE = 16 << 20  # bytes per write()/update() call: large enough to release the GIL for long


def _libc_sync_file_range():
    """Linux's sync_file_range(2) through ctypes (Python's os module does not have it), or None elsewhere."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writing the range's dirty pages, do not wait for them


def _start_writeback(f) -> None:
    """Queue the file's dirty pages for the disk now (Linux: sync_file_range, which does not wait), so the disk
    writes a piece while this thread hashes it and copies the next; without it the page cache holds the whole
    chunk until the final fsync and the disk gets nothing from this writer in the meantime. Elsewhere a no-op:
    the fsync writes it all. Its errors are left to that fsync, which reports any failed write."""
    if _SYNC_FILE_RANGE is not None:
        f.flush()
        _SYNC_FILE_RANGE(f.fileno(), 0, 0, SYNC_FILE_RANGE_WRITE)


def _safetensors_header(tensors: dict, metadata: dict) -> tuple[bytes, list]:
    """Header bytes and the (name, tensor) data order of a safetensors file.

    Tensors are laid out by descending element size so every tensor starts aligned to its own
    element size; the header is padded with spaces to 8 bytes, as safetensors itself does.
    """
    order = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header, offset = {}, 0
    for name, t in order:
        dt = _ST_DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dt is None:
            raise ValueError(f"tensor {name}: dtype {t.dtype} is not supported in chunks")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": dt, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, order


def _byte_view(t) -> memoryview:
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        raise ValueError("chunk tensors must be on the CPU")
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_chunk(shard_dir: str | Path, index: int, tensors: dict, metadata: dict | None = None,
                fsync: bool = True) -> ChunkRecord:
    """Write one chunk atomically and return its record (the caller appends it to the manifest and saves).

    The file is a standard safetensors file, streamed straight from the tensors' memory (pinned
    host buffers on a GPU run) and hashed on a second thread while it is written, so the data is
    neither copied into one big bytes object nor read back for its checksum. Deterministic: the
    same tensors and metadata give the same bytes.
    """
    missing = [n for n in TENSOR_NAMES if n not in tensors]
    if missing:
        raise ValueError(f"chunk {index}: missing tensors {missing}")
    path = Path(shard_dir) / chunk_name(index)
    meta = {k: json.dumps(v, sort_keys=True) for k, v in (metadata or {}).items()}
    header, order = _safetensors_header(tensors, meta)
    h = hashlib.sha256(header)
    size = len(header)
    # each piece is hashed on a second thread while this one writes the next (both release the GIL): a chunk takes
    # the longer of the two instead of their sum; the pieces go to the hash in order (one thread, first in first out)
    with atomic_path(path, fsync=fsync) as tmp, ThreadPoolExecutor(1, thread_name_prefix="chunk-sha256") as hasher:
        hashed = []
        with open(tmp, "wb") as f:
            f.write(header)
            for _, t in order:
                mv = _byte_view(t)
                for a in range(0, len(mv), _WRITE_PIECE):
                    piece = mv[a:a + _WRITE_PIECE]
                    hashed.append(hasher.submit(h.update, piece))
                    f.write(piece)
                    if fsync:
                        _start_writeback(f)
                size += len(mv)
        for done in hashed:
            done.result()
    rows = tensors["sample_rows"]
    return ChunkRecord(
        file=path.name,
        sha256=h.hexdigest(),
        tokens=int(tensors["input_ids"].numel()),
        samples=int(rows.numel()),
        first_row=int(rows[0]) if rows.numel() else -1,
        last_row=int(rows[-1]) if rows.numel() else -1,
        bytes=size,
    )


def dequantize(values, scale):
    """bfloat16 states from fp8 `values` [..., n * H] (or [..., H]) and their fp32 `scale` [..., n] (or [...]): each
    H values times their scale, in fp32. The one formula: the reader's load and the training's device use it."""
    import torch

    return (values.float().view(*scale.shape, -1) * scale[..., None]).view(values.shape).to(torch.bfloat16)


def dequantize_fp8(tensors: dict) -> dict:
    """Replace fp8 aux/final states and their per-token scales by bfloat16 states."""
    tensors["aux_hidden"] = dequantize(tensors.pop("aux_hidden"), tensors.pop("aux_scale"))
    tensors["final_hidden"] = dequantize(tensors.pop("final_hidden"), tensors.pop("final_scale"))
    return tensors


def load_chunk(shard_dir: str | Path, record: ChunkRecord, verify: bool = False, dequantize: bool = True) -> dict:
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
    if dequantize and "aux_scale" in tensors:
        tensors = dequantize_fp8(tensors)
    return tensors
