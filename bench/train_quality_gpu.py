"""Drafter quality on the real SmolLM2-135M-Instruct target, on one GPU, through the pipeline's own phases.

    GGUF -> HF folder (eagle3.models.convert_gguf)
    -> the target's own greedy answers to templated prompts (batched HF generate on the GPU, fp32),
       written as datagen output: <work>/datagen/<dataset>/tokenized.jsonl (input_ids + loss_mask)
    -> merge phase (run_merge: dedup, shuffle, length cap)
    -> extraction phase (plan_shards + extract_shard on the GPU, bf16, [2, 15, 27] + final state)
    -> training phase (train_phase on the GPU: TTT K=7, draft vocab, export for SGLang)
    -> evaluation phase (evaluate_phase on the GPU: held-out prompts, k=5, lossless check, random floor)

Every stage skips what is already done (answers are saved in parts; the phases are idempotent and
resumable), so a re-run after a crash or a timeout continues where it stopped. The summary, the
training/acceptance plots and metrics land in --out.

    python bench/train_quality_gpu.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --work /tmp/q --out $OUT
    python bench/train_quality_gpu.py --model ~/.cache/eagle3/SmolLM2-135M-Instruct --work /tmp/q --out /tmp/q/out \
        --prompts 64 --heldout 4 --new-tokens 32 --eval-new-tokens 24 --epochs 1   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from eagle3.extract.extractor import ExtractConfig, extract_shard  # noqa: E402
from eagle3.extract.plan import plan_shards  # noqa: E402
from eagle3.errors import PipelineError  # noqa: E402
from eagle3.io import atomic_path, read_json  # noqa: E402
from eagle3.merge.config import MergeConfig  # noqa: E402
from eagle3.merge.run import run_merge  # noqa: E402
from eagle3.models import COMPLETE_MARKER, convert_gguf, default_capture_layers, load_model, load_tokenizer, model_info  # noqa: E402
from eagle3.train import selfdistill as sd  # noqa: E402
from eagle3.train.run import EvalConfig, evaluate_phase, train_phase  # noqa: E402
from eagle3.train.trainer import TrainConfig  # noqa: E402

log = logging.getLogger("quality")


def target_folder(args, work: Path) -> Path:
    if args.model:
        return Path(args.model)
    out = work / "model"
    if not (out / COMPLETE_MARKER).is_file():
        convert_gguf(args.gguf, out)
    return out


def generate(args, model_path: Path, work: Path, device: str, times: dict) -> Path:
    """The target's answers, in parts of --part-size prompts (a finished part is never redone),
    written as one datagen-style dataset folder per part."""
    prompts = sd.make_prompts(args.prompts)
    root = work / "datagen"
    parts = [(i, prompts[i:i + args.part_size]) for i in range(0, len(prompts), args.part_size)]
    todo = [(i, p) for i, p in parts if not (root / f"S{i // args.part_size:02d}" / "tokenized.jsonl").is_file()]
    if not todo:
        return root
    t = time.time()
    model, tok = load_model(model_path, device=device), load_tokenizer(model_path)
    for i, chunk in todo:
        name = f"S{i // args.part_size:02d}"
        samples = sd.generate_answers(model, tok, chunk, args.new_tokens, batch_size=args.gen_batch, log_every=4)
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        with atomic_path(folder / "tokenized.jsonl") as tmp:
            with open(tmp, "w") as f:
                for j, s in enumerate(samples):
                    f.write(json.dumps({"sample_id": f"{name}-{i + j}", "dataset": name, **s}) + "\n")
        log.info("dataset %s: %d samples, %d answer tokens", name, len(samples), sum(sum(s["loss_mask"]) for s in samples))
    times["generate_s"] = round(time.time() - t, 1)
    del model
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="SmolLM2-135M-Instruct GGUF file (converted once into <work>/model)")
    src.add_argument("--model", help="an HF folder of the target")
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=16000)
    ap.add_argument("--part-size", type=int, default=4000)
    ap.add_argument("--heldout", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=320)
    ap.add_argument("--gen-batch", type=int, default=1024)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--compile", action="store_true", help="torch.compile the TTT loss (default: eager)")
    ap.add_argument("--eval-new-tokens", type=int, default=128)
    ap.add_argument("--floor-prompts", type=int, default=8)
    ap.add_argument("--k", type=int, default=5)
    args = ap.parse_args()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout), logging.FileHandler(work / "run.log")])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    times: dict = {}

    t = time.time()
    model_path = target_folder(args, work)
    times["convert_s"] = round(time.time() - t, 1)
    info = model_info(model_path)
    datagen = generate(args, model_path, work, device, times)

    t = time.time()
    merged = run_merge(MergeConfig(inputs=[str(datagen)], output_dir=str(work / "merge"), max_seq_len=args.max_seq_len,
                                   vocab_size=info.vocab_size, hidden_size=info.hidden_size))
    times["merge_s"] = round(time.time() - t, 1)

    t = time.time()
    capture = default_capture_layers(info.num_layers)
    shards = [extract_shard(ExtractConfig(model_path=str(model_path), extract_dir=str(work / "extract"),
                                          capture_layers=capture, chunk_mb=256, token_budget=65536), spec)
              for spec in plan_shards(work / "merge", args.shards)]
    times["extract_s"] = round(time.time() - t, 1)

    t = time.time()
    train = train_phase(TrainConfig(shard_dirs=[s["shard_dir"] for s in shards], model_path=str(model_path),
                                    output_dir=str(work / "train"), epochs=args.epochs, batch_size=args.batch_size,
                                    lr=args.lr, warmup_ratio=0.02, checkpoint_every=500, max_seq_len=args.max_seq_len,
                                    compile=args.compile, log_every=10))
    times["train_s"] = round(time.time() - t, 1)

    t = time.time()
    lossless_failure = None
    try:
        ev = evaluate_phase(EvalConfig(export_dir=train["export_dir"], model_path=str(model_path),
                                       output_dir=str(work / "evaluate"), k=args.k, max_new_tokens=args.eval_new_tokens,
                                       prompts=sd.make_prompts(args.heldout, offset=args.prompts),
                                       floor_max_prompts=args.floor_prompts))
    except PipelineError as e:  # keep the measured figures: the phase wrote them before failing
        lossless_failure = str(e)
        ev = read_json(work / "evaluate" / "report.failed.json")
    times["eval_s"] = round(time.time() - t, 1)

    tr = ev["results"]["trained"]
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:], "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "merged_rows": merged.get("rows"), "merged_tokens": merged.get("tokens"),
        "answer_tokens": read_json(work / "merge" / "stats.json")["assistant_tokens_out"],
        "truncated": merged.get("truncated"),
        "extracted_tokens": sum(s["tokens"] for s in shards), "extract_tok_per_s": [s.get("tok_per_s") for s in shards],
        "draft_vocab": train["draft_vocab_size"], "steps": train["steps"], "first": train["first"], "last": train["last"],
        "tau": ev["tau"], "tau_random_init": ev["tau_random_init"], "identical_to_greedy": ev["identical_to_greedy"],
        "lossless_failure": lossless_failure,
        "acceptance_rate_by_position": tr["acceptance_rate_by_position"], "accepted_at_least": tr["accepted_at_least"],
        "eval_prompts": tr["prompts"], "eval_new_tokens": tr["new_tokens"], "times": times,
    }
    (out / "quality_gpu.json").write_text(json.dumps(summary, indent=1))
    for src_file in (work / "train" / "training.png", work / "evaluate" / "acceptance.png",
                     work / "train" / "metrics.jsonl", work / "merge" / "stats.json"):
        if src_file.is_file():
            shutil.copy(src_file, out / src_file.name)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
