"""Compile once per worker, not once per shard task: torch's on-disk compile caches in one folder per worker.

A shard task is a fresh process; without a persistent cache each pays the whole compilation again (20-30 s at
the Qwen3-30B-A3B shape on the H200, more than a small shard's extraction). Inductor's FX graph cache, the
AOTAutograd cache and the Triton kernels all live under TORCHINDUCTOR_CACHE_DIR, keyed by the graph, the torch
build and the device, so every shard task on the same worker (and a retried shard) finds the graphs the first
one built, and a different GPU model or torch version simply misses. Writes are atomic: concurrent tasks on one
worker can share the folder.

`compile_cache_dir`: "auto" = $EAGLE3_COMPILE_CACHE, else ~/.cache/eagle3/compile/<host> (local disk: per
worker by construction); "off" = torch's own default (/tmp/torchinductor_<user>, gone with a fresh container);
any other value is the folder (on shared storage, give each host its own, e.g. .../compile/$HOSTNAME).
A compile with a pinned SDPA kernel (attention != auto) bypasses the FX graph cache (backend.compile_for).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from eagle3.errors import ConfigError

ENV = "EAGLE3_COMPILE_CACHE"


def cache_folder(setting: str) -> Path | None:
    if setting == "off":
        return None
    if setting == "auto":
        root = os.environ.get(ENV)
        return Path(root) if root else Path.home() / ".cache" / "eagle3" / "compile" / socket.gethostname()
    return Path(setting)


def use_compile_cache(setting: str) -> Path | None:
    """Point this process's torch compile caches at the worker's folder (before the first compilation) and turn
    the FX graph and AOTAutograd caches on. Returns the folder (None for "off")."""
    folder = cache_folder(setting)
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"extract param compile_cache_dir={setting!r}: cannot create {folder}: {e}") from e
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return folder


def cache_counters() -> dict:
    """Hits and misses of the FX graph and AOTAutograd caches in this process so far."""
    from torch._dynamo.utils import counters

    keys = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
    out = {k: int(counters["inductor"].get(k, 0)) for k in keys}
    out.update({k: int(v) for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")})
    return out
