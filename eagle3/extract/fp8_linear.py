"""An FP8 checkpoint's linears without the hub's kernels: fp8_linear="triton".

DeepSeek-V3 ships its weights in float8 e4m3 with a float32 scale per 128 x 128 block; transformers loads every
decoder linear as `FP8Linear`, whose forward fetches the `finegrained-fp8` Triton kernels (or DeepGEMM) from the
hub. Where no hub is reachable (the project's GPU workers) that forward fails, so the reference job's target could
not be extracted as shipped (bf16, 1.3 TB, does not fit 8 H200s). Here each such linear runs through the down
kernel of eagle3.extract.fused_moe: a linear is the one-expert case of that GEMM (every row its own pair, in
order, weight 1), so it shares its FP8 path (the input quantized per token and 128 values, amax / 448, as the
checkpoint's dynamic activation scheme; the scales applied per K block), its autotuning and its tests.

fp8_linear="scaled_mm": the same quantized input through torch's block-scaled FP8 GEMM (`F.scaled_mm`, 1 x 128
activation and 128 x 128 weight blocks, cuBLASLt on Hopper): 0.74-1.27 PFLOP/s at DeepSeek-V3's widths on an H100
against the Triton kernel's 0.3-0.6, results 2e-5 apart (bench/kernels_check.py, docs/benchmarks.md, 2026-12-05),
for each linear whose shape cuBLASLt takes without padding (the others run the Triton kernel). "auto" where it
runs: on the whole extractor (random DeepSeek-V3 shape at 4 layers in the checkpoint's blocks, side by side, one
H100, 2026-12-05) 1.35x the Triton linears' steady rate, 1.46x bf16's. The extractor records what ran, so a resume
cannot mix the two.
"""

from __future__ import annotations

import torch

from eagle3.errors import ConfigError
from eagle3.extract.fused_moe import FP8_BLOCK, block_m_for, kernels, quantize_blocks, quantize_groups

NAME = "triton"
SCALED_MM = "scaled_mm"
CHOICES = ("auto", "transformers", NAME, SCALED_MM)  # auto: SCALED_MM where scaled_mm_runs, else NAME (no hub)
PARAM = "extract param fp8_linear"
ROW_MULTIPLE = 16  # fp8_block_scaled_gemm pads T to it


@torch.library.custom_op("eagle3::fp8_block_linear", mutates_args=())
def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (weight * scale).T: weight float8 e4m3 [N, K], scale float32 [ceil(N / 128), K / 128]; the
    GEMM runs in FP8, x quantized per token and 128 values first (`quantize_groups`)."""
    k = weight.shape[1]
    xq, xs = quantize_groups(x.reshape(-1, k))
    return fp8_block_gemm(xq, xs, weight, scale, x.dtype).view(*x.shape[:-1], weight.shape[0])


def fp8_block_gemm(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """[T, N] in `out_dtype` = (xq * xs) @ (weight * scale).T for an input already quantized (xq float8 [T, K], xs
    float32 [T, K / 128]): the fused experts' down kernel with one expert and every row its own pair."""
    (t, k), n = xq.shape, weight.shape[0]
    block_m = block_m_for(t, 1, xq.device)
    capacity = -(-t // block_m) * block_m
    rows = torch.arange(capacity, dtype=torch.int32, device=xq.device).clamp_(max=t)  # t: the padding sentinel
    one_expert = torch.zeros(capacity // block_m, dtype=torch.int32, device=xq.device)
    ones = torch.ones(t, dtype=torch.float32, device=xq.device)
    _, down, tiles = kernels(xq.device, fp8=True)
    w, s = weight.contiguous(), scale.contiguous()
    out = torch.empty(t, n, dtype=out_dtype, device=xq.device)
    down[lambda meta: (-(-n // meta["BLOCK_N"]) * (capacity // block_m),)](
        xq, w, out, rows, one_expert, ones, xs, s, t, 1, capacity // block_m, n, k,
        xq.stride(0), 0, w.stride(0), out.stride(0), xs.stride(0), 0, s.stride(0),
        BLOCK_M=block_m, UPCAST=xq.device.type != "cuda", FP8=True, **tiles(n, k))
    return out


@fp8_block_linear.register_fake
def _(x, weight, scale):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("eagle3::fp8_block_scaled_mm", mutates_args=())
def fp8_block_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`fp8_block_linear` through torch's block-scaled FP8 GEMM (`fp8_block_scaled_gemm`)."""
    k = weight.shape[1]
    xq, xs = quantize_groups(x.reshape(-1, k))
    return fp8_block_scaled_gemm(xq, xs, weight, scale, x.dtype).view(*x.shape[:-1], weight.shape[0])


def fp8_block_scaled_gemm(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                          out_dtype: torch.dtype) -> torch.Tensor:
    """`fp8_block_gemm`'s product through torch's block-scaled FP8 GEMM, the scales outer-dim-major as cuBLASLt
    reads them ([T, K / 128] column-major, the weight's [K / 128, N / 128] its transpose). T is padded to a
    multiple of 16 with zero rows: cuBLASLt refuses a column-major scale whose leading dimension (T) is not 16-byte
    aligned (CUBLAS_STATUS_NOT_SUPPORTED at 16,377 rows on an H100, 2026-12-05), and the extractor's batches
    hold any number of tokens."""
    from torch.nn.functional import ScalingType, scaled_mm

    t = xq.shape[0]
    if t % ROW_MULTIPLE:
        pad = ROW_MULTIPLE - t % ROW_MULTIPLE
        xq, xs = torch.nn.functional.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(xq.dtype), \
            torch.nn.functional.pad(xs, (0, 0, 0, pad))
    out = scaled_mm(xq, weight.t(), xs.t().contiguous().t(), ScalingType.BlockWise1x128, scale.contiguous().t(),
                    ScalingType.BlockWise128x128, output_dtype=out_dtype)
    return out[:t]


@fp8_block_scaled_mm.register_fake
def _(x, weight, scale):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def scaled_mm_runs(device: torch.device) -> bool:
    """torch's block-scaled FP8 GEMM is there: a Hopper GPU (cuBLASLt's 128 x 128 block scales are sm90's) and a
    torch that exposes it (2.10+)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    try:
        from torch.nn.functional import ScalingType, scaled_mm  # noqa: F401
    except ImportError:
        return False
    return True


def scaled_mm_takes(module) -> bool:
    """cuBLASLt's shape rules for this linear, met without padding: N and K multiples of 16, and the weight's K
    blocks a multiple of 4 (some torch versions pad the scale's K blocks to 4; DeepSeek-V3's are 56, 12, 128, 4)."""
    return module.out_features % 16 == 0 and (module.in_features // FP8_BLOCK) % 4 == 0


def fp8_linears(model) -> dict:
    """{name: module} of transformers' FP8Linear modules holding float8 weights (an FP8 checkpoint's, or
    `quantize_linears`')."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    return {name: m for name, m in model.named_modules()
            if isinstance(m, FP8Linear) and m.weight.dtype == torch.float8_e4m3fn}


def check_linear(name: str, module) -> None:
    """The layout the kernel reads: 128 x 128 blocks with float32 scales, dynamic activations, whole K blocks."""
    checks = {"128 x 128 weight blocks": tuple(module.block_size or ()) == (FP8_BLOCK, FP8_BLOCK),
              "float32 scales (not ue8m0)": module.weight_scale_inv.dtype == torch.float32,
              "dynamic activation scales": module.activation_scheme == "dynamic",
              f"in_features a multiple of {FP8_BLOCK}": module.in_features % FP8_BLOCK == 0}
    missing = [k for k, ok in checks.items() if not ok]
    if missing:
        raise ConfigError(f"{PARAM}={NAME!r}: {name} lacks what the kernel reads: {', '.join(missing)}; "
                          f"use 'transformers' (its kernels come from the hub)")


class TritonFP8Linear(torch.nn.Module):
    """Mixed into an FP8Linear's class (`apply`): its forward runs `fp8_block_linear`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = fp8_block_linear(input, self.weight, self.weight_scale_inv)
        return out if self.bias is None else out + self.bias


class ScaledMMFP8Linear(TritonFP8Linear):
    """Mixed in where torch's block-scaled GEMM takes the linear: its forward runs `fp8_block_scaled_mm`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = fp8_block_scaled_mm(input, self.weight, self.weight_scale_inv)
        return out if self.bias is None else out + self.bias


def apply(model, choice: str) -> str | None:
    """Run the model's FP8 linears through `choice` ("auto": SCALED_MM where it runs, else NAME); None when it has
    none. Reversible: a model set to NAME and then to "transformers" runs transformers' forward again."""
    if choice not in CHOICES:
        raise ConfigError(f"{PARAM}={choice!r}: use one of {list(CHOICES)}")
    modules = fp8_linears(model)
    if not modules:
        return None
    device = next(iter(modules.values())).weight.device
    name = choice if choice != "auto" else SCALED_MM if scaled_mm_runs(device) else NAME
    if name == SCALED_MM and not scaled_mm_runs(device):
        raise ConfigError(f"{PARAM}={name!r}: torch's block-scaled FP8 GEMM runs on a Hopper GPU with torch 2.10+, "
                          f"not on {device}; use 'auto' or {NAME!r}")
    if name != "transformers":
        for path, module in modules.items():
            check_linear(path, module)
        kernels(torch.device("cpu"), fp8=True)  # triton is there (it quantizes the input for both)
    for module in modules.values():
        base = _transformers_class(module)
        mixin = ScaledMMFP8Linear if name == SCALED_MM and scaled_mm_takes(module) else TritonFP8Linear
        module.__class__ = base if name == "transformers" else _mixed_class(mixin, base)
    return name


def _transformers_class(module) -> type:
    cls = type(module)
    return cls.__bases__[1] if issubclass(cls, TritonFP8Linear) else cls


_CLASSES: dict[tuple[type, type], type] = {}


def _mixed_class(mixin: type, base: type) -> type:
    if (mixin, base) not in _CLASSES:
        _CLASSES[mixin, base] = type(f"{mixin.__name__[:-len('FP8Linear')]}{base.__name__}", (mixin, base), {})
    return _CLASSES[mixin, base]


def quantize_linears(model) -> int:
    """The decoder's linear weights to float8 in 128 x 128 blocks, in place, as FP8Linear modules: the layout
    DeepSeek-V3's FP8 checkpoint loads as (FP8 on load of a bf16 target; for the benchmark and the tests). Linears
    whose in_features is not whole blocks stay as they are. Returns how many were converted."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    converted = 0
    for parent in list(model.get_decoder().layers.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or child.in_features % FP8_BLOCK:
                continue
            with torch.device("meta"):
                fp8 = FP8Linear(child.in_features, child.out_features, block_size=(FP8_BLOCK, FP8_BLOCK),
                                has_bias=child.bias is not None)
            q, scale = quantize_weight(child.weight.detach())
            fp8.weight = torch.nn.Parameter(q, requires_grad=False)
            fp8.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
            if child.bias is not None:
                fp8.bias = torch.nn.Parameter(child.bias.detach(), requires_grad=False)
            setattr(parent, child_name, fp8)
            converted += 1
    return converted


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_q float8_e4m3fn [N, K], scale float32 [ceil(N / 128), K / 128]): a linear's weight in 128 x 128 blocks,
    the last row block partial where N is (as a checkpoint stores MLA's 576 rows)."""
    pad = -w.shape[0] % FP8_BLOCK
    q, scale = quantize_blocks((torch.cat([w, w.new_zeros(pad, w.shape[1])]) if pad else w)[None])
    return q[0, :w.shape[0]], scale[0]
