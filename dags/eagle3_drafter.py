"""eagle3_drafter: train an EAGLE-3 speculative-decoding drafter for a target LLM, end to end.

    preflight -> datasets -> datagen (one task per dataset) -> merge -> plan_shards
              -> extract (one task per shard, `gpu` queue and pool) -> train -> evaluate

Trigger it from the UI (the form is generated from the phase configs by eagle3.config), the REST API or
`airflow dags trigger eagle3_drafter -c '{...}'`. Every task writes under one run folder,
`<output_root>/<run_name or run_id>`, so two runs never mix files, and every phase skips the work
its manifest says is complete: clearing one task (one extraction shard, say) or the whole run
resumes rather than redoes. docs/operations.md says how to watch a run and backfill one shard.
"""

from __future__ import annotations

import os
from datetime import timedelta

from airflow.sdk import DAG, Param, task

from eagle3.config import form_params, phase_template, run_dir
from operators.datagen import DatagenOperator
from operators.extract import ExtractShardOperator, PlanShardsOperator
from operators.merge import MergeOperator
from operators.preflight import PreflightOperator
from operators.train import EvaluateDrafterOperator, TrainDrafterOperator

GPU_QUEUE = "gpu"  # the Celery queue GPU workers listen on (docker-compose.yml)
GPU_POOL = "gpu"  # one slot per GPU: at most that many GPU tasks at once
# Automatic retries of a shard (each resumes from its committed chunks). Drills that fail a shard
# on purpose and clear it by hand set 0 so the failure stays visible.
SHARD_RETRIES = int(os.environ.get("EAGLE3_SHARD_RETRIES", "3"))
# Slots of the gpu pool the train task holds: the most GPUs a run may train on (form param train_num_gpus; the
# task refuses more). Airflow fixes pool_slots when the DAG is parsed, so it cannot follow a run's form value.
TRAIN_GPU_SLOTS = int(os.environ.get("EAGLE3_TRAIN_GPU_SLOTS", "1"))

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
    user_defined_macros={"run_dir": run_dir},  # the run-folder rule the UI plugin shares
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
        config=phase_template("preflight"),
        run_params="{{ params }}",
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
        config=phase_template("datagen"),
        max_active_tis_per_dagrun=2,  # local mode starts one server per task
    ).expand(dataset=datasets)

    merge = MergeOperator(task_id="merge", config=phase_template("merge"))

    plan = PlanShardsOperator(task_id="plan_shards", config=phase_template("plan"))

    extract = ExtractShardOperator.partial(
        task_id="extract",
        queue=GPU_QUEUE,
        pool=GPU_POOL,
        config=phase_template("extract"),
        retries=SHARD_RETRIES,  # a killed or faulted shard resumes from its last committed chunk
        max_active_tis_per_dagrun=64,
        execution_timeout=timedelta(hours=24),
    ).expand(shard=plan.output)

    train = TrainDrafterOperator(
        task_id="train",
        queue=GPU_QUEUE,
        pool=GPU_POOL,
        pool_slots=TRAIN_GPU_SLOTS,
        config=phase_template("train"),
        shard_dirs=extract.output,
        overrides="{{ params.train_overrides }}",
        execution_timeout=timedelta(hours=72),
    )

    evaluate = EvaluateDrafterOperator(
        task_id="evaluate",
        queue=GPU_QUEUE,
        pool=GPU_POOL,
        config=phase_template("evaluate"),
    )

    preflight >> datasets
    datagen >> merge >> plan
    train >> evaluate
