# A later device call of the GPU quality run, on the same warm machine, once the driver is DONE: the ablation rows
# it left ("not run (deadline)"), in the foreground, without the main run; finished rows are read back, not redone.
# Results into $OUT/q-rows.tgz and the table on stdout.
#   bash bench/device/quality_resume.sh SECONDS [extra arguments of train_quality_gpu.py, e.g. --ablations batch16]
set -u
T=${1:?SECONDS}; shift
S=/root/stash
[ -f /root/q/DONE ] || { echo "NO FINISHED RUN on this machine (quality_call2_start.sh, then quality_poll.sh)"; exit 3; }
rm -f /root/q/clock-runs.json  # the driver's rates were measured beside the answers' generation: far too slow
PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 timeout $((T - 10)) python3 bench/train_quality_gpu.py \
  --gguf /root/smollm2.gguf --train-prompts $S/sharegpt.jsonl --eval-prompts $S/mtbench.jsonl --work /root/q \
  --out /root/qrows --deadline-s $((T - 20)) --gen-by-s 1 --ablations-by-s $((T - 60)) --no-main "$@" 2>&1 \
  | grep " quality " | cut -c1-200 | tail -n 20
cp /root/q/run.log /root/qrows/ 2>/dev/null
tar czf "$OUT/q-rows.tgz" -C /root qrows
cat /root/qrows/ablations.md
