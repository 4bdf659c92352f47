"""Export the trained drafter as a folder SGLang and vLLM serve (docs/train.md gives the flags), and load
such a folder back (evaluation uses the export). What each engine reads is in eagle3.train.serving.

Tensor names are those SGLang's LlamaForCausalLMEagle3.load_weights reads
(sglang python/sglang/srt/models/llama_eagle3.py): it maps `fc.*`, `midlayer.*`, `norm.*` under
its `model.` prefix, fuses q/k/v_proj into qkv_proj and gate/up_proj into gate_up_proj, turns `d2t`
into its hot-token ids (draft id + d2t) and skips `t2d`. No embed_tokens: SGLang shares the target's.
It silently ignores names it does not know, so a misspelt tensor would load "fine" and accept nothing.
vLLM's Eagle3LlamaForCausalLM (vllm/model_executor/models/llama_eagle3.py) reads the same names
(`midlayer.` -> `layers.0.`, `d2t` -> `draft_id_to_target_id`, `t2d` skipped).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from eagle3.errors import ConfigError, PipelineError
from eagle3.io import atomic_write_json, read_json, temp_path_for
from eagle3.train.model import DrafterConfig, Eagle3Drafter
from eagle3.train.serving import sglang_layer_ids, vllm_layer_ids
from eagle3.train.vocab import DraftVocab

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def engine_config(cfg: DrafterConfig, info, capture_layers: list[int], torch_dtype: str = "bfloat16") -> dict:
    """config.json for both engines: the aux layer ids in each one's convention (eagle3.train.serving)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.target_vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": torch_dtype,
        "bos_token_id": getattr(info, "bos_token_id", None),
        "eos_token_id": getattr(info, "eos_token_id", None),
        "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(capture_layers),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_layer_ids(capture_layers, getattr(info, "architecture", "")),
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
            "use_last_layernorm": True,
        },
        # ours, ignored by the engines: lets load_exported rebuild the drafter exactly
        "eagle3_pipeline": {"drafter_config": cfg.to_dict(), "capture_layers": list(capture_layers),
                            "target_model": getattr(info, "path", None)},
    }


def export_tensors(drafter: Eagle3Drafter, vocab: DraftVocab, dtype=torch.bfloat16) -> dict:
    tensors = {name: p.detach().to(dtype).contiguous() for name, p in drafter.state_dict().items()}
    if not vocab.is_full:  # a full draft vocabulary carries no map: vLLM refuses one (eagle3.train.serving)
        tensors["d2t"] = vocab.d2t.contiguous()
        tensors["t2d"] = vocab.t2d.contiguous()
    return tensors


def export_drafter(drafter: Eagle3Drafter, vocab: DraftVocab, info, capture_layers: list[int], out_dir: str | Path,
                   dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the folder via a temp folder and rename it into place (a reader never sees half an export)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    if out_dir.exists():  # replaced below: only an export of ours may be
        theirs = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else [out_dir.name]
        theirs = [n for n in theirs if n not in (CONFIG_FILE, WEIGHTS_FILE)] if out_dir.is_dir() else theirs
        if theirs:
            raise ConfigError(f"export folder {out_dir} exists and holds what no drafter export of this pipeline "
                              f"writes ({theirs[:5]}): refusing to replace it; move it away or export elsewhere")
    tmp = temp_path_for(out_dir)
    tmp.mkdir(parents=True)
    try:
        save_file(export_tensors(drafter, vocab, dtype), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        cfg = engine_config(drafter.cfg, info, capture_layers, str(dtype).replace("torch.", ""))
        atomic_write_json(tmp / CONFIG_FILE, cfg)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def load_exported(export_dir: str | Path, dtype: torch.dtype = torch.float32) -> tuple[Eagle3Drafter, DraftVocab, dict]:
    from safetensors.torch import load_file

    export_dir = Path(export_dir)
    cfg_path = export_dir / CONFIG_FILE
    if not cfg_path.is_file():
        raise PipelineError(f"{export_dir}: not a drafter export (no {CONFIG_FILE})")
    config = read_json(cfg_path)
    dcfg = DrafterConfig(**config["eagle3_pipeline"]["drafter_config"])
    tensors = load_file(str(export_dir / WEIGHTS_FILE))
    if "d2t" in tensors:
        vocab = DraftVocab.from_d2t(tensors.pop("d2t"), tensors.pop("t2d"))
    elif dcfg.draft_vocab_size == dcfg.target_vocab_size:
        vocab = DraftVocab.full(dcfg.target_vocab_size)
    else:
        raise PipelineError(f"{export_dir / WEIGHTS_FILE}: no d2t, but the draft vocabulary ({dcfg.draft_vocab_size}) "
                            f"is smaller than the target's ({dcfg.target_vocab_size})")
    drafter = Eagle3Drafter(dcfg)
    missing, unexpected = drafter.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False)
    if missing or unexpected:
        raise PipelineError(f"{export_dir / WEIGHTS_FILE}: missing tensors {missing}, unexpected {unexpected}")
    return drafter.to(dtype).eval(), vocab, config


def describe(export_dir: str | Path) -> str:
    from safetensors import safe_open

    with safe_open(str(Path(export_dir) / WEIGHTS_FILE), "pt") as f:
        return json.dumps({k: list(f.get_slice(k).get_shape()) for k in f.keys()}, indent=1)
