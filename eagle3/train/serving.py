"""What SGLang and vLLM read from a drafter export, so that each captures exactly the run's capture layers.

Capture layers are HF `hidden_states` indices (eagle3.models.resolve_capture_layers): i = the residual stream
entering decoder layer i. Read in the engines' sources (sglang 0.5.x, vllm 0.33 / main):

- SGLang reads only the nested `eagle_config.eagle_aux_hidden_state_layer_ids` (speculative/eagle_worker.py) and
  its targets capture at the input of layer id + 1 (models/llama.py `set_eagle3_layers_to_capture`: "+1 because
  sglang captures the INPUT to the layer"): nested ids = capture layers - 1. Its DeepSeek-V2/V3 model
  (models/deepseek_v2.py) adds the 1 only when the first id is 1 and otherwise captures at the ids themselves,
  so a DeepSeek target is served right only when the first capture layer is 2.
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

DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


def sglang_layer_ids(capture_layers: list[int]) -> list[int]:
    """SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids`: the decoder layers whose outputs are captured."""
    return [int(i) - 1 for i in capture_layers]


def vllm_layer_ids(capture_layers: list[int]) -> list[int]:
    """vLLM's top-level `eagle_aux_hidden_state_layer_ids`: the decoder layers whose inputs are captured."""
    return [int(i) for i in capture_layers]


def serving_problems(capture_layers: list[int], target_model_type: str) -> list[str]:
    """Engines that would feed the drafter other layers than it was trained on, with what to do about it."""
    if target_model_type in DEEPSEEK_MODEL_TYPES and capture_layers[0] != 2:
        return [f"SGLang serves a {target_model_type} target with capture layers {sglang_layer_ids(capture_layers)} "
                f"instead of {list(capture_layers)} (its DeepSeek model adds 1 to the layer ids only when the first "
                f"id is 1): serve with vLLM, or train with capture layers that start at 2"]
    return []
