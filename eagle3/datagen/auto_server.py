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


def resolve_server(mode: str, model_path: str, server_command: str | None, gguf: str | None,
                   served_model_name: str, gpus: int | None = None) -> ServerChoice:
    """Resolve the "auto" values of the datagen server (see the module doc); `gpus` None = ask torch."""
    if mode == "remote":
        if served_model_name == AUTO:
            raise ConfigError("datagen param served_model_name: 'auto' works only for a local server; in remote "
                              "mode give the endpoint's model name")
        return ServerChoice(None, None, served_model_name, "remote", "datagen_mode remote")
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


def resolved_config(cfg):
    """`cfg` (a DatagenConfig) with its "auto" server values resolved; unchanged when it has none."""
    import dataclasses

    if AUTO not in (cfg.server_command, cfg.gguf, cfg.served_model_name):
        return cfg
    c = resolve_server(cfg.mode, cfg.target.model_path, cfg.server_command, cfg.gguf,
                       cfg.served_model_name)
    return dataclasses.replace(cfg, server_command=c.server_command, gguf=c.gguf, served_model_name=c.served_model_name)
