"""The extraction phase's params, each declared once (eagle3.knobs); torch-free, so the DAG and the run config
import it without torch. What depends on the device (auto device, dtype, compile) is resolved on the torch side
(eagle3.extract.extractor.resolve_for_device).

The params fall in three kinds, which decide what a resumed shard may change (eagle3.extract.extractor):
- STATE_PARAMS define the stored states: with chunks committed, another value is refused, naming the param;
- PLAN_PARAMS only cut the work into batches and chunks: a resume keeps the committed chunks and plans the rest
  with the new values (recorded in the shard manifest);
- the rest are runtime-only and recorded in no fingerprint.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from eagle3.errors import ConfigError
from eagle3.identity import model_identity
from eagle3.knobs import check_knobs, knob, knob_meta, param_label
from eagle3.sections import DTYPE_CHOICES, TargetConfig

SECTION = "Extraction"
FP8 = "float8_e4m3fn"  # storage: e4m3 values with one fp32 scale per token and layer
STORAGE_DTYPE_CHOICES = (*DTYPE_CHOICES, FP8)
BACKEND_CHOICES = ("hf", "fused-llama")
ATTENTION_CHOICES = ("auto", "flash", "cudnn", "efficient", "math")
# (the choices are eagle3.extract.moe's, repeated here to keep this module torch-free; a test holds them equal)
EXPERTS_CHOICES = ("auto", "eager", "batched_mm", "grouped_mm", "triton_fused")
COMPILE_SCOPES = ("auto", "layers", "moe-blocks")
COMPILE_MODES = ("auto", "default", "max-autotune-no-cudagraphs")  # eagle3.extract.backend's (a test holds them equal)
FP8_LINEAR_CHOICES = ("auto", "transformers", "triton", "scaled_mm")  # = eagle3.extract.fp8_linear.CHOICES (tested)
EXPERTS_KERNEL_CHOICES = ("auto", "tiles", "tma", "tma_w")  # = eagle3.extract.moe.EXPERTS_KERNELS (tested)
MLA_JOINS_CHOICES = ("auto", "heads-major", "token-major", "in-place")  # = eagle3.extract.mla.CHOICES (tested)
STATE_PARAMS = ("model_path", "capture_layers", "dtype", "storage_dtype", "backend", "attention",
                "experts_implementation", "compile_mode", "fp8_linear", "experts_kernel", "mla_joins")
# state params added after shards were extracted without them: what those shards ran with (an FP8 checkpoint's
# linears ran transformers' hub kernels before fp8_linear; a shard of one that resumes offline needs "auto" anyway;
# the fused experts ran the tiles kernels under "auto" before experts_kernel: the extractor reads that from the
# manifest's kernel record, eagle3.extract.extractor.kernels_ran)
ADDED_STATE_PARAMS = {"experts_implementation": "auto", "compile_mode": "default", "fp8_linear": "auto",
                      "experts_kernel": "auto", "mla_joins": "auto"}
PLAN_PARAMS = ("token_budget", "chunk_mb", "pad_multiple")
# a number or "auto", resolved where the task runs (eagle3.extract.extractor.resolve_for_device)
DEVICE_AUTO_PARAMS = PLAN_PARAMS
# {param: (on a GPU, on the CPU)}. A GPU: big forwards, few large chunk files (docs/benchmarks.md). The CPU: a
# small model's demo, whose shards of ~8 answers then hold 3-4 chunks each instead of one, so a resume shows
AUTO_PLAN = {"token_budget": (16384, 256), "chunk_mb": (1024, 1)}


def stored_dtype(storage_dtype: str, compute_dtype: str) -> str:
    """The dtype the states are stored in: storage_dtype, or for "auto" fp8 where the target computes in 16 bits
    (a GPU run; "auto" compute, an estimate made before the run, counts as one) and the compute dtype else (the CPU's
    float32: exact states for the demo and the tests). fp8 halves the disk and trains drafters as good as bf16 does
    (MT-bench tau 3.21 both on 14K first turns, H100 2026-12-06, docs/benchmarks.md)."""
    if storage_dtype != "auto":
        return storage_dtype
    return FP8 if compute_dtype in ("auto", "bfloat16", "float16") else compute_dtype


@dataclass
class ExtractConfig:
    target: TargetConfig = knob(help="The run's target section (model_path, capture_layers, tp_size, dtype), "
                                     "resolved by preflight: capture_layers is a list of ints here.")
    extract_dir: str = knob(help="The folder that holds one shard-<k> folder per shard.")
    device: str = knob("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
                       help="auto = cuda if available, else cpu.")
    storage_dtype: str = knob(
        "auto", choices=STORAGE_DTYPE_CHOICES, param="storage_dtype", section=SECTION,
        help="Dtype of the stored states; float8_e4m3fn = fp8 with one scale per token and layer (half the bytes "
             "of bfloat16); auto = float8_e4m3fn where the target computes in bfloat16/float16 (a GPU run), else "
             "the compute dtype (float32 on the CPU).")
    token_budget: int | str = knob(
        "auto", min=256, pattern=r"^(auto|[0-9]+)$", param="token_budget", section=SECTION,
        help="Padded tokens per forward pass; auto = 16384 on a GPU, 256 on the CPU (whose kernels gain nothing "
             "from a larger batch, only its padding). Lower it after an out-of-memory error.")
    chunk_mb: float | str = knob(
        "auto", gt=0, pattern=r"^(auto|[0-9]*\.?[0-9]+)$", param="chunk_mb", section=SECTION,
        help="Target size of a chunk file in MiB (the unit of commit and resume); auto = 1024 on a GPU, 1 on the "
             "CPU (a few chunks a shard, so a failed shard resumes mid-way). A chunk holds whole batches: below one "
             "batch's states (token_budget tokens), each batch is still one chunk.")
    # GPU runs pin writer_threads + 1 chunk buffers of chunk_mb each (made while the model loads: HostBufferPool);
    # 6 was best of 3/6 on the H200's disk (docs/benchmarks.md)
    writer_threads: int = knob(6, min=1, max=64, help="Chunks written at once (while one fsyncs, others write).")
    verify_existing: bool = knob(False, help="Re-hash committed chunks on a resume or a finished re-run.")
    log_every_s: float = knob(10.0, gt=0, help="Seconds between progress lines (one is logged at every commit too).")
    memory_headroom: float = knob(0.9, gt=0, max=1, help="The largest planned batch's estimated memory must fit "
                                                         "this fraction of the free memory.")
    # auto = on a GPU (1.3-1.5x on the H200, docs/benchmarks.md; the first batch pays 13-25 s of compilation)
    compile: bool | str = knob("auto", help="torch.compile each decoder layer: true, false or auto (on on a GPU).")
    backend: str = knob("hf", choices=BACKEND_CHOICES, param="extract_backend", section=SECTION,
                        help="hf: HF transformers modules; fused-llama: fused q/k/v and gate/up GEMMs (Llama family).")
    attention: str = knob("auto", choices=ATTENTION_CHOICES, param="extract_attention", section=SECTION,
                          help="SDPA kernel of the forward: auto (torch picks), flash, cudnn, efficient, math. "
                               "flash needs one head dim for q, k and v; on MLA targets (DeepSeek-V3), whose v "
                               "heads are narrower, v is zero-padded to q's width (eagle3.extract.attention).")
    # MoE targets only (eagle3.extract.moe.CLASS_DEFAULTS: auto = the default of the target's class)
    experts_implementation: str = knob(
        "auto", choices=EXPERTS_CHOICES, param="extract_experts_implementation", section=SECTION,
        help="MoE targets: transformers' experts kernel (eager, batched_mm, grouped_mm) or the project's fused "
             "Triton kernels (triton_fused: needs triton); auto = the measured default of the target's class.")
    compile_scope: str = knob("auto", choices=COMPILE_SCOPES,
                              help="What is compiled: layers (each decoder layer), moe-blocks (only the MoE "
                                   "blocks); auto = the default of the target's class.")
    # a state param: the GEMM kernels it picks sum in another order
    compile_mode: str = knob("auto", choices=COMPILE_MODES,
                             help="torch.compile's mode: default, or max-autotune-no-cudagraphs (Inductor times its "
                                  "Triton GEMM templates, on Hopper a TMA grouped GEMM for MoE experts, against "
                                  "cuBLAS and aten's _grouped_mm, shape by shape; longer compiles); auto = the "
                                  "default of the target's class (max-autotune-no-cudagraphs for MoE targets, "
                                  "default elsewhere and where nothing is compiled).")
    # a state param: the two kernels quantize the activations alike but sum in another order
    fp8_linear: str = knob("auto", choices=FP8_LINEAR_CHOICES,
                           help="FP8 checkpoints (128 x 128 blocks, as DeepSeek-V3 ships): the linears' kernel. "
                                "triton: the project's (eagle3.extract.fp8_linear, no hub); scaled_mm: torch's "
                                "block-scaled FP8 GEMM (Hopper); transformers: its finegrained-fp8 or DeepGEMM "
                                "kernels, fetched from the hub; auto = scaled_mm where it runs, else triton.")
    # a state param: the kernels sum in another order (eagle3.extract.fused_moe_tma)
    experts_kernel: str = knob("auto", choices=EXPERTS_KERNEL_CHOICES,
                               help="experts_implementation triton_fused only: the structure of the bf16/fp16 "
                                    "experts GEMMs. tiles: one program a tile, A's rows gathered by pointer loads "
                                    "(eagle3.extract.fused_moe_kernels); tma: A gathered once into a sorted "
                                    "buffer, A and W through TMA on a persistent grid; tma_w: W through TMA, A "
                                    "pointer-gathered (eagle3.extract.fused_moe_tma; Hopper, or the CPU's "
                                    "interpreter); auto = tma_w on Hopper (1.11-1.13x tiles on the whole experts "
                                    "step, H100, 2026-12-06), tiles elsewhere. FP8 experts, and widths TMA cannot "
                                    "tile, run tiles.")
    # a state param: Inductor may fuse the rope into the join otherwise in the other layout (a rounding apart)
    mla_joins: str = knob("auto", choices=MLA_JOINS_CHOICES,
                          help="MLA targets (DeepSeek-V3, Kimi-K2): the layout their attention joins queries and "
                               "keys in. heads-major: transformers' forward; token-major: the projections' order, "
                               "handed to the attention as transposed views; in-place: no joins, q roped in its "
                               "rows and k's rope written into a gap of kv_b's re-laid rows (a plain, unsharded "
                               "bf16/fp16/fp32 kv_b_proj) (eagle3.extract.mla; token-major and in-place: sdpa and "
                               "eager attention only); auto = heads-major.")
    compile_cache_dir: str = knob("auto", help="torch's compile caches, shared by the shard tasks of a worker: auto "
                                               "= $EAGLE3_COMPILE_CACHE or ~/.cache/eagle3/compile/<host>; off = "
                                               "torch's default; else a folder (eagle3.extract.compile_cache).")
    # cuDNN attention builds a host-side plan per new (rows, length), ~40-60 ms on the H200, which at the 135M
    # shape made a run over new shapes 2.8x slower than over known ones (docs/benchmarks.md, run 9)
    # tp_size is the target's (TargetConfig.tp_size): rank 0 alone captures and writes (the residual stream is
    # replicated), so chunks, manifest and resume are unchanged
    rank_timeout_s: float = knob(600.0, gt=0, help="tp_size > 1: a collective that waits longer fails the shard "
                                                   "(a rank that died or hangs), and every rank is stopped.")
    pad_multiple: str | int = knob(
        "auto", min=1, pattern=r"^(auto|[1-9][0-9]*)$", param="extract_pad_multiple", section=SECTION,
        help="Right-pad each batch to a multiple of this many tokens (a bounded set of shapes); auto = 1 on the "
             "CPU, on a GPU up to 64 with padding under 1/16 of the length.")

    def __post_init__(self):
        check_knobs(self, "extract")
        check_patterns(self, "extract")
        for name in DEVICE_AUTO_PARAMS:  # the pattern lets the form's number-as-text through; the config has numbers
            value = getattr(self, name)
            if isinstance(value, str) and value != "auto":
                raise ConfigError(f"{param_label('extract', field_of(self, name))} must be a number or 'auto', "
                                  f"got {value!r}")
        if isinstance(self.compile, str) and self.compile != "auto":
            raise ConfigError(f"{param_label('extract', field_of(self, 'compile'))} must be true, false or 'auto', "
                              f"got {self.compile!r}")

    def state_params(self) -> dict:
        """The values that define the stored states (after resolve_for_device: no "auto" left in them)."""
        t = self.target
        # the target by content (eagle3.identity): a model folder copied elsewhere is the same model
        shared = {"model_path": model_identity(t.model_path), "capture_layers": t.capture_layers, "dtype": t.dtype}
        return {k: shared[k] if k in shared else getattr(self, k) for k in STATE_PARAMS}


def field_of(cfg, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cfg) if f.name == name)


def check_patterns(cfg, where: str) -> None:
    """A string knob with a `pattern` must match it (check_knobs checks types, bounds and choices)."""
    for f in dataclasses.fields(cfg):
        meta, value = knob_meta(f), getattr(cfg, f.name)
        if meta and meta["pattern"] and isinstance(value, str) and not re.fullmatch(meta["pattern"], value):
            raise ConfigError(f"{param_label(where, f)} must match {meta['pattern']}, got {value!r}")


@dataclass
class ShardPlanConfig:
    merge_dir: str = knob(help="The merged dataset (eagle3.merge.dataset) to split into shards.")
    num_shards: int = knob(2, min=1, max=4096, param="num_shards", section=SECTION,
                           help="Extraction tasks (shards of about equal tokens); one GPU each at a time.")

    def __post_init__(self):
        check_knobs(self, "plan_shards")
