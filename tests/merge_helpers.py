"""Small tokenized-JSONL datasets (datagen output format, contract 1) written by the merge tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.parquet as pq


def write_dataset(root: Path, name: str, rows: list, complete: bool = True) -> Path:
    """rows: dicts (written as JSON) or str (written verbatim, for malformed lines)."""
    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "tokenized.jsonl", "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    (folder / "manifest.json").write_text(json.dumps({"complete": complete}))
    return folder


def sample(name: str, i: int, ids: list[int], mask: list[int] | None = None) -> dict:
    return {"sample_id": f"{name}-{i}", "dataset": name, "input_ids": ids,
            "loss_mask": mask if mask is not None else [0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2)}


def random_datasets(root: Path, names=("A", "B", "C"), n=60, max_len=40, vocab=1000, seed=0) -> list[Path]:
    rng = random.Random(seed)
    out = []
    for name in names:
        rows = []
        for i in range(n):
            L = rng.randint(2, max_len)
            rows.append(sample(name, i, [rng.randrange(vocab) for _ in range(L)]))
        out.append(write_dataset(root, name, rows))
    return out


def read_all(merge_dir: Path) -> list[dict]:
    """Every row in global row order, read with plain pyarrow from the manifest (contract 2)."""
    m = json.loads((Path(merge_dir) / "manifest.json").read_text())
    rows = []
    for f in m["files"]:
        rows += pq.read_table(Path(merge_dir) / f["path"]).to_pylist()
    return rows


def part_bytes(merge_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(merge_dir).glob("part-*.parquet"))}
