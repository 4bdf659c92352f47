"""A fused-weight Llama forward for extraction: the same arithmetic as HF's LlamaModel, fewer and larger kernels.

Per decoder layer HF runs q, k and v as three GEMMs and gate and up as two; here each group is one GEMM over
concatenated weights (`w_qkv` [(h + 2 kv) d, H], `w_gate_up` [2 I, H]), and with `compile=True` one compiled
graph (dynamic batch and length) serves every layer, fusing RMSNorm's fp32 upcast, RoPE, SiLU x up and the
residual adds. Attention is SDPA with `is_causal` on a right-padded batch, as in `HFBackend`.

Only plain Llama-family layers (no attention/MLP bias, SiLU): `FusedLlamaBackend.load` refuses anything else by
name. RoPE comes from the HF model's own rotary module, so rope scaling (Llama-3.1) is whatever HF computes.
The captured states equal `output_hidden_states` of a plain HF forward (tests/test_extract_shard.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle3.errors import ConfigError
from eagle3.extract.backend import check_attention, compile_for, load_decoder, pinned_attention
from eagle3.extract.moe import class_default
from eagle3.models import ModelInfo


@dataclass
class FusedLayer:
    ln1: torch.Tensor  # input RMSNorm weight [H]
    w_qkv: torch.Tensor  # [(heads + 2 kv_heads) * head_dim, H]
    w_o: torch.Tensor  # [H, heads * head_dim]
    ln2: torch.Tensor  # post-attention RMSNorm weight [H]
    w_gate_up: torch.Tensor  # [2 I, H]
    w_down: torch.Tensor  # [H, I]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm exactly: normalise in fp32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def decoder_layer(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ln1: torch.Tensor, w_qkv: torch.Tensor,
                  w_o: torch.Tensor, ln2: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  eps: float, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """One Llama decoder layer on x [B, L, H]; cos/sin [B, L, head_dim] from the model's rotary module."""
    B, L, _ = x.shape
    q, k, v = F.linear(rms_norm(x, ln1, eps), w_qkv).split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(B, L, heads, head_dim).transpose(1, 2)
    k = k.view(B, L, kv_heads, head_dim).transpose(1, 2)
    v = v.view(B, L, kv_heads, head_dim).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
    x = x + F.linear(a.transpose(1, 2).reshape(B, L, heads * head_dim), w_o)
    gate, up = F.linear(rms_norm(x, ln2, eps), w_gate_up).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, w_down)


class FusedLlamaBackend:
    """`ExtractionBackend` for Llama-family models with fused q/k/v and gate/up weights (see module doc)."""

    def __init__(self, model=None, info: ModelInfo | None = None, compile: bool = False, attention: str = "auto",
                 compile_mode: str = "auto"):
        self.model = model  # a preloaded *ForCausalLM (the benchmark's random-weight ones); else loaded from the path
        self.info = info
        # compile_mode: a key of backend.COMPILE_MODES; auto = the dense class's (a plain Llama is dense)
        self.compile, self.compile_mode = compile, class_default("dense", "compile_mode", compile_mode)
        self.attention = attention  # SDPA kernel: a key of eagle3.extract.backend.SDPA_KERNELS

    def load(self, model_path: str, dtype: str, device: str, capture_layers: list[int]) -> None:
        check_attention(self.attention, device)
        owned = self.model is None
        load_decoder(self, model_path, dtype, device, capture_layers)
        cfg, base = self.model.config.get_text_config(), self.base
        self._check_supported(cfg, base)
        self.heads, self.kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.eps = float(cfg.rms_norm_eps)
        with torch.no_grad():
            self.layers = [FusedLayer(
                ln1=layer.input_layernorm.weight.detach(),
                w_qkv=torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                 layer.self_attn.v_proj.weight]).detach(),
                w_o=layer.self_attn.o_proj.weight.detach(),
                ln2=layer.post_attention_layernorm.weight.detach(),
                w_gate_up=torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]).detach(),
                w_down=layer.mlp.down_proj.weight.detach()) for layer in base.layers]
        self.embed, self.rotary, self.final_norm = base.embed_tokens, base.rotary_emb, base.norm.weight.detach()
        if owned:  # the unfused copies of q/k/v and gate/up are no longer needed: free their memory
            for layer in base.layers:
                for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                            layer.mlp.gate_proj, layer.mlp.up_proj):
                    lin.weight = None
        self._layer = compile_for(decoder_layer, self.attention, self.compile_mode) if self.compile else decoder_layer

    @staticmethod
    def _check_supported(cfg, base) -> None:
        layer = base.layers[0]
        problems = []
        if not all(hasattr(layer, a) for a in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")):
            problems.append(f"decoder layer type {type(layer).__name__} is not Llama-shaped")
        else:
            if any(getattr(layer.self_attn, p).bias is not None for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
                problems.append("attention projections have biases")
            if not all(hasattr(layer.mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
                problems.append("the MLP is not gate/up/down")
            elif any(getattr(layer.mlp, p).bias is not None for p in ("gate_proj", "up_proj", "down_proj")):
                problems.append("MLP projections have biases")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            problems.append(f"hidden_act is {cfg.hidden_act!r}, not 'silu'")
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            problems.append("sliding-window attention")
        if problems:
            raise ConfigError(f"backend 'fused-llama' cannot run model_type {getattr(cfg, 'model_type', '?')!r}: "
                              + "; ".join(problems) + ". Use backend 'hf'.")

    @torch.inference_mode()
    def capture(self, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        with pinned_attention(self.attention, self.device):
            return self._forward(input_ids)

    def _forward(self, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        B, L = input_ids.shape
        x = self.embed(input_ids)
        positions = torch.arange(L, device=x.device).unsqueeze(0).expand(B, L)
        cos, sin = self.rotary(x, positions)
        wanted, captured = set(self.capture_layers), {}
        if 0 in wanted:
            captured[0] = x
        for i, w in enumerate(self.layers, start=1):
            x = self._layer(x, cos, sin, w.ln1, w.w_qkv, w.w_o, w.ln2, w.w_gate_up, w.w_down,
                            self.eps, self.heads, self.kv_heads, self.head_dim)
            if i in wanted:
                captured[i] = x
        return [captured[i] for i in self.capture_layers], rms_norm(x, self.final_norm, self.eps)

    def close(self) -> None:
        self.layers = []
