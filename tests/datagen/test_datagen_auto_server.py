"""The form's "auto" datagen server: what preflight picks on this machine (no GPU: llama.cpp on the GGUF the
set-up installed), what it keeps, and the errors that name the param to set."""

from __future__ import annotations

import pytest

from eagle3.datagen.auto_server import AUTO, LLAMA_CPP_ALIAS, installed, resolve_server
from eagle3.datagen.server import DEFAULT_SERVER_COMMAND
from eagle3.errors import ConfigError
from eagle3.models import find_smollm2_gguf


def test_no_gpu_picks_llama_cpp_on_the_packaged_gguf(smollm2_path):
    c = resolve_server("local", str(smollm2_path), AUTO, AUTO, AUTO, gpus=0)
    assert c.engine == "llama.cpp" and c.why == "no GPU"
    assert c.gguf == str(find_smollm2_gguf()) and c.served_model_name == LLAMA_CPP_ALIAS
    assert "-m eagle3.datagen.llama_cpp_server" in c.server_command and f"--model_alias {LLAMA_CPP_ALIAS}" in c.server_command
    assert "llama.cpp server (no GPU)" in c.summary() and c.gguf in c.summary()


def test_a_gpu_picks_sglang_when_installed(smollm2_path):
    c = resolve_server("local", str(smollm2_path), AUTO, AUTO, AUTO, gpus=2)
    if installed("sglang"):
        assert (c.engine, c.server_command, c.served_model_name) == ("sglang", DEFAULT_SERVER_COMMAND, "default")
    else:  # the GPU alone is not enough: SGLang must be there to start
        assert c.engine == "llama.cpp" and c.why == "2 GPU(s) but SGLang is not installed"


def test_given_values_are_kept(smollm2_path, tmp_path):
    c = resolve_server("local", str(smollm2_path), "my-server --port {port}", "/m.gguf", "mine", gpus=0)
    assert (c.server_command, c.gguf, c.served_model_name, c.engine) == ("my-server --port {port}", "/m.gguf", "mine",
                                                                          "yours")
    null = resolve_server("local", str(smollm2_path), None, None, AUTO, gpus=0)  # null = SGLang, as before
    assert (null.engine, null.served_model_name) == ("sglang", "default")
    remote = resolve_server("remote", str(smollm2_path), AUTO, AUTO, "gpt-x", gpus=0)
    assert (remote.engine, remote.server_command, remote.served_model_name) == ("remote", None, "gpt-x")


def test_errors_name_the_param(smollm2_path, tmp_path):
    with pytest.raises(ConfigError, match="served_model_name: 'auto' works only for a local server"):
        resolve_server("remote", str(smollm2_path), AUTO, AUTO, AUTO, gpus=0)
    other = tmp_path / "other-model"
    other.mkdir()
    with pytest.raises(ConfigError, match=f"none was found for {other}: set the gguf param"):
        resolve_server("local", str(other), AUTO, AUTO, AUTO, gpus=0)
    (other / "x.Q4.gguf").write_bytes(b"GGUF")  # a GGUF beside the HF files is the one served
    assert resolve_server("local", str(other), AUTO, AUTO, AUTO, gpus=0).gguf == str(other / "x.Q4.gguf")
