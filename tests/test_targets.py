"""Targets beyond Llama (Qwen3, Qwen3-MoE, DeepSeek-V3 with MLA, GLM-4.5-MoE), tiny and random, on the CPU:
the extractor's states equal `output_hidden_states`, a drafter trains on them, exports in each serving engine's
convention for that architecture, and speculative decoding with it is exactly the target's greedy decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.configs import phase
from tests.support.tiny_targets import CAPTURE, HIDDEN, TARGETS, build_tiny_target

PROMPTS = 8
ANSWER_LEN = 16
STEPS = 12


@pytest.fixture(scope="module")
def targets_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-targets")


def extract(target: Path, model, tokenizer, work: Path) -> tuple[Path, list[dict]]:
    """Self-distilled samples of the target -> a merged dataset -> one shard through the real extractor."""
    from eagle3.extract.config import ExtractConfig, ShardPlanConfig
    from eagle3.extract.run import extract_shard
    from eagle3.extract.plan import plan_shards
    from tests.support.synthetic import write_merged_dataset
    from tests.support.selfdistill import generate_answers, make_prompts

    samples = generate_answers(model, tokenizer, make_prompts(PROMPTS), max_new_tokens=ANSWER_LEN)
    write_merged_dataset(work / "merge", [s["input_ids"] for s in samples],
                         loss_masks=[s["loss_mask"] for s in samples], rows_per_file=4)
    spec = plan_shards(ShardPlanConfig(str(work / "merge"), 1))[0]
    # fp32, 4 x 64 values a token: chunk_mb 0.1 gives chunks of ~100 tokens, several per shard
    cfg = phase(ExtractConfig, model_path=str(target), extract_dir=str(work / "extract"), capture_layers=CAPTURE,
                device="cpu", dtype="float32", token_budget=256, chunk_mb=0.1, writer_threads=1)
    summary = extract_shard(cfg, spec)
    assert summary["complete"] and summary["tokens"] == sum(len(s["input_ids"]) for s in samples)
    return Path(summary["shard_dir"]), samples


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [t for t in TARGETS if t != "llama"])  # Llama: the SmolLM2 tests
def test_target_extracts_trains_exports_and_decodes_losslessly(model_type, targets_root, smollm2_path,
                                                               smollm2_tokenizer, tmp_path):
    from eagle3.extract.format import ShardManifest
    from eagle3.extract.reader import HiddenStateReader
    from tests.support.reference import reference_states
    from eagle3.models import load_model, model_info
    from eagle3.evaluate.config import EvalConfig
    from eagle3.train.config import TrainConfig
    from eagle3.evaluate.run import evaluate_phase
    from eagle3.train.run import train_phase
    from tests.support.selfdistill import make_prompts
    from eagle3.train.serving import sglang_layer_ids

    target = build_tiny_target(model_type, targets_root / model_type, smollm2_path)
    info = model_info(target)
    assert info.model_type == model_type and info.num_layers == 5
    model = load_model(target)

    # 1. captured states == output_hidden_states, sample by sample, each capture layer and the final state
    shard, samples = extract(target, model, smollm2_tokenizer, tmp_path)
    assert len(ShardManifest.load(shard).chunks) >= 2
    got = {s.row: s for s in HiddenStateReader([shard], verify=True)}
    assert sorted(got) == list(range(PROMPTS))
    for row, sample in enumerate(samples):
        s = got[row]
        assert s.input_ids.tolist() == sample["input_ids"] and s.loss_mask.tolist() == sample["loss_mask"]
        aux, final = reference_states(model, sample["input_ids"], CAPTURE)
        for k in range(len(CAPTURE)):
            torch.testing.assert_close(s.aux_hidden[:, k * HIDDEN:(k + 1) * HIDDEN], aux[:, k * HIDDEN:(k + 1) * HIDDEN],
                                       rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s.final_hidden, final, rtol=1e-4, atol=1e-5)

    # 2. a drafter trains on them (the loss falls) and exports
    train = phase(TrainConfig, shard_dirs=[str(shard)], model_path=str(target), output_dir=str(tmp_path / "train"),
                        batch_size=2, max_steps=STEPS, lr=3e-3, warmup_ratio=0.1, ttt_steps=3,
                        checkpoint_every=STEPS, seed=0)
    report = train_phase(train)
    # both engines capture the trained layers; vLLM (0.33) has no EAGLE-3 hook for GLM-4.5 targets at all
    vllm_only = ["vLLM (0.33) has no EAGLE-3 hook"] if model_type == "glm4_moe" else []
    assert report["steps"] == STEPS and [p[:30] for p in report["serving_problems"]] == [v[:30] for v in vllm_only]
    assert report["last"]["loss"] < report["first"]["loss"]
    export = json.loads((Path(report["export_dir"]) / "config.json").read_text())
    drafter = export["eagle3_pipeline"]["drafter_config"]
    if info.kv_lora_rank:  # MLA: heads of the value width, not the rotary head_dim of the target's config
        assert (drafter["head_dim"], drafter["num_attention_heads"]) == (info.v_head_dim, HIDDEN // info.v_head_dim)
    else:
        assert (drafter["head_dim"], drafter["num_attention_heads"]) == (info.head_dim, info.num_attention_heads)
    assert export["head_dim"] == drafter["head_dim"] and export["eagle_aux_hidden_state_layer_ids"] == CAPTURE
    # SGLang: every one of these targets adds 1 to the ids (DeepSeek's model because the first id is then 1)
    assert export["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in CAPTURE]
    assert sglang_layer_ids(CAPTURE, info.architecture) == [i - 1 for i in CAPTURE]

    # 3. speculative decoding with the export is the target's greedy decoding, token for token
    ev = phase(EvalConfig, export_dir=report["export_dir"], model_path=str(target), output_dir=str(tmp_path / "eval"),
                    prompts=make_prompts(2, offset=500), ks=[3], max_new_tokens=ANSWER_LEN, random_floor=False)
    result = evaluate_phase(ev)
    trained = result["results"]["trained"]
    assert result["identical_to_greedy"] is True and trained["mismatches"] == []
    assert trained["by_k"]["3"]["rounds"] > 0 and 1.0 <= result["tau"]["3"] <= 4.0


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "glm4_moe"])  # dense: SmolLM2 at TP 3 elsewhere
def test_tensor_parallel_extraction_of_the_target_equals_one_process(model_type, targets_root, smollm2_path,
                                                                     tmp_path):
    """TP 2 (gloo): attention heads split, a MoE target's experts spread over the ranks (expert parallel)."""
    from eagle3.extract.config import ExtractConfig, ShardPlanConfig
    from eagle3.extract.run import extract_shard
    from eagle3.extract.plan import plan_shards
    from eagle3.extract.reader import HiddenStateReader
    from tests.support.reference import reference_states
    from tests.support.synthetic import write_merged_dataset
    from eagle3.models import load_model

    target = build_tiny_target(model_type, targets_root / model_type, smollm2_path)
    g = torch.Generator().manual_seed(1)
    samples = [[1] + torch.randint(3, 49152, (n,), generator=g).tolist() + [2] for n in (20, 33, 27)]
    write_merged_dataset(tmp_path / "merge", samples)
    spec = plan_shards(ShardPlanConfig(str(tmp_path / "merge"), 1))[0]
    cfg = phase(ExtractConfig, model_path=str(target), extract_dir=str(tmp_path / "extract"), capture_layers=CAPTURE,
                        device="cpu", dtype="float32", token_budget=256, chunk_mb=0.05, writer_threads=1, tp_size=2,
                        rank_timeout_s=120)
    summary = extract_shard(cfg, spec)
    assert summary["complete"]
    model = load_model(target)
    got = {s.row: s for s in HiddenStateReader([Path(summary["shard_dir"])], verify=True)}
    for row, ids in enumerate(samples):
        aux, final = reference_states(model, ids, CAPTURE)
        assert got[row].input_ids.tolist() == ids
        torch.testing.assert_close(got[row].aux_hidden, aux, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[row].final_hidden, final, rtol=1e-4, atol=1e-4)
