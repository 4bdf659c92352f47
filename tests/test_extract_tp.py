"""Tensor-parallel extraction (eagle3.extract.tp) on the CPU: 3 gloo ranks, the real SmolLM2-135M (9 heads, 3 kv
heads), against the one-process path; a rank SIGKILLed mid-shard; the bad tp sizes."""

import json
import os
import time
from pathlib import Path

import pytest
import torch

from eagle3.errors import ConfigError
from eagle3.extract.config import ExtractConfig, ShardPlanConfig
from eagle3.extract.run import extract_shard
from eagle3.extract.format import ShardManifest
from eagle3.extract.plan import plan_shards
from eagle3.extract.reader import HiddenStateReader
from tests.support.synthetic import write_merged_dataset
from eagle3.faults import ENV_VAR as FAULT_ENV
from eagle3.launch import RankFailed
from eagle3.extract.status import FAILURE_NAME
from tests.support.configs import phase

LAYERS = [2, 15, 27]
# 3 ranks share 2 cores in CI: few tokens; with token_budget=256 the plan runs 140 and 130 alone and 70 + 65
# in one padded batch. fp32: 4 x 576 x 4 bytes = 9.2 KB a token, so chunk_mb=0.05 makes every batch a chunk
LENGTHS = [130, 70, 65, 140]
CHUNK_MB = 0.05


@pytest.fixture(scope="module")
def spec(tmp_path_factory, smollm2_tokenizer):
    words = smollm2_tokenizer(" ".join(["Why is the sky blue?", "Name three colors.", "Count to five."] * 40))
    samples = [[1] + words["input_ids"][5 * i:5 * i + n - 2] + [2] for i, n in enumerate(LENGTHS)]
    masks = [[0] * (len(s) // 2) + [1] * (len(s) - len(s) // 2) for s in samples]
    d = tmp_path_factory.mktemp("merge")
    write_merged_dataset(d, samples, rows_per_file=2, loss_masks=masks)
    return plan_shards(ShardPlanConfig(str(d), 1))[0]


def config(smollm2_path, out, **kw):
    kw = {"model_path": str(smollm2_path), "capture_layers": LAYERS, "device": "cpu", "dtype": "float32", "token_budget": 256,
          "chunk_mb": CHUNK_MB, "writer_threads": 2, "rank_timeout_s": 60, **kw}
    return phase(ExtractConfig, extract_dir=str(out), **kw)


@pytest.fixture(scope="module")
def tp1(tmp_path_factory, smollm2_path, spec):
    out = tmp_path_factory.mktemp("tp1")
    extract_shard(config(smollm2_path, out), spec)
    return out / "shard-00000"


@pytest.fixture(scope="module")
def tp3(tmp_path_factory, smollm2_path, spec):
    out = tmp_path_factory.mktemp("tp3")
    summary = extract_shard(config(smollm2_path, out, tp_size=3), spec)
    return out / "shard-00000", summary


def samples(shard_dir: Path) -> dict:
    return {s.row: s for s in HiddenStateReader([shard_dir], verify=True)}


def sha256s(shard_dir: Path) -> list[str]:
    return [c.sha256 for c in ShardManifest.load(shard_dir).chunks]


def test_tp3_equals_tp1(tp1, tp3, spec):
    shard_dir, summary = tp3
    assert summary["complete"] and summary["tokens"] == spec.tokens and not summary["skipped"]
    m1, m3 = ShardManifest.load(tp1), ShardManifest.load(shard_dir)
    assert [(c.file, c.tokens, c.samples) for c in m1.chunks] == [(c.file, c.tokens, c.samples) for c in m3.chunks]
    assert len(m3.chunks) == 3
    a, b = samples(tp1), samples(shard_dir)
    assert sorted(a) == sorted(b) == list(range(len(LENGTHS)))
    for row in a:
        assert torch.equal(a[row].input_ids, b[row].input_ids) and torch.equal(a[row].loss_mask, b[row].loss_mask)
        # all-reduces sum the partial products in another order: fp32 rounding (values reach ~1e4)
        torch.testing.assert_close(b[row].aux_hidden, a[row].aux_hidden, rtol=1e-4, atol=1e-2)
        torch.testing.assert_close(b[row].final_hidden, a[row].final_hidden, rtol=1e-4, atol=1e-3)
    # a complete shard starts no rank: a no-op in this process
    again = extract_shard(config(None, shard_dir.parent, tp_size=3, model_path=m3.model_path), spec)
    assert again["skipped"] and again["chunks"] == len(m3.chunks)


def test_rank_killed_mid_shard_then_resume(tp3, smollm2_path, spec, tmp_path, monkeypatch):
    shard_dir = tmp_path / "shard-00000"
    monkeypatch.setenv(FAULT_ENV, f"shard=0,after_chunks=1,once_file={tmp_path / 'fired'},rank=1")
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        extract_shard(config(smollm2_path, tmp_path, tp_size=3), spec)
    took = time.monotonic() - t0
    assert info.value.rank == 1 and "SIGKILL" in info.value.error, str(info.value)
    assert took < 300, took  # spawn + load of 3 ranks on 2 loaded cores, then the kill ends it at once
    committed = ShardManifest.load(shard_dir)
    assert 1 <= len(committed.chunks) < 3 and not committed.complete
    assert json.loads((shard_dir / FAILURE_NAME).read_text())["error"].startswith("RankFailed")  # the shard view's
    summary = extract_shard(config(smollm2_path, tmp_path, tp_size=3), spec)
    assert summary["resumed_from_chunk"] == len(committed.chunks) and summary["complete"]
    # killed anywhere, the re-run gives the same bytes as an uninterrupted TP 3 run
    assert sha256s(shard_dir) == sha256s(tp3[0])
    assert {p.name for p in shard_dir.iterdir()} == {p.name for p in tp3[0].iterdir()}


def test_bad_tp_sizes(smollm2_path, spec, tmp_path):
    with pytest.raises(ConfigError, match=r"extract_tp_size=2 does not divide the target's 9 attention heads, "
                                          r"3 kv heads.*\[1, 3\]"):
        extract_shard(config(smollm2_path, tmp_path, tp_size=2), spec)
    with pytest.raises(ConfigError, match=r"extract_tp_size=3 needs 3 GPUs, but this worker sees 0"):
        extract_shard(config(smollm2_path, tmp_path, tp_size=3, device="cuda", dtype="bfloat16"), spec)
    with pytest.raises(ConfigError, match="extract_backend='hf'"):
        extract_shard(config(smollm2_path, tmp_path, tp_size=3, backend="fused-llama"), spec)
    # nothing extracted (the shard folder holds at most the failure record for the shard view)
    assert {p.name for p in (tmp_path / "shard-00000").glob("*")} <= {"last_error.json"}


def tiny_moe(kind: str):
    """Tiny random MoE targets (4 experts, top 2): Qwen3-MoE, and DeepSeek-V3 (MLA, a dense first layer, a shared
    expert)."""
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                              num_experts_per_tok=2, vocab_size=1000, decoder_sparse_step=1, mlp_only_layers=[])
    from transformers import DeepseekV3Config

    return DeepseekV3Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                            n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=1000, n_group=1,
                            topk_group=1)


@pytest.mark.parametrize("kind, experts", [("qwen3_moe", "auto"), ("deepseek_v3", "auto"),
                                           ("qwen3_moe", "triton_fused")])
def test_moe_target_tp2_with_expert_parallel_equals_tp1(kind, experts, tmp_path):
    """Each rank holds half the experts (transformers' expert parallelism); through the project's fused kernels too,
    where the pairs routed to the other rank's experts add nothing on this one."""
    from transformers import AutoModelForCausalLM

    if experts == "triton_fused":
        pytest.importorskip("triton")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_moe(kind)).save_pretrained(tmp_path / "model")
    lengths = (40, 30, 20)
    write_merged_dataset(tmp_path / "merge", [[1] + list(range(5, 5 + n)) + [2] for n in lengths], rows_per_file=2,
                         loss_masks=[[1] * (n + 2) for n in lengths])
    spec = plan_shards(ShardPlanConfig(str(tmp_path / "merge"), 1))[0]
    got = {}
    for tp in (1, 2):
        cfg = config(tmp_path / "model", tmp_path / f"tp{tp}", tp_size=tp, capture_layers=[1, 2, 3], chunk_mb=0.01,
                     experts_implementation=experts)
        assert extract_shard(cfg, spec)["tokens"] == sum(lengths) + 2 * len(lengths)
        got[tp] = samples(tmp_path / f"tp{tp}" / "shard-00000")
        # the manifest records what auto ran at every tp_size (a resume under another kernel is refused on it)
        ran = ShardManifest.load(tmp_path / f"tp{tp}" / "shard-00000").params["kernels"]
        assert ran["experts_implementation"] == ("grouped_mm" if experts == "auto" else experts)
    for row, s in got[1].items():
        assert torch.equal(s.input_ids, got[2][row].input_ids)
        torch.testing.assert_close(got[2][row].aux_hidden, s.aux_hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[2][row].final_hidden, s.final_hidden, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match=r"extract_tp_size=3 does not divide the target's 4 attention heads"):
        extract_shard(config(tmp_path / "model", tmp_path / "tp3", tp_size=3), spec)
