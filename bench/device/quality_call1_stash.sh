# Device call 1 of the GPU quality run (bench/train_quality_gpu.py): the 98 MB GGUF is over the 64 MiB a device
# call may carry, so it travels in two halves. Here (project machine):
#   G=$(python -c "from eagle3.models import find_smollm2_gguf as f; print(f())")
#   mkdir -p .gpu/p1 .gpu/p2 && split -n 2 -d "$G" /tmp/gpart. && mv /tmp/gpart.00 .gpu/p1/gguf.part00 &&
#   mv /tmp/gpart.01 .gpu/p2/gguf.part01 && sha256sum "$G" > .gpu/p2/gguf.sha256 &&
#   pip download --no-deps gguf -d .gpu/p1
# Call 1 (carry .gpu/p1): stash half 1 outside the tree. Call 2 (carry .gpu/p2) must follow while the machine is
# still warm (30 s): bench/device/quality_call2_join_and_run.sh ARGS && bench/device/quality_poll.sh 555, then
# `bash bench/device/quality_poll.sh 540` in the calls after it until it prints RUN ENDED. Call 1 may also run
# other work (the 2026-12-03 third session ran bench/extract_bench.py in it).
set -u
mkdir -p /root/stash && cp .gpu/p1/gguf.part00 .gpu/p1/gguf-*.whl /root/stash/ && ls -la /root/stash
