"""Compile once per worker: shard tasks as the operator runs them, each in a fresh process, one after another on
one worker sharing a compile cache folder (ExtractConfig.compile_cache_dir, emptied first). The first task
compiles; the second should find every graph in the cache. Per task: the time from the process's start to the
first batch's states (model build, load, compilation, the first forward) and how much of it the random model's
build took, the wall tokens/s of the whole task, the FX graph cache's hits and misses.

    python3 bench/extract_tasks.py --model qwen3-30b-a3b --tokens 2e6 --tasks 2 --out $OUT/tasks.json   # H200
    python bench/extract_tasks.py --smoke --out /tmp/tasks.json    # CPU, tiny-moe, a few thousand tokens
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child(a: argparse.Namespace) -> dict:
    """One shard task in this (fresh) process."""
    t0 = time.perf_counter()
    import torch

    from bench.extract_bench import Bench, Target, run_extractor
    from bench.extract_limits import DEFAULT_BUDGET, build_model, make_samples, sync
    from eagle3.extract.backend import HFBackend
    from eagle3.extract.compile_cache import cache_counters
    from eagle3.models import default_capture_layers

    device = torch.device(a.device)
    dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    imported = time.perf_counter() - t0
    model, path = build_model(a.model, device, getattr(torch, dtype_name), None)
    sync(device)
    built = time.perf_counter() - t0  # a random-weight model: the bench's stand-in for loading a checkpoint
    L = model.config.num_hidden_layers
    samples = make_samples(int(float(a.tokens)), a.min_len, a.max_len, model.config.vocab_size, seed=a.seed)
    first = {}
    capture = HFBackend.capture

    def timed_capture(self, ids):  # the first batch's states, synced: what the task waited before any output
        out = capture(self, ids)
        if "s" not in first:
            sync(device)
            first["s"] = time.perf_counter() - t0
        return out

    HFBackend.capture = timed_capture
    args = argparse.Namespace(cold_host_buffers=False, discard_chunks=a.discard_chunks)
    b = Bench(args, device, getattr(torch, dtype_name), dtype_name, Path(a.work))
    t = Target(model, path, samples, default_capture_layers(L), a.budget or DEFAULT_BUDGET[a.model], a.chunk_mb)
    r = run_extractor(b, t, samples, a.writers, compile=True, compile_cache_dir=a.cache)
    return {"first_batch_s": round(first["s"], 2), "imports_s": round(imported, 2), "model_built_s": round(built, 2),
            "extractor_to_first_batch_s": round(first["s"] - built, 2),
            "process_wall_s": round(time.perf_counter() - t0, 2),
            "tokens": r["tokens"], "tok_per_s_wall": r["tok_per_s_wall"], "steady_tok_per_s": r["steady_tok_per_s"],
            "extract_wall_s": r["wall_s"], **{k: r.get(k) for k in ("setup_s", "host_buffers_made_ahead_s")},
            **cache_counters()}


def parser() -> argparse.ArgumentParser:
    """The command line (tests/test_device_runs.py checks docs/device-runs.md's commands against it)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="2e6", help="tokens of each task's shard")
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=None)
    ap.add_argument("--chunk-mb", type=int, default=1024)
    ap.add_argument("--writers", type=int, default=6)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--work", default="bench_work/tasks")
    ap.add_argument("--cache", default=None, help="the worker's compile cache folder (default: <work>/cache)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--discard-chunks", action="store_true", help="delete each chunk once committed (a shard larger "
                    "than the disk; bench/extract_bench.py --discard-chunks)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny-moe, 3000 tokens, 2 tasks")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.smoke:
        a.model, a.tokens, a.min_len, a.max_len, a.device, a.chunk_mb, a.writers = "tiny-moe", "3000", 64, 400, \
            "cpu", 1, 2
    a.cache = a.cache or str(Path(a.work) / "cache")
    if a.child:
        print("TASK " + json.dumps(child(a)), flush=True)
        return 0
    shutil.rmtree(a.cache, ignore_errors=True)
    tasks = []
    for k in range(a.tasks):
        argv_k = [sys.executable, __file__, "--child", "--model", a.model, "--tokens", a.tokens, "--min-len",
                  str(a.min_len), "--max-len", str(a.max_len), "--chunk-mb", str(a.chunk_mb), "--writers",
                  str(a.writers), "--device", a.device, "--work", str(Path(a.work) / f"task{k}"), "--cache", a.cache,
                  "--seed", str(a.seed + k)] + (["--budget", str(a.budget)] if a.budget else []) \
            + (["--discard-chunks"] if a.discard_chunks else [])
        p = subprocess.run(argv_k, cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = next((x for x in p.stdout.splitlines() if x.startswith("TASK ")), None)
        if p.returncode or line is None:
            print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
            return 1
        tasks.append(json.loads(line[5:]))
        print(f"task {k}: first batch after {tasks[-1]['first_batch_s']:.1f} s (model built at "
              f"{tasks[-1]['model_built_s']:.1f} s, then {tasks[-1]['extractor_to_first_batch_s']:.1f} s in the "
              f"extractor), {tasks[-1]['tok_per_s_wall']:.0f} "
              f"tok/s wall ({tasks[-1]['steady_tok_per_s']:.0f} steady); FX graph cache hits "
              f"{tasks[-1]['fxgraph_cache_hit']}, misses {tasks[-1]['fxgraph_cache_miss']}", flush=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:] if argv is None else argv,
           "model": a.model, "tokens": a.tokens, "tasks": tasks,
           "second_over_first_wall": tasks[1]["tok_per_s_wall"] / tasks[0]["tok_per_s_wall"] if a.tasks > 1 else None,
           "first_batch_saved_s": tasks[0]["first_batch_s"] - tasks[1]["first_batch_s"] if a.tasks > 1 else None}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
