#!/usr/bin/env bash
# Builds the two payload folders of the GPU quality run (bench/train_quality_gpu.py), here on the project machine.
# A device call carries at most 64 MiB of ignored paths, and the GGUF is 98 MB, so it travels in two halves:
#   .gpu/p1: gguf.part00, the gguf wheel (the device has no gguf package), mtbench.jsonl (80 questions)
#   .gpu/p2: gguf.part01, gguf.sha256, sharegpt.jsonl (first human turns of --limit ShareGPT conversations,
#            MT-bench questions removed; `python -m eagle3 prompts sharegpt`)
# .gpu/ is ignored by git (.gitignore), so the lead copies it beside the tree and names it in `carry`.
# Usage: bash bench/device/prepare_quality_payload.sh [LIMIT=20000: all] [DEST=.gpu]; needs the public-data extra.
set -euo pipefail
LIMIT=${1:-20000}
DEST=${2:-.gpu}
G=$(python -c "from eagle3.models import find_smollm2_gguf as f; print(f())")
rm -rf "$DEST/p1" "$DEST/p2" && mkdir -p "$DEST/p1" "$DEST/p2"
TMP=$(mktemp -d)
split -n 2 -d "$G" "$TMP/gguf.part"
mv "$TMP/gguf.part00" "$DEST/p1/" && mv "$TMP/gguf.part01" "$DEST/p2/"
sha256sum "$G" | cut -d' ' -f1 > "$DEST/p2/gguf.sha256"
python -m pip download -q --no-deps "gguf==$(python -c 'import importlib.metadata as m; print(m.version("gguf"))')" \
  -d "$DEST/p1"
# the trainer writes TensorBoard event files through tensorboardX, which the device image lacks
python -m pip download -q --no-deps "tensorboardX==$(python -c 'import importlib.metadata as m; print(m.version("tensorboardX"))')" \
  -d "$DEST/p2"
python -m eagle3 prompts mtbench "$DEST/p1/mtbench.jsonl" > "$TMP/mtbench.report.json"
python -m eagle3 prompts sharegpt "$TMP/sharegpt-full.jsonl" --limit "$LIMIT" > "$DEST/p2/sharegpt.report.json"
# first human turn (and a leading system turn) only: the quality run asks single-turn prompts, and it halves the bytes
python - "$TMP/sharegpt-full.jsonl" "$DEST/p2/sharegpt.jsonl" <<'PY'
import json, sys
with open(sys.argv[1], encoding="utf-8") as src, open(sys.argv[2], "w", encoding="utf-8") as dst:
    for line in src:
        obj = json.loads(line)
        turns = obj["conversations"]
        first = next(i for i, t in enumerate(turns) if t["from"] == "human")
        dst.write(json.dumps({"id": obj.get("id"), "conversations": turns[: first + 1]}, ensure_ascii=False) + "\n")
PY
rm -rf "$TMP"
du -sh "$DEST/p1" "$DEST/p2"
for d in "$DEST/p1" "$DEST/p2"; do
  bytes=$(du -sb "$d" | cut -f1)
  [ "$bytes" -lt $((64 * 1024 * 1024)) ] || { echo "$d is $bytes bytes: over the 64 MiB a call carries"; exit 1; }
done
