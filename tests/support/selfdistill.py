"""Self-distillation datasets on one machine: the target answers prompts greedily (batched HF generate,
on the model's device), the answers are tokenized as chats and the reference extractor writes real shards.

Used by the tests and by the quality benchmarks (bench/train_quality_{cpu,gpu}.py); the pipeline proper
gets its data from the datagen, merge and extraction phases. Same on-disk format as the fast extractor
(eagle3/extract/format.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from eagle3.extract.format import ShardManifest, write_chunk
from tests.support.reference import reference_states

log = logging.getLogger(__name__)

# Prompt space for self-distillation: topics x task templates (19,536 distinct prompts). Held-out
# evaluation prompts are other (topic, template) pairs from the same space: new combinations, same kind.
TOPICS = """the moon|rain|bread|a river|the ocean|volcanoes|bees|chess|the piano|coffee|trains|winter|a library|
mountains|cats|photosynthesis|the internet|gravity|a bicycle|friendship|the desert|tea|clouds|electricity|birds|
a garden|snow|the sun|maps|robots|football|music|a forest|honey|money|a city|sleep|the brain|glass|wind|stars|
a castle|dinosaurs|fire|paper|the heart|time|soap|a bridge|recycling|airplanes|cheese|a lighthouse|whales|
the alphabet|rainbows|earthquakes|penguins|the printing press|vaccines|the wheel|candles|submarines|tigers|
elephants|ants|spiders|owls|dolphins|sharks|frogs|butterflies|horses|dogs|rabbits|wolves|octopuses|turtles|
mushrooms|apples|bananas|rice|chocolate|pizza|salt|sugar|milk|eggs|potatoes|tomatoes|lemons|olive oil|soup|
a kitchen|a hospital|a school|a museum|a farm|an airport|a market|a park|a zoo|a theater|a village|an island|
a cave|a waterfall|a glacier|a swamp|the jungle|the arctic|a beach|a canyon|a lake|the sky|thunderstorms|fog|
tornadoes|hurricanes|autumn|spring|summer|the seasons|the weather|climate change|the atmosphere|oxygen|water|
plastic|steel|wood|concrete|cotton|silk|gold|copper|diamonds|batteries|solar panels|wind turbines|nuclear power|
magnets|light|sound|heat|motion|friction|atoms|cells|DNA|bacteria|viruses|the immune system|bones|muscles|
the lungs|the stomach|blood|teeth|eyes|ears|skin|exercise|running|swimming|yoga|walking|dancing|painting|
drawing|photography|poetry|novels|newspapers|letters|email|smartphones|computers|keyboards|the mouse|
video games|television|radio|cameras|clocks|calendars|umbrellas|shoes|hats|coats|backpacks|keys|doors|windows|
stairs|elevators|roads|traffic lights|cars|buses|ships|rockets|satellites|telescopes|microscopes|the planets|
Mars|Jupiter|comets|black holes|the Milky Way|astronauts|the ocean floor|coral reefs|tides|waves|sand|rocks|
fossils|maps of the world|compasses|the north pole|deserts at night|camping|hiking|fishing|gardening|cooking|
baking|cleaning|laundry|shopping|saving money|budgeting|banks|taxes|jobs|teamwork|leadership|kindness|honesty|
patience|courage|curiosity|creativity|happiness|sadness|anger|fear|hope|memory|dreams|habits|learning|
teaching|homework|exams|reading|writing|mathematics|fractions|prime numbers|geometry|triangles|circles|
algebra|statistics|probability|history|ancient Egypt|the Romans|the Vikings|castles in Europe|pyramids|
the Great Wall of China|languages|grammar|translation|jokes|riddles|birthdays|holidays|weddings|festivals|
neighbors|grandparents|siblings|pets|babies|old age|health|vitamins|breakfast|lunch|dinner|snacks|water bottles|
recycling bins|libraries of the future|electric cars|bicycles in cities|public transport|airports at night|
the post office|firefighters|doctors|nurses|farmers|teachers|scientists|engineers|artists|musicians|chefs|
pilots|sailors|librarians|programmers|the scientific method|experiments|inventions|patents|money in history|
coins|the stock market|advertising|social media|privacy|passwords|computer viruses|the cloud|databases|
algorithms|sorting|search engines|artificial intelligence|spreadsheets|printers|3D printing|drones|bridges in cities|
skyscrapers|tunnels|dams|canals|lighthouses at sea|maps on phones|GPS|earth's core|continents|volcanic islands|
deserts and oases|rainforests|savannas|grasslands|tundra|mountains in winter|ice cream|popcorn|pancakes|
sandwiches|noodles|dumplings|spices|herbs|vegetables|fruit|nuts|seeds|flowers|trees|grass|leaves|roots|
cactus plants|sunflowers|roses|bamboo|moss|pollination|compost|worms|snails|crabs|jellyfish|seals|polar bears|
camels|giraffes|zebras|kangaroos|koalas|pandas|parrots|eagles|crows|hummingbirds|bats|mice|squirrels|foxes|deer|
bears|lions|cheetahs|gorillas|monkeys""".replace("\n", "").split("|")
TEMPLATES = ["Explain {t} to a child in two sentences.", "Write a short poem about {t}.",
             "Give three facts about {t}.", "Describe {t} in one paragraph.", "Why is {t} important?",
             "Write a haiku about {t}.", "What would happen without {t}?", "Tell a very short story about {t}.",
             "List five words related to {t}.", "What are the pros and cons of {t}?", "Write a riddle about {t}.",
             "Summarize what people should know about {t}.", "Give a fun fact about {t}.",
             "How would you explain {t} to an alien?", "Write a limerick about {t}.",
             "What questions do scientists ask about {t}?", "Compare {t} with something similar.",
             "Write a short dialogue between two friends about {t}.", "Give me a tip related to {t}.",
             "What is the history of {t} in a few sentences?", "Describe {t} using only simple words.",
             "Write a product description for {t}.", "Write a diary entry about {t}.",
             "What are common misconceptions about {t}?", "Teach me one thing about {t} step by step.",
             "Write a news headline and a short article about {t}.", "How does {t} change over time?",
             "Write a letter to a friend about {t}.", "Give three questions a student might ask about {t}.",
             "Describe {t} from the point of view of a cat.", "Write a song chorus about {t}.",
             "Explain {t} in exactly three bullet points.", "What would a world with more {t} look like?",
             "Write a motivational quote inspired by {t}.", "Give a simple definition of {t}.",
             "Describe the sounds and smells of {t}.", "Make a short quiz about {t} with answers.",
             "Write a bedtime story about {t}.", "What can children learn from {t}?",
             "Describe {t} in the style of a sports commentator.", "Write an advertisement for {t}.",
             "Explain how {t} affects everyday life.", "Write two sentences about {t}, one true and one false.",
             "Describe a day in the life of someone who loves {t}.", "Give a short speech about {t}.",
             "Write a short mystery involving {t}.", "What are three surprising things about {t}?",
             "Explain {t} to a grandparent."]


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
def generate_answers(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 32,
                     log_every: int = 1, temperature: float = 0.0, seed: int = 0) -> list[dict]:
    """The target's answers as samples {input_ids, loss_mask}: prompt masked 0, answer (with eos) 1.
    Greedy, or sampled at `temperature` > 0 (seeded: the same call gives the same answers on one machine).

    Runs on the model's device. Prompts are batched by length (less left padding) and the samples come
    back in the order of `prompts`."""
    eos = tokenizer.eos_token_id
    ids = [prompt_ids(tokenizer, p) for p in prompts]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    samples: list[dict | None] = [None] * len(ids)
    for n, b in enumerate(range(0, len(order), batch_size)):
        rows = order[b:b + batch_size]
        width = max(len(ids[i]) for i in rows)
        x = torch.tensor([[eos] * (width - len(ids[i])) + ids[i] for i in rows], device=model.device)  # left pad
        attn = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in rows], device=model.device)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
            dict(do_sample=False)
        torch.manual_seed(seed * 1_000_003 + n)
        out = model.generate(x, attention_mask=attn, max_new_tokens=max_new_tokens, pad_token_id=eos,
                             eos_token_id=eos, **sampling)
        for i, row in zip(rows, out[:, width:].tolist()):
            answer = row[: row.index(eos) + 1] if eos in row else row
            samples[i] = {"input_ids": ids[i] + answer, "loss_mask": [0] * len(ids[i]) + [1] * len(answer)}
        if (n + 1) % log_every == 0 or b + batch_size >= len(order):
            log.info("generated answers for %d/%d prompts", min(b + batch_size, len(order)), len(prompts))
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
