"""Print where a run's outputs landed and each phase's headline numbers."""

import json
import sys
from pathlib import Path

run = Path(sys.argv[1])
if not run.is_dir():
    sys.exit(f"no run folder at {run}")


def load(p: Path):
    return json.loads(p.read_text()) if p.is_file() else None


print(f"\nrun folder: {run}")
if r := load(run / "preflight" / "preflight.json"):
    print(f"  preflight : {'ok' if r['ok'] else 'FAILED'} on {r['device']}  ({run / 'preflight' / 'preflight.json'})")
for ds in sorted((run / "datagen").glob("*/report.json")):
    r = load(ds)
    print(f"  datagen   : {ds.parent.name}: {r.get('rows')} samples, {r.get('tokens')} tokens, ${r.get('cost_usd', 0):.4f}"
          f"  ({ds})")
if r := load(run / "merge" / "manifest.json"):
    print(f"  merge     : {r['rows']} samples, {r['tokens']} tokens in {len(r['files'])} file(s)  ({run / 'merge'})")
for sh in sorted((run / "extract").glob("shard-*/manifest.json")):
    r = load(sh)
    print(f"  extract   : {sh.parent.name}: {len(r['chunks'])} chunk(s), {r['tokens']} tokens, complete={r['complete']}")
if r := load(run / "train" / "report.json"):
    print(f"  train     : drafter exported to {run / 'train' / 'export'}  (report {run / 'train' / 'report.json'})")
if r := load(run / "evaluate" / "report.json"):
    print(f"  evaluate  : tau {r.get('tau')} (random-init floor {r.get('tau_random_init')}), lossless "
          f"{r.get('identical_to_greedy')}  ({run / 'evaluate' / 'report.json'})")
