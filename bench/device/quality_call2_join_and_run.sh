# Device call 2 of the GPU quality run (see quality_call1_stash.sh): join the GGUF halves, start the run detached
# (setsid: it outlives the call; poll /root/q.pid and /root/q.log in the calls that follow). The arguments go to
# bench/train_quality_gpu.py after its --gguf/--work/--out, e.g. the 2026-12-03 second run:
#   bash bench/device/quality_call2_join_and_run.sh --prompts 9300 --part-size 3100 --gen-batch 1034 --heldout 30 \
#     --new-tokens 320 --max-seq-len 512 --shards 2 --epochs 3 --batch-size 32 --lr 8e-4 --eval-new-tokens 128 \
#     --floor-prompts 4 --k 5
set -u
S=/root/stash
[ -f $S/gguf.part00 ] || { echo "STASH MISSING: this machine is not the one call 1 used"; exit 3; }
cat $S/gguf.part00 .gpu/p2/gguf.part01 > /root/smollm2.gguf
echo "$(cut -d' ' -f1 .gpu/p2/gguf.sha256)  /root/smollm2.gguf" | sha256sum -c - || exit 4
python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site $S/gguf-*.whl || exit 5
rm -rf /root/repo && mkdir -p /root/repo && cp -r bench eagle3 /root/repo/  # frozen copy: later calls re-send the tree
cd /root/repo
PYTHONPATH=/root/site PYTHONUNBUFFERED=1 setsid nohup python3 bench/train_quality_gpu.py --gguf /root/smollm2.gguf \
  --work /root/q --out /root/qout "$@" > /root/q.log 2>&1 < /dev/null &
echo $! > /root/q.pid
