"""The pipeline's GPU path end to end, on one GPU, in one process: extraction shards -> training -> export ->
speculative-decoding evaluation, exactly through the phase functions the operators call.

Needs no weights on the GPU machine (the real ones are over the 64 MiB one call carries), so the target is a
random-weight model with SmolLM2's config and its real tokenizer (config and tokenizer files are small). Its
acceptance figures say nothing about quality; this run checks that every CUDA code path works (pinned/async
extraction, compiled bf16 training, export, lossless speculative decoding on the GPU) and times them.

    python bench/gpu_pipeline_smoke.py --meta <folder with config.json + tokenizer files> --out <dir>
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--meta", required=True, help="config.json, tokenizer.json, tokenizer_config.json, chat template")
    p.add_argument("--work", default="/tmp/eagle3-gpu-smoke")
    p.add_argument("--out", required=True)
    p.add_argument("--samples", type=int, default=600)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=200)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--eval-prompts", type=int, default=6)
    a = p.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    from eagle3.extract.extractor import ExtractConfig, extract_shard
    from eagle3.extract.plan import plan_shards
    from eagle3.extract.synthetic import write_merged_dataset
    from eagle3.train.run import EvalConfig, evaluate_phase, train_phase
    from eagle3.train.trainer import TrainConfig

    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    model_dir = work / "target"
    shutil.copytree(a.meta, model_dir)
    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(model_dir)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)  # random weights, SmolLM2 shape
    report: dict = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                    "torch": torch.__version__}

    rng = np.random.default_rng(0)
    samples = [rng.integers(3, cfg.vocab_size, size=int(rng.integers(a.min_len, a.max_len))).tolist() for _ in range(a.samples)]
    write_merged_dataset(work / "merge", samples)
    specs = plan_shards(work / "merge", a.shards)
    t = time.perf_counter()
    shard_out = [extract_shard(ExtractConfig(model_path=str(model_dir), extract_dir=str(work / "extract"),
                                             chunk_mb=64, token_budget=65536), s) for s in specs]
    report["extract"] = {"seconds": round(time.perf_counter() - t, 2), "tokens": sum(o["tokens"] for o in shard_out),
                         "shards": [{k: o[k] for k in ("shard", "chunks", "tokens", "tok_per_s")} for o in shard_out]}
    # a finished shard re-run is a no-op on the GPU too
    again = extract_shard(ExtractConfig(model_path=str(model_dir), extract_dir=str(work / "extract"), chunk_mb=64,
                                        token_budget=65536), specs[0])
    report["extract"]["rerun_skipped"] = again["skipped"]

    t = time.perf_counter()
    tcfg = TrainConfig(shard_dirs=[o["shard_dir"] for o in shard_out], model_path=str(model_dir),
                       output_dir=str(work / "train"), max_steps=a.train_steps, batch_size=8, lr=5e-4,
                       checkpoint_every=100, max_seq_len=2048)
    tr = train_phase(tcfg)
    report["train"] = {"seconds": round(time.perf_counter() - t, 2), "steps": tr["steps"],
                       "train_tokens": tr["train_tokens"], "last": tr["last"]}
    metrics = [json.loads(line) for line in open(work / "train" / "metrics.jsonl")]
    report["train"]["first_loss"] = metrics[0]["loss"]
    report["train"]["tokens_per_s_last"] = metrics[-1].get("tokens_per_s")

    prompts = ["What is the capital of France?", "Write a haiku about rain.", "Explain recursion briefly.",
               "List three fruits.", "How do magnets work?", "Translate 'thank you' into French."]
    t = time.perf_counter()
    ev = evaluate_phase(EvalConfig(export_dir=str(work / "train" / "export"), model_path=str(model_dir),
                                   output_dir=str(work / "evaluate"), prompts=prompts[:a.eval_prompts], k=3, max_new_tokens=48))
    report["evaluate"] = {"seconds": round(time.perf_counter() - t, 2), "tau": ev["tau"],
                          "tau_random_init": ev["tau_random_init"], "identical_to_greedy": ev["identical_to_greedy"]}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_pipeline_smoke.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
