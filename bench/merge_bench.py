"""Merge + shuffle benchmark: tokens/s and peak RSS of run_merge on synthetic tokenized JSONL, vs a naive
baseline (load everything, random.shuffle, write one parquet file) measured side by side.

    python bench/merge_bench.py                    # 10M and 100M tokens, baseline on 10M
    python bench/merge_bench.py --sizes 10 --no-baseline

Each measurement runs in its own child process that reports its own peak RSS (getrusage ru_maxrss), so one
run's memory never hides another's. Data is generated once under --data (10 datasets, real-looking shape:
log-normal lengths around 2K tokens with a tail past 8192, ids in the SmolLM2 vocab, mask = assistant tail).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 49152
N_DATASETS = 10


def generate(folder: Path, total_tokens: int, seed: int = 0) -> Path:
    """Write N_DATASETS folders of tokenized.jsonl holding `total_tokens` tokens in all (cached)."""
    done = folder / "GENERATED"
    if done.exists():
        return folder
    rng = np.random.default_rng(seed)
    per_ds = total_tokens // N_DATASETS
    for d in range(N_DATASETS):
        name = f"D{d:02d}"
        (folder / name).mkdir(parents=True, exist_ok=True)
        n, i = 0, 0
        with open(folder / name / "tokenized.jsonl", "w") as f:
            while n < per_ds:
                L = int(min(max(16, rng.lognormal(7.4, 0.8)), 40_000, per_ds - n + 16))
                ids = rng.integers(0, VOCAB, L)
                prompt = int(L * rng.uniform(0.1, 0.6))
                mask = "0," * prompt + "1," * (L - prompt)
                f.write(f'{{"sample_id": "{name}-{i:08d}", "dataset": "{name}", '
                        f'"input_ids": [{",".join(map(str, ids.tolist()))}], '
                        f'"loss_mask": [{mask[:-1]}]}}\n')
                n += L
                i += 1
    done.write_text(str(total_tokens))
    return folder


CHILD_MERGE = """
import json, resource, sys, time
from eagle3.merge import MergeConfig, run_merge
from eagle3.sections import TargetConfig
# SmolLM2-135M's facts, as preflight resolves them (the estimate and the vocab bound; no model folder needed)
target = TargetConfig(model_path="SmolLM2-135M-Instruct", capture_layers=[2, 15, 27], num_layers=30,
                      hidden_size=576, vocab_size=%d)
t = time.perf_counter()
s = run_merge(MergeConfig(inputs=[sys.argv[1]], output_dir=sys.argv[2], seed=1, target=target,
                          extraction_tokens_per_s=50000, verify_existing=False))
dt = time.perf_counter() - t
st = json.load(open(sys.argv[2] + "/stats.json"))
print(json.dumps({"seconds": dt, "tokens_in": st["tokens_in"], "tokens_out": s["tokens"], "rows": s["rows"],
                  "files": s["files"], "estimate": s["extraction_estimate"],
                  "cpu_s": sum(resource.getrusage(resource.RUSAGE_SELF)[:2]),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
""" % VOCAB

CHILD_NAIVE = """
import json, random, resource, sys, time, glob
import pyarrow as pa, pyarrow.parquet as pq
t = time.perf_counter()
rows = []
for path in sorted(glob.glob(sys.argv[1] + "/*/tokenized.jsonl")):
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            r["input_ids"], r["loss_mask"] = r["input_ids"][:8192], r["loss_mask"][:8192]
            r["length"] = len(r["input_ids"])
            rows.append(r)
random.Random(1).shuffle(rows)
table = pa.Table.from_pylist(rows)
pq.write_table(table, sys.argv[2] + "/naive.parquet", compression="zstd", compression_level=1)
dt = time.perf_counter() - t
tokens = sum(len(r["input_ids"]) for r in rows)
print(json.dumps({"seconds": dt, "cpu_s": sum(resource.getrusage(resource.RUSAGE_SELF)[:2]),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def child(code: str, data: Path, out: Path) -> dict:
    import shutil
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code, str(data), str(out)], capture_output=True, text=True, env=env)
    if p.returncode:
        raise SystemExit(p.stderr)
    return json.loads(p.stdout.strip().splitlines()[-1])


def input_tokens(data: Path) -> int:
    return int((data / "GENERATED").read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/tmp/eagle3-merge-bench")
    ap.add_argument("--sizes", default="10,100", help="millions of tokens")
    ap.add_argument("--no-baseline", action="store_true")
    args = ap.parse_args()
    base = Path(args.data)
    results = {}
    for m in [int(s) for s in args.sizes.split(",")]:
        data = generate(base / f"in-{m}M", m * 1_000_000)
        gb = sum(p.stat().st_size for p in data.glob("*/tokenized.jsonl")) / 1e9
        r = child(CHILD_MERGE, data, base / f"out-{m}M")
        r["input_gb"] = gb
        r["tokens_per_s"] = r["tokens_in"] / r["seconds"]
        r["tokens_per_cpu_s"] = r["tokens_in"] / r["cpu_s"]
        r["loadavg_after"] = os.getloadavg()[0]
        results[f"merge_{m}M"] = r
        print(f"merge {m}M tokens ({gb:.2f} GB JSONL): {r['seconds']:.1f} s, {r['tokens_per_s'] / 1e6:.2f}M tokens/s,"
              f" ({r['tokens_per_cpu_s'] / 1e6:.2f}M tokens per CPU-second, load avg {r['loadavg_after']:.1f}),"
              f" peak RSS {r['peak_rss_mb']:.0f} MB, {r['rows']} rows in {r['files']} files, estimate {r['estimate']}",
              flush=True)
        if m == min(int(s) for s in args.sizes.split(",")) and not args.no_baseline:
            b = child(CHILD_NAIVE, data, base / f"naive-{m}M")
            b["tokens_per_s"] = r["tokens_in"] / b["seconds"]
            b["tokens_per_cpu_s"] = r["tokens_in"] / b["cpu_s"]
            results[f"naive_{m}M"] = b
            print(f"naive {m}M tokens: {b['seconds']:.1f} s, {b['tokens_per_s'] / 1e6:.2f}M tokens/s,"
                  f" ({b['tokens_per_cpu_s'] / 1e6:.2f}M per CPU-second), peak RSS {b['peak_rss_mb']:.0f} MB"
                  f" -> merge is {r['tokens_per_s'] / b['tokens_per_s']:.1f}x"
                  f" faster with {b['peak_rss_mb'] / r['peak_rss_mb']:.1f}x less memory", flush=True)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    if len(sizes) > 1:
        lo, hi = results[f"merge_{sizes[0]}M"], results[f"merge_{sizes[-1]}M"]
        print(f"RSS ratio {sizes[-1]}M/{sizes[0]}M: {hi['peak_rss_mb'] / lo['peak_rss_mb']:.2f}")
    print(json.dumps({"machine": f"{platform.node()} {os.cpu_count()} cpus", "date": time.strftime("%Y-%m-%d"),
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
