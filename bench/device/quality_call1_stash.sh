# Device call 1 of the GPU quality run (carry .gpu/p1, built by bench/device/prepare_quality_payload.sh): stash
# GGUF half 1, the gguf wheel and the MT-bench prompts outside the tree, where call 2 (the next call, on the same
# warm machine) finds them. The rest of the call is free for other work.
set -u
mkdir -p /root/stash && cp .gpu/p1/gguf.part00 .gpu/p1/gguf-*.whl .gpu/p1/mtbench.jsonl /root/stash/ && ls -la /root/stash
