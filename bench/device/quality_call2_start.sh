# Device call 2 of the GPU quality run (carry .gpu/p2; call 1 = quality_call1_stash.sh on the same warm machine):
# join the GGUF halves, start the run in its own process session (bench/device/quality_driver.sh: it outlives this
# call and runs on while the machine is held), then watch it with quality_poll.sh until this call's end.
#   bash bench/device/quality_call2_start.sh DEADLINE_S [POLL_S] [-- extra arguments of train_quality_gpu.py]
# DEADLINE_S: seconds from now by which the whole run (the evaluators' speed comparison included) ends: the
# session's device time left, less the poll calls' gaps and a margin. Later calls: bash bench/device/quality_poll.sh.
set -u
D=${1:?DEADLINE_S}; P=${2:-560}; shift $(( $# < 2 ? $# : 2 )); [ "${1:-}" = "--" ] && shift
S=/root/stash
[ -f $S/gguf.part00 ] || { echo "STASH MISSING: this machine is not the one call 1 used"; exit 3; }
cat $S/gguf.part00 .gpu/p2/gguf.part01 > /root/smollm2.gguf
echo "$(cat .gpu/p2/gguf.sha256)  /root/smollm2.gguf" | sha256sum -c - || exit 4
python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site $S/gguf-*.whl .gpu/p2/tensorboard*-*.whl || exit 5
cp .gpu/p2/sharegpt.jsonl $S/
rm -rf /root/repo && mkdir -p /root/repo /root/q /root/qout && cp -r bench eagle3 /root/repo/  # the frozen copy it runs
setsid nohup bash /root/repo/bench/device/quality_driver.sh "$D" "$@" > /root/q/driver.log 2>&1 < /dev/null &
sleep 5
exec bash bench/device/quality_poll.sh "$P"
