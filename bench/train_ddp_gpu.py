"""Training on 1 vs N GPUs through the real trainer (eagle3.train.trainer.train, DDP or FSDP2 over NCCL): the same
global batch must give the same loss curve, and N GPUs should train ~N x the tokens per second.

The target is a random-weight Llama of SmolLM2's width (hidden 576, vocab 49152, 2 layers: only its embedding,
lm_head and the states it produces matter), the data 512-token random samples whose states the reference
extractor writes. Each run trains `--steps` optimizer steps at batch_size 8 x grad_accum 1.

    python bench/train_ddp_gpu.py --gpus 2 [--parallel ddp,fsdp] [--steps 30] [--out FILE]
    python bench/train_ddp_gpu.py --smoke      # CPU, gloo, a tiny shape: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def build_target(out: Path, smoke: bool) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=1000) if smoke else dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                                     num_key_value_heads=3, vocab_size=49152)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=4, tie_word_embeddings=False, **shape))
    model.save_pretrained(str(out))
    return out


def build_shards(target: Path, out: Path, samples: int, length: int, device: str) -> list[Path]:
    from eagle3.models import load_model
    from tests.support.selfdistill import write_shards

    model = load_model(target, device=device)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    data = [{"input_ids": torch.randint(3, vocab, (length,), generator=g).tolist(),
             "loss_mask": [0] * (length // 4) + [1] * (length - length // 4)} for _ in range(samples)]
    return write_shards(model, data, out, [1, 2, 3], num_shards=1, chunk_samples=16, model_path=str(target))


def run(target: Path, shards: list[Path], out: Path, gpus: int, parallel: str, steps: int, device: str) -> dict:
    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import read_metrics, train

    cfg = TrainConfig(shard_dirs=[str(s) for s in shards], model_path=str(target), output_dir=str(out),
                      batch_size=8, max_steps=steps, ttt_steps=7, lr=1e-3, checkpoint_every=steps, seed=0,
                      device=device, num_gpus=gpus, parallel=parallel, draft_vocab_size=8000)
    t0 = time.time()
    train(cfg)
    seconds = time.time() - t0
    m = read_metrics(out / "metrics.jsonl")
    return {"gpus": gpus, "parallel": parallel, "seconds_with_startup": round(seconds, 1),
            "tokens_per_s_last": round(m[-1]["tokens_per_s"]), "loss": [r["loss"] for r in m]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--parallel", default="ddp,fsdp")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    device = "cpu" if a.smoke else "cuda"
    steps = 4 if a.smoke else a.steps
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target = build_target(root / "target", a.smoke)
        shards = build_shards(target, root / "shards", 16 if a.smoke else 512, 64 if a.smoke else 512, device)
        results = [run(target, shards, root / "n1", 1, "ddp", steps, device)]
        for parallel in a.parallel.split(","):
            results.append(run(target, shards, root / f"n{a.gpus}-{parallel}", a.gpus, parallel, steps, device))
    ref = torch.tensor(results[0]["loss"])
    for r in results[1:]:
        diff = (torch.tensor(r["loss"]) - ref).abs().max().item()
        r["max_abs_loss_diff_vs_1"] = diff
        r["speedup_vs_1"] = round(r["tokens_per_s_last"] / max(1, results[0]["tokens_per_s_last"]), 2)
    summary = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "steps": steps,
               "results": [{k: v for k, v in r.items() if k != "loss"} | {"first_loss": r["loss"][0],
                                                                         "last_loss": r["loss"][-1]} for r in results]}
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
