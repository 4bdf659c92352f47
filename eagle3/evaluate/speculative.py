"""Speculative decoding with the HF target and the exported drafter: what the drafter is worth.

Per round: the drafter proposes k tokens greedily in a chain, the target checks them all in ONE
forward over its KV cache, the longest prefix that matches the target's own greedy choice is kept
plus one bonus token from the target (its choice at the first mismatch, or after the last draft).
So the output is exactly greedy decoding of the target, which `evaluate` asserts token by token.

Drafter slot t holds (target feature of token t, embedding of token t+1) at position t, like training.
After each round the drafter cache is cut back to the slots backed by real target features and
extended with the features the verify forward just produced for the accepted tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from eagle3.errors import PipelineError
from eagle3.models import kv_cache_kwarg, returned_kv_cache
from eagle3.train.model import Eagle3Drafter, crop_cache
from eagle3.train.vocab import DraftVocab

log = logging.getLogger(__name__)


@dataclass
class SpecStats:
    k: int
    rounds: int = 0
    new_tokens: int = 0  # produced by verify rounds (bonus included)
    accepted_at: list = field(default_factory=list)  # accepted_at[i]: rounds whose draft i+1 was accepted
    history: list = field(default_factory=list)  # drafts accepted in each round, in order (one prompt's stats)

    def __post_init__(self):
        self.accepted_at = [0] * self.k

    @property
    def tau(self) -> float:
        return self.new_tokens / max(1, self.rounds)

    def add(self, accepted: int) -> None:
        self.rounds += 1
        self.new_tokens += accepted + 1
        self.history.append(accepted)
        for i in range(accepted):
            self.accepted_at[i] += 1

    def merge(self, other: "SpecStats") -> None:
        self.rounds += other.rounds
        self.new_tokens += other.new_tokens
        self.accepted_at = [a + b for a, b in zip(self.accepted_at, other.accepted_at)]

    def to_dict(self) -> dict:
        reached = [self.rounds] + self.accepted_at[:-1]  # rounds in which draft i was still in play
        return {
            "k": self.k, "rounds": self.rounds, "new_tokens": self.new_tokens, "tau": self.tau,
            "accepted_at_least": [a / max(1, self.rounds) for a in self.accepted_at],
            "acceptance_rate_by_position": [a / r if r else 0.0 for a, r in zip(self.accepted_at, reached)],
        }


class SpeculativeDecoder:
    def __init__(self, target, drafter: Eagle3Drafter, vocab: DraftVocab, capture_layers: list[int], eos_id: int | None):
        self.target, self.drafter, self.vocab = target, drafter, vocab
        self.capture_layers, self.eos_id = list(capture_layers), eos_id
        self.embed = target.get_input_embeddings()
        self.d2t = vocab.d2t
        self.cache_kwarg = kv_cache_kwarg(target)
        hs = drafter.cfg.hidden_size
        if target.config.hidden_size != hs:
            raise PipelineError(f"drafter hidden_size {hs} != target hidden_size {target.config.hidden_size}")

    def _target(self, ids: list[int], cache):
        x = torch.tensor([ids], dtype=torch.long, device=self.target.device)
        out = self.target(input_ids=x, **{self.cache_kwarg: cache}, use_cache=True, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in self.capture_layers], -1).float()
        return out.logits[0].argmax(-1).tolist(), aux, returned_kv_cache(out)

    def _draft(self, tokens: list[int], hidden, start: int, cache: dict, fuse: bool):
        emb = self.embed(torch.tensor([tokens], device=self.target.device)).float()
        pos = torch.arange(start, start + len(tokens), device=emb.device)[None]
        logits, state = self.drafter.forward_cached(emb, hidden[None] if hidden.dim() == 2 else hidden, pos, cache, fuse)
        draft_id = int(logits[0, -1].argmax())
        return draft_id + int(self.d2t[draft_id]), state[:, -1:]

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, k: int) -> tuple[list[int], SpecStats]:
        if k < 1:
            raise PipelineError(f"speculative k must be >= 1, got {k}")
        stats = SpecStats(k)
        greedy, aux, tcache = self._target(prompt_ids, None)
        new = [greedy[-1]]
        dcache: dict = {}
        committed = len(prompt_ids)  # drafter slots backed by real target features
        next_tok, state = self._draft(prompt_ids[1:] + new, aux, 0, dcache, fuse=True)
        while len(new) < max_new_tokens and new[-1] != self.eos_id:
            drafts = [next_tok]
            for j in range(1, k):  # chain: feed own state and own token, one position further
                tok, state = self._draft([drafts[-1]], state, committed - 1 + j, dcache, fuse=False)
                drafts.append(tok)
            cached = committed  # target cache holds positions 0..committed-1
            pred, aux, tcache = self._target([new[-1]] + drafts, tcache)
            a = 0
            while a < k and drafts[a] == pred[a]:
                a += 1
            accepted = drafts[:a] + [pred[a]]
            stats.add(a)
            if a < k:  # drop the rejected drafts' k/v (transformers 5 crops by a negative count)
                tcache.crop(-(k - a))
            assert tcache.get_seq_length() == cached + a + 1
            crop_cache(dcache, committed)
            next_tok, state = self._draft(accepted, aux[: a + 1], committed, dcache, fuse=True)
            committed += a + 1
            new += accepted
        return self._finish(new, max_new_tokens), stats

    def _finish(self, new: list[int], max_new_tokens: int) -> list[int]:
        new = new[:max_new_tokens]
        if self.eos_id is not None and self.eos_id in new:
            new = new[: new.index(self.eos_id) + 1]
        return new

    @torch.no_grad()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Plain greedy decoding of the target with HF generate: the reference speculation must equal."""
        x = torch.tensor([prompt_ids], dtype=torch.long, device=self.target.device)
        out = self.target.generate(x, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=self.eos_id,
                                   pad_token_id=self.eos_id, attention_mask=torch.ones_like(x))
        return self._finish(out[0, len(prompt_ids):].tolist(), max_new_tokens)


def tau_of(rounds_per_prompt: list[list[int]], first_tokens: int = 0) -> dict:
    """Acceptance length over the given prompts' rounds; with first_tokens > 0, only the rounds that start
    within the first `first_tokens` new tokens (the early part of answers, before any repetition loop)."""
    rounds = tokens = 0
    for history in rounds_per_prompt:
        done = 1  # the first new token comes from the prefill forward, before any round
        for a in history:
            if first_tokens and done >= first_tokens:
                break
            rounds, tokens, done = rounds + 1, tokens + a + 1, done + a + 1
    return {"prompts": len(rounds_per_prompt), "rounds": rounds, "tau": tokens / rounds if rounds else None}


def tau_breakdown(per_prompt: list[dict], max_new_tokens: int) -> dict:
    """tau split by how the answer ended (eos: a natural end; cap: hit max_new_tokens, often a repetition
    loop that is easy to draft) and over the first 64 / 128 new tokens of every answer."""
    hist = [p["accepted_per_round"] for p in per_prompt]
    out = {"ended_with_eos": tau_of([h for h, p in zip(hist, per_prompt) if p["ended_with_eos"]]),
           "hit_cap": tau_of([h for h, p in zip(hist, per_prompt) if not p["ended_with_eos"]])}
    for n in (64, 128):
        if n < max_new_tokens:
            out[f"first_{n}_tokens"] = tau_of(hist, first_tokens=n)
    return out


@dataclass
class Answer:
    """One speculative answer: its new tokens (cut at max_new_tokens, eos included) and the drafts accepted in
    each verify round, in order (the first new token comes from the prefill, before any round)."""

    tokens: list[int]
    accepted_per_round: list[int]


class SequentialDecoder:
    """The evaluation's decoder interface (eagle3.evaluate.evaluation.DECODERS), one prompt at a time:
    `speculate` with the chain drafter, `greedy` with HF generate as the lossless reference."""

    def __init__(self, target, drafter, vocab, capture_layers, eos_id, batch_tokens: int = 0):
        # batch_tokens: one prompt at a time leaves no batch to bound
        self.spec = SpeculativeDecoder(target, drafter, vocab, capture_layers, eos_id)

    def speculate(self, prompts: list[list[int]], max_new_tokens: int, k: int) -> list[Answer]:
        out = []
        for ids in prompts:
            tokens, st = self.spec.generate(ids, max_new_tokens, k)
            out.append(Answer(tokens, st.history))
        return out

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return [self.spec.greedy(ids, max_new_tokens) for ids in prompts]
