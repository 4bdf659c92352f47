""""auto" for the local datagen server: one trigger form whose defaults run wherever the README's set-up ran.

    server_command, gguf, served_model_name = "auto"   (the form's defaults)

resolve into, once, in preflight (then every datagen task gets the same values through preflight's XCom):
  - a GPU is visible and SGLang is installed -> SGLang on the HF folder (its served model name is "default");
  - else llama.cpp's server (llama-cpp-python, the CPU set-up installs it) on the model's GGUF: a `*.gguf`
    inside model_path, or the packaged SmolLM2 GGUF when model_path is that model's converted folder;
    the server serves it under the alias "target";
  - else a ConfigError that names the params to set.
A value the user gave is kept as it is. The choice and its reason go to preflight's summary and log.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from eagle3.errors import ConfigError, PipelineError

AUTO = "auto"
LLAMA_CPP_ALIAS = "target"
SGLANG_SERVED_NAME = "default"  # what SGLang serves a model as unless --served-model-name is given


@dataclass(frozen=True)
class ServerChoice:
    server_command: str | None
    gguf: str | None
    served_model_name: str
    engine: str  # "sglang", "llama.cpp", "yours" (a command the user gave) or "remote"
    why: str

    def summary(self) -> str:
        if self.engine == "remote":
            return f"datagen: remote endpoint, model {self.served_model_name!r}"
        gguf = f", gguf {self.gguf}" if self.gguf else ""
        return (f"datagen: {self.engine} server ({self.why}), served model {self.served_model_name!r}{gguf}; "
                f"command: {self.server_command}")


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def find_gguf(model_path: str) -> str | None:
    """The GGUF of the target: one inside its folder, or the packaged SmolLM2 one for its converted folder."""
    from eagle3.models import SMOLLM2_DIRNAME, find_smollm2_gguf

    found = sorted(Path(model_path).glob("*.gguf"))
    if found:
        return str(found[0])
    if Path(model_path).name == SMOLLM2_DIRNAME:
        try:
            return str(find_smollm2_gguf())
        except PipelineError:
            return None
    return None


# Named servers the form may ask for without free-form commands (eagle3.settings.ALLOW_SERVER_COMMAND), and the
# serving flags their server_extra_args may hold: none of them loads code or reads files named by the form.
VLLM_COMMAND = ("python -m vllm.entrypoints.openai.api_server --model {model_path} --host {host} --port {port} "
                "--served-model-name " + SGLANG_SERVED_NAME)
NAMED_SERVERS = ("sglang", "vllm", "llama.cpp")
SERVER_FLAGS = {
    "sglang": {"--tp", "--tp-size", "--dp", "--dp-size", "--mem-fraction-static", "--context-length", "--dtype",
               "--quantization", "--kv-cache-dtype", "--max-running-requests", "--max-total-tokens",
               "--chunked-prefill-size", "--attention-backend", "--cuda-graph-max-bs", "--disable-radix-cache",
               "--disable-cuda-graph", "--enable-torch-compile", "--random-seed"},
    "vllm": {"--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp", "--gpu-memory-utilization",
             "--max-model-len", "--dtype", "--quantization", "--kv-cache-dtype", "--max-num-seqs",
             "--max-num-batched-tokens", "--enforce-eager", "--seed", "--no-enable-prefix-caching"},
    "llama.cpp": {"--n_ctx", "--n_threads", "--n_batch", "--n_gpu_layers", "--seed"},
}
FLAG_VALUE = re.compile(r"^[A-Za-z0-9._:+]+$")


def check_form_server(server_command: str | None, extra_args: str | None) -> list[str]:
    """What the trigger form may ask of the local datagen server, unless the deployment allows free-form commands:
    auto, null (SGLang) or a named server, and for it only the serving flags SERVER_FLAGS lists."""
    from eagle3.settings import ALLOW_SERVER_COMMAND, enabled

    if enabled(ALLOW_SERVER_COMMAND):
        return []
    problems = []
    if server_command not in (AUTO, None, *NAMED_SERVERS):
        problems.append(f"datagen param server_command {server_command!r}: free-form server commands are off in this "
                        f"deployment (a form value runs as a program on the workers); use auto or one of "
                        f"{list(NAMED_SERVERS)}, or ask the deployment to set EAGLE3_ALLOW_SERVER_COMMAND=true")
    engine = server_command if server_command in NAMED_SERVERS else "sglang"
    allowed = set().union(*SERVER_FLAGS.values()) if server_command == AUTO else SERVER_FLAGS[engine]
    try:
        words = shlex.split(extra_args or "")
    except ValueError as e:  # an unclosed quote
        return problems + [f"datagen param server_extra_args {extra_args!r}: {e}"]
    for tok in words:
        flag = tok.split("=", 1)[0]
        ok = flag in allowed if tok.startswith("-") else bool(FLAG_VALUE.match(tok))
        if tok.startswith("-") and "=" in tok:
            ok = ok and bool(FLAG_VALUE.match(tok.split("=", 1)[1]))
        if not ok:
            problems.append(f"datagen param server_extra_args: {tok!r} is not a serving flag this deployment allows "
                            f"for {engine if server_command != AUTO else 'the auto-chosen server'} "
                            f"({sorted(allowed)}; values: letters, digits, . _ : +)")
    return problems


def resolve_server(mode: str, model_path: str, server_command: str | None, gguf: str | None,
                   served_model_name: str, gpus: int | None = None) -> ServerChoice:
    """Resolve the "auto" values of the datagen server (see the module doc); `gpus` None = ask torch."""
    if mode == "remote":
        if served_model_name == AUTO:
            raise ConfigError("datagen param served_model_name: 'auto' works only for a local server; in remote "
                              "mode give the endpoint's model name")
        return ServerChoice(None, None, served_model_name, "remote", "datagen_mode remote")
    if server_command in NAMED_SERVERS:
        return _named(server_command, model_path, gguf, served_model_name)
    if server_command != AUTO:
        gguf = find_gguf(model_path) if gguf == AUTO else gguf
        name = SGLANG_SERVED_NAME if served_model_name == AUTO else served_model_name
        return ServerChoice(server_command, gguf, name, "sglang" if server_command is None else "yours",
                            "server_command given" if server_command else "server_command null = SGLang")
    from eagle3.datagen.llama_cpp_server import command_template
    from eagle3.datagen.server import DEFAULT_SERVER_COMMAND

    if gpus is None:
        from eagle3.launch import visible_gpus

        gpus = visible_gpus()
    if gpus and installed("sglang"):
        name = SGLANG_SERVED_NAME if served_model_name == AUTO else served_model_name
        return ServerChoice(DEFAULT_SERVER_COMMAND, None if gguf == AUTO else gguf, name, "sglang",
                            f"{gpus} GPU(s) and SGLang installed")
    why = "no GPU" if not gpus else f"{gpus} GPU(s) but SGLang is not installed"
    if not installed("llama_cpp"):
        raise ConfigError(f"datagen server_command 'auto': {why}, and llama-cpp-python (the CPU server) is not "
                          f"installed either: install one (`pip install 'llama-cpp-python[server]'`) or set "
                          f"server_command, or use datagen_mode 'remote'")
    path = find_gguf(model_path) if gguf in (AUTO, None) else gguf
    if not path:
        raise ConfigError(f"datagen server_command 'auto' chose llama.cpp ({why}), which serves a GGUF file, but "
                          f"none was found for {model_path}: set the gguf param (or server_command)")
    alias = LLAMA_CPP_ALIAS if served_model_name == AUTO else served_model_name
    return ServerChoice(command_template(alias), path, alias, "llama.cpp", why)


def _named(engine: str, model_path: str, gguf: str | None, served_model_name: str) -> ServerChoice:
    from eagle3.datagen.llama_cpp_server import command_template
    from eagle3.datagen.server import DEFAULT_SERVER_COMMAND

    if engine == "llama.cpp":
        path = find_gguf(model_path) if gguf in (AUTO, None) else gguf
        if not path:
            raise ConfigError(f"datagen server_command 'llama.cpp' serves a GGUF file, but none was found for "
                              f"{model_path}: set the gguf param")
        alias = LLAMA_CPP_ALIAS if served_model_name == AUTO else served_model_name
        return ServerChoice(command_template(alias), path, alias, engine, "server_command llama.cpp")
    if served_model_name not in (AUTO, SGLANG_SERVED_NAME):
        raise ConfigError(f"datagen param served_model_name {served_model_name!r}: the named {engine} server serves "
                          f"the model as {SGLANG_SERVED_NAME!r}; leave it auto")
    command = DEFAULT_SERVER_COMMAND if engine == "sglang" else VLLM_COMMAND
    return ServerChoice(command, None if gguf == AUTO else gguf, SGLANG_SERVED_NAME, engine,
                        f"server_command {engine}")


def resolved_config(cfg):
    """`cfg` (a DatagenConfig) with its "auto" server values resolved; unchanged when it has none."""
    import dataclasses

    if AUTO not in (cfg.server_command, cfg.gguf, cfg.served_model_name):
        return cfg
    c = resolve_server(cfg.mode, cfg.target.model_path, cfg.server_command, cfg.gguf,
                       cfg.served_model_name)
    return dataclasses.replace(cfg, server_command=c.server_command, gguf=c.gguf, served_model_name=c.served_model_name)
