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

from eagle3.evaluate.spec_batch import length_batches
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


def next_turn_ids(tokenizer, messages: list[dict], user: str) -> list[int] | None:
    """The tokens that follow a conversation's last answer (its eos) up to the generation prompt of the next user
    turn, as the chat template renders them; None when the template does not render the conversation so far as a
    prefix of the longer one (a template that rewrites answers: the conversation stops there)."""
    if not messages:
        return prompt_ids(tokenizer, user)
    render = tokenizer.apply_chat_template
    through_answer = render(messages[:-1], tokenize=False, add_generation_prompt=True) + messages[-1]["content"] + \
        (tokenizer.eos_token or "")
    full = render([*messages, {"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    if not full.startswith(through_answer):
        return None
    return tokenizer(full[len(through_answer):], add_special_tokens=False)["input_ids"]


def sampling_kwargs(temperature: float) -> dict:
    """Greedy at 0, else plain sampling at `temperature` (no top-k/top-p cut), for generate_batch and
    generate_continuous alike."""
    return dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)


def size_static_cache_for_this_call(model, generate_kwargs: dict) -> None:
    """HF generate sizes a static cache for the longest call the model has ever made (`_previous_max_cache_length`,
    kept to spare torch.compile a recompile), so after one long context every later batch attends over that whole
    length: in the every-turn answers (H200, 2026-12-06) a group's turn 1 after another group's 2,048-token turns
    took 211 s where the first group's took 69 s. Uncompiled (`disable_compile`, static-eager) a cache sized for
    this call costs nothing; compiled, HF's choice stands (a new length would be a new graph)."""
    if generate_kwargs.get("disable_compile") and hasattr(model, "_previous_max_cache_length"):
        model._previous_max_cache_length = -1


@torch.no_grad()
def generate_batch(model, contexts: list[list[int]], max_new_tokens: int, eos: int, batch_size: int,
                   temperature: float, seed: int, log_every: int = 1, max_batch_tokens: int = 0,
                   **generate_kwargs) -> list[list[int]]:
    """One answer per context (token ids, with eos when it ended), in the order of `contexts`. Contexts are
    batched by length (less left padding) within batch_size rows and max_batch_tokens, rows x (the longest context +
    max_new_tokens): the evaluation's length_batches. 1,000 rows of every-turn contexts (turn 2: up to 1,566
    tokens) ran out of an H100's 80 GB (2026-12-06): the row count alone does not bound the memory once contexts
    grow turn by turn. `generate_kwargs` go to HF generate (e.g. cache_implementation)."""
    answers: list[list[int] | None] = [None] * len(contexts)
    sampling = sampling_kwargs(temperature)
    batches = length_batches([len(c) + max_new_tokens for c in contexts], max_batch_tokens, batch_size)
    done = 0
    for n, rows in enumerate(batches):
        width = max(len(contexts[i]) for i in rows)
        x = torch.tensor([[eos] * (width - len(contexts[i])) + contexts[i] for i in rows], device=model.device)
        attn = torch.tensor([[0] * (width - len(contexts[i])) + [1] * len(contexts[i]) for i in rows],
                            device=model.device)  # left pad
        torch.manual_seed(seed * 1_000_003 + n)
        size_static_cache_for_this_call(model, generate_kwargs)
        out = model.generate(x, attention_mask=attn, max_new_tokens=max_new_tokens, pad_token_id=eos,
                             eos_token_id=eos, **sampling, **generate_kwargs)
        for i, row in zip(rows, out[:, width:].tolist()):
            answers[i] = row[: row.index(eos) + 1] if eos in row else row
        done += len(rows)
        if (n + 1) % log_every == 0 or n + 1 == len(batches):
            log.info("generated answers for %d/%d contexts", done, len(contexts))
    return answers


@torch.no_grad()
def generate_continuous(model, contexts: list[list[int]], max_new_tokens: int, eos: int, temperature: float,
                        seed: int) -> list[list[int]]:
    """generate_batch's answers through transformers' continuous batching (a paged KV cache, finished rows replaced
    by waiting ones at once, CUDA graphs on a GPU) instead of fixed batches that run until their longest answer
    ends. Greedy answers are the same tokens (tested on the CPU); sampled ones are seeded but not reproducible
    across batch compositions."""
    from transformers import GenerationConfig

    sampling = sampling_kwargs(temperature)
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos, **sampling)
    torch.manual_seed(seed)
    out = model.generate_batch(inputs=contexts, generation_config=config, progress_bar=False)
    if set(out) != {f"req_{i}" for i in range(len(contexts))}:  # the request ids transformers 5.x gives, in order
        raise RuntimeError(f"continuous batching returned requests {sorted(out)[:4]}..., not req_0..req_"
                           f"{len(contexts) - 1}: this transformers names them otherwise")
    answers = []
    for i in range(len(contexts)):
        row = list(out[f"req_{i}"].generated_tokens)
        answers.append(row[: row.index(eos) + 1] if eos in row else row)
    return answers


def generate_answers(model, tokenizer, prompts: list[str | list[str]], max_new_tokens: int, batch_size: int = 32,
                     log_every: int = 1, temperature: float = 0.0, seed: int = 0, max_context: int = 0,
                     engine: str = "generate", max_batch_tokens: int = 0, **generate_kwargs) -> list[dict]:
    """The target's answers as samples {input_ids, loss_mask, turns}: prompt and template tokens masked 0, each
    answer (with its eos) 1. Greedy, or sampled at `temperature` > 0 (seeded: the same call gives the same
    answers on one machine). Runs on the model's device; the samples come back in the order of `prompts`.

    A prompt is one user turn or a conversation (a list of user turns): as the datagen does for multi-turn prompt
    files, turn r is answered after the target's own answers to turns 1..r-1, and the sample holds the whole
    conversation (the exact tokens the target generated, the template's tokens between turns). All conversations'
    turn r are generated together, batched by length. A conversation stops before a turn whose context already
    has `max_context` tokens (0 = no limit; training cuts samples there anyway) and after an answer that hit
    max_new_tokens (a cut answer is no context for the next turn); `turns` counts the turns answered.
    `engine`: "generate" (HF generate in batches of batch_size rows and max_batch_tokens, generate_batch) or
    "continuous" (generate_continuous)."""
    if engine not in ("generate", "continuous"):
        raise ValueError(f"engine={engine!r}: use 'generate' or 'continuous'")
    eos = tokenizer.eos_token_id
    convs = [[p] if isinstance(p, str) else list(p) for p in prompts]
    samples = [{"input_ids": [], "loss_mask": [], "turns": 0} for _ in convs]
    messages: list[list[dict]] = [[] for _ in convs]
    open_ = [True] * len(convs)
    for r in range(max(len(c) for c in convs)):
        todo, contexts, unrendered, long = [], [], 0, 0
        for i, conv in enumerate(convs):
            if not open_[i] or r >= len(conv):
                continue
            step = next_turn_ids(tokenizer, messages[i], conv[r])
            context = samples[i]["input_ids"] + (step or [])
            if step is None or (max_context and len(context) >= max_context):
                open_[i] = False
                unrendered, long = unrendered + (step is None), long + (step is not None)
                continue
            todo.append(i)
            contexts.append(context)
        if unrendered:  # a tokenizer whose eos is not the template's end of turn closes every conversation here
            log.warning("turn %d: %d conversations stopped: the chat template does not render the conversation so "
                        "far (answers through eos %r) as a prefix of the next turn's prompt", r + 1, unrendered,
                        tokenizer.eos_token)
        if not todo:
            break
        if engine == "continuous":
            answers = generate_continuous(model, contexts, max_new_tokens, eos, temperature, seed + 7919 * r)
        else:
            answers = generate_batch(model, contexts, max_new_tokens, eos, batch_size, temperature, seed + 7919 * r,
                                     log_every, max_batch_tokens, **generate_kwargs)
        for i, context, answer in zip(todo, contexts, answers):
            s = samples[i]
            s["loss_mask"] += [0] * (len(context) - len(s["input_ids"])) + [1] * len(answer)
            s["input_ids"] = context + answer
            s["turns"] += 1
            text = tokenizer.decode(answer[:-1] if answer[-1:] == [eos] else answer, skip_special_tokens=False)
            messages[i] += [{"role": "user", "content": convs[i][r]}, {"role": "assistant", "content": text}]
            open_[i] = answer[-1:] == [eos]
        log.info("turn %d: %d conversations answered, %d of them cut at max_new_tokens; %d stopped at max_context",
                 r + 1, len(todo), sum(not open_[i] for i in todo), long)
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
