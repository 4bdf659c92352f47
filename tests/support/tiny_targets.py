"""Tiny random-weight targets of the architectures the pipeline supports, saved as HF folders.

Each has SmolLM2's tokenizer (vocab 49152, ChatML template), so prompts, chat formatting and the
draft-vocabulary logic run exactly as for the real target, and shapes small enough that a whole
extract -> train -> export -> evaluate round takes seconds on the CPU. The configs keep what makes
each architecture different from Llama: Qwen3's head_dim != hidden / heads and q/k norms, Qwen3-MoE's
routed experts, DeepSeek-V3's multi-head latent attention (q/kv LoRA ranks, split rope/nope head dims)
with grouped routing, shared experts and a first dense layer, GLM-4.5-MoE's partial rotary and
sigmoid routing with shared experts. Heads (4), kv heads (2 or 4) and experts (4) divide by 2, so
every one of them also runs at tensor / expert parallel size 2.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

NUM_LAYERS = 5
CAPTURE = [2, 3, 4]  # HF hidden_states indices, ascending in 1..L-1; first = 2 like EAGLE-3's default
HIDDEN = 64
VOCAB = 49152  # SmolLM2's tokenizer

_COMMON = dict(hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS, num_attention_heads=4, vocab_size=VOCAB,
               max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2,
               tie_word_embeddings=False)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

# model_type -> (config class name, the fields that differ from _COMMON)
TARGETS = {
    "llama": ("LlamaConfig", dict(intermediate_size=128, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(intermediate_size=128, num_key_value_heads=2, head_dim=32)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=128, num_key_value_heads=2, head_dim=16, num_experts=4,
                                         decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, **_MOE)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        intermediate_size=128, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=1.0, rope_scaling=None, **_MOE)),
    "glm4_moe": ("Glm4MoeConfig", dict(
        intermediate_size=128, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, n_routed_experts=4,
        n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, use_qk_norm=True,
        routed_scaling_factor=1.0, **_MOE)),
}


def build_tiny_target(model_type: str, out_dir: str | Path, tokenizer_dir: str | Path, seed: int = 0) -> Path:
    """Write a random-weight `model_type` model (fp32 safetensors) and SmolLM2's tokenizer to out_dir, once
    (a lock lets parallel test processes share it)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").is_file():
            return out
        cls_name, fields = TARGETS[model_type]
        config = getattr(transformers, cls_name)(**{**_COMMON, **fields})
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tmp = out.with_name(out.name + ".tmp")
        model.save_pretrained(str(tmp))
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(tmp))
        tmp.rename(out)
    return out
