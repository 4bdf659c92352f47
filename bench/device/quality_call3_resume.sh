# Device call 3+ of the GPU quality run (no carry; the same warm machine as calls 1-2): the speed comparison of the
# evaluators on the main run's drafter (bench/eval_speed.py, into $OUT/eval_speed), then the ablation rows the
# earlier call left, under --deadline-s (default 540 s less the speed run). Extra arguments go to the quality script.
# SEQ_TURNS (default 4): turns today's one-prompt evaluator runs per k (~10 s a 512-token turn with its greedy check, from the 121 s for 20 x 320 tokens of the issue).
set -u
S=/root/stash
[ -d /root/q/train-main/export ] || { echo "NO MAIN RUN: call 2 did not finish its main row on this machine"; exit 3; }
cd /root/repo
t0=$(date +%s)
if [ ! -f /root/eval_speed.done ]; then
  PYTHONPATH=/root/site:/root/repo python3 bench/eval_speed.py --model /root/q/model --export /root/q/train-main/export \
    --prompts $S/mtbench.jsonl --max-new-tokens 512 --ks 5,7 --sequential-turns ${SEQ_TURNS:-4} --out "$OUT/eval_speed" 2>&1 \
    | grep -v "it/s\]" | tail -n 30 && touch /root/eval_speed.done
fi
left=$(( 540 - ($(date +%s) - t0) ))
PYTHONPATH=/root/site:/root/repo PYTHONUNBUFFERED=1 python3 bench/train_quality_gpu.py --gguf /root/smollm2.gguf \
  --train-prompts $S/sharegpt.jsonl --eval-prompts $S/mtbench.jsonl --work /root/q --out "$OUT/q" \
  --deadline-s $left "$@" 2>&1 | grep -v "it/s\]" | tail -n 60
