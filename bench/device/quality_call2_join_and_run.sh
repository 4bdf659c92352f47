# Device call 2 of the GPU quality run (carry .gpu/p2; call 1 = quality_call1_stash.sh on the same warm machine):
# join the GGUF halves, then run bench/train_quality_gpu.py in the foreground under its --deadline-s (default
# 480 s: the call's 600 s less the GGUF conversion and the last stage's overrun). Results land in $OUT/q as they
# are measured (ablations.md/json, quality_gpu.json, plots, run.log). Extra arguments go to the script, e.g.
#   bash bench/device/quality_call2_join_and_run.sh --deadline-s 480
# A later call on the same warm machine continues the unfinished rows (every stage resumes; nothing is redone):
#   bash bench/device/quality_call3_resume.sh --deadline-s 540
set -u
S=/root/stash
[ -f $S/gguf.part00 ] || { echo "STASH MISSING: this machine is not the one call 1 used"; exit 3; }
cat $S/gguf.part00 .gpu/p2/gguf.part01 > /root/smollm2.gguf
echo "$(cat .gpu/p2/gguf.sha256)  /root/smollm2.gguf" | sha256sum -c - || exit 4
python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site $S/gguf-*.whl .gpu/p2/tensorboard*-*.whl || exit 5
cp .gpu/p2/sharegpt.jsonl $S/
rm -rf /root/repo && mkdir -p /root/repo && cp -r bench eagle3 /root/repo/  # frozen copy for the resuming calls
cd /root/repo
PYTHONPATH=/root/site:/root/repo PYTHONUNBUFFERED=1 python3 bench/train_quality_gpu.py --gguf /root/smollm2.gguf \
  --train-prompts $S/sharegpt.jsonl --eval-prompts $S/mtbench.jsonl --work /root/q --out "$OUT/q" \
  --deadline-s 480 "$@" 2>&1 | grep -v "it/s\]" | tail -n 60
