"""eagle3_drafter: train an EAGLE-3 speculative-decoding drafter for a target LLM, end to end.

    preflight -> datasets -> datagen (one task per dataset) -> merge -> plan_shards
              -> extract (one task per shard, `gpu` queue and pool) -> train -> evaluate

Trigger it from the UI (the form is built from `params` below), the REST API or
`airflow dags trigger eagle3_drafter -c '{...}'`. Every task writes under one run folder,
`<output_root>/<run_name or run_id>`, so two runs never mix files, and every phase skips the work
its manifest says is complete: clearing one task (one extraction shard, say) or the whole run
resumes rather than redoes. docs/operations.md says how to watch a run and backfill one shard.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

from airflow.sdk import DAG, Param, task

from operators.datagen import DatagenOperator
from operators.extract import ExtractShardOperator, PlanShardsOperator
from operators.merge import MergeOperator
from operators.preflight import PreflightOperator
from operators.train import EvaluateDrafterOperator, TrainDrafterOperator

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = os.environ.get(
    "EAGLE3_MODEL_PATH",
    str(Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3")) / "SmolLM2-135M-Instruct"),
)
DEFAULT_OUTPUT_ROOT = os.environ.get("EAGLE3_OUTPUT_ROOT", str(Path.home() / "eagle3-runs"))
GPU_QUEUE = "gpu"  # the Celery queue GPU workers listen on (docker-compose.yml)
GPU_POOL = "gpu"  # one slot per GPU: at most that many GPU tasks at once
# Automatic retries of a shard (each resumes from its committed chunks). Drills that fail a shard
# on purpose and clear it by hand set 0 so the failure stays visible.
SHARD_RETRIES = int(os.environ.get("EAGLE3_SHARD_RETRIES", "3"))

# Optional text params default to None, not "": the UI trigger form treats "" as a missing value.
# One folder per run: the user's run_name if given, else the Airflow run id made path-safe.
RUN_DIR = (
    "{{ params.output_root }}/"
    "{{ params.run_name if params.run_name else run_id | replace(':', '-') | replace('+', '-') }}"
)
MODEL_FACT = "{{{{ ti.xcom_pull(task_ids='preflight')['{}'] }}}}"  # facts preflight read from config.json

DATASET_SPEC = {
    "type": "object",
    "required": ["name", "prompt_file"],
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.-]*$"},
        "prompt_file": {"type": "string", "minLength": 1},
        "system_prompt": {"type": ["string", "null"]},
        "max_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "seed": {"type": ["integer", "null"]},
        "limit": {"type": ["integer", "null"], "minimum": 1},
        "on_bad_line": {"enum": ["fail", "skip"]},
        "drop_truncated": {"type": "boolean"},
    },
}

PARAMS = {
    # -- the run
    "model_path": Param(DEFAULT_MODEL, type="string", minLength=1, section="Run",
                        description="HF-format folder of the target model (config.json, tokenizer, safetensors)."),
    "output_root": Param(DEFAULT_OUTPUT_ROOT, type="string", minLength=1, section="Run",
                         description="Folder under which each run gets its own sub-folder (shared storage on a cluster)."),
    "run_name": Param(None, type=["null", "string"], pattern="^[A-Za-z0-9._-]+$", section="Run",
                      description="Name of the run folder; empty = the Airflow run id. Reuse a name to resume a run."),
    "allow_cpu": Param(False, type="boolean", section="Run",
                       description="Run on the CPU when no GPU is found (demo, tests)."),
    "capture_layers": Param(None, type=["null", "array"], items={"type": "integer", "minimum": 0}, minItems=1,
                            maxItems=8, section="Run",
                            description="HF hidden_states indices to capture; null = EAGLE-3's [2, L//2, L-3]."),
    "estimated_tokens": Param(0, type="integer", minimum=0, section="Run",
                              description="Tokens expected for extraction; preflight checks free disk against it."),
    # -- data generation
    "datasets": Param(
        [{"name": "A1", "prompt_file": str(REPO / "data/demo/A1.jsonl"), "max_tokens": 256},
         {"name": "B1", "prompt_file": str(REPO / "data/demo/B1.jsonl"), "max_tokens": 256}],
        type="array", minItems=1, items=DATASET_SPEC, section="Data generation",
        description="Prompt datasets, one generation task each (fields: docs/datagen.md)."),
    "datagen_mode": Param("local", enum=["local", "remote"], section="Data generation",
                          description="local: the task starts server_command; remote: the endpoint of datagen_conn_id."),
    "datagen_conn_id": Param(None, type=["null", "string"], section="Data generation",
                             description="Airflow Connection holding the endpoint URL and API key (remote mode)."),
    "served_model_name": Param("default", type="string", minLength=1, section="Data generation",
                               description="Model name sent in each request (what the endpoint serves)."),
    "server_command": Param(None, type=["null", "string"], section="Data generation",
                            description="Local server command ({model_path} {port} {host} {gguf}); empty = SGLang."),
    "server_extra_args": Param(None, type=["null", "string"], section="Data generation",
                               description="Extra flags for the local server, e.g. '--tp 8'."),
    "gguf": Param(None, type=["null", "string"], section="Data generation",
                  description="GGUF file for servers that take one ({gguf} in server_command)."),
    "datagen_client": Param({"concurrency": 256, "max_failed_fraction": 0.01}, type="object",
                            section="Data generation",
                            description="Client params: concurrency, request_timeout_s, max_retries, "
                                        "max_failed_fraction, price_prompt_per_m, price_completion_per_m."),
    # -- merge
    "include": Param([], type="array", items={"type": "string"}, section="Merge",
                     description="Datasets to keep (empty = all)."),
    "exclude": Param([], type="array", items={"type": "string"}, section="Merge", description="Datasets to drop."),
    "max_seq_len": Param(8192, type="integer", minimum=16, maximum=1_048_576, section="Merge",
                         description="Sequence-length cap."),
    "cap_policy": Param("truncate", enum=["truncate", "drop"], section="Merge",
                        description="What to do with a longer sample."),
    "seed": Param(0, type="integer", minimum=0, section="Merge", description="Shuffle seed."),
    # -- extraction
    "num_shards": Param(4, type="integer", minimum=1, maximum=4096, section="Extraction",
                        description="Extraction shards (one GPU task each); balanced by tokens."),
    "token_budget": Param(16384, type="integer", minimum=256, section="Extraction",
                          description="Padded tokens per forward pass; lower it after an out-of-memory error."),
    "chunk_mb": Param(1024, type="number", exclusiveMinimum=0, section="Extraction",
                      description="Target size of one committed chunk (MiB): the unit a killed shard resumes from."),
    "storage_dtype": Param("auto", enum=["auto", "bfloat16", "float16", "float32", "float8_e4m3fn"],
                           section="Extraction", description="Stored hidden-state dtype (auto = compute dtype)."),
    "extract_backend": Param("hf", enum=["hf", "fused-llama"], section="Extraction",
                             description="Forward pass: HF modules, or fused q/k/v and gate/up GEMMs (Llama family)."),
    "extract_attention": Param("auto", enum=["auto", "flash", "cudnn", "efficient", "math"], section="Extraction",
                               description="SDPA attention kernel of the extraction forward (auto: torch picks)."),
    "extract_pad_multiple": Param("auto", type=["string", "integer"], pattern="^(auto|[1-9][0-9]*)$", minimum=1,
                                  section="Extraction",
                                  description="Pad each batch's length to a multiple of this (1 = no extra padding), "
                                              "so a shard meets few batch shapes; auto = up to 64 on GPU, padding "
                                              "under 1/16 of the length, 1 on CPU."),
    # -- training and evaluation
    "ttt_steps": Param(7, type="integer", minimum=1, maximum=16, section="Training",
                       description="Training-time-test depth K."),
    "draft_vocab_size": Param(32000, type="integer", minimum=2, section="Training",
                              description="Draft vocabulary (capped at the distinct tokens seen)."),
    "epochs": Param(1, type="integer", minimum=1, section="Training", description="Passes over the data."),
    "max_steps": Param(0, type="integer", minimum=0, section="Training",
                       description="Optimizer steps; 0 = run the epochs."),
    "lr": Param(1e-4, type="number", exclusiveMinimum=0, section="Training", description="Peak learning rate."),
    "batch_size": Param(4, type="integer", minimum=1, section="Training", description="Samples per micro-batch."),
    "train_overrides": Param({}, type="object", section="Training",
                             description="Any other TrainConfig field (docs/train.md)."),
    "eval_prompts_file": Param(str(REPO / "data/demo/eval.jsonl"), type="string", minLength=1, section="Evaluation",
                               description="Held-out prompts (JSONL with prompt or messages)."),
    "eval_k": Param(5, type="integer", minimum=1, maximum=32, section="Evaluation",
                    description="Draft tokens per target forward."),
    "eval_max_new_tokens": Param(64, type="integer", minimum=1, section="Evaluation",
                                 description="Tokens generated per prompt."),
}

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
        model_path="{{ params.model_path }}",
        output_dir=RUN_DIR + "/preflight",
        capture_layers="{{ params.capture_layers }}",
        estimated_tokens="{{ params.estimated_tokens }}",
        allow_cpu="{{ params.allow_cpu }}",
        retries=0,  # a failed check does not fix itself
        execution_timeout=timedelta(minutes=10),
    )

    @task(task_id="datasets", retries=0)
    def list_datasets(params=None) -> list[dict]:
        """Check every dataset spec now (a typo fails here, not after hours) and fan them out."""
        from eagle3.datagen import DatasetSpec

        for i, d in enumerate(params["datasets"]):
            DatasetSpec.from_dict(d, where=f"params.datasets[{i}]")
        return list(params["datasets"])

    datasets = list_datasets()

    datagen = DatagenOperator.partial(
        task_id="datagen",
        output_dir=RUN_DIR + "/datagen",
        tokenizer_path="{{ params.model_path }}",
        model_path="{{ params.model_path }}",
        conn_id="{{ params.datagen_conn_id or None }}",
        mode="{{ params.datagen_mode }}",
        model="{{ params.served_model_name }}",
        client="{{ params.datagen_client }}",
        server_command="{{ params.server_command or None }}",
        server_extra_args="{{ params.server_extra_args }}",
        gguf="{{ params.gguf }}",
        max_active_tis_per_dagrun=2,  # local mode starts one server per task
    ).expand(dataset=datasets)

    merge = MergeOperator(
        task_id="merge",
        inputs=[RUN_DIR + "/datagen"],
        output_dir=RUN_DIR + "/merge",
        include="{{ params.include }}",
        exclude="{{ params.exclude }}",
        max_seq_len="{{ params.max_seq_len }}",
        cap_policy="{{ params.cap_policy }}",
        seed="{{ params.seed }}",
        vocab_size=MODEL_FACT.format("vocab_size"),
        hidden_size=MODEL_FACT.format("hidden_size"),
        num_capture_layers="{{ ti.xcom_pull(task_ids='preflight')['capture_layers'] | length }}",
    )

    plan = PlanShardsOperator(task_id="plan_shards", merge_dir=RUN_DIR + "/merge", num_shards="{{ params.num_shards }}")

    extract = ExtractShardOperator.partial(
        task_id="extract",
        queue=GPU_QUEUE,
        pool=GPU_POOL,
        model_path="{{ params.model_path }}",
        extract_dir=RUN_DIR + "/extract",
        capture_layers=MODEL_FACT.format("capture_layers"),
        token_budget="{{ params.token_budget }}",
        storage_dtype="{{ params.storage_dtype }}",
        backend="{{ params.extract_backend }}",
        attention="{{ params.extract_attention }}",
        pad_multiple="{{ params.extract_pad_multiple }}",
        chunk_mb="{{ params.chunk_mb }}",
        retries=SHARD_RETRIES,  # a killed or faulted shard resumes from its last committed chunk
        max_active_tis_per_dagrun=64,
        execution_timeout=timedelta(hours=24),
    ).expand(shard=plan.output)

    train = TrainDrafterOperator(
        task_id="train",
        queue=GPU_QUEUE,
        pool=GPU_POOL,
        shard_dirs=extract.output,
        model_path="{{ params.model_path }}",
        output_dir=RUN_DIR + "/train",
        train_config={
            "ttt_steps": "{{ params.ttt_steps }}",
            "draft_vocab_size": "{{ params.draft_vocab_size }}",
            "epochs": "{{ params.epochs }}",
            "max_steps": "{{ params.max_steps }}",
            "lr": "{{ params.lr }}",
            "batch_size": "{{ params.batch_size }}",
        },
        train_overrides="{{ params.train_overrides }}",
        execution_timeout=timedelta(hours=72),
    )

    evaluate = EvaluateDrafterOperator(
        task_id="evaluate",
        queue=GPU_QUEUE,
        pool=GPU_POOL,
        export_dir=RUN_DIR + "/train/export",
        model_path="{{ params.model_path }}",
        output_dir=RUN_DIR + "/evaluate",
        prompts_file="{{ params.eval_prompts_file }}",
        k="{{ params.eval_k }}",
        max_new_tokens="{{ params.eval_max_new_tokens }}",
    )

    preflight >> datasets
    datagen >> merge >> plan
    train >> evaluate
