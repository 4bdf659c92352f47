"""The extract param mla_joins (eagle3/extract/mla.py) on the tiny DeepSeek-V3 target, on the CPU: the token-major
joins give transformers' states (eager: the same bits; compiled: within rounding), and so does the in-place layout
(kv_b_proj re-laid with a gap, given back bit for bit), in the extractor and resumed byte-identical; what runs is
recorded and a resume that would mix two layouts is refused, naming the param, as is in-place where it cannot run."""

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


def hidden_states(model, ids) -> tuple:
    with torch.no_grad():
        return model(ids, output_hidden_states=True, use_cache=False).hidden_states


def kv_b(model, layer: int = 0) -> torch.nn.Linear:
    return model.model.layers[layer].self_attn.kv_b_proj


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("rope_interleave", [True, False])
def test_in_place_forward_gives_transformers_states(rope_interleave, attention):
    """Both ropes, both strided attention functions, a batch of two: kv_b_proj re-laid with a rope-wide gap a head,
    every hidden state transformers' within float32's rounding."""
    model = tiny_deepseek(rope_interleave)
    model.config._attn_implementation = attention
    ids = torch.randint(3, 1000, (2, 13), generator=torch.Generator().manual_seed(1))
    want = hidden_states(model, ids)
    attn, rows = model.model.layers[0].self_attn, kv_b(model).out_features
    assert mla.apply(model, "in-place") == "in-place" and attn.forward.__func__ is mla.in_place_forward
    heads, nope, rope, v = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    assert rows == heads * (nope + v) and kv_b(model).weight.shape[0] == kv_b(model).out_features == \
        heads * (nope + rope + v)
    assert not kv_b(model).weight.view(heads, -1, attn.kv_lora_rank)[:, nope:nope + rope].any()  # the gap
    got = hidden_states(model, ids)
    assert len(got) == len(want)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a)
    with pytest.raises(ValueError, match="'in-place' runs without a KV cache"):
        model(ids, use_cache=True)


def test_in_place_round_trip_gives_kv_b_back_bit_for_bit():
    """in-place twice re-lays once; token-major and heads-major after it drop the gap, the weight the same bits,
    transformers' forward and states back."""
    model = tiny_deepseek(True)
    ids = torch.randint(3, 1000, (1, 9), generator=torch.Generator().manual_seed(2))
    want, attn = hidden_states(model, ids), model.model.layers[0].self_attn
    weights = [kv_b(model, i).weight.detach().clone() for i in range(len(model.model.layers))]
    mla.apply(model, "in-place")
    gapped = kv_b(model).weight.detach().clone()
    assert mla.apply(model, "in-place") == "in-place" and torch.equal(kv_b(model).weight, gapped)
    for a, b in zip(want, hidden_states(model, ids)):
        torch.testing.assert_close(b, a)
    assert mla.apply(model, "token-major") == "token-major" and attn.forward.__func__ is mla.token_major_forward
    assert torch.equal(kv_b(model).weight, weights[0]) and kv_b(model).out_features == weights[0].shape[0]
    mla.apply(model, "in-place")
    assert mla.apply(model, "auto") == "heads-major" and "forward" not in vars(attn)
    for i, w in enumerate(weights):
        linear = kv_b(model, i)
        assert torch.equal(linear.weight, w) and linear.weight.dtype == w.dtype and linear.out_features == w.shape[0]
        assert type(linear.weight) is torch.nn.Parameter and linear.weight.requires_grad  # as from_config made it
    assert all(torch.equal(a, b) for a, b in zip(want, hidden_states(model, ids)))


def test_in_place_with_a_kv_b_bias():
    """A kv_b_proj with a bias (DeepSeek-V3 has none): the bias re-laid with the weight, zero in the gap, so the
    states are transformers'; given back the same bits."""
    model = tiny_deepseek(False)
    g = torch.Generator().manual_seed(3)
    for layer in model.model.layers:
        old = layer.self_attn.kv_b_proj
        layer.self_attn.kv_b_proj = torch.nn.Linear(old.in_features, old.out_features, bias=True)
        with torch.no_grad():
            layer.self_attn.kv_b_proj.weight.copy_(old.weight)
            layer.self_attn.kv_b_proj.bias.copy_(torch.randn(old.out_features, generator=g))
    ids = torch.randint(3, 1000, (2, 7), generator=g)
    want, bias = hidden_states(model, ids), kv_b(model).bias.detach().clone()
    mla.apply(model, "in-place")
    assert kv_b(model).bias.shape == (kv_b(model).out_features,)
    for a, b in zip(want, hidden_states(model, ids)):
        torch.testing.assert_close(b, a)
    mla.apply(model, "heads-major")
    assert torch.equal(kv_b(model).bias, bias)


class QuantizedLinear(torch.nn.Linear):
    """A stand-in for a quantized or FP8 kv_b_proj (transformers' FP8Linear is an nn.Linear too)."""


@pytest.mark.parametrize("case", ["flex_attention", "subclass", "fp8_weight", "tensor_parallel"])
def test_in_place_refused_where_it_cannot_run(case):
    """in-place on an attention function that does not read strides, a kv_b_proj that is not a plain floating
    nn.Linear, or a tensor-parallel model: a ConfigError naming the param, the model left as it was."""
    model = tiny_deepseek(True)
    attn = model.model.layers[-1].self_attn  # the last: the layers before it would be re-laid first
    old = attn.kv_b_proj
    if case == "flex_attention":
        model.config._attn_implementation = case
    elif case == "subclass":
        attn.kv_b_proj = QuantizedLinear(old.in_features, old.out_features, bias=False)
    elif case == "fp8_weight":
        attn.kv_b_proj.weight = torch.nn.Parameter(old.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
    else:
        model._tp_size = 2
    want = {"flex_attention": "'flex_attention'", "subclass": "QuantizedLinear, not a plain nn.Linear",
            "fp8_weight": "float8_e4m3fn", "tensor_parallel": "sharded"}[case]
    rows = kv_b(model).weight.shape
    with pytest.raises(ConfigError, match=rf"extract param mla_joins='in-place'.*{want}"):
        mla.apply(model, "in-place")
    assert kv_b(model).weight.shape == rows and all("forward" not in vars(m) for m in mla.mla_modules(model))


def test_mla_joins_choices_targets_and_attention_functions(targets):
    """The config's choices are the module's; a target without MLA resolves to None; a bad value is refused at the
    config, and token-major on an attention function that does not read strides at load, naming the param."""
    from eagle3.models import load_model

    assert MLA_JOINS_CHOICES == mla.CHOICES and "in-place" in MLA_JOINS_CHOICES
    assert mla.apply(load_model(targets["llama"]), "token-major") is None
    assert mla.apply(load_model(targets["llama"]), "in-place") is None
    with pytest.raises(ConfigError, match="mla_joins"):
        phase(ExtractConfig, model_path=str(targets["deepseek_v3"]), extract_dir="/tmp/x", mla_joins="token_major")
    ds = load_model(targets["deepseek_v3"])
    ds.config._attn_implementation = "flex_attention"
    with pytest.raises(ConfigError, match="mla_joins='token-major'.*'flex_attention'"):
        mla.apply(ds, "token-major")
    assert mla.apply(ds, "heads-major") == "heads-major"


@pytest.mark.parametrize("layout", ["token-major", "in-place"])
def test_mla_joins_shard_equals_heads_major_and_resumes_byte_identical(targets, merged, tmp_path, layout):
    """Through the extractor, batched with padding: token-major stores the heads-major shard's bits (in-place its
    states within float32's rounding: kv_b's GEMM is wider), the manifest records it, a cut shard resumes
    byte-identical, and resuming it with the other layout is refused, naming mla_joins."""
    spec, samples = merged
    ds = targets["deepseek_v3"]
    heads = run(ds, tmp_path / "heads", spec)
    whole = run(ds, tmp_path / "whole", spec, mla_joins=layout)
    shard_dir = Path(whole["shard_dir"])
    m = ShardManifest.load(shard_dir)
    assert m.params["kernels"]["mla_joins"] == layout and m.params["states"]["mla_joins"] == layout
    assert ShardManifest.load(Path(heads["shard_dir"])).params["kernels"]["mla_joins"] == "heads-major"
    got, want = states(shard_dir), states(Path(heads["shard_dir"]))
    assert sorted(got) == list(range(len(samples)))
    tol = {} if layout == "in-place" else {"rtol": 0, "atol": 0}
    for r in got:
        for i in (0, 1):
            torch.testing.assert_close(got[r][i], want[r][i], **tol)
    cut = run(ds, tmp_path / "cut", spec, mla_joins=layout)
    cut_dir = Path(cut["shard_dir"])
    cut_after(cut_dir, ShardManifest.load(cut_dir), 2)
    with pytest.raises(ConfigError, match=f"mla_joins='{layout}', this run has mla_joins='auto'"):
        run(ds, tmp_path / "cut", spec)
    resumed = run(ds, tmp_path / "cut", spec, mla_joins=layout)
    assert resumed["resumed_from_chunk"] == 2 and resumed["complete"]
    assert chunk_bytes(cut_dir) == chunk_bytes(shard_dir)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["token-major", "in-place"])
def test_compiled_mla_joins_states_equal_output_hidden_states(targets, merged, tmp_path, monkeypatch, layout):
    """Compiled as the GPU runs it (each decoder layer, Inductor fusing the rope and the joins, or the in-place
    writes into the projections' outputs): the states equal a plain one-sample forward's (compiled heads-major:
    tests/test_moe_extract.py)."""
    from eagle3.models import load_model

    monkeypatch.setenv("EAGLE3_COMPILE_CACHE", str(tmp_path / "cache"))
    torch._dynamo.reset()
    spec, samples = merged
    out = run(targets["deepseek_v3"], tmp_path, spec, compile=True, mla_joins=layout)
    assert ShardManifest.load(Path(out["shard_dir"])).params["kernels"]["mla_joins"] == layout
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
