#!/usr/bin/env bash
# One-shot init (compose service airflow-init): migrate the metadata DB, then create the pools and
# connections the DAG uses, from the environment. Idempotent: safe to run on every `docker compose up`.
#   EAGLE3_GPU_POOL_SLOTS  slots of pool "gpu" = GPUs across all GPU workers (default: the GPUs nvidia-smi
#                          lists here, at least 1)
#   EAGLE3_CONN_<ID>       a connection URI, created as connection id <id> lower-cased,
#                          e.g. EAGLE3_CONN_EAGLE3_ENDPOINT='openai://:sk-...@openrouter.ai/api/v1'
set -euo pipefail
airflow db migrate
if [ -z "${EAGLE3_GPU_POOL_SLOTS:-}" ]; then
  gpus=0
  command -v nvidia-smi >/dev/null && gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  EAGLE3_GPU_POOL_SLOTS=$(( gpus > 0 ? gpus : 1 ))
fi
airflow pools set gpu "${EAGLE3_GPU_POOL_SLOTS:-1}" "one slot per GPU (extraction shards, training)"
for var in $(compgen -e | grep '^EAGLE3_CONN_' || true); do
  conn_id=$(echo "${var#EAGLE3_CONN_}" | tr '[:upper:]' '[:lower:]')
  airflow connections delete "$conn_id" >/dev/null 2>&1 || true
  airflow connections add "$conn_id" --conn-uri "${!var}" >/dev/null   # the URI (with its key) is never echoed
  echo "connection $conn_id set"
done
# SimpleAuthManager reads user passwords from this file (AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE)
python - <<'PY'
import json, os
path = os.environ["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path, "w") as f:
    json.dump({"admin": os.environ.get("EAGLE3_ADMIN_PASSWORD", "admin")}, f)
PY
mkdir -p "${EAGLE3_OUTPUT_ROOT:-/data/runs}" "${EAGLE3_CACHE:-/data/cache}"
echo "init done: pool gpu = $EAGLE3_GPU_POOL_SLOTS slot(s); UI login admin / \$EAGLE3_ADMIN_PASSWORD (default admin)"
