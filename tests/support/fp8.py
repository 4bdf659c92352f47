"""The definitions the FP8 kernels are tested against: DeepSeek-V3's dynamic activation quantization (each row's
groups of 128 values scaled by amax / 448, as transformers' act_quant does it in torch) and dequantization."""

from __future__ import annotations

import torch

GROUP, FP8_MAX = 128, 448.0


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q float8_e4m3fn [R, K], scale float32 [R, K / 128]) in torch's ops."""
    r, k = x.shape
    groups = x.float().view(r, k // GROUP, GROUP)
    scale = groups.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    return (groups / scale[..., None]).to(torch.float8_e4m3fn).view(r, k), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 values of float8 rows [R, K] with scales per 128 values of a row (activations: [R, K / 128]) or per
    128 x 128 block (weights: [ceil(R / 128), K / 128])."""
    r, k = q.shape
    per_row = scale if scale.shape[0] == r else scale.repeat_interleave(GROUP, 0)[:r]
    return (q.double().view(r, k // GROUP, GROUP) * per_row.double()[..., None]).view(r, k)
