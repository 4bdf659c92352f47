"""Small self-distillation datasets on one machine: the target answers prompts greedily (batched HF
generate), the answers are tokenized as chats and the reference extractor writes real shards.

Used by the tests and by the CPU quality run; the pipeline proper gets its data from the datagen,
merge and extraction phases. Same on-disk format as the fast extractor (eagle3/extract/format.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from eagle3.extract.format import ShardManifest, write_chunk
from eagle3.extract.reference import reference_states

log = logging.getLogger(__name__)

TOPICS = ["the moon", "rain", "bread", "a river", "the ocean", "volcanoes", "bees", "chess", "the piano", "coffee",
          "trains", "winter", "a library", "mountains", "cats", "photosynthesis", "the internet", "gravity",
          "a bicycle", "friendship", "the desert", "tea", "clouds", "electricity", "birds", "a garden", "snow",
          "the sun", "maps", "robots", "football", "music", "a forest", "honey", "money", "a city", "sleep",
          "the brain", "glass", "wind", "stars", "a castle", "dinosaurs", "fire", "paper", "the heart", "time",
          "soap", "a bridge", "recycling", "airplanes", "cheese", "a lighthouse", "whales", "the alphabet"]
TEMPLATES = ["Explain {t} to a child in two sentences.", "Write a short poem about {t}.",
             "Give three facts about {t}.", "Describe {t} in one paragraph.", "Why is {t} important?",
             "Write a haiku about {t}.", "What would happen without {t}?", "Tell a very short story about {t}."]


def make_prompts(n: int, offset: int = 0) -> list[str]:
    """n distinct prompts; `offset` selects a disjoint range (held-out prompts use another offset)."""
    pairs = [(t, tpl) for tpl in TEMPLATES for t in TOPICS]
    g = torch.Generator().manual_seed(1234)
    order = torch.randperm(len(pairs), generator=g).tolist()
    if offset + n > len(pairs):
        raise ValueError(f"only {len(pairs)} distinct prompts")
    return [pairs[i][1].format(t=pairs[i][0]) for i in order[offset:offset + n]]


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 32) -> list[dict]:
    """Greedy answers of the target as samples {input_ids, loss_mask}: prompt masked 0, answer (with eos) 1."""
    eos = tokenizer.eos_token_id
    samples = []
    for b in range(0, len(prompts), batch_size):
        ids = [prompt_ids(tokenizer, p) for p in prompts[b:b + batch_size]]
        width = max(map(len, ids))
        x = torch.tensor([[eos] * (width - len(i)) + i for i in ids])  # left padding
        attn = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
        out = model.generate(x, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=eos, eos_token_id=eos)
        for i, row in zip(ids, out[:, width:].tolist()):
            answer = row[: row.index(eos) + 1] if eos in row else row
            samples.append({"input_ids": i + answer, "loss_mask": [0] * len(i) + [1] * len(answer)})
        log.info("generated answers for %d/%d prompts", len(samples), len(prompts))
    return samples


def write_shards(model, samples: list[dict], out_dir: str | Path, capture_layers: list[int], num_shards: int = 2,
                 chunk_samples: int = 8, dtype: torch.dtype = torch.bfloat16, model_path: str = "") -> list[Path]:
    """Extract with the reference oracle and write `num_shards` complete shard folders."""
    out_dir = Path(out_dir)
    per_shard = -(-len(samples) // num_shards)
    dirs = []
    for s in range(num_shards):
        d = out_dir / f"shard-{s:05d}"
        d.mkdir(parents=True, exist_ok=True)
        first = s * per_shard
        rows = list(range(first, min(len(samples), first + per_shard)))
        man = ShardManifest(shard=s, model_path=model_path, capture_layers=list(capture_layers),
                            hidden_size=model.config.hidden_size, dtype=str(dtype).replace("torch.", ""),
                            rows=[[rows[0], rows[-1] + 1]] if rows else [])
        for c, start in enumerate(range(0, len(rows), chunk_samples)):
            chunk_rows = rows[start:start + chunk_samples]
            ids, mask, aux, fin, offs = [], [], [], [], [0]
            for r in chunk_rows:
                a, f = reference_states(model, samples[r]["input_ids"], capture_layers)
                ids += samples[r]["input_ids"]
                mask += samples[r]["loss_mask"]
                aux.append(a.to(dtype))
                fin.append(f.to(dtype))
                offs.append(len(ids))
            man.chunks.append(write_chunk(d, c, {
                "input_ids": torch.tensor(ids, dtype=torch.int32), "loss_mask": torch.tensor(mask, dtype=torch.uint8),
                "aux_hidden": torch.cat(aux), "final_hidden": torch.cat(fin),
                "sample_offsets": torch.tensor(offs, dtype=torch.int64),
                "sample_rows": torch.tensor(chunk_rows, dtype=torch.int64)}, fsync=False))
        man.complete = True
        man.save(d)
        dirs.append(d)
    return dirs
