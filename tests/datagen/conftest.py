"""Fixtures for the datagen tests: a REAL OpenAI-compatible server (llama.cpp) on the real SmolLM2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from eagle3.datagen.server import free_port


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from eagle3.models import find_smollm2_gguf

    return find_smollm2_gguf()


@pytest.fixture(scope="session")
def llama_server(smollm2_gguf):
    """llama.cpp's server on the real SmolLM2 GGUF (through eagle3.datagen.llama_cpp_server, which keeps it off the
    CPU buffer types that crash it on AMX Xeons); one request at a time, ~50 tok/s on this CPU."""
    pytest.importorskip("llama_cpp.server", reason="install the test extra: llama-cpp-python[server]")
    port = free_port()
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"eagle3-llama-{port}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "eagle3.datagen.llama_cpp_server", "--model", str(smollm2_gguf),
                             "--host", "127.0.0.1", "--port", str(port), "--model_alias", "smollm2"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                assert json.load(r)["data"][0]["id"] == "smollm2"
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the llama.cpp server did not start; see {log.name}")
            time.sleep(0.3)
    yield {"url": url + "/v1", "port": port, "pid": proc.pid}
    proc.terminate()
    proc.wait(10)
    log.close()

