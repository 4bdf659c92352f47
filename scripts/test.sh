#!/usr/bin/env bash
# The test suite, from a fresh clone: sets up the venv, the model cache and the services, then runs pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
bash scripts/setup.sh test
bash scripts/services.sh
python -m eagle3 prepare-model >/dev/null
# Two workers, a test file each at a time (module fixtures stay in one process): the suite waits on subprocesses
# (Airflow, llama.cpp, torchrun) much of its time, so two run in 24 minutes what one ran in 46 on 2 cores.
# Every Airflow test takes its own database, Redis database and ports (tests/airflow_harness.py).
# EAGLE3_TEST_WORKERS=0 runs it in one process.
python -m pytest -n "${EAGLE3_TEST_WORKERS:-2}" --dist loadfile "$@"
