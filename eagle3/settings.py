"""Deployment settings: what the people who run the deployment decide, not whoever can trigger a run.

Each is declared once here and read from the environment of the scheduler and workers, as `EAGLE3_<NAME>` or as
Airflow config (`AIRFLOW__EAGLE3__<NAME>`, section [eagle3]); the trigger form cannot set them. The trust model
they serve: docs/operations.md, "Who may do what".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from eagle3.errors import ConfigError


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    help: str

    def raw(self) -> str:
        for var in (f"EAGLE3_{self.name}", f"AIRFLOW__EAGLE3__{self.name}"):
            if os.environ.get(var, "").strip():
                return os.environ[var].strip()
        return self.default


ALLOW_SERVER_COMMAND = Setting(
    "ALLOW_SERVER_COMMAND", "false",
    "true: the form's server_command may be any command line and server_extra_args any flags (whoever triggers a "
    "run then runs programs on the workers); false: only the named servers (sglang, vllm, llama.cpp) with the "
    "serving flags eagle3.datagen.auto_server lists")
PATH_ROOTS = Setting(
    "PATH_ROOTS", "",
    "colon-separated folders that the form's paths (output_root, model_path, prompt files, gguf, eval_prompts) "
    "must lie in, symlinks resolved; empty: anywhere")
SETTINGS = (ALLOW_SERVER_COMMAND, PATH_ROOTS)


def enabled(setting: Setting) -> bool:
    value = setting.raw().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"deployment setting EAGLE3_{setting.name}={setting.raw()!r}: use true or false")


def path_roots() -> list[Path]:
    return [Path(os.path.realpath(p)) for p in PATH_ROOTS.raw().split(":") if p.strip()]


def outside_roots(label: str, path: str | os.PathLike) -> str | None:
    """A problem when `path` (symlinks resolved) lies outside every allowed root; None when inside or unconfined."""
    roots = path_roots()
    if not roots:
        return None
    real = Path(os.path.realpath(path))
    if any(real == r or r in real.parents for r in roots):
        return None
    return (f"{label} {path} is outside the folders this deployment allows (EAGLE3_PATH_ROOTS: "
            f"{', '.join(map(str, roots))})")
