"""Extraction backends: run the target's forward pass and hand back the captured hidden states.

A backend owns the model and one forward pass; the extractor (eagle3.extract.extractor) owns
batching, copies, files and resume. Another engine (e.g. SGLang's model runner) plugs in by
implementing `ExtractionBackend`.

Layer numbering: capture index i is HF `hidden_states[i]`: 0 = the embeddings, i >= 1 = the
output of decoder layer i-1. The final state is the last hidden state after the final norm
(the lm_head input); the lm_head itself is never run.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from eagle3.errors import ConfigError
from eagle3.extract import fp8_linear, mla, moe
from eagle3.extract.attention import apply_attention, rows_not_packed
from eagle3.models import ModelInfo, model_info

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
GPU_DTYPES = ("bfloat16", "float16")
CPU_DTYPES = ("float32", "bfloat16")
# SDPA kernels a run can pin (`attention`); "auto" leaves the choice to torch, call by call. Which is fastest
# depends on the GPU and the torch/cuDNN build (the H200 figures: docs/benchmarks.md).
SDPA_KERNELS = {"auto": None, "flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
CUDA_ONLY_KERNELS = ("cudnn", "efficient")
# torch.compile's modes a run can choose (`compile_mode`); max-autotune-no-cudagraphs times Inductor's Triton GEMM
# templates (on Hopper its TMA grouped GEMM for the MoE experts) against cuBLAS / aten's _grouped_mm per shape;
# auto = the target class's (eagle3.extract.moe.CLASS_DEFAULTS), resolved at load
COMPILE_MODES = ("auto", "default", "max-autotune-no-cudagraphs")


def check_dtype(dtype: str, device: str) -> torch.dtype:
    allowed = GPU_DTYPES if device.startswith("cuda") else CPU_DTYPES
    if dtype not in allowed:
        raise ConfigError(f"dtype={dtype!r} is not supported on {device}: use one of {list(allowed)}")
    return DTYPES[dtype]


def check_attention(attention: str, device: str) -> None:
    if attention not in SDPA_KERNELS:
        raise ConfigError(f"attention={attention!r}: use one of {list(SDPA_KERNELS)}")
    if attention in CUDA_ONLY_KERNELS and not str(device).startswith("cuda"):
        raise ConfigError(f"attention={attention!r} needs a CUDA device, the run is on {device}: use 'auto'")


def sdpa_context(attention: str):
    """The context a forward runs in so that every SDPA call uses the `attention` kernel. torch.compile picks
    the kernel while tracing, so the first (tracing) call must run inside it too, as `capture` does."""
    if SDPA_KERNELS[attention] is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, SDPA_KERNELS[attention])])


@contextlib.contextmanager
def pinned_attention(attention: str, device):
    """`sdpa_context`, with torch's "no available kernel" turned into an error that names the param."""
    try:
        with sdpa_context(attention):
            yield
    except RuntimeError as e:
        if attention != "auto" and "no available kernel" in str(e).lower():
            raise ConfigError(f"attention={attention!r}: torch has no {attention} SDPA kernel for this model's "
                              f"attention on {device} ({str(e).splitlines()[0]}); use attention='auto'") from e
        raise


def compile_for(fn, attention: str, mode: str = "default"):
    """torch.compile with dynamic shapes, for a forward run under `attention`, in Inductor's `mode` (COMPILE_MODES).
    torch's compile caches (Inductor's FX graph cache, the AOTAutograd cache, on disk across processes) key a graph
    without the SDPA kernel it was traced under (pytorch/pytorch#185449): a pinned kernel can be handed a graph
    traced for another (seen on the H200: attention="cudnn" ran FlashAttention after a flash run had filled the
    cache) and leaves its own graph for later runs of other kernels. So a pinned kernel compiles without them
    (every task traces afresh); "auto" keeps them."""
    if mode not in COMPILE_MODES[1:]:
        raise ConfigError(f"extract param compile_mode={mode!r}: use one of {list(COMPILE_MODES[1:])}")
    # torch.compile takes a mode or options, not both: the mode as the options it stands for
    from torch._inductor import list_mode_options

    options = dict(list_mode_options(mode))
    if attention != "auto":
        options["fx_graph_cache"] = False  # the AOTAutograd cache needs it too
    return torch.compile(fn, dynamic=True, options=options or None)


class ExtractionBackend(Protocol):
    hidden_size: int
    num_layers: int
    device: torch.device
    dtype: torch.dtype

    def load(self, model_path: str, dtype: str, device: str, capture_layers: list[int]) -> None:
        """Load the model and prepare to capture `capture_layers` (HF hidden_states indices)."""

    def capture(self, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Forward a right-padded [B, L] batch on the device; return ([B, L, H] per capture layer, final [B, L, H])."""


def on_device(have: torch.device, want: str) -> bool:
    """Is a tensor on `have` already on `want` ("cuda" means any index, as .to("cuda") would keep it)?"""
    want = torch.device(want)
    return have.type == want.type and want.index in (None, have.index)


def load_decoder(backend, model_path: str, dtype: str, device: str, capture_layers: list[int],
                 tp_plan: str | None = None) -> None:
    """The setup every HF-weights backend shares: load `backend.model` (unless preloaded) on `device` in `dtype`,
    find its decoder, and check the capture layers against it. Sets backend.model/.info/.base/.num_layers/
    .hidden_size/.capture_layers/.device/.dtype. `tp_plan` ("auto"): transformers' tensor parallelism over the
    default process group, each rank on its LOCAL_RANK device (eagle3.extract.tp)."""
    torch_dtype = check_dtype(dtype, device)
    if backend.model is None:
        from transformers import AutoModelForCausalLM

        from eagle3.fit import check_fp8_device, fp8_checkpoint, load_config

        backend.info = model_info(model_path)
        config = load_config(model_path)
        check_fp8_device(config, device, model_path)
        if fp8_checkpoint(config) and not tp_plan:  # the FP8 quantizer places the weights itself
            backend.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch_dtype, device_map=device)
        elif tp_plan:
            backend.model = AutoModelForCausalLM.from_pretrained(
                str(model_path), dtype=torch_dtype, distributed_config=distributed_config(model_path, tp_plan))
        else:
            backend.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch_dtype).to(device)
    elif not on_device(next(backend.model.parameters()).device, device) or backend.model.dtype != torch_dtype:
        # (a model already in place is left alone: torchao's quantized weights need not support .to)
        backend.model = backend.model.to(device=device, dtype=torch_dtype)
    backend.model.eval()
    model = backend.model
    backend.base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    backend.num_layers = len(backend.base.layers)
    backend.hidden_size = int(model.config.get_text_config().hidden_size)
    # the run's capture layers were checked against config.json by preflight (TargetConfig.resolved); a model
    # given in memory (the benchmark, tests) is checked here, where its layers are known
    bad = [i for i in capture_layers if not 1 <= i < backend.num_layers]
    if bad:
        raise ConfigError(f"capture layers {bad} do not exist: the model has {backend.num_layers} decoder layers, "
                          f"so capture layers must be in 1..{backend.num_layers - 1}")
    backend.capture_layers = list(capture_layers)
    backend.device = next(model.parameters()).device
    backend.dtype = torch_dtype


def distributed_config(model_path: str, tp_plan: str):
    """transformers' tensor parallelism over the default process group; a MoE target's experts spread over the
    ranks (expert parallelism) rather than each expert split."""
    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    from eagle3.fit import load_config, num_experts

    moe = bool(num_experts(load_config(model_path)))
    n = dist.get_world_size()
    return DistributedConfig(tp_size=n, tp_plan=tp_plan, **({"ep_size": n} if moe else {}))


class HFBackend:
    """HF transformers causal LM: hooks on the capture layers only, the base model called without lm_head.

    The batch carries no attention mask: with right padding and causal attention a real token never
    attends to a later pad, so its states equal those of the unpadded sample, and SDPA can take its
    fused causal path.
    """

    def __init__(self, model=None, info: ModelInfo | None = None, compile: bool = False, attention: str = "auto",
                 tp_plan: str | None = None, experts: str = "auto", compile_scope: str = "auto",
                 compile_mode: str = "auto", fp8_linear: str = "auto", experts_kernel: str = "auto",
                 token_budget: int | str = 0, mla_joins: str = "auto"):
        self.model = model  # a preloaded *ForCausalLM (the benchmark builds random-weight ones)
        self.experts, self.compile_scope = experts, compile_scope  # eagle3.extract.moe
        self.experts_kernel = experts_kernel  # the fused experts' GEMMs (eagle3.extract.moe.resolve_experts_kernel)
        # the run's planned batch, which sets the fused experts' BLOCK_M once a run (0 or "auto": each batch's own)
        self.token_budget = token_budget if isinstance(token_budget, int) else 0
        self.fp8_linear = fp8_linear  # an FP8 checkpoint's linears (eagle3.extract.fp8_linear)
        self.mla_joins = mla_joins  # MLA attention's q/k layout (eagle3.extract.mla)
        self.resolved: dict = {}
        self.tp_plan = tp_plan
        self.info = info
        self.compile, self.compile_mode = compile, compile_mode
        self.attention = attention  # SDPA kernel: a key of SDPA_KERNELS
        self.attn_implementation: str | None = None  # transformers' attention function the model runs (load)
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = []

    # -- setup --------------------------------------------------------------------------
    def load(self, model_path: str, dtype: str, device: str, capture_layers: list[int]) -> None:
        check_attention(self.attention, device)
        load_decoder(self, model_path, dtype, device, capture_layers, tp_plan=self.tp_plan)
        self.resolved = moe.resolve(self.model, self.experts, self.compile_scope, self.compile_mode)
        experts = self.resolved["experts_implementation"]
        self.resolved["router"] = moe.apply_experts_implementation(self.model, experts)
        self.resolved["experts_kernel"] = moe.apply_experts_kernel(self.model, experts, self.experts_kernel,
                                                                   self.token_budget)
        self.resolved["fp8_linear"] = fp8_linear.apply(self.model, self.fp8_linear)
        # flash on MLA (v heads narrower than q/k): v zero-padded (eagle3.extract.attention)
        self.attn_implementation = apply_attention(self.model, self.attention)
        self.resolved["mla_joins"] = mla.apply(self.model, self.mla_joins)  # after the attention function is set
        layers = self.base.layers
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._compile(moe.compile_targets(self.base, self.resolved["compile_scope"]) if self.compile else [])
        # hidden_states[i] is the output of layer i-1 (index 0: the embedding output)
        for i in sorted(set(capture_layers)):
            module = self.base.embed_tokens if i == 0 else layers[i - 1]
            self._hooks.append(module.register_forward_hook(self._make_hook(i)))

    def _compile(self, modules) -> None:
        """Regional compilation: each decoder layer's forward (and the final norm), or only the MoE blocks
        (compile_scope), is compiled with dynamic batch and length, fusing the elementwise work eager mode runs
        as separate kernels (RMSNorm's fp32 upcast, RoPE, SiLU x up, residual adds, the routing). The layers
        share one code object, so one graph serves them all; the capture hooks stay outside the compiled region.
        A preloaded model compiled before for another kernel or mode is compiled again from its eager forward
        (compile_for's caches)."""
        for module in self.model.modules():  # compiled before for another scope, or compile is off now
            if "_eagle3_eager_forward" in module.__dict__ and not any(module is m for m in modules):
                module.forward = module.__dict__.pop("_eagle3_eager_forward")
                module._eagle3_compiled = None
        mode = self.resolved["compile_mode"]
        compiled_for = (self.attention, mode)
        for module in modules:
            if getattr(module, "_eagle3_compiled", None) != compiled_for:
                eager = module.__dict__.get("_eagle3_eager_forward", module.forward)
                module._eagle3_eager_forward = eager
                module.forward = compile_for(eager, self.attention, mode)
                module._eagle3_compiled = compiled_for

    def _make_hook(self, index: int):
        def hook(module, args, output):
            self._captured[index] = output[0] if isinstance(output, tuple) else output
        return hook

    # -- forward ------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        self._captured.clear()
        with pinned_attention(self.attention, self.device), rows_not_packed():
            out = self.base(input_ids=input_ids, use_cache=False)
        aux = [self._captured.pop(i) for i in self.capture_layers]
        return aux, out.last_hidden_state

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
