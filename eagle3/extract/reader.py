"""Read extracted hidden states back across shards: the one way the training phase reads them.

By sample (`iter(reader)`), or by chunk: `chunks()` lists the committed chunks in shard, chunk order,
`load(chunk)` reads one and `sample_lengths(chunk)` reads only its sample offsets (no hidden states).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from eagle3.extract.format import ChunkRecord, CorruptChunkError, ShardManifest, load_chunk


@dataclass
class Sample:
    row: int
    input_ids: "torch.Tensor"  # int32 [T]
    loss_mask: "torch.Tensor"  # uint8 [T]
    aux_hidden: "torch.Tensor"  # [T, n_capture * hidden]
    final_hidden: "torch.Tensor"  # [T, hidden]


@dataclass(frozen=True)
class Chunk:
    """One committed chunk: its shard folder and its manifest record (tokens, samples, file)."""

    shard_dir: Path
    record: ChunkRecord


class HiddenStateReader:
    """Iterate the samples of one or more shard folders in shard, chunk, row order.

    Only committed chunks (those in each manifest) are read. With `require_complete`, a shard
    whose extraction has not finished is an error rather than silently partial data.
    """

    def __init__(self, shard_dirs: list[str | Path], verify: bool = False, require_complete: bool = True):
        self.shard_dirs = [Path(d) for d in shard_dirs]
        if not self.shard_dirs:
            raise CorruptChunkError("no shard folders given to HiddenStateReader")
        self.verify = verify
        self.manifests = [ShardManifest.load(d) for d in self.shard_dirs]
        for d, m in zip(self.shard_dirs, self.manifests):
            if require_complete and not m.complete:
                raise CorruptChunkError(f"{d}/manifest.json: shard {m.shard} is not complete ({len(m.chunks)} chunks)")
        first = self.manifests[0]
        for d, m in zip(self.shard_dirs, self.manifests):
            if (m.hidden_size, m.capture_layers) != (first.hidden_size, first.capture_layers):
                raise CorruptChunkError(
                    f"{d}: hidden_size {m.hidden_size} / capture_layers {m.capture_layers} differ from "
                    f"{self.shard_dirs[0]} ({first.hidden_size} / {first.capture_layers})"
                )

    @property
    def hidden_size(self) -> int:
        return self.manifests[0].hidden_size

    @property
    def capture_layers(self) -> list[int]:
        return self.manifests[0].capture_layers

    @property
    def num_samples(self) -> int:
        return sum(m.samples for m in self.manifests)

    @property
    def num_tokens(self) -> int:
        return sum(m.tokens for m in self.manifests)

    def chunks(self) -> list[Chunk]:
        """The committed chunks that hold samples, in shard then chunk order."""
        return [Chunk(d, rec) for d, m in zip(self.shard_dirs, self.manifests) for rec in m.chunks if rec.samples]

    def load(self, chunk: Chunk, dequantize: bool = True) -> dict:
        """All tensors of one chunk (eagle3.extract.format lists them), checked against its record; fp8 states
        as bf16, or with dequantize=False as stored (e4m3 values and their per-token scales)."""
        return load_chunk(chunk.shard_dir, chunk.record, verify=self.verify, dequantize=dequantize)

    def sample_lengths(self, chunk: Chunk) -> list[int]:
        """Token count of each sample of a chunk, read from its offsets alone (the hidden states stay on disk)."""
        from safetensors import SafetensorError, safe_open

        path = chunk.shard_dir / chunk.record.file
        try:
            with safe_open(str(path), "pt") as f:
                offsets = f.get_tensor("sample_offsets").tolist()
        except (SafetensorError, OSError) as e:
            raise CorruptChunkError(f"{path}: unreadable safetensors chunk: {e}") from e
        if len(offsets) != chunk.record.samples + 1 or offsets[-1] != chunk.record.tokens:
            raise CorruptChunkError(f"{path}: sample_offsets do not match the manifest's {chunk.record.samples} "
                                    f"samples / {chunk.record.tokens} tokens")
        return [b - a for a, b in zip(offsets, offsets[1:])]

    def iter_chunks(self) -> Iterator[dict]:
        for chunk in self.chunks():
            yield self.load(chunk)

    def __iter__(self) -> Iterator[Sample]:
        for t in self.iter_chunks():
            off = t["sample_offsets"].tolist()
            for i, row in enumerate(t["sample_rows"].tolist()):
                a, b = off[i], off[i + 1]
                yield Sample(row, t["input_ids"][a:b], t["loss_mask"][a:b], t["aux_hidden"][a:b], t["final_hidden"][a:b])
