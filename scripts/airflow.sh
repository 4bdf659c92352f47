#!/usr/bin/env bash
# The Airflow UI on this machine, ready to use: `airflow standalone` (SQLite + LocalExecutor) in the background.
#   bash scripts/airflow.sh start     the target model converted once, the DB migrated, pool `gpu` = the GPUs
#                                     found (1 on a CPU-only machine), login admin / admin, start, wait until
#                                     healthy, unpause eagle3_drafter
#   bash scripts/airflow.sh status    running or not, and the health of its parts
#   bash scripts/airflow.sh stop      stop it and everything it started (tasks included)
# Settings (environment): EAGLE3_AIRFLOW_PORT (8080), EAGLE3_ADMIN_PASSWORD (admin), AIRFLOW_HOME (.airflow),
# EAGLE3_GPU_POOL_SLOTS (the GPUs nvidia-smi lists, at least 1), EAGLE3_AIRFLOW_HOST (127.0.0.1: the UI and REST
# API on this machine only; another address is refused while the password is the default). Log:
# $AIRFLOW_HOME/standalone.log.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
PORT="${EAGLE3_AIRFLOW_PORT:-8080}"
HOST="${EAGLE3_AIRFLOW_HOST:-127.0.0.1}"
URL="http://localhost:$PORT"
PIDFILE="$AIRFLOW_HOME/standalone.pid"
LOG="$AIRFLOW_HOME/standalone.log"
DAG_ID=eagle3_drafter
USER_NAME=admin
PASSWORD="${EAGLE3_ADMIN_PASSWORD:-admin}"

# The login: SIMPLE_AUTH_MANAGER_USERS is "user:ROLE"; the password comes from the passwords file (else Airflow
# generates one). The same login lets preflight read the pools through the REST API (eagle3_airflow/deployment.py).
export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="$USER_NAME:admin"
export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE="$AIRFLOW_HOME/passwords.json"
# Airflow's default host is 0.0.0.0: every interface, an open door on a shared GPU host with a known login
export AIRFLOW__API__HOST="$HOST" AIRFLOW__API__PORT="$PORT" AIRFLOW__API__BASE_URL="$URL"
export AIRFLOW__CORE__EXECUTION_API_SERVER_URL="$URL/execution/"
export AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION=False
export AIRFLOW_CONN_EAGLE3_AIRFLOW_API="{\"conn_type\": \"airflow_api\", \"host\": \"$URL\", \"login\": \"$USER_NAME\", \"password\": \"$PASSWORD\"}"

running() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

health() { curl -fsS --max-time 3 "$URL/api/v2/monitor/health" 2>/dev/null; }

healthy() {  # the API answers and the scheduler and dag-processor report healthy
  health | python -c 'import json,sys; h=json.load(sys.stdin); sys.exit(0 if all(h.get(k,{}).get("status")=="healthy" for k in ("scheduler","dag_processor")) else 1)' 2>/dev/null
}

gpu_slots() {
  if [ -n "${EAGLE3_GPU_POOL_SLOTS:-}" ]; then echo "$EAGLE3_GPU_POOL_SLOTS"; return; fi
  local n=0
  command -v nvidia-smi >/dev/null && n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  echo $(( n > 0 ? n : 1 ))
}

session_pids() { ps -eo pid=,sid= | awk -v s="$1" '$2 == s {print $1}'; }

stop() {
  if ! running; then rm -f "$PIDFILE"; echo "airflow standalone is not running"; return 0; fi
  local sid; sid=$(cat "$PIDFILE")
  # by session: standalone's parts share its process group, but each task runs in a group of its own
  kill -TERM $(session_pids "$sid") 2>/dev/null || true
  for _ in $(seq 1 60); do [ -z "$(session_pids "$sid")" ] && break; sleep 0.5; done
  local left; left=$(session_pids "$sid")
  [ -n "$left" ] && kill -KILL $left 2>/dev/null || true
  rm -f "$PIDFILE"
  echo "airflow standalone stopped"
}

local_only() { case "$1" in 127.*|localhost|::1|"[::1]") return 0 ;; *) return 1 ;; esac; }

start() {
  if ! local_only "$HOST" && [ "$PASSWORD" = admin ]; then
    echo "refusing to serve the Airflow UI and REST API on $HOST (EAGLE3_AIRFLOW_HOST) with the default login" \
         "admin / admin: set EAGLE3_ADMIN_PASSWORD to a password of your own, or leave EAGLE3_AIRFLOW_HOST unset" \
         "(127.0.0.1: this machine only)" >&2
    exit 1
  fi
  if running; then echo "airflow standalone is already running (pid $(cat "$PIDFILE"))"; print_login; return 0; fi
  command -v airflow >/dev/null || { echo "no airflow in $EAGLE3_VENV: run bash scripts/setup.sh server first" >&2; exit 1; }
  python -m eagle3 prepare-model >/dev/null  # the default model_path (converted once, then a quick check)
  mkdir -p "$AIRFLOW_HOME"
  python -c 'import json,sys; json.dump({sys.argv[1]: sys.argv[2]}, open(sys.argv[3], "w"))' \
    "$USER_NAME" "$PASSWORD" "$AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"
  chmod 600 "$AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"
  echo "migrating the metadata DB ($AIRFLOW__DATABASE__SQL_ALCHEMY_CONN)"
  airflow db migrate >"$AIRFLOW_HOME/migrate.log" 2>&1 || { tail -20 "$AIRFLOW_HOME/migrate.log"; exit 1; }
  local slots; slots=$(gpu_slots)
  airflow pools set gpu "$slots" "one slot per GPU (extraction shards, training)" >/dev/null
  echo "pool gpu: $slots slot(s)"
  setsid airflow standalone >>"$LOG" 2>&1 < /dev/null &
  echo $! >"$PIDFILE"
  echo "starting airflow standalone (pid $!, log $LOG)"
  for _ in $(seq 1 180); do
    healthy && break
    running || { tail -30 "$LOG"; echo "airflow standalone exited; see $LOG" >&2; exit 1; }
    sleep 1
  done
  healthy || { echo "not healthy after 180 s; see $LOG" >&2; exit 1; }
  unpause
  print_login
}

unpause() {  # a DAG paused earlier stays paused: unpause it through the REST API once it is parsed
  python - "$URL" "$USER_NAME" "$PASSWORD" "$DAG_ID" <<'PY'
import sys, time, requests
url, user, password, dag = sys.argv[1:]
token = requests.post(f"{url}/auth/token", json={"username": user, "password": password}, timeout=30).json()["access_token"]
auth = {"Authorization": f"Bearer {token}"}
for _ in range(120):
    r = requests.patch(f"{url}/api/v2/dags/{dag}", json={"is_paused": False}, headers=auth, timeout=30)
    if r.ok:
        print(f"DAG {dag} unpaused")
        sys.exit(0)
    time.sleep(1)
sys.exit(f"DAG {dag} not found after 120 s ({r.status_code}: {r.text[:300]}); see the import errors in the UI")
PY
}

print_login() {
  echo "Airflow UI: $URL   login: $USER_NAME / $PASSWORD   (stop: bash scripts/airflow.sh stop)"
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  status)
    if running; then echo "running (pid $(cat "$PIDFILE")), $URL"; health || true; echo; else echo "not running"; exit 3; fi ;;
  *) echo "usage: bash scripts/airflow.sh start|stop|status" >&2; exit 2 ;;
esac
