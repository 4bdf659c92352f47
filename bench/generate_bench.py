"""The quality run's answer generation, step by step: HF generate's decoding step on a random-weight SmolLM2-135M
shape, by KV cache (--gen-cache) and attention (--gen-attention), side by side in one process, and whether the
grouped attention gives the same greedy tokens.

    python3 bench/generate_bench.py [--batches 1000,2000] [--context 512] [--new-tokens 64] [--out F.json]
    python bench/generate_bench.py --smoke        # CPU, a tiny shape

A row: B contexts of L tokens (half of them left-padded by L/3, as a batch of conversations sorted by length
is), greedy, `new_tokens` + 1 tokens each (no eos stop), in one generate call whose streamer stamps each token as it
reaches the host: prefill = the first token's time, a decoding step = the median time between two later tokens (a
median of `new_tokens` steps: one slow step, on a busy CPU, does not move it). Random weights: the speed of a step
does not depend on them (docs/benchmarks.md, "Quality").
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.quality_prompts import GEN_ATTENTION, GEN_CACHES, set_attention  # noqa: E402
from tests.support.selfdistill import size_static_cache_for_this_call  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192)
TINY = dict(SMOLLM2, hidden_size=144, intermediate_size=128, num_hidden_layers=2, vocab_size=500, head_dim=16)


def batch(rows: int, length: int, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(rows + length))
    mask = torch.ones_like(ids)
    mask[: rows // 2, : length // 3] = 0
    return ids.to(device), mask.to(device)


class TokenClock:
    """A generate streamer that stamps the time each `put` reaches it: the prompt's, then one a step. generate
    copies the tokens to the host before `put`, so on a GPU a stamp comes after that step's kernels."""

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def timed_generate(model, ids, mask, new_tokens: int, cache: str) -> tuple[TokenClock, torch.Tensor]:
    """Greedy generation of exactly `new_tokens` tokens a row; the clock holds 1 + new_tokens stamps."""
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    size_static_cache_for_this_call(model, GEN_CACHES[cache])  # a row's cache for its own context, not a longer one
    sync()
    clock = TokenClock()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=2, streamer=clock, **GEN_CACHES[cache])
    assert len(clock.stamps) == 1 + new_tokens, f"{len(clock.stamps)} streamer stamps for {new_tokens} tokens"
    return clock, out[:, ids.shape[1]:]


def prefill_and_step_s(clock: TokenClock) -> tuple[float, float]:
    """The first token's time (the prefill) and the median time between two later tokens (a decoding step)."""
    s = clock.stamps
    return s[1] - s[0], statistics.median(b - a for a, b in zip(s[1:], s[2:]))


def step_error(model, ids, mask) -> dict:
    """One decoding step after a prefill (the step grouped attention folds), each attention's logits against an
    fp32 sdpa reference: its largest error over the logits' range, and the rows whose top token is the
    reference's. On random weights the top logits nearly tie, so greedy tokens part on rounding alone; equal errors
    say grouped rounds no worse than sdpa, whatever the tokens do."""
    def logits(m, attention):
        set_attention(m, attention)
        first = m(input_ids=ids, attention_mask=mask, use_cache=True)
        step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        return m(input_ids=ids[:, -1:], attention_mask=step_mask, past_key_values=first.past_key_values,
                 use_cache=True).logits[:, -1].float()

    reference = logits(copy.deepcopy(model).float(), "sdpa")
    scale = (reference.max() - reference.min()).item()
    report = {}
    for attention in GEN_ATTENTION:
        got = logits(model, attention)
        report[attention] = {"max_error": (got - reference).abs().max().item() / scale,
                             "top1_agreement": (got.argmax(-1) == reference.argmax(-1)).float().mean().item()}
    return report


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1000,2000", help="rows a batch, comma-separated")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--caches", default="dynamic,static-eager", help=f"of {list(GEN_CACHES)}")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny shape")
    ap.add_argument("--out", default=None)
    return ap


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    if a.smoke:
        a.batches, a.context, a.new_tokens = "4", 12, 4
    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    torch.manual_seed(0)
    config = LlamaConfig(**(TINY if a.smoke else SMOLLM2))
    model = LlamaForCausalLM(config).to(device, torch.bfloat16 if device == "cuda" else torch.float32).eval()
    caches = a.caches.split(",")
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rows": []}
    with torch.no_grad():
        ids, mask = batch(min(64, int(a.batches.split(",")[0])), min(256, a.context), config.vocab_size, device)
        tokens = {}
        for attention in GEN_ATTENTION:  # the same greedy tokens, and the warm-up
            set_attention(model, attention)
            tokens[attention] = {c: timed_generate(model, ids, mask, 16, c)[1] for c in caches}
        same = {c: bool(torch.equal(tokens["sdpa"][c], tokens["grouped"][c])) for c in caches}
        report["grouped_same_tokens"] = same
        print(f"grouped attention gives the same greedy tokens: {same}", flush=True)
        report["step_error_vs_fp32"] = step_error(model, ids, mask)
        print(f"a decoding step's logits against fp32 sdpa: {report['step_error_vs_fp32']}", flush=True)
        for rows in map(int, a.batches.split(",")):
            ids, mask = batch(rows, a.context, config.vocab_size, device)
            for attention in GEN_ATTENTION:
                set_attention(model, attention)
                for cache in caches:
                    try:
                        first, step = prefill_and_step_s(timed_generate(model, ids, mask, a.new_tokens + 1, cache)[0])
                        row = {"rows": rows, "context": a.context, "attention": attention, "cache": cache,
                               "prefill_s": first, "step_ms": step * 1e3, "tok_per_s": rows / step}
                        print(f"{attention:7s} {cache:12s} B={rows} L={a.context}: prefill {first:.2f} s, "
                              f"{row['step_ms']:.1f} ms a step, {row['tok_per_s']:.0f} tokens/s", flush=True)
                    except torch.OutOfMemoryError as e:
                        row = {"rows": rows, "attention": attention, "cache": cache, "error": str(e)[:200]}
                        print(f"{attention} {cache} B={rows}: out of memory", flush=True)
                    report["rows"].append(row)
                    if device == "cuda":
                        torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
