# Watch the GPU quality run (quality_driver.sh, running in its own session on this warm machine) for up to
# POLL_S seconds or until it is done: two progress lines (one a lane) every 45 s; then its results so far into $OUT/q.tgz
# (ablations.md/json, quality_gpu.json, plots, eval_speed, the logs) and the table on stdout.
#   bash bench/device/quality_poll.sh [POLL_S=560]
set -u
P=${1:-560}
[ -f /root/q/driver.log ] || { echo "NO RUN: quality_call2_start.sh did not start one on this machine"; exit 3; }
end=$(( $(date +%s) + P ))
i=0
while [ "$(date +%s)" -lt "$end" ] && [ ! -f /root/q/DONE ]; do
  sleep 5; i=$((i + 1)); [ $((i % 9)) -eq 0 ] || continue
  for lane in gen runs; do
    echo "$(date +%T) | $(grep " $lane " /root/q/run.log 2>/dev/null | grep -v 'tok/s, ETA' | tail -n 1 | cut -c1-200)"
  done
done
cp /root/q/run.log /root/q/driver.log /root/qout/ 2>/dev/null
tar czf "$OUT/q.tgz" -C /root qout
[ -f /root/q/DONE ] && echo DONE || echo RUNNING
tail -n 25 /root/q/driver.log | cut -c1-300
cat /root/qout/ablations.md 2>/dev/null
