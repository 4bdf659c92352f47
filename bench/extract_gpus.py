"""Extraction on several GPUs of one host (issue 28, item 8), the shard task as the operator runs it:

  - tensor parallel: one shard at tp_size 1, 2, 4, 8 (`--tp`; eagle3.extract.tp: transformers' tp_plan="auto",
    NCCL, experts spread for a MoE target) -> tokens/s against N x the one-GPU rate;
  - shard per GPU (`--shards N`): N shard tasks at once, each in its own process on its own GPU
    (CUDA_VISIBLE_DEVICES, as the Celery worker pins them) -> the aggregate rate, beside the disk's fsynced write
    rate with as many writers: which limit binds on one host;
  - a rank killed mid-shard (`--kill`): EAGLE3_INJECT_FAULT SIGKILLs rank 1 after 2 committed chunks -> RankFailed;
    the re-run resumes, and its chunks equal those of the uninterrupted run at that tp_size byte for byte.

The target is a random-weight shape (bench/extract_limits.py) saved once as an HF folder under --work (tensor
parallel loads it with from_pretrained). Keep NVLink multicast off (NCCL_NVLS_ENABLE=0: set here if unset).

    python3 bench/extract_gpus.py --model 8b --tokens 1e6 --tp 1,2,4,8 --shards 8 --kill --out $OUT/gpus.json
    python bench/extract_gpus.py --smoke --out /tmp/gpus.json     # CPU, gloo: tp 1 and 2, 2 shards, the kill
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
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def save_target(name: str, folder: Path, dtype: str, device: str) -> Path:
    """The random-weight shape as an HF folder (config.json + safetensors), built once (on the GPU: faster), and
    nothing of it left on the device for the ranks."""
    import torch

    from bench.extract_limits import build_model

    if (folder / "config.json").is_file():
        return folder
    model, _ = build_model(name, device, getattr(torch, dtype), None)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tmp.rename(folder)
    del model
    free_device(device)
    return folder


def free_device(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def config(a, model_dir: Path, out: Path, tp: int):
    from eagle3.extract.config import ExtractConfig
    from eagle3.sections import TargetConfig

    target = TargetConfig(model_path=str(model_dir), tp_size=tp, dtype=a.dtype).resolved()  # EAGLE-3's layers
    return ExtractConfig(target=target, extract_dir=str(out), device=a.device, token_budget=a.budget,
                         chunk_mb=a.chunk_mb, writer_threads=a.writers, rank_timeout_s=a.rank_timeout_s,
                         log_every_s=10.0)


def timed_shard(a, model_dir: Path, out: Path, tp: int, spec) -> dict:
    from eagle3.extract.run import extract_shard

    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    s = extract_shard(config(a, model_dir, out, tp), spec)
    wall = time.perf_counter() - start
    free_device(a.device)  # a tp_size 1 run loads the target in this process: none of it stays for the ranks
    return {"tp_size": tp, "tokens": s["tokens"], "chunks": s["chunks"], "wall_s": round(wall, 2),
            "tok_per_s_wall": s["tokens"] / wall}


def child(a) -> None:
    """One shard task in this process (--child SHARD): what a pinned worker slot runs."""
    from eagle3.extract.plan import plan_shards
    from eagle3.extract.config import ShardPlanConfig

    spec = plan_shards(ShardPlanConfig(str(Path(a.work) / "merge"), a.shards))[a.child]
    print("SHARD " + json.dumps(timed_shard(a, Path(a.work) / "model", Path(a.work) / f"per-gpu-{a.child}", 1,
                                            spec)), flush=True)


def shard_per_gpu(a) -> dict:
    """--shards shard tasks at once, one a GPU, each a fresh process: the aggregate rate and the disk beside it."""
    from bench.extract_limits import disk_probe

    procs, start = [], time.perf_counter()
    for k in range(a.shards):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if a.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(k)
        argv = [sys.executable, __file__, *a.argv, "--work", a.work, "--child", str(k)]
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = []
    for k, p in enumerate(procs):
        out, err = p.communicate()
        line = next((x for x in out.splitlines() if x.startswith("SHARD ")), None)
        if p.returncode or line is None:
            raise RuntimeError(f"shard task {k} failed (exit {p.returncode}): {err[-2000:]}")
        results.append(json.loads(line[6:]))
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    probe = disk_probe(Path(a.work) / "disk", int(a.disk_gb * 1e9), a.chunk_mb << 20, a.shards * a.writers, False)
    for k in range(a.shards):
        shutil.rmtree(Path(a.work) / f"per-gpu-{k}", ignore_errors=True)
    return {"shards": a.shards, "tasks": results, "wall_s": round(wall, 2), "tok_per_s_aggregate": tokens / wall,
            "disk_bytes_per_s": probe, "writers_per_task": a.writers}


def kill_and_resume(a, model_dir: Path, tp: int, spec, reference: Path) -> dict:
    """Rank 1 SIGKILLed after 2 committed chunks -> RankFailed; the re-run resumes and ends byte-identical."""
    from eagle3.extract.format import ShardManifest
    from eagle3.extract.run import extract_shard
    from eagle3.faults import ENV_VAR
    from eagle3.launch import RankFailed

    out = Path(a.work) / "killed"
    shutil.rmtree(out, ignore_errors=True)
    once = Path(a.work) / "fault-fired"
    once.unlink(missing_ok=True)
    os.environ[ENV_VAR] = f"shard=0,after_chunks=2,once_file={once},rank=1"
    start = time.perf_counter()
    try:
        extract_shard(config(a, model_dir, out, tp), spec)
        raise RuntimeError("the injected rank kill did not stop the shard")
    except RankFailed as e:
        failed = {"rank": e.rank, "error": str(e.error)[:200], "after_s": round(time.perf_counter() - start, 1)}
    finally:
        os.environ.pop(ENV_VAR, None)
    committed = len(ShardManifest.load(out / "shard-00000").chunks)
    summary = extract_shard(config(a, model_dir, out, tp), spec)
    sha = [c.sha256 for c in ShardManifest.load(out / "shard-00000").chunks]
    ref = [c.sha256 for c in ShardManifest.load(reference / "shard-00000").chunks]
    shutil.rmtree(out, ignore_errors=True)
    return {"tp_size": tp, "failed": failed, "committed_before_rerun": committed,
            "resumed_from_chunk": summary.get("resumed_from_chunk"), "chunks": len(sha), "byte_identical": sha == ref}


def parser() -> argparse.ArgumentParser:
    """The command line (tests/test_device_runs.py checks docs/device-runs.md's commands against it)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="8b", help="a random-weight shape of bench/extract_limits.py")
    ap.add_argument("--tokens", default="1e6")
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--tp", default="1,2,4,8", help="tp_size values, comma list (each <= the GPUs)")
    ap.add_argument("--shards", type=int, default=0, help="also N shard tasks at once, one a GPU (0 = skip)")
    ap.add_argument("--kill", action="store_true", help="also kill rank 1 mid-shard at the largest tp_size, re-run")
    ap.add_argument("--budget", type=int, default=32768)
    ap.add_argument("--chunk-mb", type=int, default=1024)
    ap.add_argument("--writers", type=int, default=6)
    ap.add_argument("--disk-gb", type=float, default=8.0, help="bytes of the disk probe beside --shards")
    ap.add_argument("--rank-timeout-s", type=float, default=600.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--work", default="bench_work/gpus")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo: the tiny shape, tp 1,2, 2 shards, the kill")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    a.argv, a.work = list(sys.argv[1:] if argv is None else argv), str(Path(a.work).resolve())
    if a.smoke:
        a.model, a.tokens, a.min_len, a.max_len, a.tp, a.shards, a.kill = "tiny", "2400", 64, 400, "1,2", 2, True
        a.budget, a.chunk_mb, a.writers, a.disk_gb, a.device, a.dtype = 512, 1, 2, 0.01, "cpu", "float32"
        a.rank_timeout_s = 120.0
    if a.child is not None:
        child(a)
        return 0

    from bench.extract_limits import make_samples
    from eagle3.extract.config import ShardPlanConfig
    from eagle3.extract.plan import plan_shards
    from tests.support.synthetic import write_merged_dataset

    work = Path(a.work)
    model_dir = save_target(a.model, work / "model", a.dtype, a.device)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    shutil.rmtree(work / "merge", ignore_errors=True)
    samples = make_samples(int(float(a.tokens)), a.min_len, a.max_len, vocab, seed=1)
    write_merged_dataset(work / "merge", samples, rows_per_file=512)
    spec = plan_shards(ShardPlanConfig(str(work / "merge"), 1))[0]
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": a.argv, "model": a.model,
           "tokens": spec.tokens, "tp": []}
    tps = [int(x) for x in a.tp.split(",")]
    for tp in tps:
        r = timed_shard(a, model_dir, work / f"tp{tp}", tp, spec)
        res["tp"].append(r)
        print(f"tp_size {tp}: {r['tok_per_s_wall']:.0f} tok/s wall ({r['tokens']} tokens, {r['wall_s']} s)",
              flush=True)
    one = res["tp"][0]["tok_per_s_wall"] if tps[0] == 1 else None
    for r in res["tp"]:
        r["speedup_over_tp1"] = r["tok_per_s_wall"] / one if one else None
        r["fraction_of_n_gpus"] = r["tok_per_s_wall"] / (one * r["tp_size"]) if one else None
    if a.kill:
        tp = max(t for t in tps if t > 1)
        res["kill"] = kill_and_resume(a, model_dir, tp, spec, work / f"tp{tp}")
        print(f"rank 1 killed at tp_size {tp}: {res['kill']['failed']}; re-run resumed from chunk "
              f"{res['kill']['resumed_from_chunk']}, byte-identical: {res['kill']['byte_identical']}", flush=True)
    if a.shards:
        plan_shards(ShardPlanConfig(str(work / "merge"), a.shards))  # the children read the same plan
        res["per_gpu"] = agg = shard_per_gpu(a)
        disk = agg["disk_bytes_per_s"]
        print(f"{a.shards} shard tasks at once: {agg['tok_per_s_aggregate']:.0f} tok/s aggregate"
              + (f" ({agg['tok_per_s_aggregate'] / (one * a.shards):.2f} of {a.shards} x tp_size 1)" if one else "")
              + f"; disk probe with {a.shards * a.writers} writers {disk / 1e9:.2f} GB/s", flush=True)
    for tp in tps:
        shutil.rmtree(work / f"tp{tp}", ignore_errors=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
