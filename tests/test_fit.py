"""eagle3.fit and preflight's "what fits": weight bytes from config.json alone, tp sizes that do not divide the
model, the smallest tp_size that fits. The big shapes are config.json files only (no weights)."""

import json
import stat

import pytest

from eagle3.errors import ConfigError
from eagle3.fit import check_fits, check_tp_divides, load_config, smallest_fitting_tp, weight_estimate
from eagle3.preflight import PreflightConfig, PreflightError, run_preflight
from eagle3.sections import TargetConfig
from tests.support.configs import phase

GIB = 2**30
H200_FREE = 139 * GIB
LLAMA_70B = dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, torch_dtype="bfloat16")
LLAMA_8B = dict(LLAMA_70B, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)
# DeepSeek-V3's config.json: MLA attention, 3 dense layers then 256 routed + 1 shared expert, block-wise FP8
DEEPSEEK_V3 = dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                   num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256, n_shared_experts=1,
                   moe_layer_freq=1, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280,
                   torch_dtype="bfloat16", quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                                "weight_block_size": [128, 128]})
QWEN3_235B = dict(model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                  num_hidden_layers=94, num_experts=128, decoder_sparse_step=1, mlp_only_layers=[],
                  num_attention_heads=64, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                  torch_dtype="bfloat16")


@pytest.mark.parametrize("cfg,published", [(LLAMA_8B, 8.03e9), (LLAMA_70B, 70.55e9), (DEEPSEEK_V3, 671e9),
                                           (QWEN3_235B, 235.09e9)])
def test_parameter_counts_match_the_published_sizes(cfg, published):
    assert weight_estimate(cfg).total_params == pytest.approx(published, rel=0.003)


def test_smollm2_count_equals_its_loaded_parameters(smollm2_path, smollm2_model):
    est = weight_estimate(load_config(smollm2_path), dtype="float32")
    assert est.total_params == sum(p.numel() for p in smollm2_model.parameters())
    assert est.total_bytes == 4 * est.total_params


def test_per_gpu_bytes_shrink_with_tp_and_fp8_halves_the_linears():
    one, eight = weight_estimate(LLAMA_70B, 1), weight_estimate(LLAMA_70B, 8)
    assert one.total_bytes == eight.total_bytes == one.per_gpu_bytes
    embed = 128256 * 8192 * 2  # replicated on every rank
    assert eight.per_gpu_bytes == pytest.approx((one.total_bytes - embed) / 8 + embed, rel=1e-3)
    fp8 = weight_estimate(DEEPSEEK_V3, 8)
    bf16 = weight_estimate({k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}, 8)
    assert fp8.quantized == "fp8" and bf16.quantized is None
    assert 0.5 < fp8.total_bytes / bf16.total_bytes < 0.52  # all but embeddings/lm_head/norms/routers at 1 byte


def test_tp_that_does_not_divide_names_param_and_counts():
    with pytest.raises(ConfigError, match=r"extract_tp_size=3 does not divide the target's 64 attention heads, "
                                          r"8 kv heads.*\[1, 2, 4, 8\]"):
        check_tp_divides(LLAMA_70B, 3, "extract_tp_size")
    with pytest.raises(ConfigError, match=r"extract_tp_size=16 does not divide the target's 8 kv heads"):
        check_tp_divides(LLAMA_70B, 16, "extract_tp_size")
    with pytest.raises(ConfigError, match=r"extract_tp_size=6 does not divide the target's 128 attention heads, "
                                          r"128 kv heads, 256 experts"):
        check_tp_divides(DEEPSEEK_V3, 6, "extract_tp_size")
    check_tp_divides(QWEN3_235B, 4, "extract_tp_size")


def test_what_fits_an_h200_node():
    assert smallest_fitting_tp(LLAMA_8B, H200_FREE) == 1
    assert smallest_fitting_tp(LLAMA_70B, H200_FREE) == 2  # 131 GiB of bf16 weights
    assert smallest_fitting_tp(DEEPSEEK_V3, H200_FREE) == 8  # 627 GiB in fp8
    with pytest.raises(ConfigError, match=r"extract_tp_size=1: the target's weights need about 131.4 GiB per GPU.*"
                                          r"the smallest tp_size that fits is extract_tp_size=2"):
        check_fits(LLAMA_70B, 1, H200_FREE, "extract_tp_size")
    bf16 = {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}
    with pytest.raises(ConfigError, match=r"extract_tp_size=16, more than the 8 GPUs of this worker"):
        check_fits(bf16, 8, H200_FREE, "extract_tp_size", gpus=8)
    assert check_fits(DEEPSEEK_V3, 8, H200_FREE, "extract_tp_size").per_gpu_bytes < 0.8 * H200_FREE


def fake_nvidia_smi(tmp_path, free_mib: list[int], total_mib: int = 143771):
    lines = "".join(f"{i}, NVIDIA H200, {total_mib}, {total_mib - f}, 570.1, 9.0\\n" for i, f in enumerate(free_mib))
    exe = tmp_path / "bin" / "nvidia-smi"
    exe.parent.mkdir(exist_ok=True)
    exe.write_text(f"#!/bin/sh\nprintf '{lines}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def test_preflight_says_what_fits(smollm2_path, tmp_path):
    big = tmp_path / "llama70b"
    big.mkdir()
    (big / "config.json").write_text(json.dumps(LLAMA_70B))
    def preflight(model, out, tp_size=1, nvidia_smi=None):
        target = TargetConfig(model_path=str(model), tp_size=tp_size).resolved()
        return run_preflight(PreflightConfig(output_dir=str(out), allow_cpu=True), target, nvidia_smi=nvidia_smi)

    with pytest.raises(PreflightError) as info:
        preflight(big, tmp_path / "pf", nvidia_smi=fake_nvidia_smi(tmp_path, [139 * 1024] * 8))
    fails = "\n".join(info.value.failures)
    assert "smallest tp_size that fits is extract_tp_size=2" in fails
    assert info.value.report["fit"]["smallest_tp_size"] == 2
    # a tp size that does not divide the heads fails in preflight, before any task loads the model
    with pytest.raises(PreflightError, match=r"extract_tp_size=2 does not divide the target's 9 attention heads, "
                                             r"3 kv heads"):
        preflight(smollm2_path, tmp_path / "pf2", tp_size=2)
    assert preflight(smollm2_path, tmp_path / "pf3", tp_size=3)["fit"]["tp_size"] == 3  # no GPU: divisibility only


def test_fp8_checkpoint_on_the_cpu_is_a_clear_error(smollm2_path, tmp_path):
    """transformers would dequantize an FP8 checkpoint to bf16 on the CPU without a word: refused, in preflight
    and at load, naming the file."""
    from eagle3.extract.config import ExtractConfig, ShardPlanConfig
    from eagle3.extract.run import extract_shard
    from eagle3.extract.plan import plan_shards
    from tests.support.synthetic import write_merged_dataset

    fp8 = tmp_path / "fp8-target"
    fp8.mkdir()
    cfg = dict(load_config(smollm2_path), quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                               "weight_block_size": [128, 128]})
    (fp8 / "config.json").write_text(json.dumps(cfg))
    write_merged_dataset(tmp_path / "merge", [[1, 5, 6, 2]], rows_per_file=1, loss_masks=[[0, 1, 1, 1]])
    spec = plan_shards(ShardPlanConfig(str(tmp_path / "merge"), 1))[0]
    want = r"fp8-target/config.json: the target is stored in FP8.*this run is on cpu"
    with pytest.raises(ConfigError, match=want):
        extract_shard(phase(ExtractConfig, model_path=str(fp8), capture_layers=[2, 15, 27],
                            extract_dir=str(tmp_path / "x"), device="cpu"), spec)
    with pytest.raises(PreflightError, match=want):
        run_preflight(PreflightConfig(output_dir=str(tmp_path / "pf"), allow_cpu=True),
                      TargetConfig(model_path=str(fp8)).resolved(), nvidia_smi=None)
