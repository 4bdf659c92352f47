"""How the extractor runs a target with routed experts, chosen from the model's config: the experts kernel
(transformers' `experts_implementation`) and what is compiled (`compile_scope`). Dense targets are unchanged.

Defaults per target class (eagle3.flops.target_class): CLASS_DEFAULTS. Both MoE rows run the project's fused
experts kernels (eagle3.extract.fused_moe), each decoder layer compiled: on the whole extractor, side by side with
transformers' grouped_mm path in one process (one H100, 2026-12-05, docs/benchmarks.md "MoE targets"), 1.29x wall /
1.24x steady at the random Qwen3-30B-A3B shape and 1.47x / 1.26x at the DeepSeek-V3 shape. `auto_experts` keeps
them to where they run compiled and falls back to grouped_mm elsewhere. The other values are levers
`bench/extract_bench.py --variants` compares side by side on the device (docs/device-runs.md).
"""

from __future__ import annotations

import sys

import torch

from eagle3.errors import ConfigError
from eagle3.extract import fused_moe
from eagle3.flops import target_class

# transformers' experts kernels that need nothing beyond torch (deepgemm and sonicmoe fetch kernels from the hub),
# and the project's own two fused Triton kernels (eagle3.extract.fused_moe)
EXPERTS_CHOICES = ("auto", "eager", "batched_mm", "grouped_mm", "triton_fused")
# layers: each decoder layer (and the final norm) compiled, one graph for all; moe-blocks: only the MoE blocks
# (router, routed and shared experts), attention and dense layers eager
COMPILE_SCOPES = ("auto", "layers", "moe-blocks")
# compile_mode: max-autotune-no-cudagraphs ran the Qwen3-30B-A3B shape 1.07x wall / 1.06x steady over the default
# mode on a 2e6-token shard (one H100, 2026-12-05, docs/benchmarks.md); not measured on the other classes
AUTOTUNE = "max-autotune-no-cudagraphs"
CLASS_DEFAULTS = {
    "dense": {"experts_implementation": None, "compile_scope": "layers", "compile_mode": "default"},
    "moe": {"experts_implementation": fused_moe.NAME, "compile_scope": "layers", "compile_mode": AUTOTUNE},
    "mla": {"experts_implementation": None, "compile_scope": "layers", "compile_mode": "default"},  # as dense
    "moe-mla": {"experts_implementation": fused_moe.NAME, "compile_scope": "layers", "compile_mode": "default"},
}
FALLBACK_EXPERTS = "grouped_mm"  # where the fused kernels cannot run compiled (auto_experts)
# experts_kernel: the fused kernels' bf16/fp16 GEMMs (fused_moe.KERNELS); auto = "tma_w" on Hopper, 1.13x / 1.11x
# the tiles kernels on the whole experts step at the Qwen3-30B-A3B / DeepSeek-V3 widths (H100, 2026-12-06)
EXPERTS_KERNELS = ("auto", *fused_moe.KERNELS)
AUTO_EXPERTS_KERNEL = "tma_w"
KERNEL_PARAM = "extract param experts_kernel"


def model_class(model) -> str:
    return target_class(model.config.get_text_config().to_dict())


def class_default(cls: str, knob: str, value: str) -> str:
    """What `knob`="auto" runs for a target of class `cls` (CLASS_DEFAULTS); other values as they are."""
    return CLASS_DEFAULTS[cls][knob] if value == "auto" else value


def class_compile_mode(model_config: dict, compile_mode: str) -> str:
    """What compile_mode="auto" runs for a target of this config (its class's default); other values as they are."""
    return class_default(target_class(model_config), "compile_mode", compile_mode)


def resolve(model, experts: str, compile_scope: str, compile_mode: str = "auto") -> dict:
    """The class of `model` and the values its "auto"s take: {"class", "experts_implementation", "compile_scope",
    "compile_mode"}. Experts in float8 (an FP8 checkpoint's) take the fused kernels, which read them without a hub
    kernel."""
    cls = model_class(model)
    d = CLASS_DEFAULTS[cls]
    if experts != "auto" and d["experts_implementation"] is None:
        raise ConfigError(f"extract param experts_implementation={experts!r}: the target is {cls}, it has no routed "
                          f"experts; use 'auto'")
    modules = experts_modules(model)
    device = modules[0].gate_up_proj.device if modules else None
    auto = auto_experts(d["experts_implementation"], modules, device)
    return {"class": cls, "experts_implementation": auto if experts == "auto" else experts,
            "compile_scope": class_default(cls, "compile_scope", compile_scope),
            "compile_mode": class_default(cls, "compile_mode", compile_mode)}


def auto_experts(default: str | None, modules: list, device: torch.device | None) -> str | None:
    """What "auto" runs: the class default where the project's fused kernels run compiled (a GPU, triton there,
    a layout they read), else transformers' grouped_mm (on the CPU Triton interprets the kernels: many times
    slower). Experts in float8 (an FP8 checkpoint's) take the fused kernels anywhere: transformers' FP8 kernels
    come from the hub, the project's do not."""
    if default is None or not modules:
        return default
    if getattr(getattr(modules[0], "gate_up_proj", None), "dtype", None) == torch.float8_e4m3fn:
        return fused_moe.NAME
    if default == fused_moe.NAME and not (device is not None and device.type == "cuda" and fused_moe.reads(modules)):
        return FALLBACK_EXPERTS
    return default


def resolve_experts_kernel(modules: list, experts: str | None, kernel: str) -> str | None:
    """What experts_kernel=`kernel` runs on these experts modules under experts_implementation `experts`: None where
    the fused kernels do not run; "tiles" for FP8 weights, for "auto" off Hopper (the CPU included: its interpreter
    runs the TMA kernels, only when asked) and where the TMA kernels cannot tile the widths; else the TMA kernels
    ("auto": AUTO_EXPERTS_KERNEL). ConfigError, naming the param, for an unknown value, or TMA asked of a GPU below
    sm_90."""
    if kernel not in EXPERTS_KERNELS:
        raise ConfigError(f"{KERNEL_PARAM}={kernel!r}: use one of {list(EXPERTS_KERNELS)}")
    if experts != fused_moe.NAME or not modules:
        return None
    w = modules[0].gate_up_proj
    if kernel == "tiles" or w.dtype == torch.float8_e4m3fn:
        return "tiles"
    if w.device.type == "cuda" and (capability := torch.cuda.get_device_capability(w.device)) < (9, 0):
        if kernel == "auto":
            return "tiles"
        major, minor = capability
        raise ConfigError(f"{KERNEL_PARAM}={kernel!r}: the TMA kernels need a Hopper GPU or newer (compute "
                          f"capability 9.0), {w.device} is {major}.{minor}; use 'auto' or 'tiles'")
    if kernel == "auto" and w.device.type != "cuda":
        return "tiles"
    try:
        from eagle3.extract import fused_moe_tma
    except ImportError as e:  # a triton without tensor descriptors
        if kernel == "auto":
            return "tiles"
        raise ConfigError(f"{KERNEL_PARAM}={kernel!r}: the TMA kernels do not load ({e}); use 'tiles'") from e
    on_gpu = w.device.type == "cuda"
    if not all(fused_moe_tma.runs(torch.empty(1, m.gate_up_proj.shape[-1], dtype=m.gate_up_proj.dtype,
                                              device="meta"), m.gate_up_proj, m.down_proj, on_gpu=on_gpu)
               for m in modules):
        return "tiles"  # (fused_experts would fall back call by call)
    return AUTO_EXPERTS_KERNEL if kernel == "auto" else kernel


def apply_experts_kernel(model, experts: str | None, kernel: str, planned_tokens: int = 0) -> str | None:
    """Resolve experts_kernel (`resolve_experts_kernel`) and set it on each experts module, where
    fused_moe.experts_forward reads it, with the tokens of the run's planned batch (fused_moe.block_m_for); what
    runs (None: no fused experts)."""
    modules = experts_modules(model) if experts == fused_moe.NAME else []
    resolved = resolve_experts_kernel(modules, experts, kernel)
    for module in modules:
        setattr(module, fused_moe.KERNEL_ATTR, resolved)
        setattr(module, fused_moe.PLANNED_TOKENS_ATTR, planned_tokens)
    return resolved


def apply_experts_implementation(model, name: str | None) -> str | None:
    """Switch the model's experts kernel (a no-op for dense targets or when it already runs `name`), and its
    softmax top-k routers to the fused router's kernel with the fused experts, back to transformers' code else.
    Returns the router that runs: fused_router.NAME where it took some over, None for the model's own."""
    if name is None:
        return None
    router = None
    if name == fused_moe.NAME:
        from eagle3.extract import fused_router

        router = fused_router.NAME if fused_router.apply(model) else None
    elif "eagle3.extract.fused_router" in sys.modules:  # (not imported: no router was taken over)
        sys.modules["eagle3.extract.fused_router"].restore(model)
    if getattr(model.config, "_experts_implementation", None) == name:
        return router
    if name == fused_moe.NAME:
        fused_moe.register(experts_modules(model))
    try:
        model.set_experts_implementation(name)
    except (ValueError, ImportError, RuntimeError) as e:
        raise ConfigError(f"extract param experts_implementation={name!r}: transformers refuses it for "
                          f"{type(model).__name__}: {e}") from e
    return router


def experts_modules(model) -> list:
    """The routed experts' modules (transformers' experts interface: gate_up_proj, down_proj, ...)."""
    return [block.experts for block in moe_blocks(model.get_decoder().layers)]


def moe_blocks(layers) -> list:
    """The MLP modules of the layers that route to experts (they hold an `experts` submodule)."""
    return [layer.mlp for layer in layers if hasattr(getattr(layer, "mlp", None), "experts")]


def compile_targets(base, scope: str) -> list:
    """The modules whose forward is compiled for `scope`."""
    if scope == "layers":
        return [*base.layers, base.norm]
    if scope == "moe-blocks":
        blocks = moe_blocks(base.layers)
        if not blocks:
            raise ConfigError("extract param compile_scope='moe-blocks': the target has no MoE block; use 'layers'")
        return blocks
    raise ConfigError(f"extract param compile_scope={scope!r}: use one of {list(COMPILE_SCOPES)}")
