"""Small helpers shared by the datagen tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def llama_server_command() -> str:
    """The local-server command template the tests (and the demo) use in place of SGLang."""
    return (f"{sys.executable} -m eagle3.datagen.llama_cpp_server --model {{gguf}} --host {{host}} --port {{port}} "
            f"--model_alias smollm2")


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path
