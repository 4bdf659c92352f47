"""Small helpers shared by the datagen tests."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.datagen.llama_cpp_server import command_template


def llama_server_command() -> str:
    """The local-server command template the tests (and the demo) use in place of SGLang."""
    return command_template("smollm2")


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path
