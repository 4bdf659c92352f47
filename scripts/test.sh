#!/usr/bin/env bash
# The test suite, from a fresh clone: sets up the venv, the model cache and the services, then runs pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
bash scripts/setup.sh test
bash scripts/services.sh
python -m eagle3 prepare-model >/dev/null
python -m pytest "$@"
