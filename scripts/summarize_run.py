"""Print where a run's outputs landed and each phase's headline numbers."""

import json
import sys
from pathlib import Path

run = Path(sys.argv[1])
if not run.is_dir():
    sys.exit(f"no run folder at {run}")
print(f"\nrun folder: {run}")
pf = run / "preflight" / "preflight.json"
if pf.is_file():
    r = json.loads(pf.read_text())
    print(f"  preflight: {'ok' if r['ok'] else 'FAILED'} on {r['device']}; report {pf}")
for name in ("datagen", "merge", "extract", "train", "evaluate"):
    for rep in sorted((run / name).glob("**/report.json")) if (run / name).is_dir() else []:
        print(f"  {name}: {rep}")
