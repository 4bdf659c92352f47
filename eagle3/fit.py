"""What fits: a target's weight bytes per GPU at a tensor-parallel size, from its config.json alone, and the disk
bytes a token of extracted states takes (bytes_per_token).

Preflight runs this before any task loads a model: a tp_size that does not divide the attention heads, kv heads
or experts fails naming the param and the counts; weights that do not fit the free GPU memory fail with the
smallest tp_size that would.

The estimate counts every linear weight of the decoder (dense MLP, MoE experts + shared experts + router, MLA
attention for DeepSeek-V3-style configs), the embeddings and the lm_head. Per GPU: transformers' tp_plan shards
the decoder's linear layers (experts across ranks) and the lm_head; embeddings and norms are replicated. A
block-wise FP8 checkpoint (`quantization_config.quant_method == "fp8"`) keeps its decoder linears at 1 byte
(+ one fp32 scale per weight block); the rest stays in the checkpoint's dtype. An estimate: activations,
the KV-free extraction forward and the CUDA context come on top (`headroom`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3.errors import ConfigError
from eagle3.extract.config import stored_dtype

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")


def load_config(model_path: str | Path) -> dict:
    path = Path(model_path) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: unreadable config.json: {e}") from e
    return cfg


def _text(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def fp8_checkpoint(cfg: dict) -> bool:
    return (cfg.get("quantization_config") or {}).get("quant_method") == "fp8"


def check_fp8_device(cfg: dict, device: str, model_path: str | Path) -> None:
    """A block-wise FP8 checkpoint loads as it is only on a GPU: transformers would silently dequantize it to bf16
    on the CPU (another model than the one served), so the CPU is refused, naming the file."""
    if fp8_checkpoint(cfg) and not str(device).startswith("cuda"):
        q = cfg["quantization_config"]
        raise ConfigError(f"{Path(model_path) / 'config.json'}: the target is stored in FP8 (quantization_config: "
                          f"quant_method='fp8', weight_block_size={q.get('weight_block_size')}); it loads as it is on "
                          f"a CUDA GPU of compute capability >= 8.9 only, this run is on {device}: run on such a GPU, "
                          f"or use a bf16 copy of the target")


def num_experts(cfg: dict) -> int:
    t = _text(cfg)
    return next((int(t[k]) for k in EXPERT_KEYS if t.get(k)), 0)


def split_counts(cfg: dict) -> dict[str, int]:
    """What tensor parallelism splits across ranks and each rank must get a whole number of."""
    t = _text(cfg)
    heads = int(t["num_attention_heads"])
    counts = {"attention heads": heads, "kv heads": int(t.get("num_key_value_heads") or heads)}
    if num_experts(cfg):
        counts["experts"] = num_experts(cfg)
    return counts


def check_tp_divides(cfg: dict, tp_size: int, param: str, where: str = "") -> None:
    bad = {k: n for k, n in split_counts(cfg).items() if n % tp_size}
    if bad:
        what = ", ".join(f"{n} {k}" for k, n in bad.items())
        ok = [d for d in range(1, 65) if all(n % d == 0 for n in split_counts(cfg).values())]
        raise ConfigError(f"{param}={tp_size} does not divide the target's {what}{' (' + where + ')' if where else ''}"
                          f": each rank must hold whole heads and experts; tp sizes that divide them all: {ok}")


def _layer_kinds(t: dict) -> list[bool]:
    """Per decoder layer: True = MoE MLP."""
    n = int(t["num_hidden_layers"])
    experts = next((int(t[k]) for k in EXPERT_KEYS if t.get(k)), 0)
    if not experts:
        return [False] * n
    first_dense = int(t.get("first_k_dense_replace") or 0)  # DeepSeek-V3, GLM-4.5
    freq = int(t.get("moe_layer_freq") or t.get("decoder_sparse_step") or 1)  # DeepSeek / Qwen-MoE
    dense_only = set(t.get("mlp_only_layers") or [])
    return [i >= first_dense and i not in dense_only and (i - first_dense) % freq == 0 for i in range(n)]


def _attention_params(t: dict) -> int:
    H, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
    if t.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3)
        rope, nope = int(t["qk_rope_head_dim"]), int(t["qk_nope_head_dim"])
        v, kv_lora, q_lora = int(t["v_head_dim"]), int(t["kv_lora_rank"]), int(t.get("q_lora_rank") or 0)
        q = H * q_lora + q_lora * heads * (nope + rope) if q_lora else H * heads * (nope + rope)
        return q + H * (kv_lora + rope) + kv_lora * heads * (nope + v) + heads * v * H
    hd = int(t.get("head_dim") or H // heads)
    kv = int(t.get("num_key_value_heads") or heads)
    return H * heads * hd * 2 + H * kv * hd * 2


@dataclass(frozen=True)
class WeightEstimate:
    tp_size: int
    total_params: int
    total_bytes: int
    per_gpu_bytes: int
    quantized: str | None  # "fp8" for a block-wise FP8 checkpoint

    def to_dict(self) -> dict:
        return asdict(self)


def weight_estimate(cfg: dict, tp_size: int = 1, dtype: str | None = None) -> WeightEstimate:
    """Weight bytes of the whole target and of one of `tp_size` ranks. `dtype`: the compute dtype the run loads
    non-quantized weights in (None = the checkpoint's torch_dtype/dtype, else bfloat16)."""
    t = _text(cfg)
    H, vocab = int(t["hidden_size"]), int(t["vocab_size"])
    ckpt = str(cfg.get("torch_dtype") or cfg.get("dtype") or t.get("torch_dtype") or "bfloat16")
    wbytes = DTYPE_BYTES.get(dtype or ckpt, 2)
    q = cfg.get("quantization_config") or {}
    fp8 = fp8_checkpoint(cfg)
    block = q.get("weight_block_size") or [128, 128]
    lin_bytes = (1 + 4 / (block[0] * block[1])) if fp8 else wbytes  # 1 byte + one fp32 scale a block
    inter = int(t.get("intermediate_size") or 4 * H)
    moe_inter = int(t.get("moe_intermediate_size") or inter)
    experts = num_experts(cfg)
    shared = int(t.get("n_shared_experts") or 0) + (1 if t.get("shared_expert_intermediate_size") else 0)
    shared_inter = int(t.get("shared_expert_intermediate_size") or moe_inter)
    attn = _attention_params(t)
    sharded = 0  # linear params split across ranks
    replicated = 2 * H * int(t["num_hidden_layers"]) + H  # the layers' norms and the final norm
    for moe in _layer_kinds(t):
        sharded += attn
        if moe:
            sharded += experts * 3 * H * moe_inter + shared * 3 * H * shared_inter
            replicated += H * experts  # router
        else:
            sharded += 3 * H * inter
    embed = vocab * H
    tied = bool(cfg.get("tie_word_embeddings", t.get("tie_word_embeddings", False)))
    head = 0 if tied else vocab * H
    total_params = sharded + replicated + embed + head
    total = int(sharded * lin_bytes + (replicated + embed + head) * wbytes)
    per_gpu = int(sharded * lin_bytes / tp_size + (replicated + embed) * wbytes + head * wbytes / tp_size)
    return WeightEstimate(tp_size, total_params, total, per_gpu, "fp8" if fp8 else None)


def smallest_fitting_tp(cfg: dict, free_bytes: int, headroom: float = 0.8, max_tp: int = 64,
                        dtype: str | None = None) -> int | None:
    """The smallest tp_size that divides heads/kv heads/experts and whose weights fit headroom x free_bytes."""
    for tp in range(1, max_tp + 1):
        if all(n % tp == 0 for n in split_counts(cfg).values()) and \
                weight_estimate(cfg, tp, dtype).per_gpu_bytes <= headroom * free_bytes:
            return tp
    return None


def check_fits(cfg: dict, tp_size: int, free_bytes: int, param: str, headroom: float = 0.8,
               dtype: str | None = None, gpus: int | None = None) -> WeightEstimate:
    """ConfigError naming `param` when tp_size does not divide the model or its weights do not fit one GPU's
    free memory (with the tp_size that would fit). `gpus`: how many the worker has (None = not checked)."""
    check_tp_divides(cfg, tp_size, param)
    est = weight_estimate(cfg, tp_size, dtype)
    if est.per_gpu_bytes > headroom * free_bytes:
        best = smallest_fitting_tp(cfg, free_bytes, headroom, dtype=dtype)
        hint = (f"the smallest tp_size that fits is {param}={best}" if best
                else "no tp_size up to 64 fits one node: the target needs several nodes (docs/operations.md)")
        if best and gpus is not None and best > gpus:
            hint += f", more than the {gpus} GPUs of this worker (docs/operations.md: a target larger than a node)"
        raise ConfigError(f"{param}={tp_size}: the target's weights need about {est.per_gpu_bytes / 2**30:.1f} GiB "
                          f"per GPU ({est.total_bytes / 2**30:.1f} GiB in all, {est.total_params / 1e9:.1f}B params"
                          f"{', fp8' if est.quantized else ''}), more than {headroom:.0%} of the "
                          f"{free_bytes / 2**30:.1f} GiB free per GPU; {hint}")
    return est


# Bytes of one stored value per storage dtype
STORAGE_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


def bytes_per_token(num_capture_layers: int, hidden_size: int, storage_dtype: str) -> int:
    """Bytes one token takes in a chunk: its states (the capture layers and the final state), its int32 id and
    uint8 loss mask, and with fp8 storage one fp32 scale per state. Preflight's disk check, merge's estimate
    and the extractor's chunk sizing all use this."""
    # "auto": an estimate made before the run (preflight, merge) counts the GPU run's storage, fp8; the CPU demo
    # stores float32
    storage_dtype = stored_dtype(storage_dtype, "auto")
    states = num_capture_layers + 1
    scales = 4 * states if storage_dtype == "float8_e4m3fn" else 0
    return states * hidden_size * STORAGE_ITEMSIZE[storage_dtype] + 5 + scales
