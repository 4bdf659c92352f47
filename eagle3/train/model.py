"""The EAGLE-3 drafter for a Llama-family target, readable top to bottom.

One drafter step at sequence slot t takes
    e_t = embed(x_{t+1})            the target's frozen token embedding of the NEXT token
    g_t = fc(aux_t)                 the 3 captured target layers fused (step 0), or the drafter's
                                    own previous output state (steps >= 1, no fc)
and runs one Llama decoder layer whose attention input is concat(input_layernorm(e_t),
hidden_norm(g_t)) (2H wide), with g_t as the residual stream. The final norm feeds an lm_head over
the draft vocabulary; the pre-norm state is what the next step consumes. This mirrors SGLang's
LlamaForCausalLMEagle3 (python/sglang/srt/models/llama_eagle3.py) so the parameter names here are
the tensor names of the exported checkpoint (SGLang adds its own `model.` prefix when loading).

Attention comes in two shapes:
- `forward_cached`: inference with a growing k/v cache (speculative decoding);
- `ttt_attention`: training-time test, where step k at slot t sees the step-0 keys of slots <= t
  plus the keys of its own steps 1..k at slot t - exactly what inference sees when it drafts k
  tokens after slot t.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    draft_vocab_size: int
    target_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    num_aux_layers: int = 3

    @classmethod
    def from_target(cls, info, draft_vocab_size: int, num_aux_layers: int = 3) -> "DrafterConfig":
        """The drafter takes the target's shapes (eagle3.models.ModelInfo), head_dim included: it need not be
        hidden / heads (Qwen3: 128; a GLM-4.5 shape, 5120 / 96, is not even an integer), and serving engines
        build the draft attention from the exported head_dim. A target with multi-head latent attention has no
        Llama-shaped attention to copy (its head_dim is the rotary part of q/k alone): the drafter then takes
        heads of the value width, hidden / v_head_dim of them, sharing 8 kv heads where that divides (for
        DeepSeek-V3: 56 heads of 128, 8 kv heads, the shape of SpecForge's DeepSeek-V3 drafter)."""
        heads, kv_heads, head_dim = info.num_attention_heads, info.num_key_value_heads, info.head_dim
        if getattr(info, "kv_lora_rank", 0) and getattr(info, "v_head_dim", 0):
            head_dim = info.v_head_dim
            heads = max(1, info.hidden_size // head_dim)
            kv_heads = math.gcd(heads, 8)
        return cls(
            hidden_size=info.hidden_size,
            intermediate_size=info.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            draft_vocab_size=draft_vocab_size,
            target_vocab_size=info.vocab_size,
            rms_norm_eps=info.rms_norm_eps,
            rope_theta=info.rope_theta,
            max_position_embeddings=info.max_position_embeddings,
            num_aux_layers=num_aux_layers,
        )

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama rotary embedding (rotate-half layout) of x [B, heads, T, d] at integer positions [B, T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.to(torch.float32)[:, None, :, None] * inv_freq  # [B, 1, T, d/2]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated = torch.cat([-x2, x1], -1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim, self.theta = cfg.num_attention_heads, cfg.num_key_value_heads, d, cfg.rope_theta
        self.q_proj = nn.Linear(2 * h, self.n_heads * d, bias=False)  # input is concat(embedding, feature)
        self.k_proj = nn.Linear(2 * h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return rope(q, positions, self.theta), rope(k, positions, self.theta), v

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(self.n_heads // self.n_kv, dim=1) if self.n_kv != self.n_heads else t

    def ttt_attention(self, q, keys: list, values: list) -> torch.Tensor:
        """Step k = len(keys)-1 of training-time test. keys[0]/values[0]: step-0 k/v of all slots [B, kv, T, d]
        (causal); keys[j]/values[j], j >= 1: the k/v that steps j made at the SAME slot (a diagonal)."""
        scale = 1.0 / math.sqrt(self.head_dim)
        T = q.shape[2]
        k0, v0 = self.expand_kv(keys[0]), self.expand_kv(values[0])
        s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, h, T, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        s0 = s0.masked_fill(~causal, float("-inf"))
        diag = [((q * self.expand_kv(k)).sum(-1, keepdim=True) * scale) for k in keys[1:]]  # each [B, h, T, 1]
        p = torch.softmax(torch.cat([s0, *diag], -1).float(), dim=-1).to(q.dtype)
        out = p[..., :T] @ v0
        for j, v in enumerate(values[1:]):
            out = out + p[..., T + j: T + j + 1] * self.expand_kv(v)
        return out

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The single decoder layer (SGLang: `midlayer`)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # applied to the token embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # applied to the fused feature
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attn_input(self, embeds, hidden):
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, attn_out, residual):
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.num_aux_layers * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(state))

    def ttt_forward(self, aux: torch.Tensor, embeds_per_step: list, positions: torch.Tensor):
        """Training-time test unrolled len(embeds_per_step) steps over every slot at once.

        aux [B, T, 3H]; embeds_per_step[k] [B, T, H] = embedding of token t+1+k at slot t; positions [B, T] (= t).
        Step k runs at position t+k and feeds on step k-1's output state. Returns the list of logits per step.
        """
        attn = self.midlayer.self_attn
        hidden = self.fc(aux)
        keys, values, all_logits = [], [], []
        for k, embeds in enumerate(embeds_per_step):
            x = self.midlayer.attn_input(embeds, hidden)
            q, kk, vv = attn.qkv(x, positions + k)
            keys.append(kk)
            values.append(vv)
            out = attn.project_out(attn.ttt_attention(q, keys, values))
            hidden = self.midlayer.finish(out, hidden)  # pre-norm state: the next step's input feature
            all_logits.append(self.logits(hidden))
        return all_logits

    def forward(self, aux: torch.Tensor, embeds_per_step: list, positions: torch.Tensor):
        """= ttt_forward: the training call, which DistributedDataParallel wraps (it syncs gradients of forward)."""
        return self.ttt_forward(aux, embeds_per_step, positions)

    @torch.no_grad()
    def forward_cached(self, embeds, hidden, positions, cache: dict, fuse: bool):
        """Inference: new slots [B, S] attend to every cached slot plus the new ones causally.

        cache = {"k": [B, kv, L, d] or None, "v": ...} is extended in place. `fuse` applies fc (real target
        features); draft chain steps pass the previous output state unfused. Returns (logits, state)."""
        attn = self.midlayer.self_attn
        if fuse:
            hidden = self.fc(hidden)
        q, k, v = attn.qkv(self.midlayer.attn_input(embeds, hidden), positions)
        if cache.get("k") is not None:
            k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
        cache["k"], cache["v"] = k, v
        L, S = k.shape[2], q.shape[2]
        mask = torch.ones(S, L, dtype=torch.bool, device=q.device).tril(diagonal=L - S)
        out = F.scaled_dot_product_attention(q, attn.expand_kv(k), attn.expand_kv(v), attn_mask=mask)
        state = self.midlayer.finish(attn.project_out(out), hidden)
        return self.logits(state), state


def crop_cache(cache: dict, length: int) -> None:
    if cache.get("k") is not None:
        cache["k"], cache["v"] = cache["k"][:, :, :length], cache["v"][:, :, :length]


def drafter_matmul_params(cfg: DrafterConfig) -> dict:
    """Weights multiplied per token per step, for FLOP counting (fc runs at step 0 only)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    attn = 2 * h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d + cfg.num_attention_heads * d * h
    return {"fc": cfg.num_aux_layers * h * h, "step": attn + 3 * h * i + h * cfg.draft_vocab_size}
