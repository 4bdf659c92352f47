"""eagle3_drafter: train an EAGLE-3 speculative-decoding drafter for a target LLM, end to end.

    preflight -> datasets -> datagen (one task per dataset) -> merge -> plan_shards
              -> extract (one task per shard, `gpu` queue and pool) -> train -> evaluate

Trigger it from the UI (the form is generated from the run configuration's sections by eagle3.config), the
REST API or `airflow dags trigger eagle3_drafter -c '{...}'`. Preflight builds the run configuration from the form
and resolves it once; every later task gets its phase's part of it from preflight's XCom (`phase_config`).
Every task writes under one run folder,
`<output_root>/<run_name or run_id>`, so two runs never mix files, and every phase skips the work
its manifest says is complete: clearing one task (one extraction shard, say) or the whole run
resumes rather than redoes. docs/operations.md says how to watch a run and backfill one shard.
The train task produces the Asset `eagle3_drafter` (eagle3_airflow.operators.train.DRAFTER_ASSET): a DAG with
`schedule=[DRAFTER_ASSET]` runs on every new drafter, its export folder in the event's extra.
"""

from __future__ import annotations

import os
from datetime import timedelta

from airflow.sdk import DAG, Param, task

from eagle3.config import form_params, gpu_slots, phase_config
from eagle3_airflow.operators.datagen import DatagenOperator
from eagle3_airflow.operators.extract import ExtractShardOperator, PlanShardsOperator
from eagle3_airflow.operators.merge import MergeOperator
from eagle3_airflow.operators.preflight import PreflightOperator
from eagle3_airflow.operators.train import DRAFTER_ASSET, EvaluateDrafterOperator, TrainDrafterOperator

GPU_QUEUE = "gpu"  # the Celery queue GPU workers listen on (docker-compose.yml)
GPU_POOL = "gpu"  # one slot per GPU: at most that many GPU tasks at once
# Automatic retries of a shard (each resumes from its committed chunks). Drills that fail a shard
# on purpose and clear it by hand set 0 so the failure stays visible.
SHARD_RETRIES = int(os.environ.get("EAGLE3_SHARD_RETRIES", "3"))
# gpu pool slots per task, fixed at parse time (the scheduler reserves them before a task runs):
# EAGLE3_EXTRACT_TP_SIZE (a shard's tensor-parallel ranks, and the evaluation's: the same tp_size),
# EAGLE3_DATAGEN_GPUS (a local datagen server's GPUs) and EAGLE3_TRAIN_GPU_SLOTS (the most GPUs a run trains on)
GPU_SLOTS = gpu_slots()
DATAGEN_ON_GPUS = ({"queue": GPU_QUEUE, "pool": GPU_POOL, "pool_slots": GPU_SLOTS["datagen"]}
                   if GPU_SLOTS["datagen"] else {})

# The trigger form, generated from the phase configs' knobs (eagle3.config): one definition per param.
PARAMS = {name: Param(p["default"], section=p["section"], description=p["description"], **p["schema"])
          for name, p in form_params().items()}

with DAG(
    dag_id="eagle3_drafter",
    description="Train an EAGLE-3 drafter: preflight, datagen, merge, extract, train, evaluate",
    schedule=None,
    catchup=False,
    params=PARAMS,
    render_template_as_native_obj=True,
    max_active_runs=4,
    default_args={
        "retries": 2,
        "retry_delay": timedelta(seconds=30),
        "retry_exponential_backoff": True,
        "max_retry_delay": timedelta(minutes=10),
        "execution_timeout": timedelta(hours=12),
    },
    tags=["eagle3", "speculative-decoding"],
    doc_md=__doc__,
) as dag:
    preflight = PreflightOperator(
        task_id="preflight",
        run_params="{{ params }}",
        gpu_slots=GPU_SLOTS,  # the form's extract_tp_size must fit the extract task's slots
        retries=0,  # a failed check does not fix itself
        execution_timeout=timedelta(minutes=10),
    )

    @task(task_id="datasets", retries=0)
    def list_datasets(params=None) -> list[dict]:
        """Fan the dataset specs out (preflight already checked every one)."""
        return list(params["datasets"])

    datasets = list_datasets()

    datagen = DatagenOperator.partial(
        task_id="datagen",
        config=phase_config("datagen"),
        max_active_tis_per_dagrun=2,  # local mode starts one server per task
        **DATAGEN_ON_GPUS,
    ).expand(dataset=datasets)

    merge = MergeOperator(task_id="merge", config=phase_config("merge"))

    plan = PlanShardsOperator(task_id="plan_shards", config=phase_config("plan"))

    extract = ExtractShardOperator.partial(
        task_id="extract",
        queue=GPU_QUEUE,
        pool=GPU_POOL,
        pool_slots=GPU_SLOTS["extract"],  # tp_size ranks, one GPU each
        config=phase_config("extract"),
        retries=SHARD_RETRIES,  # a killed or faulted shard resumes from its last committed chunk
        max_active_tis_per_dagrun=64,
        execution_timeout=timedelta(hours=24),
    ).expand(shard=plan.output)

    train = TrainDrafterOperator(
        task_id="train",
        queue=GPU_QUEUE,
        pool=GPU_POOL,
        pool_slots=GPU_SLOTS["train"],  # train_num_gpus ranks at most (preflight checks)
        config=phase_config("train"),
        shard_dirs=extract.output,
        mlflow_conn_id="eagle3_mlflow",  # metrics to MLflow too when this Connection exists
        outlets=[DRAFTER_ASSET],  # a DAG scheduled on the asset runs after each training
        execution_timeout=timedelta(hours=72),
    )

    evaluate = EvaluateDrafterOperator(
        task_id="evaluate",
        queue=GPU_QUEUE,
        pool=GPU_POOL,
        pool_slots=GPU_SLOTS["extract"],  # the target in extract_tp_size ranks, as extraction ran it
        config=phase_config("evaluate"),
    )

    preflight >> datasets
    datagen >> merge >> plan
    train >> evaluate
