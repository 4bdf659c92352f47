"""What an input IS, for the fingerprints that decide whether a phase's output can be reused or resumed: its
content, never the path it lives at. A run folder, a model or a dataset moved or copied to other storage keeps
its identity, so a copied run resumes instead of failing with "written with other params".

- a model folder: its config.json (hashed) and its weight files (names and sizes: hashing 100s of GB per task
  would cost minutes, and a changed weight file changes its size or its config in practice);
- a tokenizer: its tokenizer files, hashed (small);
- a file: its sha256.
A path that does not exist (a model built in memory by tests) is its own identity.
"""

from __future__ import annotations

from pathlib import Path

from eagle3.io import sha256_file

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt")


def model_identity(model_path: str | Path) -> dict | str:
    path = Path(model_path)
    if not (path / "config.json").is_file():
        return str(model_path)
    weights = sorted([p.name, p.stat().st_size] for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)  # JSON-alike
    return {"config_sha256": sha256_file(path / "config.json"), "weights": weights}


def tokenizer_identity(path: str | Path) -> dict | str:
    path = Path(path)
    files = {name: sha256_file(path / name) for name in TOKENIZER_FILES if (path / name).is_file()}
    return files or model_identity(path)  # a GGUF-only folder: the model file carries the tokenizer


def file_identity(path: str | Path) -> str:
    path = Path(path)
    return sha256_file(path) if path.is_file() else str(path)
