"""Worker-side helpers for GPU hosts: pin each task slot to its GPUs, name the worker.

A Celery GPU worker runs `--concurrency <gpus / gpus per task>` child processes; child `i` (billiard's
stable process index, reused when a child is replaced) gets CUDA_VISIBLE_DEVICES=<its group of GPUs>,
and every task it runs inherits that: an 8-GPU host runs 8 shards at once, one GPU each, or with
EAGLE3_GPUS_PER_TASK=4 (tensor-parallel shards of extract_tp_size 4) 2 shards of 4 GPUs each.
The Celery glue that calls this lives in eagle3_airflow/celery_config.py; this module has no
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


# the gpu pool slots a task may hold (eagle3.config.GPU_SLOT_ENV): a worker slot must see at least that many GPUs
TASK_GPU_ENV = ("EAGLE3_EXTRACT_TP_SIZE", "EAGLE3_TRAIN_GPU_SLOTS", "EAGLE3_DATAGEN_GPUS")


def _positive(env: dict[str, str], key: str, least: int = 1) -> int | None:
    value = env.get(key, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < least:
        raise ValueError(f"{key}={value!r}: expected an integer >= {least} (GPUs per task slot)")
    return int(value)


def gpus_per_task(env: dict[str, str] | None = None) -> int:
    """GPUs each task slot holds: EAGLE3_GPUS_PER_TASK, else the most GPUs any task holds (EAGLE3_EXTRACT_TP_SIZE,
    EAGLE3_TRAIN_GPU_SLOTS, EAGLE3_DATAGEN_GPUS: the DAG's gpu pool slots per task), else 1. Every slot of a worker
    has the same size, so no task ever sees fewer GPUs than the pool slots it holds."""
    env = os.environ if env is None else env
    explicit = _positive(env, "EAGLE3_GPUS_PER_TASK")
    if explicit:
        return explicit
    return max([1] + [n for key in TASK_GPU_ENV if (n := _positive(env, key, least=0))])


def gpus_for_slot(slot: int, gpus: list[str], per_task: int = 1) -> list[str]:
    """Slot i's GPUs: the (i mod groups)-th group of `per_task` consecutive GPUs."""
    if not gpus:
        raise ValueError("no GPUs to pin to: set EAGLE3_GPUS or CUDA_VISIBLE_DEVICES, or disable pinning")
    if slot < 0:
        raise ValueError(f"slot must be >= 0, got {slot}")
    if per_task > len(gpus) or len(gpus) % per_task:
        raise ValueError(f"{len(gpus)} GPUs ({','.join(gpus)}) do not split into groups of {per_task} "
                         f"(EAGLE3_GPUS_PER_TASK / EAGLE3_EXTRACT_TP_SIZE): use a divisor of {len(gpus)}")
    group = slot % (len(gpus) // per_task)
    return gpus[group * per_task:(group + 1) * per_task]


def task_slots(env: dict[str, str] | None = None) -> int:
    """How many tasks this worker runs at once (its Celery concurrency): GPUs / GPUs per task."""
    gpus, per = visible_gpus(env), gpus_per_task(env)
    gpus_for_slot(0, gpus, per)  # the checks
    return len(gpus) // per


def pin_process_to_gpu(slot: int, env: dict[str, str] | None = None) -> str | None:
    """Set CUDA_VISIBLE_DEVICES (and EAGLE3_GPU_SLOT) for this process from its slot.

    Does nothing unless EAGLE3_PIN_GPUS is "1" (CPU workers share the same Celery config).
    Must run before anything initialises CUDA in the process. Returns the GPU ids chosen ("3" or "4,5,6,7")."""
    env = os.environ if env is None else env
    if env.get("EAGLE3_PIN_GPUS", "0") != "1":
        return None
    gpus = visible_gpus(env)
    gpu = ",".join(gpus_for_slot(slot, gpus, gpus_per_task(env)))
    env["EAGLE3_VISIBLE_GPUS"] = ",".join(gpus)  # keep the full list: a replaced child re-pins from it
    env["CUDA_VISIBLE_DEVICES"] = gpu
    env["EAGLE3_GPU_SLOT"] = str(slot)
    return gpu


def worker_hostname() -> str:
    """Hostname Airflow records per task (set [core] hostname_callable to eagle3_airflow.worker.worker_hostname):
    EAGLE3_WORKER_NAME when set (several workers on one host stay distinguishable), else the FQDN."""
    return os.environ.get("EAGLE3_WORKER_NAME") or socket.getfqdn()
