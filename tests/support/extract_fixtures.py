"""The shard extractor tests' data and runs, shared by tests/test_extract_shard.py (the real SmolLM2-135M-Instruct)
and tests/test_extract_pipeline.py (a tiny random Llama): the merged dataset, its one-shard spec, the reference
states, the configs and the finished runs the resume tests compare against.

The fixtures are imported into a test module by name; module-scoped, each module builds its own.
"""

from pathlib import Path

import pytest
import torch

from eagle3.extract.config import ExtractConfig, ShardPlanConfig
from eagle3.extract.plan import plan_shards
from eagle3.extract.run import extract_shard
from tests.support.configs import phase
from tests.support.reference import reference_states
from tests.support.synthetic import write_merged_dataset

LAYERS = [1, 2, 15, 27]  # low to high (HF hidden_states indices)
# fp32 on CPU: 5 x 576 x 4 bytes = 11.5 KB a token, so chunk_mb=0.1 gives chunks of <= 9 tokens
# (a chunk is never smaller than one batch: here every batch is a chunk); the samples are 129..150 tokens, so
# the least budget (256) runs each alone and a budget of 300 padded tokens batches two of unequal length
CHUNK_MB = 0.1
BUDGET = 256
BATCHED = 300
LENGTHS = [140, 129, 150, 133]


def chunk_bytes(shard_dir: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(shard_dir.glob("chunk-*.safetensors"))}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, smollm2_tokenizer):
    """A small merged dataset of real text (two files), LENGTHS tokens: kept small for the 2-core CI."""
    tok = smollm2_tokenizer
    text = " ".join(["Hi", "What is 2+2?", "Name three colors of the rainbow.", "ok", "Why is the sky blue?",
                     "Translate 'good morning' to French.", "Count to five, then stop.", "The sea and the wind."] * 12)
    words = tok(text)["input_ids"]
    samples = [[1] + words[7 * i:7 * i + n - 2] + [2] for i, n in enumerate(LENGTHS)]  # <|im_start|> ... <|im_end|>
    masks = [[0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2) for ids in samples]
    d = tmp_path_factory.mktemp("merge")
    write_merged_dataset(d, samples, rows_per_file=3, loss_masks=masks)
    return d, samples, masks


@pytest.fixture(scope="module")
def reference(dataset, smollm2_model):
    """The oracle: one plain forward per sample with output_hidden_states=True."""
    return [reference_states(smollm2_model, ids, LAYERS) for ids in dataset[1]]


@pytest.fixture(scope="module")
def spec(dataset):
    return plan_shards(ShardPlanConfig(str(dataset[0]), 1))[0]


def config(smollm2_path, out, **kw):
    kw = {"capture_layers": LAYERS, "device": "cpu", "dtype": "float32", "token_budget": BUDGET,
          "chunk_mb": CHUNK_MB, "writer_threads": 2, **kw}
    return phase(ExtractConfig, model_path=str(smollm2_path), extract_dir=str(out), **kw)


@pytest.fixture(scope="module")
def batched(tmp_path_factory, smollm2_path, spec):
    out = tmp_path_factory.mktemp("batched")
    summary = extract_shard(config(smollm2_path, out), spec)
    return out / "shard-00000", summary


TINY_SHAPE = {"num_layers": 4, "hidden_size": 64, "intermediate_size": 128}


@pytest.fixture(scope="module")
def tiny_model():
    """A random 4-layer Llama: the write pipeline's tests need chunks, not the real model's compute (a chunk of
    130+ tokens through SmolLM2 takes seconds on a loaded 2-core machine, against a few ms here)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=49152)
    return AutoModelForCausalLM.from_config(cfg).eval()


def tiny_run(tiny_model, spec, out, try_number=None, **kw):
    """extract_shard with the tiny model: 4 x 64 fp32 values a token, so chunk_mb=0.1 gives chunks of <= 101
    tokens: every batch is a chunk."""
    from eagle3.extract.backend import HFBackend

    cfg = phase(ExtractConfig, **{"model_path": "tiny", "extract_dir": str(out), "capture_layers": [1, 2, 3],
                           "device": "cpu", "dtype": "float32", "token_budget": BUDGET, "chunk_mb": CHUNK_MB,
                           "writer_threads": 2, **kw})
    return extract_shard(cfg, spec, backend=HFBackend(model=tiny_model), model_config=TINY_SHAPE,
                         try_number=try_number)


@pytest.fixture(scope="module")
def tiny_done(tmp_path_factory, tiny_model, spec):
    out = tmp_path_factory.mktemp("tiny")
    summary = tiny_run(tiny_model, spec, out)
    return out / "shard-00000", summary
