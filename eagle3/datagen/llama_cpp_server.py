"""llama.cpp's OpenAI-compatible server (llama-cpp-python) with the CPU's "extra" weight buffers off.

    python -m eagle3.datagen.llama_cpp_server --model <gguf> --host 127.0.0.1 --port 8000 --model_alias smollm2

The same command line as `python -m llama_cpp.server`; the demo and the tests start the local endpoint with it.
Why: llama-cpp-python 0.3.36, built on a Xeon with AMX (this project's VMs, 2026-12-03), puts the weights in its
AMX / repacked CPU buffer types and then dies with SIGSEGV on the first completion, so every request after it
fails to connect; with plain buffers (`use_extra_bufts = False`, llama.cpp's `--no-repack`) it serves the same
replies. The server has no setting for it, so the model's default params are wrapped before it starts.
"""

from __future__ import annotations

import runpy
import sys


def command_template(model_alias: str = "smollm2") -> str:
    """The `server_command` (LocalServer placeholders {gguf} {host} {port}) that starts this wrapper with this
    Python: the demo's and the tests' local endpoint."""
    return (f"{sys.executable} -m eagle3.datagen.llama_cpp_server --model {{gguf}} --host {{host}} --port {{port}} "
            f"--model_alias {model_alias}")


def _without_extra_buffers(default_params):
    def params():
        p = default_params()
        p.use_extra_bufts = False
        return p
    return params


def main() -> None:
    import llama_cpp.llama  # here, not at the top: command_template must not need llama-cpp-python installed

    low_level = llama_cpp.llama.llama_cpp  # the ctypes module the Llama class takes its defaults from
    low_level.llama_model_default_params = _without_extra_buffers(low_level.llama_model_default_params)
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
