"""The export against the serving engines' own rules: which target layers each captures from our config.json,
and whether it loads the vocabulary map. Each rule is restated here from the engine's source, independently
of eagle3.train.serving, so a change there cannot silently agree with itself."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3.models import ModelInfo


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "glm4_moe": "Glm4MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "glm_moe_dsa": "GlmMoeDsaForCausalLM"}


def info(model_type: str = "llama", layers: int = 30, vocab: int = 300) -> ModelInfo:
    return ModelInfo(path="/target", model_type=model_type, num_layers=layers, hidden_size=32, intermediate_size=64,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=vocab,
                     max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                     architecture=ARCHITECTURES[model_type])


def default_layers(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def sglang_captures(config: dict, target_model_type: str, num_layers: int) -> list[int]:
    """HF hidden_states indices SGLang feeds the drafter. sglang python/sglang/srt/speculative/eagle_worker.py
    reads eagle_config["eagle_aux_hidden_state_layer_ids"] (None -> the target's default); the target's
    set_eagle3_layers_to_capture (models/llama.py, qwen3.py, qwen3_moe.py, glm4_moe.py) captures the input of
    layer id + 1; models/deepseek_v2.py (DeepseekV3ForCausalLM, and GlmMoeDsaForCausalLM of glm4_moe.py, a
    subclass) adds the 1 only when the first id is 1 (sglang 0.5.23)."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return default_layers(num_layers)
    if target_model_type in ("deepseek_v3", "glm_moe_dsa") and ids[0] != 1:
        return list(ids)
    return [i + 1 for i in ids]


def vllm_v1_captures(config: dict, num_layers: int) -> list[int]:
    """vllm/v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config: top-level ids, else the nested
    eagle_config ids, else the target's default; models/llama.py captures the input of layer idx."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else default_layers(num_layers)


def vllm_v2_captures(config: dict, num_layers: int) -> list[int]:
    """vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config: top-level ids,
    else eagle_config["layer_ids"], else the target's default."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get("layer_ids")
    return list(ids) if ids else default_layers(num_layers)


def vllm_draft_to_target(config: dict, tensors: dict) -> torch.Tensor:
    """vllm/model_executor/models/llama_eagle3.py: logits of draft id i go to target id i + d2t[i] (zeros when the
    checkpoint has no d2t); a d2t beside draft_vocab_size == vocab_size is refused (vLLM then expects none)."""
    if "d2t" in tensors and config["draft_vocab_size"] == config["vocab_size"]:
        raise ValueError("vLLM: draft_vocab_size equals the target vocab, but the checkpoint has a d2t")
    d2t = tensors.get("d2t", torch.zeros(config["draft_vocab_size"], dtype=torch.long))
    return torch.arange(config["draft_vocab_size"]) + d2t


def sglang_draft_to_target(config: dict, tensors: dict) -> torch.Tensor:
    """sglang models/llama_eagle3.py: hot_token_id = d2t + arange; without d2t none, and the draft lm_head must
    cover the whole vocabulary (ParallelLMHead(draft_vocab_size) against the target's logits)."""
    if "d2t" in tensors:
        return tensors["d2t"] + torch.arange(tensors["d2t"].shape[0])
    assert config["draft_vocab_size"] == config["vocab_size"], "SGLang: no d2t for a partial draft vocabulary"
    return torch.arange(config["vocab_size"])


def export(tmp_path, target: ModelInfo, capture: list[int], draft_ids: torch.Tensor):
    from safetensors.torch import load_file

    from eagle3.train.export import export_drafter
    from eagle3.train.model import DrafterConfig, Eagle3Drafter
    from eagle3.train.vocab import DraftVocab

    vocab = DraftVocab(draft_ids, target.vocab_size)
    drafter = Eagle3Drafter(DrafterConfig.from_target(target, vocab.size, len(capture)))
    out = export_drafter(drafter, vocab, target, capture, tmp_path / "export")
    return json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors")), out


@pytest.mark.parametrize("model_type,layers,capture", [
    ("llama", 30, [2, 15, 27]),  # the default of a 30-layer target
    ("llama", 30, [1, 5, 9]),  # custom, incl. the first decoder layer's output
    ("qwen3", 36, [3, 18, 33, 35]),  # four layers, none the default
    ("qwen3_moe", 48, [1, 24, 45]),
    ("glm4_moe", 46, [1, 23, 43]),  # GLM-4.5/4.6: SGLang adds the 1 whatever the first id
    ("deepseek_v3", 61, [2, 30, 58]),  # SGLang's DeepSeek model: first id 1, so it adds the 1
    ("deepseek_v3", 61, [3, 30, 58]),  # first id 3: it takes the ids as they are
    ("glm_moe_dsa", 78, [4, 39, 75]),  # GLM-5 runs on SGLang's DeepSeek model
])
def test_both_engines_capture_exactly_our_capture_layers(tmp_path, model_type, layers, capture):
    from eagle3.train.serving import serving_problems

    config, _, _ = export(tmp_path, info(model_type, layers), capture, torch.arange(0, 300, 3))
    assert sglang_captures(config, model_type, layers) == capture
    assert vllm_v1_captures(config, layers) == capture
    assert vllm_v2_captures(config, layers) == capture
    # the layer ids are right for both engines; vLLM (0.33) has no EAGLE-3 hook for GLM-4.5 targets at all
    assert set(serving_problems(capture, ARCHITECTURES[model_type])) == ({"vllm"} if model_type == "glm4_moe" else set())


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm_moe_dsa"])
def test_a_deepseek_model_target_whose_first_capture_is_1_is_reported(tmp_path, model_type):
    """Ids [0, ..] make SGLang's DeepSeek model capture the embeddings, ids [1, ..] layer 2: no ids give 1."""
    from eagle3.train.serving import serving_problems

    capture = [1, 30, 58]
    config, _, _ = export(tmp_path, info(model_type, 61), capture, torch.arange(0, 300, 3))
    assert vllm_v1_captures(config, 61) == vllm_v2_captures(config, 61) == capture
    for ids in ([0, 29, 57], [1, 30, 58]):
        assert sglang_captures({"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}}, model_type, 61) != capture
    problems = serving_problems(capture, ARCHITECTURES[model_type])
    problem = problems["sglang"]
    assert set(problems) == {"sglang"} and "cannot serve" in problem and str(capture) in problem and "vLLM" in problem


def test_a_draft_vocabulary_of_the_whole_target_vocabulary_loads_in_both_engines(tmp_path):
    from eagle3.train.export import load_exported

    target = info(vocab=300)
    config, tensors, out = export(tmp_path, target, [2, 15, 27], torch.arange(300))
    assert config["draft_vocab_size"] == config["vocab_size"] == 300
    assert torch.equal(vllm_draft_to_target(config, tensors), torch.arange(300))
    assert torch.equal(sglang_draft_to_target(config, tensors), torch.arange(300))
    _, vocab, _ = load_exported(out)
    assert vocab.is_full and torch.equal(vocab.to_target(torch.tensor([0, 299])), torch.tensor([0, 299]))


def test_a_partial_draft_vocabulary_maps_the_same_in_both_engines(tmp_path):
    draft_ids = torch.tensor([0, 4, 5, 17, 250])
    config, tensors, _ = export(tmp_path, info(vocab=300), [2, 15, 27], draft_ids)
    assert torch.equal(vllm_draft_to_target(config, tensors), draft_ids)
    assert torch.equal(sglang_draft_to_target(config, tensors), draft_ids)
