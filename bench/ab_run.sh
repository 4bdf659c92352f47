#!/usr/bin/env bash
# One benchmark command from two trees, alternated in one call (A B A B ...), so that a slower host or a warmer
# cache favours neither: a regression check of new code against an old commit (docs/device-runs.md, "A/B").
#   bench/ab_run.sh OLD_TREE ROUNDS OUT_DIR -- python3 bench/extract_bench.py --models 8b ...
# OLD_TREE: a copy of the old commit (`git archive COMMIT | tar -x -C .ab/old`, carried); the new tree is the
# current folder. Each run gets `--out OUT_DIR/ab-{old,new}-<round>.json` appended; its log goes beside it.
set -uo pipefail
old=$(cd "$1" && pwd); rounds=$2; out=$(mkdir -p "$3" && cd "$3" && pwd); shift 3
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "usage: $0 OLD_TREE ROUNDS OUT_DIR -- COMMAND..." >&2; exit 2; }
new=$(pwd)
for ((i = 0; i < rounds; i++)); do
  for side in old new; do
    tree=$old; [ "$side" = new ] && tree=$new
    echo "== round $i: $side ($tree)"
    (cd "$tree" && "$@" --out "$out/ab-$side-$i.json") >"$out/ab-$side-$i.log" 2>&1
    echo "   exit $?, $(tail -n 1 "$out/ab-$side-$i.log" | cut -c1-160)"
  done
done
