import os
import pytest

from eagle3_airflow.worker import gpu_for_slot, pin_process_to_gpu, visible_gpus, worker_hostname


def test_visible_gpus_order_of_sources():
    assert visible_gpus({"EAGLE3_GPUS": "4, 5", "CUDA_VISIBLE_DEVICES": "0"}) == ["4", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-abc,GPU-def"}) == ["GPU-abc", "GPU-def"]


def test_each_slot_gets_its_own_gpu_and_wraps():
    gpus = [str(i) for i in range(8)]
    assert [gpu_for_slot(s, gpus) for s in range(8)] == gpus
    assert gpu_for_slot(9, gpus) == "1"
    with pytest.raises(ValueError, match="no GPUs to pin to"):
        gpu_for_slot(0, [])


def test_pinning_only_when_enabled():
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert pin_process_to_gpu(1, env) is None and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    env["EAGLE3_PIN_GPUS"] = "1"
    assert pin_process_to_gpu(1, env) == "3"
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["EAGLE3_GPU_SLOT"] == "1"
    # re-pinning the same process (a second call) still sees the full list, not only "3"
    assert pin_process_to_gpu(0, env) == "2"


def test_tensor_parallel_slots_get_a_group_of_gpus():
    from eagle3_airflow.worker import gpus_for_slot, task_slots

    gpus = [str(i) for i in range(8)]
    assert [gpus_for_slot(s, gpus, 4) for s in range(3)] == [gpus[:4], gpus[4:], gpus[:4]]
    assert gpus_for_slot(5, gpus, 1) == ["5"]
    with pytest.raises(ValueError, match=r"8 GPUs .* do not split into groups of 3"):
        gpus_for_slot(0, gpus, 3)
    env = {"EAGLE3_GPUS": ",".join(gpus), "EAGLE3_EXTRACT_TP_SIZE": "2", "EAGLE3_PIN_GPUS": "1"}
    assert task_slots(env) == 4 and pin_process_to_gpu(1, env) == "2,3" and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    # a slot has as many GPUs as the largest task holds: training on 4 GPUs makes every slot 4 GPUs
    env["EAGLE3_TRAIN_GPU_SLOTS"] = "4"
    assert task_slots(env) == 2 and pin_process_to_gpu(1, env) == "4,5,6,7"
    env["EAGLE3_GPUS_PER_TASK"] = "8"  # an explicit size wins
    assert task_slots(env) == 1 and pin_process_to_gpu(3, env) == ",".join(gpus)


def test_worker_hostname_override(monkeypatch):
    monkeypatch.setenv("EAGLE3_WORKER_NAME", "gpu-worker-7")
    assert worker_hostname() == "gpu-worker-7"


def _child_env(_):
    import time

    time.sleep(0.2)  # keep every child busy so the 6 calls spread over all 3
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def _init_like_celery():
    # what celery.concurrency.prefork.process_initializer does last in every new child
    from celery.signals import worker_process_init

    worker_process_init.send(sender=None)


def test_pool_children_are_pinned_one_gpu_each(monkeypatch):
    """billiard (Celery's prefork pool) children with the project's worker_process_init hook:
    each child's index picks its GPU. The Celery integration test checks it inside a real Airflow worker."""
    from billiard import Pool

    import eagle3_airflow.celery_config  # noqa: F401  connects the hook

    monkeypatch.setenv("EAGLE3_PIN_GPUS", "1")
    monkeypatch.setenv("EAGLE3_GPUS", "0,1,2")
    with Pool(3, initializer=_init_like_celery) as pool:
        seen = pool.map(_child_env, range(12), chunksize=1)
    assert sorted(set(seen)) == ["0", "1", "2"]
