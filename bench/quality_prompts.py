"""The quality run's training prompts: conversations of a prompt JSONL (`python -m eagle3 prompts sharegpt OUT`),
their first user turn or every user turn, what they amount to in samples and prompt tokens, and the target's
answers to them (`generate`, in parts kept between sessions).

    python bench/quality_prompts.py sharegpt.jsonl [--model DIR] [--max-prompt-tokens 768] [--out counts.json]

prints, for the first turns and for all turns, the conversations kept (a first turn longer than
--max-prompt-tokens, templated, is passed over, as the quality run does), the user turns and their tokens. A
conversation is one sample either way (the datagen's layout: every answer in one sample); all turns add the later
turns' prompts and answers to it. Runs on the CPU in seconds (the tokenizer only).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.errors import PipelineError  # noqa: E402

TURNS = ("first", "all")
log = logging.getLogger("quality")


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


# --gen-cache: HF generate's KV cache. dynamic grows each layer's cache by a concatenation a step (a new, larger
# tensor each time: the suspect behind 7K answer tokens/s on an H100 at batch 1,000); static preallocates it and
# makes generate compile its decoding step on a GPU (again as cache length and batch size change); static-eager
# preallocates without compiling.
GEN_CACHES = {"dynamic": {}, "static": {"cache_implementation": "static"},
              "static-eager": {"cache_implementation": "static", "disable_compile": True}}
# --gen-attention: transformers' sdpa repeats SmolLM2's 3 kv heads for its 9 query heads at every decoding step
# (35% of the GPU's time at batch 1,000 on an H100); grouped folds the query heads instead (eagle3.grouped_sdpa)
GEN_ATTENTION = ("sdpa", "grouped")


def set_attention(model, attention: str) -> None:
    """Run the target's attention as --gen-attention names it (GEN_ATTENTION)."""
    from eagle3.grouped_sdpa import use_grouped_sdpa

    use_grouped_sdpa(model) if attention == "grouped" else model.set_attn_implementation("sdpa")


def generate(args, prompts: list[list[str]], model_path: Path, root: Path, temperature: float, clock,
             device: str, until: float | None = None) -> int:
    """The target's answers to the conversations (--gen-turns: each one's first turn or every turn, a turn not
    answered once its context reaches --all-turns-seq-len) in parts of --part-size conversations (a finished part
    is never redone), one datagen-style dataset folder per part under root; no part starts that would end past
    `until` (default: the clock's deadline). --gen-group parts are answered by one call, turn by turn together:
    a part's later turns are few conversations each (a third of them reach turn 2), and a decoding step costs
    about as long for 20 rows as for 300, so parts answered apart spend most of their time on those small turns.
    Returns the conversations answered."""
    from eagle3.models import load_model, load_tokenizer
    from tests.support import selfdistill as sd

    parts = [(part_name(root.name, i // args.part_size), i) for i in range(0, len(prompts), args.part_size)]
    todo = [p for p in parts if not (root / p[0] / "tokenized.jsonl").is_file()]
    group = max(1, args.gen_group)
    model = tok = None
    for g in range(0, len(todo), group):
        names = todo[g:g + group]
        chunks = [prompts[i:i + args.part_size] for _, i in names]
        if not clock.allows("generate", sum(map(len, chunks)), until):
            log.info("generation at %s: deadline, %d parts left", root.name, len(todo) - g)
            break
        if model is None:
            dtype = "bfloat16" if device == "cuda" else "float32"
            model, tok = load_model(model_path, dtype=dtype, device=device), load_tokenizer(model_path)
            set_attention(model, args.gen_attention)
        t = time.time()
        answer = functools.partial(sd.generate_answers, model, tok, [c for chunk in chunks for c in chunk],
                                   args.new_tokens, batch_size=args.gen_batch, max_batch_tokens=args.gen_batch_tokens,
                                   log_every=4, temperature=temperature,
                                   seed=1 + names[0][1] // args.part_size, max_context=args.all_turns_seq_len)
        try:
            samples = answer(engine=args.gen_engine, **GEN_CACHES[args.gen_cache])
        except Exception:  # noqa: BLE001 - an engine or cache not measured yet must not cost the session's answers
            if (args.gen_engine, args.gen_cache, args.gen_attention) == ("generate", "dynamic", "sdpa"):
                raise
            log.exception("%s/%s: --gen-engine %s --gen-cache %s --gen-attention %s failed; this and later parts use "
                          "HF generate with the dynamic cache and sdpa", root.name, names[0][0], args.gen_engine,
                          args.gen_cache, args.gen_attention)
            args.gen_engine, args.gen_cache, args.gen_attention, t = "generate", "dynamic", "sdpa", time.time()
            set_attention(model, args.gen_attention)
            samples = answer(engine="generate")
        clock.record("generate", len(samples), time.time() - t)
        tokens = sum(sum(s["loss_mask"]) for s in samples)
        for (name, i), chunk in zip(names, chunks):
            write_part(root / name, samples[:len(chunk)], root.name, i)
            samples = samples[len(chunk):]
        log.info("%s/%s: %d answers, %.0f answer tok/s (%s)", root.name, "+".join(n for n, _ in names),
                 sum(map(len, chunks)), tokens / (time.time() - t), args.gen_engine)
    return answered_parts(root, args.part_size, len(prompts))[1]


def part_name(answers: str, p: int) -> str:
    """Answer part p's folder, which is its dataset name: P000... for greedy answers, S000... for sampled ones (the
    set's initial), so both sets merge together (a merge refuses a dataset name twice)."""
    return f"{'P' if answers.startswith('greedy') else answers[0].upper()}{p:03d}"


def write_part(folder: Path, samples: list[dict], answers: str, first: int) -> None:
    """One part's tokenized.jsonl (the conversations with an answered turn), atomically."""
    from eagle3.io import atomic_path

    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / "tokenized.jsonl") as tmp, open(tmp, "w") as f:
        for j, s in enumerate(samples):
            if s["turns"]:
                f.write(json.dumps({"sample_id": f"{answers}-{first + j}", "dataset": folder.name, **s}) + "\n")


def answered_parts(root: Path, part_size: int, n_prompts: int) -> tuple[int, int]:
    """(leading parts answered, the prompts they hold): parts are merged as a prefix, so a gap ends the count."""
    parts = 0
    while parts * part_size < n_prompts and (root / part_name(root.name, parts) / "tokenized.jsonl").is_file():
        parts += 1
    return parts, min(n_prompts, parts * part_size)


def parser() -> argparse.ArgumentParser:
    """The command line (tests/test_device_runs.py checks docs/device-runs.md's commands against it)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompts", help="prompt JSONL")
    ap.add_argument("--model", default="", help="the target's folder (its tokenizer; default: the cached SmolLM2)")
    ap.add_argument("--max-prompt-tokens", type=int, default=768)
    ap.add_argument("--limit", type=int, default=10 ** 9, help="lines read at most")
    ap.add_argument("--out", default="")
    return ap


def main() -> None:
    args = parser().parse_args()
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
