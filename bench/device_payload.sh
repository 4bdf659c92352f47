#!/usr/bin/env bash
# The quality run's payload for the device machine (docs/device-runs.md), built here under .gpu/ (ignored by git):
#   bash bench/device_payload.sh [HELDOUT]
# .gpu/p1: the GGUF's first half, the wheels of gguf and of jsonschema with its dependencies (the device image has
#   neither; eagle3.config imports jsonschema), the 80 MT-bench questions, the last HELDOUT (default 500) ShareGPT
#   conversations (the held-out varied set: evaluated, never trained on).
# .gpu/p2: the GGUF's second half and its sha256, the tensorboardX wheel, the other conversations gzipped.
# Each half stays under one call's 64 MiB. Needs the project's venv with the public-data extra (setup.sh test).
set -euo pipefail
HELDOUT=${1:-500}
cd "$(dirname "$0")/.."
version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
wheels() {  # NAME==VERSION ... into DIR, for the device's Python 3.12 on x86-64
  local dir=$1; shift
  python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$@"
}
G=$(python -c "from eagle3.models import find_smollm2_gguf as f; print(f())")
rm -rf .gpu/p1 .gpu/p2 && mkdir -p .gpu/p1 .gpu/p2
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
split -n 2 -d "$G" "$tmp/gguf.part" && mv "$tmp/gguf.part00" .gpu/p1/ && mv "$tmp/gguf.part01" .gpu/p2/
sha256sum "$G" | cut -d' ' -f1 > .gpu/p2/gguf.sha256
wheels .gpu/p1 "gguf==$(version gguf)" "jsonschema==$(version jsonschema)" \
  "jsonschema-specifications==$(version jsonschema-specifications)" "referencing==$(version referencing)" \
  "rpds-py==$(version rpds-py)"
wheels .gpu/p2 "tensorboardX==$(version tensorboardX)"
python -m eagle3 prompts mtbench .gpu/p1/mtbench.jsonl
python -m eagle3 prompts sharegpt "$tmp/sharegpt.jsonl" > .gpu/p2/sharegpt.report.json
head -n "-$HELDOUT" "$tmp/sharegpt.jsonl" | gzip > .gpu/p2/sharegpt.jsonl.gz
tail -n "$HELDOUT" "$tmp/sharegpt.jsonl" > .gpu/p1/heldout.jsonl
du -sb .gpu/p1 .gpu/p2 | while read -r bytes dir; do
  [ "$bytes" -lt 67108864 ] || { echo "$dir: $bytes bytes, over one call's 64 MiB"; exit 1; }
  echo "$dir: $bytes bytes"
done
