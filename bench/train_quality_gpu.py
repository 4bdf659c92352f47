"""Drafter quality on the real SmolLM2-135M-Instruct target, on one GPU, through the pipeline's own phases.

    GGUF -> HF folder (eagle3.models.convert_gguf)
    -> the target's own answers to templated prompts (batched HF generate on the GPU, bf16; greedy, then
       optional sampled passes), written as datagen output: <work>/datagen/<dataset>/tokenized.jsonl
    -> merge phase (run_merge: dedup, shuffle, length cap)
    -> extraction phase (plan_shards + extract_shard on the GPU, bf16, [2, 15, 27] + final state)
    -> training phase (train_phase on the GPU: TTT K=7, draft vocab, export for SGLang)
    -> evaluation phase (evaluate_phase on the GPU: MT-bench with --eval-prompts mtbench, both turns, else
       held-out templated prompts; k=5 and 7, lossless check, random floor; tau per turn and category, over
       answers ending with eos, the share hitting max_new_tokens, over the first 64/128 tokens)

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

from eagle3.extract.config import ExtractConfig, ShardPlanConfig  # noqa: E402
from eagle3.extract.extractor import extract_shard  # noqa: E402
from eagle3.extract.plan import plan_shards  # noqa: E402
from eagle3.errors import PipelineError  # noqa: E402
from eagle3.io import atomic_path, read_json  # noqa: E402
from eagle3.merge.config import MergeConfig  # noqa: E402
from eagle3.merge.run import run_merge  # noqa: E402
from eagle3.models import COMPLETE_MARKER, convert_gguf, default_capture_layers, load_model, load_tokenizer, model_info  # noqa: E402
from eagle3.train import selfdistill as sd  # noqa: E402
from eagle3.train.config import EvalConfig, TrainConfig  # noqa: E402
from eagle3.train.run import evaluate_phase, train_phase  # noqa: E402

log = logging.getLogger("quality")


def target_folder(args, work: Path) -> Path:
    if args.model:
        return Path(args.model)
    out = work / "model"
    if not (out / COMPLETE_MARKER).is_file():
        convert_gguf(args.gguf, out)
    return out


def generate(args, model_path: Path, work: Path, device: str, times: dict) -> Path:
    """The target's answers, in parts of --part-size prompts (a finished part is never redone), written as
    one datagen-style dataset folder per part: greedy answers first (S00, S01, ...), then --sampled-passes
    passes over the same prompts sampled at --temperature (T000, ...: more distinct contexts; the teacher is
    the target's own distribution at every position either way). With --gen-seconds, no new part starts
    once the time spent plus the last part's duration would pass it, and with --gen-max-answer-tokens none
    once this run made that many answer tokens (states take 4 x hidden x 2 bytes a token on disk): the run
    trains on the parts done."""
    prompts = sd.make_prompts(args.prompts)
    root = work / "datagen"
    parts = [(f"S{i // args.part_size:02d}", i, 0.0, 0) for i in range(0, len(prompts), args.part_size)]
    for p in range(args.sampled_passes):
        parts += [(f"T{p}{i // args.part_size:02d}", i, args.temperature, 1 + p * 1000 + i // args.part_size)
                  for i in range(0, len(prompts), args.part_size)]
    todo = [part for part in parts if not (root / part[0] / "tokenized.jsonl").is_file()]
    if not todo:
        return root
    t = time.time()
    dtype = args.gen_dtype or ("bfloat16" if device == "cuda" else "float32")
    model, tok = load_model(model_path, dtype=dtype, device=device), load_tokenizer(model_path)
    answer_tokens, last_part_s = 0, 0.0
    for n_done, (name, i, temperature, seed) in enumerate(todo):
        over_time = args.gen_seconds and time.time() - t + last_part_s > args.gen_seconds
        if over_time or (args.gen_max_answer_tokens and answer_tokens >= args.gen_max_answer_tokens):
            log.info("generation budget reached (%s s, %s answer tokens): %d of %d parts left undone",
                     args.gen_seconds, args.gen_max_answer_tokens, len(todo) - n_done, len(parts))
            break
        t_part = time.time()
        samples = sd.generate_answers(model, tok, prompts[i:i + args.part_size], args.new_tokens,
                                      batch_size=args.gen_batch, log_every=4, temperature=temperature, seed=seed)
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        with atomic_path(folder / "tokenized.jsonl") as tmp:
            with open(tmp, "w") as f:
                for j, s in enumerate(samples):
                    f.write(json.dumps({"sample_id": f"{name}-{i + j}", "dataset": name, **s}) + "\n")
        last_part_s = time.time() - t_part
        n_answer = sum(sum(s["loss_mask"]) for s in samples)
        answer_tokens += n_answer
        log.info("dataset %s (temperature %s): %d samples, %d answer tokens, %.0f answer tok/s", name, temperature,
                 len(samples), n_answer, n_answer / last_part_s)
    times["generate_s"] = round(time.time() - t, 1)
    times["generate_answer_tok_per_s"] = round(answer_tokens / max(1e-9, times["generate_s"]))
    times["generate_dtype"] = dtype
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
    ap.add_argument("--gen-dtype", default=None, help="dtype of the generating target (default bfloat16 on GPU)")
    ap.add_argument("--gen-seconds", type=float, default=0, help="time budget for generation (0 = none)")
    ap.add_argument("--gen-max-answer-tokens", type=float, default=0, help="no new part past this many (0 = none)")
    ap.add_argument("--sampled-passes", type=int, default=0, help="passes of sampled answers after the greedy one")
    ap.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampled passes")
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--train-tokens", type=float, default=0,
                    help="epochs = round(this / merged tokens), at least 1 (overrides --epochs)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--compile", action="store_true", help="torch.compile the TTT loss (default: eager)")
    ap.add_argument("--eval-new-tokens", type=int, default=128)
    ap.add_argument("--floor-prompts", type=int, default=8)
    ap.add_argument("--ks", type=lambda v: [int(x) for x in v.split(",")], default=[5, 7])
    ap.add_argument("--eval-prompts", default="", help="mtbench or a JSONL file (default: held-out templated prompts)")
    ap.add_argument("--eval-max-prompts", type=int, default=0, help="conversations evaluated (0 = all)")
    ap.add_argument("--decoder", default="sequential", help="the evaluation's speculative decoder")
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
              for spec in plan_shards(ShardPlanConfig(str(work / "merge"), args.shards))]
    times["extract_s"] = round(time.time() - t, 1)

    epochs = max(1, round(args.train_tokens / merged["tokens"])) if args.train_tokens else args.epochs
    t = time.time()
    train = train_phase(TrainConfig(shard_dirs=[s["shard_dir"] for s in shards], model_path=str(model_path),
                                    output_dir=str(work / "train"), epochs=epochs, batch_size=args.batch_size,
                                    lr=args.lr, warmup_ratio=0.02, checkpoint_every=500, max_seq_len=args.max_seq_len,
                                    compile=args.compile, log_every=10))
    times["train_s"] = round(time.time() - t, 1)

    t = time.time()
    lossless_failure = None
    try:
        ev = evaluate_phase(EvalConfig(export_dir=train["export_dir"], model_path=str(model_path),
                                       output_dir=str(work / "evaluate"), ks=args.ks, max_new_tokens=args.eval_new_tokens,
                                       prompts=[] if args.eval_prompts else sd.make_prompts(args.heldout, offset=args.prompts),
                                       prompts_file=args.eval_prompts, max_prompts=args.eval_max_prompts,
                                       decoder=args.decoder, floor_max_prompts=args.floor_prompts))
    except PipelineError as e:  # keep the measured figures: the phase wrote them before failing
        lossless_failure = str(e)
        ev = read_json(work / "evaluate" / "report.failed.json")
    times["eval_s"] = round(time.time() - t, 1)

    by_k = ev["results"]["trained"]["by_k"]
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:], "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "merged_rows": merged.get("rows"), "merged_tokens": merged.get("tokens"),
        "answer_tokens": read_json(work / "merge" / "stats.json")["assistant_tokens_out"],
        "truncated": merged.get("truncated"),
        "extracted_tokens": sum(s["tokens"] for s in shards), "extract_tok_per_s": [s.get("tok_per_s") for s in shards],
        "epochs": epochs, "draft_vocab": train["draft_vocab_size"], "steps": train["steps"], "first": train["first"],
        "last": train["last"],
        "tau": ev["tau"], "tau_random_init": ev["tau_random_init"], "identical_to_greedy": ev["identical_to_greedy"],
        "lossless_failure": lossless_failure,
        "tau_ended_with_eos": ev["tau_ended_with_eos"], "share_hit_cap": ev["share_hit_cap"],
        "tau_per_turn": ev["tau_per_turn"], "tau_per_category": ev["tau_per_category"],
        "acceptance_rate_by_position": {k: r["acceptance_rate_by_position"] for k, r in by_k.items()},
        "tau_breakdown": {k: r["tau_breakdown"] for k, r in by_k.items()},
        "eval_conversations": ev["conversations"], "eval_answers": ev["answers"],
        "eval_new_tokens": {k: r["new_tokens"] for k, r in by_k.items()},
        "eval_seconds": ev["results"]["trained"]["seconds"], "times": times,
    }
    (out / "quality_gpu.json").write_text(json.dumps(summary, indent=1))
    for src_file in (work / "train" / "training.png", work / "evaluate" / "acceptance.png",
                     work / "train" / "metrics.jsonl", work / "merge" / "stats.json"):
        if src_file.is_file():
            shutil.copy(src_file, out / src_file.name)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
