"""The extract param mla_joins (eagle3/extract/mla.py) on the tiny DeepSeek-V3 target, on the CPU: the token-major
joins give transformers' states (eager: the same bits; compiled: within rounding), in the extractor and resumed
byte-identical; what runs is recorded and a resume that would mix the two is refused, naming the param."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from eagle3.errors import ConfigError
from eagle3.extract import mla
from eagle3.extract.config import MLA_JOINS_CHOICES, ExtractConfig
from eagle3.extract.format import ShardManifest
from eagle3.extract.reader import HiddenStateReader
from tests.support.configs import phase
from tests.support.tiny_targets import _COMMON, TARGETS, build_tiny_target
from tests.test_moe_extract import LENGTHS, assert_states_equal_reference, chunk_bytes, cut_after, run
from tests.support.synthetic import one_shard_of_random_samples


@pytest.fixture(scope="module")
def targets(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("mla-targets")
    return {t: build_tiny_target(t, root / t, smollm2_path) for t in ("deepseek_v3", "llama")}


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    return one_shard_of_random_samples(tmp_path_factory.mktemp("merge"), LENGTHS, rows_per_file=4)


def tiny_deepseek(rope_interleave: bool):
    cls, fields = TARGETS["deepseek_v3"]
    config = getattr(transformers, cls)(**{**_COMMON, **fields}, rope_interleave=rope_interleave)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def states(shard_dir: Path) -> dict:
    return {s.row: (s.aux_hidden, s.final_hidden) for s in HiddenStateReader([shard_dir], verify=True)}


@pytest.mark.parametrize("rope_interleave", [True, False])
def test_token_major_forward_gives_transformers_states_bit_for_bit(rope_interleave):
    """Both ropes (DeepSeek-V3's interleaved pairs, and halves), a batch of two: every hidden state the same bits,
    and "heads-major" gives the class's forward back."""
    model = tiny_deepseek(rope_interleave)
    ids = torch.randint(3, 1000, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids, output_hidden_states=True, use_cache=False).hidden_states
        assert mla.apply(model, "token-major") == "token-major"
        attn = model.model.layers[0].self_attn
        assert attn.forward.__func__ is mla.token_major_forward
        got = model(ids, output_hidden_states=True, use_cache=False).hidden_states
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        with pytest.raises(ValueError, match="without a KV cache"):  # extraction runs none; generation would
            model(ids, use_cache=True)
        assert mla.apply(model, "auto") == "heads-major" and "forward" not in vars(attn)


def test_mla_joins_choices_targets_and_attention_functions(targets):
    """The config's choices are the module's; a target without MLA resolves to None; a bad value is refused at the
    config, and token-major on an attention function that does not read strides at load, naming the param."""
    from eagle3.models import load_model

    assert MLA_JOINS_CHOICES == mla.CHOICES
    assert mla.apply(load_model(targets["llama"]), "token-major") is None
    with pytest.raises(ConfigError, match="mla_joins"):
        phase(ExtractConfig, model_path=str(targets["deepseek_v3"]), extract_dir="/tmp/x", mla_joins="token_major")
    ds = load_model(targets["deepseek_v3"])
    ds.config._attn_implementation = "flex_attention"
    with pytest.raises(ConfigError, match="mla_joins='token-major'.*'flex_attention'"):
        mla.apply(ds, "token-major")
    assert mla.apply(ds, "heads-major") == "heads-major"


def test_token_major_shard_equals_heads_major_and_resumes_byte_identical(targets, merged, tmp_path):
    """Through the extractor, batched with padding: token-major stores the heads-major shard's bits, the manifest
    records it, a cut shard resumes byte-identical, and resuming it with the other layout is refused, naming
    mla_joins."""
    spec, samples = merged
    ds = targets["deepseek_v3"]
    heads = run(ds, tmp_path / "heads", spec)
    whole = run(ds, tmp_path / "whole", spec, mla_joins="token-major")
    shard_dir = Path(whole["shard_dir"])
    m = ShardManifest.load(shard_dir)
    assert m.params["kernels"]["mla_joins"] == "token-major" and m.params["states"]["mla_joins"] == "token-major"
    assert ShardManifest.load(Path(heads["shard_dir"])).params["kernels"]["mla_joins"] == "heads-major"
    got, want = states(shard_dir), states(Path(heads["shard_dir"]))
    assert sorted(got) == list(range(len(samples))) and all(
        torch.equal(got[r][i], want[r][i]) for r in got for i in (0, 1))
    cut = run(ds, tmp_path / "cut", spec, mla_joins="token-major")
    cut_dir = Path(cut["shard_dir"])
    cut_after(cut_dir, ShardManifest.load(cut_dir), 2)
    with pytest.raises(ConfigError, match="mla_joins='token-major', this run has mla_joins='auto'"):
        run(ds, tmp_path / "cut", spec)
    resumed = run(ds, tmp_path / "cut", spec, mla_joins="token-major")
    assert resumed["resumed_from_chunk"] == 2 and resumed["complete"]
    assert chunk_bytes(cut_dir) == chunk_bytes(shard_dir)


@pytest.mark.slow
def test_compiled_token_major_states_equal_output_hidden_states(targets, merged, tmp_path, monkeypatch):
    """Compiled as the GPU runs it (each decoder layer, Inductor fusing the rope and the joins): the states equal a
    plain one-sample forward's (compiled heads-major: tests/test_moe_extract.py)."""
    from eagle3.models import load_model

    monkeypatch.setenv("EAGLE3_COMPILE_CACHE", str(tmp_path / "cache"))
    torch._dynamo.reset()
    spec, samples = merged
    out = run(targets["deepseek_v3"], tmp_path, spec, compile=True, mla_joins="token-major")
    assert ShardManifest.load(Path(out["shard_dir"])).params["kernels"]["mla_joins"] == "token-major"
    assert_states_equal_reference(load_model(targets["deepseek_v3"]), Path(out["shard_dir"]), samples, atol=5e-4)


def test_mla_shard_from_before_mla_joins_resumes_as_heads_major(targets, merged, tmp_path):
    """A DeepSeek-V3 shard whose manifest names no mla_joins (states or kernel record: written before it existed)
    ran transformers' forward: it resumes under auto byte-identical, and token-major is refused."""
    spec, _ = merged
    ds = targets["deepseek_v3"]
    whole = run(ds, tmp_path / "whole", spec)
    cut = run(ds, tmp_path / "cut", spec)
    shard_dir = Path(cut["shard_dir"])
    m = ShardManifest.load(shard_dir)
    del m.params["states"]["mla_joins"], m.params["kernels"]["mla_joins"]
    cut_after(shard_dir, m, 2)
    with pytest.raises(ConfigError, match="mla_joins"):
        run(ds, tmp_path / "cut", spec, mla_joins="token-major")
    resumed = run(ds, tmp_path / "cut", spec)
    assert resumed["resumed_from_chunk"] == 2 and resumed["complete"]
    assert chunk_bytes(shard_dir) == chunk_bytes(Path(whole["shard_dir"]))
    assert ShardManifest.load(shard_dir).params["kernels"]["mla_joins"] == "heads-major"
