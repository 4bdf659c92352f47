# Wait (at most $1 seconds) for the detached quality run of quality_call2_join_and_run.sh, then show its log tail
# and copy what it has written so far into $OUT/qout. Used at the end of call 2 and in the calls after it.
set -u
end=$(( $(date +%s) + ${1:-560} ))
while [ "$(date +%s)" -lt $end ] && kill -0 "$(cat /root/q.pid)" 2>/dev/null; do sleep 5; done
kill -0 "$(cat /root/q.pid)" 2>/dev/null && echo "RUN STILL GOING" || echo "RUN ENDED"
grep -v "it/s\]" /root/q.log | tail -n 40
mkdir -p "$OUT/qout" && cp -r /root/qout/. "$OUT/qout/" 2>/dev/null
cp /root/q.log "$OUT/qout/q.log" 2>/dev/null
cp /root/q/evaluate/report*.json "$OUT/qout/" 2>/dev/null
true
