"""What SGLang and vLLM read from a drafter export, so that each captures exactly the run's capture layers.

Capture layers are HF `hidden_states` indices (eagle3.models.resolve_capture_layers): i = the residual stream
entering decoder layer i. Read in the engines' sources (sglang 0.5.x, vllm 0.33 / main):

- SGLang reads only the nested `eagle_config.eagle_aux_hidden_state_layer_ids` (speculative/eagle_worker.py) and
  its targets capture at the input of layer id + 1 (models/llama.py `set_eagle3_layers_to_capture`: "+1 because
  sglang captures the INPUT to the layer"): nested ids = capture layers - 1. The same holds for Qwen3(-MoE) and
  GLM-4.5/4.6 (models/glm4_moe.py). Its DeepSeek-V2/V3 model (models/deepseek_v2.py, and the classes built on it:
  GLM-5 `GlmMoeDsaForCausalLM`, Mistral-Large-3, Kimi-K2.5; models/glm4_moe_lite.py has the same code) adds the 1
  only when the first id is 1 and otherwise captures at the ids themselves. So for those targets the export
  writes capture - 1 when the first capture layer is 2 and the capture layers themselves when it is 3 or more;
  a first capture layer of 1 cannot be expressed (ids [0, ..] capture the embeddings, ids [1, ..] layer 2).
- vLLM reads a top-level `eagle_aux_hidden_state_layer_ids` first in both runners (v1/worker/gpu_model_runner.py
  `_get_eagle3_aux_layers_from_config`, v1/worker/gpu/spec_decode/eagle/eagle3_utils.py) and its targets capture
  at the input of that layer (models/llama.py: `if idx in self.aux_hidden_state_layers`): top-level ids = capture
  layers. Without it the V1 runner takes the nested ids as such (one layer early) and the V2 runner
  `eagle_config["layer_ids"]`, then the default (2, L // 2, L - 3).
- Vocabulary: vLLM (models/llama_eagle3.py) maps draft ids through `d2t` when the checkpoint has one and expects
  none when draft_vocab_size equals the target vocab; SGLang (models/llama_eagle3.py) without `d2t` drafts over
  the whole vocabulary. So a draft vocabulary that is the whole target vocabulary is exported without d2t/t2d.
"""

from __future__ import annotations

# SGLang target classes (config.json `architectures`) whose set_eagle3_layers_to_capture adds 1 to the ids only
# when the first id is 1 (sglang 0.5.23 models/deepseek_v2.py, glm4_moe_lite.py and their subclasses)
SGLANG_FIRST_ID_RULE = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                        "GlmMoeDsaForCausalLM", "Glm4MoeLiteForCausalLM", "MistralLarge3ForCausalLM",
                        "KimiK25ForConditionalGeneration")


def sglang_layer_ids(capture_layers: list[int], architecture: str = "") -> list[int]:
    """SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` that make `architecture` capture exactly
    `capture_layers` (where it can: serving_problems says when not)."""
    if architecture in SGLANG_FIRST_ID_RULE and capture_layers[0] != 2:
        return [int(i) for i in capture_layers]
    return [int(i) - 1 for i in capture_layers]


def vllm_layer_ids(capture_layers: list[int]) -> list[int]:
    """vLLM's top-level `eagle_aux_hidden_state_layer_ids`: the decoder layers whose inputs are captured."""
    return [int(i) for i in capture_layers]


# vLLM targets without an EAGLE-3 hook (vllm 0.33: no SupportsEagle3 on these model classes)
VLLM_NO_EAGLE3 = ("Glm4MoeForCausalLM",)
ENGINES = ("sglang", "vllm")


def serving_problems(capture_layers: list[int], architecture: str) -> dict[str, str]:
    """{engine: why it cannot serve this drafter as trained, and what to do}: preflight checks them before the run
    (a failure for the engines the run must serve, PreflightConfig.serving_engines; a note for the others)."""
    out = {}
    if architecture in SGLANG_FIRST_ID_RULE and capture_layers[0] == 1:
        out["sglang"] = (f"SGLang cannot serve a {architecture} target with capture layers {list(capture_layers)}: "
                         f"its model adds 1 to the layer ids only when the first id is 1, so a first capture layer "
                         f"of 1 (the output of decoder layer 0) cannot be expressed; serve with vLLM, or train with "
                         f"capture layers that start at 2 or later")
    if architecture in VLLM_NO_EAGLE3:
        out["vllm"] = (f"vLLM (0.33) has no EAGLE-3 hook for {architecture} targets: serve the drafter with SGLang")
    return out
