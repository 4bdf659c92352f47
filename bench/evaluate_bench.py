"""Evaluation benchmark: the evaluate phase's decoder on MT-bench, against the one-prompt evaluator as baseline.

Prompts: MT-bench's 160 turns (turn 2 after the target's own greedy turn-1 answer, built once and shared).
- batched (the evaluate phase): eagle3.evaluate.spec_batch.BatchedDecoder, every turn at once per k, lossless by a
  teacher-forced check (its `greedy` = speculation at k verified in one target forward per batch).
- sequential (the baseline, `EvalConfig.decoder="sequential"`): eagle3.evaluate.speculative, one prompt at a time,
  plus HF greedy generate per prompt as the lossless reference. Slow: --sequential-turns limits it to the first
  N turns (0 = none; tokens/s makes the two comparable; the summary says how many turns each ran).
Both must give the same tokens where both ran. Writes eval_speed.json to --out.

    python bench/evaluate_bench.py --model DIR --export DRAFTER_EXPORT --prompts mtbench.jsonl --out $OUT  # GPU
    python bench/evaluate_bench.py --smoke --out /tmp/es                                # CPU: random tiny drafter
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

from eagle3.evaluate.evaluation import build_turn_prompts, read_conversations, select  # noqa: E402
from eagle3.evaluate.spec_batch import BatchedDecoder, check_summary, teacher_forced_check  # noqa: E402
from eagle3.evaluate.speculative import SpeculativeDecoder, tau_of  # noqa: E402

log = logging.getLogger("evaluate_bench")


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def load(args, device: str):
    from eagle3.models import ensure_smollm2, load_model, load_tokenizer, model_info
    from eagle3.train.export import load_exported
    from eagle3.train.model import DrafterConfig, Eagle3Drafter
    from eagle3.train.vocab import DraftVocab

    model_path = args.model or str(ensure_smollm2())
    tok, target = load_tokenizer(model_path), load_model(model_path, device=device)
    if args.export:
        drafter, vocab, config = load_exported(args.export)
        capture = config["eagle3_pipeline"]["capture_layers"]
    else:  # smoke: a random drafter of the target's shape (tau ~1: speed and losslessness only)
        info = model_info(model_path)
        torch.manual_seed(0)
        drafter, vocab = Eagle3Drafter(DrafterConfig.from_target(info, 4096)).eval(), DraftVocab(
            torch.arange(4096, dtype=torch.int64), info.vocab_size)
        from eagle3.models import default_capture_layers

        capture = default_capture_layers(info.num_layers)
    return tok, target, drafter.to(device), vocab, capture


def run_batched(dec: BatchedDecoder, turns, max_new: int, k: int) -> dict:
    sync()
    t = time.time()
    answers = dec.speculate([p.ids for p in turns], max_new, k)
    sync()
    spec_s = time.time() - t
    checks = teacher_forced_check(dec.spec.target, [p.ids for p in turns], [a.tokens for a in answers], max_new,
                                  dec.spec.eos_id, dec.spec.tie_tol)
    sync()
    bad, ties = check_summary(checks)
    wall = time.time() - t
    tokens = sum(len(a.tokens) for a in answers)
    return {"turns": len(turns), "new_tokens": tokens, "speculate_s": round(spec_s, 2),
            "check_s": round(wall - spec_s, 2),
            "wall_s": round(wall, 2), "tok_per_s": round(tokens / wall, 1),
            "tau": tau_of([a.accepted_per_round for a in answers])["tau"], "not_greedy": len(bad), "tie_tokens": ties,
            "identical_to_reference": sum(a.tokens == p.greedy for a, p in zip(answers, turns)),
            "tokens": [a.tokens for a in answers]}


def run_sequential(dec: SpeculativeDecoder, turns, max_new: int, k: int) -> dict:
    sync()
    t = time.time()
    outs, hist, same = [], [], 0
    for p in turns:
        tokens, st = dec.generate(p.ids, max_new, k)
        same += tokens == dec.greedy(p.ids, max_new)  # today's lossless check: a second, plain generation
        outs.append(tokens)
        hist.append(st.history)
    sync()
    wall = time.time() - t
    tokens = sum(len(o) for o in outs)
    return {"turns": len(turns), "new_tokens": tokens, "wall_s": round(wall, 2), "tok_per_s": round(tokens / wall, 1),
            "tau": tau_of(hist)["tau"], "identical_to_greedy": same, "tokens": outs}


def parser() -> argparse.ArgumentParser:
    """The command line (tests/test_device_runs.py checks docs/device-runs.md's commands against it)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target HF folder (default: the SmolLM2 of ~/.cache/eagle3)")
    ap.add_argument("--export", help="drafter export folder (default with --smoke: a random drafter)")
    ap.add_argument("--prompts", default="mtbench", help="MT-bench question.jsonl, a prompt JSONL or `mtbench`")
    ap.add_argument("--conversations", type=int, default=0, help="conversations (0 = all; round-robin categories)")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--ks", type=lambda v: [int(x) for x in v.split(",")], default=[5, 7])
    ap.add_argument("--batch-size", type=int, default=256, help="batched decoder: prompts per batch")
    ap.add_argument("--sequential-turns", type=int, default=24, help="turns today's evaluator runs (0 = none)")
    ap.add_argument("--smoke", action="store_true", help="CPU: 2 conversations, 16 tokens, k=3, random drafter")
    ap.add_argument("--out", required=True)
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.smoke:
        args.conversations, args.max_new_tokens, args.ks, args.sequential_turns = 2, 16, [3], 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok, target, drafter, vocab, capture = load(args, device)
    convs = select(read_conversations(args.prompts), args.conversations)
    batched = BatchedDecoder(target, drafter, vocab, capture, tok.eos_token_id, reference_k=args.ks[0],
                             batch_size=args.batch_size)
    sync()
    t = time.time()
    turns = build_turn_prompts(tok, batched, convs, args.max_new_tokens)  # the turn-2 contexts, verified greedy
    sync()
    summary = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:],
               "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
               "conversations": len(convs), "turns": len(turns), "max_new_tokens": args.max_new_tokens,
               "build_turns_s": round(time.time() - t, 2), "build_check": dict(batched.check), "by_k": {}}
    seq = SpeculativeDecoder(target, drafter, vocab, capture, tok.eos_token_id)
    for k in args.ks:
        fresh = BatchedDecoder(target, drafter, vocab, capture, tok.eos_token_id, batch_size=args.batch_size)
        b = run_batched(fresh, turns, args.max_new_tokens, k)  # a fresh decoder: nothing reused from the build
        r = {"batched": {n: v for n, v in b.items() if n != "tokens"}}
        if args.sequential_turns:
            s = run_sequential(seq, turns[: args.sequential_turns], args.max_new_tokens, k)
            r["sequential"] = {n: v for n, v in s.items() if n != "tokens"}
            r["same_tokens_both"] = sum(x == y for x, y in zip(s["tokens"], b["tokens"]))
            r["speedup_tok_per_s"] = round(b["tok_per_s"] / max(1e-9, s["tok_per_s"]), 1)
        summary["by_k"][str(k)] = r
        log.info("k=%d: %s", k, json.dumps(r))
        (out / "eval_speed.json").write_text(json.dumps(summary, indent=1))  # partial results as it goes
    print(json.dumps(summary, indent=1))
    def lossless(r: dict) -> bool:
        seq = r.get("sequential")
        return not r["batched"]["not_greedy"] and (seq is None or r["same_tokens_both"] == seq["turns"] ==
                                                    seq["identical_to_greedy"])

    bad = [k for k, r in summary["by_k"].items() if not lossless(r)]
    if bad:
        sys.exit(f"not lossless at k={bad}: see {out / 'eval_speed.json'}")


if __name__ == "__main__":
    main()
