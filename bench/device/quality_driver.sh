# The GPU quality run on the device, started by quality_call2_start.sh in its own process session: the quality
# script (answers, base + ablations, main run) under DEADLINE_S less the speed comparison's reserve, then the
# evaluators' speed comparison on the main drafter (bench/eval_speed.py) when its time is left. /root/q/DONE at
# the end. Results in /root/qout (quality_poll.sh copies them into $OUT as q.tgz).
#   bash quality_driver.sh DEADLINE_S [extra arguments of train_quality_gpu.py]
set -u
D=$1; shift
RESERVE=${EVAL_SPEED_S:-130}
S=/root/stash
t0=$(date +%s)
cd /root/repo
export PYTHONPATH=/root/site:/root/repo PYTHONUNBUFFERED=1
python3 bench/train_quality_gpu.py --gguf /root/smollm2.gguf --train-prompts $S/sharegpt.jsonl \
  --eval-prompts $S/mtbench.jsonl --work /root/q --out /root/qout --deadline-s "$D" --reserve-s "$RESERVE" "$@" \
  2>&1 | grep -v "it/s\]"
left=$(( D - ($(date +%s) - t0) ))
echo "quality script done; ${left}s left"
if [ "$left" -gt $((RESERVE - 20)) ] && [ -d /root/q/train-main/export ]; then
  python3 bench/eval_speed.py --model /root/q/model --export /root/q/train-main/export --prompts $S/mtbench.jsonl \
    --max-new-tokens 512 --ks 5 --sequential-turns ${SEQ_TURNS:-4} --out /root/qout/eval_speed 2>&1 | grep -v "it/s\]"
fi
touch /root/q/DONE
