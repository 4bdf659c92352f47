"""Preflight's deployment check as pure functions: a pool that does not exist or is too small, a Celery queue no
worker listens on; each message names the pool/queue, the tasks and the fix. (The check against a real Airflow:
tests/test_airflow_first_hour.py::test_missing_pool_fails_preflight_with_the_reason.)"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3_airflow.deployment import pool_problems, queue_problems, task_needs


@dataclass
class Task:
    task_id: str
    pool: str = "default_pool"
    queue: str = "default"
    pool_slots: int = 1


def test_needs_group_tasks_by_pool_and_queue():
    pools, queues = task_needs([Task("merge"), Task("extract", "gpu", "gpu"), Task("train", "gpu", "gpu", 2)])
    assert pools == {"default_pool": {"merge": 1}, "gpu": {"extract": 1, "train": 2}}
    assert queues == {"default": ["merge"], "gpu": ["extract", "train"]}


def test_missing_and_small_pools():
    needed = {"default_pool": {"merge": 1}, "gpu": {"extract": 1, "train": 2}}
    assert pool_problems(needed, {"default_pool": 128, "gpu": 2}) == []
    [missing] = pool_problems(needed, {"default_pool": 128})
    assert "pool 'gpu' does not exist" in missing and "['extract', 'train']" in missing
    assert "airflow pools set gpu" in missing
    [small] = pool_problems(needed, {"default_pool": 128, "gpu": 1})
    assert "pool 'gpu' has 1 slot(s) but task(s) ['train'] need 2" in small


def test_queue_without_a_worker():
    needed = {"default": ["merge"], "gpu": ["extract"]}
    assert queue_problems(needed, {"w1": [{"name": "default"}], "w2": [{"name": "gpu"}]}) == []
    [p] = queue_problems(needed, {"w1": [{"name": "default"}]})
    assert "Celery queue 'gpu'" in p and "['extract']" in p and "{'w1': ['default']}" in p
    assert "airflow celery worker --queues gpu" in p
    assert len(queue_problems(needed, {})) == 2  # no worker answered at all
