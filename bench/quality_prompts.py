"""The quality run's training prompts: conversations of a prompt JSONL (`python -m eagle3 prompts sharegpt OUT`),
their first user turn or every user turn, and what they amount to in samples and prompt tokens.

    python bench/quality_prompts.py sharegpt.jsonl [--model DIR] [--max-prompt-tokens 768] [--out counts.json]

prints, for the first turns and for all turns, the conversations kept (a first turn longer than
--max-prompt-tokens, templated, is passed over, as the quality run does), the user turns and their tokens. A
conversation is one sample either way (the datagen's layout: every answer in one sample); all turns add the later
turns' prompts and answers to it. Runs on the CPU in seconds (the tokenizer only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.errors import PipelineError  # noqa: E402

TURNS = ("first", "all")


def read_conversations(path: str, n: int, tokenizer, max_prompt_tokens: int, turns: str = "first") -> list[list[str]]:
    """The user turns of the first n usable lines, in file order (turns="first": the first one only). A line whose
    first turn, templated, is longer than max_prompt_tokens is passed over (generation batches stay dense); a
    leading system turn is dropped (the template's default system prompt is used, as for every prompt here)."""
    from eagle3.datagen.prompts import BadLine, parse_prompt_line
    from tests.support.selfdistill import prompt_ids

    if turns not in TURNS:
        raise PipelineError(f"turns={turns!r}: use one of {list(TURNS)}")
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if len(out) >= n:
                break
            try:
                _, users = parse_prompt_line(json.loads(line))
            except (json.JSONDecodeError, BadLine):
                continue
            if len(prompt_ids(tokenizer, users[0])) <= max_prompt_tokens:
                out.append(users[:1] if turns == "first" else users)
    if not out:
        raise PipelineError(f"{path}: no usable prompt")
    return out


def first_turns(src: Path, dst: Path) -> None:
    """A part of all-turn answers (tokenized.jsonl) cut after each sample's first answer: the sample the same
    conversation's first turn alone gives (its prompt, then the first answer through its eos), once per part."""
    from eagle3.io import atomic_path

    if (dst / "tokenized.jsonl").is_file():
        return
    dst.mkdir(parents=True, exist_ok=True)
    with open(src / "tokenized.jsonl") as f, atomic_path(dst / "tokenized.jsonl") as tmp, open(tmp, "w") as g:
        for line in f:
            s = json.loads(line)
            mask = s["loss_mask"]
            start = mask.index(1)
            end = mask.index(0, start) if 0 in mask[start:] else len(mask)
            g.write(json.dumps({**s, "input_ids": s["input_ids"][:end], "loss_mask": mask[:end], "turns": 1}) + "\n")


def prompt_counts(conversations: list[list[str]], tokenizer) -> dict:
    """Samples (conversations), user turns, and the tokens of the user turns' texts (untemplated) and of the first
    turns templated (what the first generation round reads)."""
    from tests.support.selfdistill import prompt_ids

    texts = [t for c in conversations for t in c]
    enc = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return {"samples": len(conversations), "user_turns": len(texts),
            "user_turn_tokens": sum(len(e) for e in enc),
            "first_turn_tokens_templated": sum(len(prompt_ids(tokenizer, c[0])) for c in conversations),
            "turns_per_sample": round(len(texts) / max(1, len(conversations)), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompts", help="prompt JSONL")
    ap.add_argument("--model", default="", help="the target's folder (its tokenizer; default: the cached SmolLM2)")
    ap.add_argument("--max-prompt-tokens", type=int, default=768)
    ap.add_argument("--limit", type=int, default=10 ** 9, help="lines read at most")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from eagle3.models import ensure_smollm2, load_tokenizer

    tok = load_tokenizer(args.model or ensure_smollm2())
    t = time.time()
    report = {"prompts": args.prompts, "max_prompt_tokens": args.max_prompt_tokens}
    for turns in TURNS:
        report[turns] = prompt_counts(read_conversations(args.prompts, args.limit, tok, args.max_prompt_tokens,
                                                         turns), tok)
    report["seconds"] = round(time.time() - t, 1)
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
