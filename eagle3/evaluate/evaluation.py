"""Speculative-decoding evaluation over conversations (MT-bench): every turn, several k, a lossless check.

Turn t of a conversation is asked after the target's own greedy answers to turns 1..t-1, through the chat
template, the way MT-bench is run. The greedy answers come first, turn by turn (they build the next turn's
prompt, and they are the lossless reference); then each k speculates on every turn's prompt in one call, so
a batched decoder gets them all at once. An answer must equal the greedy one token for token.

A decoder is anything with
    speculate(prompts: list[list[int]], max_new_tokens, k) -> list[Answer]   (eagle3.evaluate.speculative.Answer)
    greedy(prompts: list[list[int]], max_new_tokens) -> list[list[int]]      (the target's greedy answers)
built as DECODERS[name](target, drafter, vocab, capture_layers, eos_id, batch_tokens=...); EvalConfig.decoder picks
it.

Figures per k: tau over whole answers (tokens per target forward), tau over the answers that end with eos
(a small model's greedy loops up to max_new_tokens are easy to draft and inflate tau), the share of
answers that hit max_new_tokens, and the same per turn and per category.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from eagle3.errors import ConfigError
from eagle3.evaluate.speculative import Answer, SpecStats, tau_breakdown, tau_of
from eagle3.io import BadJSONLine, json_line, not_a_file

log = logging.getLogger(__name__)

MTBENCH = "mtbench"  # EvalConfig.prompts_file value: MT-bench's 80 questions from the public-data extra

# name -> "module:class"; imported on use so a decoder's own needs stay out of the others' way
DECODERS = {"batched": "eagle3.evaluate.spec_batch:BatchedDecoder",
            "sequential": "eagle3.evaluate.speculative:SequentialDecoder"}


def make_decoder(name: str, target, drafter, vocab, capture_layers, eos_id, batch_tokens: int):
    if name not in DECODERS:
        raise ConfigError(f"eval param decoder={name!r}: use one of {sorted(DECODERS)}")
    module, cls = DECODERS[name].split(":")
    return getattr(importlib.import_module(module), cls)(target, drafter, vocab, capture_layers, eos_id,
                                                         batch_tokens=batch_tokens)


@dataclass
class EvalConversation:
    user_turns: list[str]
    system: str | None = None
    category: str = "all"
    question_id: str | int | None = None


@dataclass
class TurnPrompt:
    conv: int  # index into the conversations
    turn: int  # 1-based
    category: str
    question_id: str | int | None
    ids: list[int]
    greedy: list[int]  # the target's greedy answer: the reference, and the next turn's context


def read_conversations(path: str | Path) -> list[EvalConversation]:
    """Held-out conversations from JSONL: MT-bench's question.jsonl ({"question_id", "category", "turns"}), or
    any prompt-file shape the datagen reads (eagle3.datagen.prompts; assistant turns there are ignored: the
    target answers every user turn itself). `mtbench` = the MT-bench file of the public-data extra."""
    from eagle3.datagen.prompts import BadLine, parse_prompt_line
    from eagle3.datagen.public_prompts import mtbench_source, mtbench_turns

    if str(path) == MTBENCH:
        path = mtbench_source()
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"eval param prompts_file: {path} {not_a_file(path)}")
    out = []
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json_line(line)
            if isinstance(obj, dict) and "turns" in obj:
                turns, system = mtbench_turns(obj), None
            else:
                system, turns = parse_prompt_line(obj)
        except (BadJSONLine, BadLine) as e:
            raise ConfigError(f"{path}:{n}: {e} (expected MT-bench {{\"turns\": [...]}} or a prompt line: "
                              f"{{\"prompt\"}}, {{\"messages\"}} or {{\"conversations\"}})") from None
        out.append(EvalConversation(list(turns), system, str(obj.get("category") or "all"),
                                    obj.get("question_id", obj.get("id", n))))
    if not out:
        raise ConfigError(f"eval param prompts_file: {path} holds no conversation")
    return out


def select(convs: list[EvalConversation], n: int) -> list[EvalConversation]:
    """The first n conversations taken round-robin over categories (file order within each), so a few
    MT-bench questions still cover several categories; n = 0 keeps all."""
    if not n or n >= len(convs):
        return list(convs)
    by_cat: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(convs):
        by_cat[c.category].append(i)
    picked: list[int] = []
    queues = list(by_cat.values())
    while len(picked) < n:
        for q in queues:
            if q and len(picked) < n:
                picked.append(q.pop(0))
    return [convs[i] for i in sorted(picked)]


def _messages(conv: EvalConversation, answers: list[str], turn: int) -> list[dict]:
    msgs = [{"role": "system", "content": conv.system}] if conv.system else []
    for t in range(turn):
        msgs.append({"role": "user", "content": conv.user_turns[t]})
        if t < turn - 1:
            msgs.append({"role": "assistant", "content": answers[t]})
    return msgs


def build_turn_prompts(tokenizer, decoder, convs: list[EvalConversation], max_new_tokens: int,
                       max_context: int = 0) -> list[TurnPrompt]:
    """Every turn's prompt with the target's greedy answers to the earlier turns, and its own greedy answer.
    A turn whose prompt + max_new_tokens passes `max_context` (the target's context; 0 = none) is not asked,
    nor any later turn of its conversation: past its context the target's answers mean nothing."""
    texts: list[list[str]] = [[] for _ in convs]
    out: list[TurnPrompt] = []
    ended: dict[int, tuple[int, int]] = {}  # conversation -> (the turn not asked, its prompt's tokens)
    for turn in range(1, max(len(c.user_turns) for c in convs) + 1):
        live = [i for i, c in enumerate(convs) if len(c.user_turns) >= turn and i not in ended]
        ids = [tokenizer.apply_chat_template(_messages(convs[i], texts[i], turn), add_generation_prompt=True,
                                             return_dict=True)["input_ids"] for i in live]
        if max_context:
            ended |= {i: (turn, len(p)) for i, p in zip(live, ids) if len(p) + max_new_tokens > max_context}
            ids = [p for i, p in zip(live, ids) if i not in ended]
            live = [i for i in live if i not in ended]
        if not live:
            continue
        for i, p, g in zip(live, ids, decoder.greedy(ids, max_new_tokens)):
            out.append(TurnPrompt(i, turn, convs[i].category, convs[i].question_id, list(p), list(g)))
            texts[i].append(tokenizer.decode(g, skip_special_tokens=True).strip())
    if ended:
        i, (turn, n) = next(iter(ended.items()))
        skipped = sum(len(convs[c].user_turns) - t + 1 for c, (t, _) in ended.items())
        log.warning("%d turns of %d conversations not asked: their prompt + max_new_tokens (%d) passes the target's "
                    "context (%d tokens); the first: conversation %s turn %d (%d prompt tokens)", skipped, len(ended),
                    max_new_tokens, max_context, convs[i].question_id, turn, n)
    if not out:
        raise ConfigError(f"eval: no turn fits the target's context ({max_context} tokens) with eval_max_new_tokens "
                          f"{max_new_tokens}: lower it or give shorter prompts")
    return out


def _summary(records: list[dict]) -> dict:
    hist = [r["accepted_per_round"] for r in records]
    eos = [h for h, r in zip(hist, records) if r["ended_with_eos"]]
    return {"answers": len(records), "rounds": sum(len(h) for h in hist), "tau": tau_of(hist)["tau"],
            "tau_ended_with_eos": tau_of(eos)["tau"], "answers_ended_with_eos": len(eos),
            "share_hit_cap": sum(r["hit_cap"] for r in records) / len(records) if records else None}


def answers_report(turns: list[TurnPrompt], answers: list[Answer], k: int, max_new_tokens: int, eos_id,
                   check_greedy: bool = True) -> dict:
    """The figures of one k over the given turns' speculative answers (and their lossless check)."""
    total = SpecStats(k)
    records, mismatches = [], []
    for t, a in zip(turns, answers, strict=True):
        for acc in a.accepted_per_round:
            total.add(acc)
        eos = bool(a.tokens) and a.tokens[-1] == eos_id
        rec = {"conv": t.conv, "question_id": t.question_id, "turn": t.turn, "category": t.category,
               "new_tokens": len(a.tokens), "ended_with_eos": eos,
               "hit_cap": not eos and len(a.tokens) >= max_new_tokens,
               "accepted_per_round": list(a.accepted_per_round)}
        if check_greedy:
            rec["identical_to_greedy"] = a.tokens == t.greedy
            if a.tokens != t.greedy:
                first = next((j for j, (x, y) in enumerate(zip(a.tokens, t.greedy)) if x != y),
                             min(len(a.tokens), len(t.greedy)))
                mismatches.append({"k": k, "conv": t.conv, "question_id": t.question_id, "turn": t.turn,
                                   "first_difference": first, "len_spec": len(a.tokens), "len_greedy": len(t.greedy)})
        records.append(rec)
    report = total.to_dict()
    report.pop("tau")  # the same figure as summary's tau (tokens per round), kept once
    report.update(_summary(records))
    report["per_turn"] = {str(n): _summary([r for r in records if r["turn"] == n])
                          for n in sorted({r["turn"] for r in records})}
    report["per_category"] = {c: _summary([r for r in records if r["category"] == c])
                              for c in sorted({r["category"] for r in records})}
    report.update({"max_new_tokens": max_new_tokens, "tau_breakdown": tau_breakdown(records, max_new_tokens),
                   "identical_to_greedy": not mismatches if check_greedy else None, "mismatches": mismatches,
                   "per_answer": records})
    return report


def evaluate_conversations(decoder, tokenizer, convs: list[EvalConversation], max_new_tokens: int, ks: list[int],
                           turns: list[TurnPrompt] | None = None, check_greedy: bool = True,
                           max_context: int = 0) -> dict:
    """Greedy answers for every turn that fits `max_context` (unless `turns` already holds them), then one
    speculative pass per k. Returns {"by_k": {str(k): answers_report}, "turns": the TurnPrompts,
    "turns_past_context", "mismatches", timings}."""
    t0, past = time.time(), None
    if turns is None:
        log.info("greedy answers (the reference) to %d conversations, at most %d new tokens each ...", len(convs),
                 max_new_tokens)
        turns = build_turn_prompts(tokenizer, decoder, convs, max_new_tokens, max_context)
        past = sum(len(c.user_turns) for c in convs) - len(turns)
    seconds = {"greedy": round(time.time() - t0, 2)}
    log.info("%d answers in %.0f s; speculative decoding at k = %s ...", len(turns), seconds["greedy"], list(ks))
    by_k = {}
    for k in ks:
        t1 = time.time()
        answers = decoder.speculate([t.ids for t in turns], max_new_tokens, k)
        seconds[f"k{k}"] = round(time.time() - t1, 2)
        by_k[str(k)] = answers_report(turns, answers, k, max_new_tokens, tokenizer.eos_token_id, check_greedy)
        log.info("k=%d: tau %.2f over %d answers in %.0f s", k, by_k[str(k)]["tau"] or 0.0, len(turns),
                 seconds[f"k{k}"])
    mismatches = [m for r in by_k.values() for m in r["mismatches"]]
    return {"conversations": len(convs), "answers": len(turns), "max_new_tokens": max_new_tokens, "ks": list(ks),
            "turns_past_context": past,
            "by_k": by_k, "turns": turns, "identical_to_greedy": not mismatches if check_greedy else None,
            "mismatches": mismatches, "seconds": seconds}
