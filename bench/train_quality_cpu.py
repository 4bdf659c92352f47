"""Drafter quality on the real SmolLM2-135M-Instruct target, entirely on this CPU machine.

The device cannot hold the target's weights (517 MB > the 64 MiB that travels), so: the target
answers N prompts greedily (batched HF generate), the reference oracle extracts the states, the
drafter trains with TTT, and speculative decoding on held-out prompts measures tau at k=5 against a
randomly initialised drafter of the same shape (the floor). Every stage is cached in OUT_DIR.

    python bench/train_quality_cpu.py OUT_DIR [--prompts 400] [--new-tokens 128] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from eagle3.models import default_capture_layers, ensure_smollm2, load_model, load_tokenizer  # noqa: E402
from eagle3.train import selfdistill as sd  # noqa: E402
from eagle3.train.run import EvalConfig, evaluate_phase, train_phase  # noqa: E402
from eagle3.train.trainer import TrainConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--heldout", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = ensure_smollm2()
    times = {}

    samples_path = out / "samples.jsonl"
    samples = [json.loads(ln) for ln in samples_path.read_text().splitlines()] if samples_path.is_file() else []
    if len(samples) < args.prompts:  # answers of a smaller earlier run are reused: make_prompts(n) is a prefix
        t = time.time()
        model, tok = load_model(path), load_tokenizer(path)
        samples += sd.generate_answers(model, tok, sd.make_prompts(args.prompts)[len(samples):], args.new_tokens,
                                       batch_size=32)
        samples_path.write_text("".join(json.dumps(s) + "\n" for s in samples))
        times["generate_s"] = time.time() - t
    shards = out / "shards"
    if not (shards / "shard-00001" / "manifest.json").is_file():
        t = time.time()
        model = load_model(path)
        sd.write_shards(model, samples, shards, default_capture_layers(30), num_shards=2, chunk_samples=32,
                        model_path=str(path))
        times["extract_s"] = time.time() - t
    t = time.time()
    train = train_phase(TrainConfig(
        shard_dirs=[str(shards / "shard-00000"), str(shards / "shard-00001")], model_path=str(path),
        output_dir=str(out / "train"), batch_size=args.batch_size, epochs=args.epochs, lr=args.lr, warmup_ratio=0.05,
        checkpoint_every=50, ttt_steps=7, max_seq_len=512))
    times["train_s"] = time.time() - t
    t = time.time()
    ev = evaluate_phase(EvalConfig(export_dir=str(out / "train" / "export"), model_path=str(path),
                                   output_dir=str(out / "eval"), prompts=sd.make_prompts(args.heldout, offset=args.prompts),
                                   k=5, max_new_tokens=args.eval_new_tokens))
    times["eval_s"] = time.time() - t
    summary = {
        "train_samples": len(samples), "train_tokens": sum(len(s["input_ids"]) for s in samples),
        "answer_tokens": sum(sum(s["loss_mask"]) for s in samples), "draft_vocab": train["draft_vocab_size"],
        "steps": train["steps"], "last_acc_k": train["last"]["acc_k"], "tau_k5": ev["tau"],
        "tau_k5_random_init": ev["tau_random_init"], "identical_to_greedy": ev["identical_to_greedy"],
        "acceptance_rate_by_position": ev["results"]["trained"]["acceptance_rate_by_position"], "times": times,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
