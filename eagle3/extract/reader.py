"""Read extracted hidden states back, sample by sample, across shards (the training phase's input)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from eagle3.extract.format import CorruptChunkError, ShardManifest, load_chunk


@dataclass
class Sample:
    row: int
    input_ids: "torch.Tensor"  # int32 [T]
    loss_mask: "torch.Tensor"  # uint8 [T]
    aux_hidden: "torch.Tensor"  # [T, n_capture * hidden]
    final_hidden: "torch.Tensor"  # [T, hidden]


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

    def iter_chunks(self) -> Iterator[dict]:
        for d, m in zip(self.shard_dirs, self.manifests):
            for rec in m.chunks:
                yield load_chunk(d, rec, verify=self.verify)

    def __iter__(self) -> Iterator[Sample]:
        for t in self.iter_chunks():
            off = t["sample_offsets"].tolist()
            for i, row in enumerate(t["sample_rows"].tolist()):
                a, b = off[i], off[i + 1]
                yield Sample(row, t["input_ids"][a:b], t["loss_mask"][a:b], t["aux_hidden"][a:b], t["final_hidden"][a:b])
