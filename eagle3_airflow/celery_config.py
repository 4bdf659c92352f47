"""Celery config for the Airflow workers: Airflow's defaults plus one GPU per worker child process.

Point Airflow at it with AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS=eagle3_airflow.celery_config.CELERY_CONFIG.
Importing it connects a `worker_process_init` handler; Celery's prefork children inherit it and run it
right after they start, before any task, so each child (and every task process it forks) sees only
its own GPU. With EAGLE3_PIN_GPUS unset (CPU workers, scheduler) the handler does nothing.
"""

from __future__ import annotations

import logging

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG
from celery.signals import worker_process_init

from eagle3_airflow.worker import pin_process_to_gpu

log = logging.getLogger(__name__)

CELERY_CONFIG = dict(DEFAULT_CELERY_CONFIG)


@worker_process_init.connect
def _pin_child_to_gpu(**_):
    from billiard.process import current_process

    slot = getattr(current_process(), "index", None)
    if slot is None:
        return
    gpu = pin_process_to_gpu(int(slot))
    if gpu is not None:
        log.info("celery child %s pinned to CUDA_VISIBLE_DEVICES=%s", slot, gpu)
