#!/usr/bin/env bash
# The main job: the whole eagle3_drafter DAG on the embedded Airflow (SQLite + `airflow dags test`),
# with the real SmolLM2-135M-Instruct target, on the CPU. Prints where the outputs landed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
bash scripts/setup.sh server
model=$(python -m eagle3 prepare-model)
export EAGLE3_OUTPUT_ROOT="${EAGLE3_OUTPUT_ROOT:-$ROOT/runs}"
run_name="${EAGLE3_RUN_NAME:-demo}"
mkdir -p "$AIRFLOW_HOME"
airflow db migrate >/dev/null
conf=$(python scripts/demo_conf.py --model-path "$model" --output-root "$EAGLE3_OUTPUT_ROOT" --run-name "$run_name")
echo "running eagle3_drafter with conf: $conf"
airflow dags test eagle3_drafter -c "$conf"
python scripts/summarize_run.py "$EAGLE3_OUTPUT_ROOT/$run_name"
