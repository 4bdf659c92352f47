"""Worker-side helpers for GPU hosts: pin each task slot to one GPU, name the worker.

A Celery GPU worker runs `--concurrency <gpus>` child processes; child `i` (billiard's stable
process index, reused when a child is replaced) gets CUDA_VISIBLE_DEVICES=<gpus[i % len(gpus)]>,
and every task it runs inherits that, so an 8-GPU host runs 8 shards at once, one per GPU.
The Celery glue that calls this lives in operators/celery_config.py; this module has no
Airflow or Celery import so it can be tested alone.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess


def visible_gpus(env: dict[str, str] | None = None) -> list[str]:
    """The GPU ids this worker may hand out: EAGLE3_GPUS ("0,1,2"), else the inherited
    CUDA_VISIBLE_DEVICES (e.g. what a container runtime gave), else every GPU `nvidia-smi -L` lists."""
    env = os.environ if env is None else env
    for key in ("EAGLE3_GPUS", "EAGLE3_VISIBLE_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = env.get(key, "").strip()
        if value:
            return [g.strip() for g in value.split(",") if g.strip()]
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            return []
        return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]
    return []


def gpu_for_slot(slot: int, gpus: list[str]) -> str:
    if not gpus:
        raise ValueError("no GPUs to pin to: set EAGLE3_GPUS or CUDA_VISIBLE_DEVICES, or disable pinning")
    if slot < 0:
        raise ValueError(f"slot must be >= 0, got {slot}")
    return gpus[slot % len(gpus)]


def pin_process_to_gpu(slot: int, env: dict[str, str] | None = None) -> str | None:
    """Set CUDA_VISIBLE_DEVICES (and EAGLE3_GPU_SLOT) for this process from its slot.

    Does nothing unless EAGLE3_PIN_GPUS is "1" (CPU workers share the same Celery config).
    Must run before anything initialises CUDA in the process. Returns the GPU id chosen."""
    env = os.environ if env is None else env
    if env.get("EAGLE3_PIN_GPUS", "0") != "1":
        return None
    gpus = visible_gpus(env)
    gpu = gpu_for_slot(slot, gpus)
    env["EAGLE3_VISIBLE_GPUS"] = ",".join(gpus)  # keep the full list: a replaced child re-pins from it
    env["CUDA_VISIBLE_DEVICES"] = gpu
    env["EAGLE3_GPU_SLOT"] = str(slot)
    return gpu


def worker_hostname() -> str:
    """Hostname Airflow records per task (set [core] hostname_callable to eagle3.worker.worker_hostname):
    EAGLE3_WORKER_NAME when set (several workers on one host stay distinguishable), else the FQDN."""
    return os.environ.get("EAGLE3_WORKER_NAME") or socket.getfqdn()
