# Sourced by the other scripts: where things live, and the embedded Airflow (SQLite + LocalExecutor).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export EAGLE3_VENV="${EAGLE3_VENV:-$ROOT/.venv}"
export PATH="$EAGLE3_VENV/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export EAGLE3_CACHE="${EAGLE3_CACHE:-$HOME/.cache/eagle3}"
export AIRFLOW_HOME="${AIRFLOW_HOME:-$ROOT/.airflow}"
export AIRFLOW__CORE__DAGS_FOLDER="$ROOT/dags"
export AIRFLOW__CORE__PLUGINS_FOLDER="$ROOT/plugins"
# Airflow 3.3.2's task runner reads plugins/.airflowignore as glob patterns through pathspec's GitWildMatchPattern,
# which pathspec 1.x deprecates: a DeprecationWarning at the top of every task log, nothing a user can act on.
# (Set, PYTHONWARNINGS also stops Airflow turning on its own DeprecationWarnings: airflow/configuration.py.)
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore:GitWildMatchPattern}"
export AIRFLOW__CORE__LOAD_EXAMPLES=False
export AIRFLOW__CORE__EXECUTOR="${AIRFLOW__CORE__EXECUTOR:-LocalExecutor}"
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN:-sqlite:///$AIRFLOW_HOME/airflow.db}"
