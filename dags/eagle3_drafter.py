"""eagle3_drafter: train an EAGLE-3 drafter for a target LLM, end to end.

Trigger it from the UI (the form is built from `params` below) or with
`airflow dags trigger eagle3_drafter -c '{...}'`. Every task writes under one run folder,
`<output_root>/<run_name or run_id>`, so two runs never mix files, and every phase skips
work its manifest says is complete, so clearing a task (or the whole run) resumes.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

from airflow.sdk import DAG, Param

from operators.preflight import PreflightOperator

DEFAULT_MODEL = os.environ.get(
    "EAGLE3_MODEL_PATH",
    str(Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3")) / "SmolLM2-135M-Instruct"),
)
DEFAULT_OUTPUT_ROOT = os.environ.get("EAGLE3_OUTPUT_ROOT", str(Path.home() / "eagle3-runs"))

# One folder per run: the user's run_name if given, else the Airflow run id made path-safe.
RUN_DIR = (
    "{{ params.output_root }}/"
    "{{ params.run_name if params.run_name else run_id | replace(':', '-') | replace('+', '-') }}"
)

PARAMS = {
    "model_path": Param(DEFAULT_MODEL, type="string", minLength=1,
                        description="HF-format folder of the target model (config.json, tokenizer, safetensors)."),
    "output_root": Param(DEFAULT_OUTPUT_ROOT, type="string", minLength=1,
                         description="Folder under which each run gets its own sub-folder."),
    "run_name": Param("", type="string", pattern="^[A-Za-z0-9._-]*$",
                      description="Name of the run folder; empty = the Airflow run id. Reuse a name to resume a run."),
    "capture_layers": Param(None, type=["null", "array"], items={"type": "integer", "minimum": 0},
                            minItems=1, maxItems=8,
                            description="HF hidden_states indices to capture; null = [2, L//2, L-3]."),
    "estimated_tokens": Param(0, type="integer", minimum=0,
                              description="Tokens expected for extraction; preflight checks free disk against it."),
    "allow_cpu": Param(False, type="boolean", description="Run on the CPU when no GPU is found (demo, tests)."),
}

with DAG(
    dag_id="eagle3_drafter",
    description="Train an EAGLE-3 speculative-decoding drafter: preflight, datagen, merge, extract, train, evaluate",
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
