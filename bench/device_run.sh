#!/usr/bin/env bash
# A run on the device machine that outlives the call starting it, watched from later calls (docs/device-runs.md).
#   bash bench/device_run.sh start NAME [SECONDS] -- COMMAND ...
#   bash bench/device_run.sh poll NAME SECONDS [DIR ...]
# start: copies bench/, eagle3/ and tests/support/ (the benches import it) to /root/runs/NAME/repo (a later call
#   replaces the tree it starts in), runs
#   COMMAND there in its own process session (setsid nohup), output in /root/runs/NAME/log and its exit status in
#   /root/runs/NAME/DONE at the end, then polls it for SECONDS (default 0).
# ($DEVICE_RUNS replaces /root/runs.)
# poll: until DONE or SECONDS have passed, the log's last line every 45 s; then the log and each DIR into
#   $OUT/NAME.tgz and the log's last 25 lines on stdout. Exit 0 once done, 3 while it still runs or none started.
set -u
CMD=${1:?start or poll}; NAME=${2:?NAME}; shift 2
R=${DEVICE_RUNS:-/root/runs}/$NAME
case $CMD in
start)
  P=0; [ "${1:-}" != "--" ] && { P=$1; shift; }; [ "${1:-}" = "--" ] && shift
  [ $# -gt 0 ] || { echo "no COMMAND after --"; exit 2; }
  [ -f "$R/log" ] && [ ! -f "$R/DONE" ] && { echo "$NAME is still running"; exit 3; }
  rm -rf "$R" && mkdir -p "$R/repo/tests" && cp -r bench eagle3 "$R/repo/" && cp -r tests/support "$R/repo/tests/"
  (cd "$R/repo" && PYTHONUNBUFFERED=1 setsid nohup bash -c '"$@"; echo $? > '"$R/DONE" _ "$@" \
    > "$R/log" 2>&1 < /dev/null &)
  sleep 5
  exec bash "$0" poll "$NAME" "$P"
  ;;
poll)
  P=${1:?SECONDS}; shift
  [ -f "$R/log" ] || { echo "NO RUN named $NAME on this machine"; exit 3; }
  end=$(( $(date +%s) + P )); i=0
  while [ "$(date +%s)" -lt "$end" ] && [ ! -f "$R/DONE" ]; do
    sleep 5; i=$((i + 1)); [ $((i % 9)) -eq 0 ] && echo "$(date +%T) | $(tail -n 1 "$R/log" | cut -c1-200)"
  done
  tar czf "${OUT:-/tmp}/$NAME.tgz" -C / "${R#/}/log" "${@#/}" 2>/dev/null
  tail -n 25 "$R/log" | cut -c1-300
  [ -f "$R/DONE" ] && { echo "DONE (exit $(cat "$R/DONE"))"; exit 0; }
  echo RUNNING; exit 3
  ;;
*) echo "start or poll, not $CMD"; exit 2 ;;
esac
