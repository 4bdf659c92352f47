"""Batched lossless speculative decoding: many prompts at once, greedy, per-row acceptance.

The same rounds as eagle3.evaluate.speculative (the drafter proposes k tokens in a chain, the target checks them
in one forward, the longest matching prefix plus the target's own next token is kept), for a left-padded batch:

- Rows accept different numbers of drafts, so a round appends k+1 slots to every row's caches (target k/v and
  drafter k/v) and marks only the first a+1 of them valid in that row's key mask; positions are explicit per
  row, so a hole in the cache changes nothing a valid query sees. When holes take over a quarter of the
  cache, every row's valid slots are packed to the right again (order kept, so causality by cache index holds).
- The drafter chain's k-1 slots are the cache's tail in every row: cut back uniformly after the verify.
- A finished row (eos or max_new_tokens) leaves the batch: every tensor and cache keeps only live rows.

The lossless check needs no second generation: `teacher_forced_check` runs the target once over
prompt + answer (batched) and verifies that every answer token is the target's argmax at its position, that
nothing follows an eos and that an answer without eos is max_new_tokens long: that is greedy decoding's
definition. A token whose logit is within `tie_tol` of the maximum counts as a numerical tie (reported apart).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from eagle3.errors import PipelineError
from eagle3.models import kv_cache_kwarg

log = logging.getLogger(__name__)


def _cut(tokens: list[int], max_new_tokens: int, eos_id) -> list[int]:
    tokens = tokens[:max_new_tokens]
    if eos_id is not None and eos_id in tokens:
        tokens = tokens[: tokens.index(eos_id) + 1]
    return tokens


def _left_pad(seqs: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, L - len(s):] = torch.tensor(s)
            mask[i, L - len(s):] = 1
    return ids.to(device), mask.to(device)


def _pack_index(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the indices of its valid slots right-aligned in a [B, max valid] index (front filled with slot 0,
    masked) and the new validity mask: a stable sort puts invalid slots first and keeps the valid ones' order."""
    n = int(valid.sum(1).max())
    order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices[:, -n:]
    return order, valid.gather(1, order)


def length_batches(lengths: list[int], token_budget: int, max_rows: int = 0) -> list[list[int]]:
    """Indices by length, cut into batches of similar length: a batch takes rows while rows x its longest stays
    within `token_budget` (one row at least; 0 = no limit) and, when `max_rows` is set, up to max_rows rows. Also
    the bench's answer generation's batches (tests/support/selfdistill.generate_batch)."""
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        last = batches[-1] if batches else None
        if last and len(last) != max_rows and (not token_budget or (len(last) + 1) * lengths[i] <= token_budget):
            last.append(i)
        else:
            batches.append([i])
    return batches


class BatchedSpeculativeDecoder:
    def __init__(self, target, drafter, vocab, capture_layers: list[int], eos_id: int | None,
                 batch_size: int = 256, batch_tokens: int = 131072, tie_tol: float = 1e-3):
        self.target, self.drafter = target, drafter
        self.capture_layers, self.eos_id = list(capture_layers), eos_id
        self.pad_id = eos_id if eos_id is not None else 0
        self.embed = target.get_input_embeddings()
        self.device = target.device
        self.d2t = vocab.d2t.to(self.device)
        self.cache_kwarg = kv_cache_kwarg(target)
        self.batch_size, self.batch_tokens, self.tie_tol = batch_size, batch_tokens, tie_tol
        self.packs = 0  # times the caches were packed (a test checks the path runs)
        if target.config.hidden_size != drafter.cfg.hidden_size:
            raise PipelineError(f"drafter hidden_size {drafter.cfg.hidden_size} != target hidden_size "
                                f"{target.config.hidden_size}")

    # ------------------------------------------------------------------ one forward of each model

    def _target(self, ids, attn_mask, positions, cache, logits_to_keep: int = 0):
        out = self.target(input_ids=ids, attention_mask=attn_mask, position_ids=positions, **{self.cache_kwarg: cache},
                          use_cache=True, output_hidden_states=True, logits_to_keep=logits_to_keep)
        aux = torch.cat([out.hidden_states[i] for i in self.capture_layers], -1).float()
        return out.logits.argmax(-1), aux

    def _draft(self, tokens, hidden, positions, cache: dict, valid, fuse: bool, last_only: bool = False):
        """Drafter slots [B, S] appended to `cache` (k, v, valid [B, L]); each attends to the valid cached slots
        before it and to itself. Returns (target-vocab token ids [B, S], output states [B, S, H]); with
        `last_only` (the prefill) both for the last slot alone: [B, S, draft vocab] logits outgrow the card."""
        d = self.drafter
        attn = d.midlayer.self_attn
        emb = self.embed(tokens).float()
        if fuse:
            hidden = d.fc(hidden)
        q, k, v = attn.qkv(d.midlayer.attn_input(emb, hidden), positions)
        if cache.get("k") is not None:
            k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            valid = torch.cat([cache["valid"], valid], 1)
        cache.update(k=k, v=v, valid=valid)
        L, S = k.shape[2], q.shape[2]
        causal = torch.ones(S, L, dtype=torch.bool, device=q.device).tril(diagonal=L - S)
        itself = F.pad(torch.eye(S, dtype=torch.bool, device=q.device), (L - S, 0))
        mask = (causal & valid[:, None, :].bool()) | itself  # [B, S, L]; itself: no row without a key
        out = F.scaled_dot_product_attention(q, attn.expand_kv(k), attn.expand_kv(v), attn_mask=mask[:, None])
        state = d.midlayer.finish(attn.project_out(out), hidden)
        if last_only:
            state = state[:, -1:]
        ids = d.logits(state).argmax(-1)
        return ids + self.d2t[ids], state

    # ------------------------------------------------------------------ decoding

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, k: int) -> list[tuple[list[int], list[int]]]:
        """(answer tokens, drafts accepted per round) for every prompt, in batches of similar length: at most
        `batch_size` prompts and `batch_tokens` rows x (longest prompt + max_new_tokens) (order restored)."""
        if k < 1:
            raise PipelineError(f"speculative k must be >= 1, got {k}")
        if any(not p for p in prompts):
            raise PipelineError("speculative decoding got an empty prompt")
        out: list = [None] * len(prompts)
        lengths = [len(p) + max_new_tokens for p in prompts]
        for idx in length_batches(lengths, self.batch_tokens, self.batch_size):
            for i, r in zip(idx, self._generate_batch([prompts[i] for i in idx], max_new_tokens, k)):
                out[i] = r
        return out

    def _generate_batch(self, prompts, max_new_tokens: int, k: int):
        dev, B = self.device, len(prompts)
        ids, tmask = _left_pad(prompts, self.pad_id, dev)
        pos = (tmask.cumsum(1) - 1).clamp(min=0)
        tcache = DynamicCache()
        greedy, aux = self._target(ids, tmask, pos, tcache, logits_to_keep=1)  # prefill: the last logits only
        last = greedy[:, -1]  # the first new token of every row
        dcache: dict = {}
        nxt, state = self._draft(torch.cat([ids[:, 1:], last[:, None]], 1), aux, pos, dcache, tmask.bool(), True,
                                 last_only=True)
        nxt = nxt[:, -1]
        tlen = tmask.sum(1)  # per row: tokens in the target cache = position of the next one
        new = [[t] for t in last.tolist()]
        hist: list[list[int]] = [[] for _ in range(B)]
        rows = list(range(B))  # live row -> prompt index
        ar = torch.arange(k + 1, device=dev)
        keep = [i for i, r in enumerate(rows) if not self._done(new[r], max_new_tokens)]
        while keep:
            if len(keep) < len(rows):  # finished rows leave every tensor and cache
                sel = torch.tensor(keep, device=dev)
                rows = [rows[i] for i in keep]
                last, nxt, state, tlen, tmask = last[sel], nxt[sel], state[sel], tlen[sel], tmask[sel]
                dcache = {n: t[sel] for n, t in dcache.items()}
                for layer in tcache.layers:
                    layer.batch_select_indices(sel)
            n = len(rows)
            drafts = [nxt]
            for j in range(1, k):  # the chain: own state and own token, one position further
                tok, state = self._draft(drafts[-1][:, None], state, (tlen - 1 + j)[:, None], dcache,
                                         torch.ones(n, 1, dtype=torch.bool, device=dev), False)
                drafts.append(tok[:, 0])
            if k > 1:
                dcache = {name: t[..., : t.shape[-1] - (k - 1)] if name == "valid" else t[:, :, : -(k - 1)]
                          for name, t in dcache.items()}
            drafts = torch.stack(drafts, 1)  # [n, k]
            tmask = torch.cat([tmask, torch.ones(n, k + 1, dtype=tmask.dtype, device=dev)], 1)
            pred, aux = self._target(torch.cat([last[:, None], drafts], 1), tmask, tlen[:, None] + ar, tcache)
            a = (drafts == pred[:, :k]).long().cumprod(1).sum(1)  # [n] drafts accepted per row
            valid = ar[None] <= a[:, None]  # [n, k+1]: the accepted drafts and the target's own next token
            tmask[:, -(k + 1):] = valid
            bonus = pred.gather(1, a[:, None])[:, 0]
            kept = torch.where(ar[None, :k] < a[:, None], drafts, bonus[:, None])
            tokens = torch.cat([kept, bonus[:, None]], 1)  # slot i: accepted token i (its next token's embedding)
            tok, st = self._draft(tokens, aux, tlen[:, None] + ar, dcache, valid, True)
            nxt, state = tok.gather(1, a[:, None])[:, 0], st[torch.arange(n, device=dev), a][:, None]
            last, tlen = bonus, tlen + a + 1
            for r, acc, toks in zip(rows, a.tolist(), tokens.tolist()):
                hist[r].append(acc)
                new[r] += toks[: acc + 1]
            keep = [i for i, r in enumerate(rows) if not self._done(new[r], max_new_tokens)]
            if tmask.numel() and (tmask == 0).float().mean() > 0.25:
                tmask, dcache = self._pack(tmask, tcache, dcache)
        return [(_cut(new[r], max_new_tokens, self.eos_id), hist[r]) for r in range(B)]

    def _done(self, tokens: list[int], max_new_tokens: int) -> bool:
        return len(tokens) >= max_new_tokens or (self.eos_id is not None and self.eos_id in tokens)

    def _pack(self, tmask, tcache, dcache):
        """Drop the rejected slots of both caches (each row's valid slots right-aligned, order kept)."""
        self.packs += 1
        idx, tmask = _pack_index(tmask)
        for layer in tcache.layers:  # keys and values gathered each by its own shape: MLA's differ (DeepSeek)
            layer.keys, layer.values = (t.gather(2, idx[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
                                        for t in (layer.keys, layer.values))
        didx, dvalid = _pack_index(dcache["valid"])
        g = didx[:, None, :, None].expand(-1, dcache["k"].shape[1], -1, dcache["k"].shape[3])
        return tmask, {"k": dcache["k"].gather(2, g), "v": dcache["v"].gather(2, g), "valid": dvalid}


@torch.no_grad()
def teacher_forced_check(target, prompts: list[list[int]], answers: list[list[int]], max_new_tokens: int, eos_id,
                         tie_tol: float = 1e-3, token_budget: int = 65536) -> list[dict | None]:
    """Per answer: None when it is the target's greedy answer, else {"first_difference", "reason", ...}.

    One target forward over prompt + answer (batched, left-padded, about `token_budget` tokens a batch, logits
    kept only for the answer positions). A token whose logit is below the maximum by at most `tie_tol` passes as
    a tie (counted in the result as {"ties": n} only when the answer otherwise passes: see `check_summary`)."""
    device, pad = target.device, eos_id if eos_id is not None else 0

    result: list = [None] * len(prompts)
    for batch in length_batches([len(p) + len(a) for p, a in zip(prompts, answers)], token_budget):
        for b in batch:  # shape rules first: they need no forward
            ans = answers[b]
            if not ans:
                result[b] = {"first_difference": 0, "reason": "empty answer"}
            elif eos_id is not None and eos_id in ans[:-1]:
                result[b] = {"first_difference": ans.index(eos_id) + 1, "reason": "tokens after eos"}
            elif ans[-1] != eos_id and len(ans) != max_new_tokens:
                result[b] = {"first_difference": len(ans), "reason": f"stopped at {len(ans)} tokens without eos "
                                                                     f"(max_new_tokens {max_new_tokens})"}
        batch = [b for b in batch if result[b] is None]
        if not batch:
            continue
        ids, mask = _left_pad([prompts[b] + answers[b][:-1] for b in batch], pad, device)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        n_keep = max(len(answers[b]) for b in batch)
        logits = target(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=n_keep).logits.float()
        for row, b in enumerate(batch):
            ans = torch.tensor(answers[b], device=device)
            lg = logits[row, n_keep - len(ans):]
            margin = lg.max(-1).values - lg.gather(1, ans[:, None])[:, 0]
            bad = (margin > tie_tol).nonzero()
            if len(bad):
                p = int(bad[0])
                result[b] = {"first_difference": p, "reason": "not the target's argmax",
                             "token": answers[b][p], "argmax": int(lg[p].argmax()), "margin": float(margin[p])}
            elif ties := int((margin > 0).sum()):
                result[b] = {"ties": ties}
    return result


def check_summary(results: list[dict | None]) -> tuple[list[int], int]:
    """(indices of answers that are not greedy, number of tie tokens among those that are)."""
    bad = [i for i, r in enumerate(results) if r is not None and "reason" in r]
    ties = sum(r["ties"] for r in results if r is not None and "ties" in r)
    return bad, ties


class BatchedDecoder:
    """The evaluation's decoder interface (eagle3.evaluate.evaluation.DECODERS), batched.

    `greedy` needs no plain generation: it speculates at `reference_k` and verifies every answer by teacher
    forcing; an answer the check rejects (a decoder bug) is replaced by HF greedy generate's, so the
    evaluation's comparison with the reference reports it as not lossless. Answers are kept per (prompt,
    max_new_tokens, k), so the evaluation's pass at reference_k reuses the verified answers."""

    def __init__(self, target, drafter, vocab, capture_layers, eos_id, reference_k: int = 5, **kw):
        self.spec = BatchedSpeculativeDecoder(target, drafter, vocab, capture_layers, eos_id, **kw)
        self.reference_k = reference_k
        self.check = {"answers": 0, "not_greedy": 0, "tie_tokens": 0}
        self._answers: dict = {}

    def _speculate(self, prompts, max_new_tokens: int, k: int):
        from eagle3.evaluate.speculative import Answer

        keys = [(tuple(p), max_new_tokens, k) for p in prompts]
        todo = list(dict.fromkeys(key for key in keys if key not in self._answers))
        for key, (tokens, hist) in zip(todo, self.spec.generate([list(key[0]) for key in todo], max_new_tokens, k)):
            self._answers[key] = Answer(tokens, hist)
        return [self._answers[key] for key in keys]

    def speculate(self, prompts: list[list[int]], max_new_tokens: int, k: int):
        return self._speculate(prompts, max_new_tokens, k)

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        answers = [a.tokens for a in self._speculate(prompts, max_new_tokens, self.reference_k)]
        t = self.spec.target
        results = teacher_forced_check(t, prompts, answers, max_new_tokens, self.spec.eos_id, self.spec.tie_tol)
        bad, ties = check_summary(results)
        self.check["answers"] += len(prompts)
        self.check["not_greedy"] += len(bad)
        self.check["tie_tokens"] += ties
        for i in bad:
            log.error("speculative answer %d is not greedy: %s; reference from HF generate", i, results[i])
            x = torch.tensor([prompts[i]], device=t.device)
            out = t.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=self.spec.eos_id, pad_token_id=self.spec.pad_id)
            answers[i] = _cut(out[0, x.shape[1]:].tolist(), max_new_tokens, self.spec.eos_id)
        return answers
