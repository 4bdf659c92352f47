#!/usr/bin/env bash
# The quality run's payload for the device machine (docs/device-runs.md), built here under .gpu/ (ignored by git):
#   [PARTS=3] [TORCHAO=0.17.0] bash bench/device_payload.sh [HELDOUT]
# .gpu/p1: the GGUF's first part, the wheels of gguf and of jsonschema with its dependencies (the device image has
#   neither; eagle3.config imports jsonschema), the 80 MT-bench questions, the last HELDOUT (default 500) ShareGPT
#   conversations (the held-out varied set: evaluated, never trained on).
# .gpu/p2 (the last part, .gpu/pPARTS): the GGUF's last part and its sha256, the tensorboardX wheel, the other
#   conversations gzipped; parts between them: the GGUF's parts alone. PARTS (default 2): the GGUF is split in that
#   many parts, one a call.
# TORCHAO: that torchao version's wheel goes into .gpu/p1 too (the rows that extract from the target FP8 on load:
#   fp8w_first, fp8-weights; the device image has no torchao).
# Each part, with what travels in every call (the files git tracks or does not ignore: bench/answers/ included),
# stays under one call's 64 MiB. Needs the project's venv with the public-data extra (setup.sh test).
set -euo pipefail
HELDOUT=${1:-500}
PARTS=${PARTS:-2}
[[ $PARTS =~ ^[1-9][0-9]*$ ]] || { echo "PARTS=$PARTS: the number of parts the GGUF travels in, a whole number (2 or more fit a call)"; exit 2; }
cd "$(dirname "$0")/.."
version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
wheels() {  # NAME==VERSION ... into DIR, for the device's Python 3.12 on x86-64
  local dir=$1; shift
  python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$@"
}
G=$(python -c "from eagle3.models import find_smollm2_gguf as f; print(f())")
rm -rf .gpu/p[0-9]* && for k in $(seq "$PARTS"); do mkdir -p ".gpu/p$k"; done
LAST=.gpu/p$PARTS
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
split -n "$PARTS" -d "$G" "$tmp/gguf.part"
for k in $(seq "$PARTS"); do mv "$tmp/gguf.part$(printf %02d $((k - 1)))" ".gpu/p$k/"; done
sha256sum "$G" | cut -d' ' -f1 > "$LAST/gguf.sha256"
wheels .gpu/p1 "gguf==$(version gguf)" "jsonschema==$(version jsonschema)" \
  "jsonschema-specifications==$(version jsonschema-specifications)" "referencing==$(version referencing)" \
  "rpds-py==$(version rpds-py)"
wheels "$LAST" "tensorboardX==$(version tensorboardX)"
[ -z "${TORCHAO:-}" ] || python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --platform manylinux_2_28_x86_64 -d .gpu/p1 "torchao==$TORCHAO"
python -m eagle3 prompts mtbench .gpu/p1/mtbench.jsonl
python -m eagle3 prompts sharegpt "$tmp/sharegpt.jsonl" > "$LAST/sharegpt.report.json"
head -n "-$HELDOUT" "$tmp/sharegpt.jsonl" | gzip > "$LAST/sharegpt.jsonl.gz"
tail -n "$HELDOUT" "$tmp/sharegpt.jsonl" > .gpu/p1/heldout.jsonl
tree=$(git ls-files -z -co --exclude-standard | xargs -0 cat 2>/dev/null | wc -c)
echo "the tree that travels in every call: $tree bytes"
du -sb .gpu/p[0-9]* | while read -r bytes dir; do
  [ $((bytes + tree)) -lt 67108864 ] || {
    echo "$dir: $bytes bytes + the tree, over one call's 64 MiB: PARTS=$((PARTS + 1)) bash $0"; exit 1; }
  echo "$dir: $bytes bytes"
done
