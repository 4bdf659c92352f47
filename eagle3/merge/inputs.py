"""Find the datasets to merge: dataset folders holding tokenized.jsonl (the datagen output: eagle3.datagen.contract)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eagle3.errors import ConfigError
from eagle3.datagen.contract import TOKENIZED
from eagle3.io import MANIFEST_NAME



@dataclass(frozen=True)
class DatasetInput:
    name: str  # the folder name; every line's "dataset" field must equal it
    path: Path  # <folder>/tokenized.jsonl
    size: int
    mtime_ns: int
    datagen_complete: bool  # the datagen manifest.json beside it says complete

    def identity(self) -> list:
        """What the fingerprint records: the dataset's content, not its path. A complete datagen output's content
        is the sha256 its manifest records for the file (checked against the size); another file's is its
        modification time, with its size (hashing every input before a skip would cost a pass over them)."""
        try:
            m = json.loads((self.path.parent / MANIFEST_NAME).read_text())
        except (OSError, ValueError):
            m = {}
        if isinstance(m, dict) and m.get("complete") and m.get("sha256") and m.get("file") == self.path.name:
            return [self.name, self.size, m["sha256"]]
        return [self.name, self.size, self.mtime_ns]


def _datagen_complete(folder: Path) -> bool:
    try:
        return bool(json.loads((folder / MANIFEST_NAME).read_text()).get("complete"))
    except (OSError, ValueError, AttributeError):
        return False


def _describe(folder: Path) -> DatasetInput:
    f = folder / TOKENIZED
    st = f.stat()
    return DatasetInput(folder.name, f, st.st_size, st.st_mtime_ns, _datagen_complete(folder))


def discover_datasets(inputs: list[str], include: list[str] | None = None,
                      exclude: list[str] = (), require_datagen_complete: bool = False) -> list[DatasetInput]:
    """Each input is a dataset folder or a parent of dataset folders. Returned sorted by name, so the order
    inputs are given in never changes the result."""
    found: dict[str, DatasetInput] = {}
    for raw in inputs:
        p = Path(raw)
        if p.is_file() and p.name == TOKENIZED:
            p = p.parent
        if not p.is_dir():
            raise ConfigError(f"inputs: {raw} is not a folder")
        if (p / TOKENIZED).is_file():
            folders = [p]
        else:
            folders = sorted(c for c in p.iterdir() if c.is_dir() and (c / TOKENIZED).is_file())
            if not folders:
                raise ConfigError(f"inputs: {raw} holds no {TOKENIZED} and no dataset folders with one")
        for folder in folders:
            ds = _describe(folder)
            prev = found.get(ds.name)
            if prev is not None and prev.path.resolve() != ds.path.resolve():
                raise ConfigError(f"inputs: dataset name {ds.name!r} appears twice: {prev.path} and {ds.path}")
            found[ds.name] = ds
    if include is not None:
        unknown = sorted(set(include) - set(found))
        if unknown:
            raise ConfigError(f"include: no dataset named {unknown}; found {sorted(found)}")
        found = {k: v for k, v in found.items() if k in set(include)}
    found = {k: v for k, v in found.items() if k not in set(exclude)}
    if not found:
        raise ConfigError(f"inputs: no dataset left to merge (include={include}, exclude={list(exclude)})")
    if require_datagen_complete:
        bad = [str(d.path.parent / MANIFEST_NAME) for d in found.values() if not d.datagen_complete]
        if bad:
            raise ConfigError(f"require_datagen_complete: datagen not complete (manifest missing or complete!=true): {bad}")
    return [found[k] for k in sorted(found)]
