#!/usr/bin/env bash
# Start a Celery worker for the "gpu" queue with one task slot per GPU on this host, or per group of
# EAGLE3_GPUS_PER_TASK GPUs (default: the most GPUs a task holds, eagle3_airflow.worker.gpus_per_task): a
# tensor-parallel shard or a multi-GPU training run sees all its GPUs.
# GPUs: EAGLE3_GPUS ("0,1,2,3") or CUDA_VISIBLE_DEVICES if set, else every GPU nvidia-smi lists.
# Extra arguments are passed to `airflow celery worker` (e.g. --celery-hostname gpu-a@%h).
set -euo pipefail
gpus=$(python -c 'from eagle3_airflow.worker import visible_gpus; print(",".join(visible_gpus()))')
if [ -z "$gpus" ]; then
  echo "gpu-worker: no GPU visible (nvidia-smi -L lists none, EAGLE3_GPUS unset)" >&2
  exit 1
fi
export EAGLE3_GPUS="$gpus" EAGLE3_PIN_GPUS=1
n=$(python -c 'from eagle3_airflow.worker import task_slots; print(task_slots())')
per=$(python -c 'from eagle3_airflow.worker import gpus_per_task; print(gpus_per_task())')
echo "gpu-worker: ${n} slot(s), GPUs ${gpus}, ${per} a slot"
exec airflow celery worker --queues "${EAGLE3_GPU_QUEUE:-gpu}" --concurrency "$n" "$@"
