"""MoE and MLA targets in the extractor, on the CPU: the FLOP count of a token (by hand and by torch's flop
counter), the experts kernel and compile scope chosen from the model's config, the states they capture against
`output_hidden_states`, resume byte-identical, and the per-worker compile cache across processes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from eagle3.errors import ConfigError
from eagle3.extract import moe
from eagle3.extract.config import COMPILE_SCOPES, EXPERTS_CHOICES, EXPERTS_KERNEL_CHOICES, ExtractConfig
from eagle3.extract.format import ShardManifest
from eagle3.extract.reader import HiddenStateReader
from eagle3.extract.run import extract_shard
from eagle3.faults import ENV_VAR as FAULT_ENV, InjectedFault
from eagle3.flops import active_linear_params, attention_dims, routed_expert_params, sample_flops, target_class
from tests.support.configs import phase
from tests.support.reference import reference_states
from tests.support.synthetic import one_shard_of_random_samples
from tests.support.tiny_targets import _COMMON, CAPTURE, TARGETS, build_tiny_target

ROOT = Path(__file__).resolve().parents[1]
MOE_TYPES = ["qwen3_moe", "deepseek_v3"]
LENGTHS = [90, 70, 120, 60, 100, 80, 110]  # budget 256: 2-3 samples a batch, a batch a chunk


def tiny_config(model_type: str) -> dict:
    return {**_COMMON, **TARGETS[model_type][1], "model_type": model_type}


def test_active_flops_of_a_token_match_a_hand_count():
    # DeepSeek-V3 tiny: hidden 64, 5 layers (the first dense), 4 heads, MLA q_lora 32, kv_lora 16, nope 16,
    # rope 8, v 16; 4 experts of width 32, top 2, one shared expert; dense width 128
    mla_attention = (64 * 32 + 32 * 4 * (16 + 8)  # q_a, q_b
                     + 64 * (16 + 8) + 16 * 4 * (16 + 16)  # kv_a (latent + shared rope key), kv_b (k_nope, v per head)
                     + 4 * 16 * 64)  # o
    assert mla_attention == 12800
    dense_mlp = 3 * 64 * 128
    moe_mlp = 64 * 4 + 2 * 3 * 64 * 32 + 3 * 64 * 32  # router, 2 routed experts, the shared expert
    ds = tiny_config("deepseek_v3")
    assert active_linear_params(ds) == 5 * mla_attention + dense_mlp + 4 * moe_mlp == 163328
    assert routed_expert_params(ds) == 4 * 2 * 3 * 64 * 32
    # causal attention over 10 tokens: contexts 1..10, 2 x heads x (qk 24 + v 16) a context position, 5 layers
    assert sample_flops(ds, 10) == 2 * 163328 * 10 + 5 * 2 * 4 * (24 + 16) * 55
    # Qwen3-MoE tiny: GQA 4 heads / 2 kv heads of head_dim 16 on hidden 64, every layer MoE (4 experts, top 2)
    qw = tiny_config("qwen3_moe")
    gqa = 64 * 4 * 16 * 2 + 64 * 2 * 16 * 2  # q, o; k, v
    assert active_linear_params(qw) == 5 * (gqa + 64 * 4 + 2 * 3 * 64 * 32)
    assert sample_flops(qw, 3) == 2 * active_linear_params(qw) * 3 + 5 * 2 * 4 * 32 * 6
    assert [target_class(c) for c in (tiny_config("llama"), qw, ds)] == ["dense", "moe", "moe-mla"]


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_flop_formula_matches_torchs_flop_counter(model_type):
    """Every matmul of the decoder layers, counted by torch as it runs (eager experts: each expert multiplies
    only the tokens routed to it): from two lengths, the part linear in the tokens equals 2 x active linear
    params a token; the quadratic part is attention's scores and values, which torch counts unmasked (n x n,
    where the causal formula has n(n+1)/2), or not at all where its SDPA op has no flop formula."""
    import transformers
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    cls_name, fields = TARGETS[model_type]
    config = getattr(transformers, cls_name)(**{**_COMMON, **fields})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.set_experts_implementation("eager")

    def layer_flops(n):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model.model(input_ids=torch.randint(3, 1000, (1, n)), use_cache=False)
        counts = counter.get_flop_counts()
        layers = [k for k in counts if k.split(".")[-2:-1] == ["layers"]]
        assert len(layers) == _COMMON["num_hidden_layers"]
        return sum(counts[k][op] for k in layers for op in counts[k])

    n = 12
    c1, c2 = layer_flops(n), layer_flops(2 * n)  # c = a n + b n^2
    a, b = (4 * c1 - c2) / (2 * n), (c2 - 2 * c1) / (2 * n * n)
    assert a == 2 * active_linear_params(tiny_config(model_type))
    heads, qk, v = attention_dims(tiny_config(model_type))
    assert b in (0, _COMMON["num_hidden_layers"] * 2 * heads * (qk + v))


@pytest.fixture(scope="module")
def targets(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("moe-targets")
    return {t: build_tiny_target(t, root / t, smollm2_path) for t in [*MOE_TYPES, "llama"]}


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    return one_shard_of_random_samples(tmp_path_factory.mktemp("merge"), LENGTHS, rows_per_file=4)


def run(target, out, spec, **kw):
    # 4 x 64 fp32 values a token, chunk_mb 0.02: ~20 tokens, so every batch is a chunk (resume has a middle)
    cfg = phase(ExtractConfig, **{"model_path": str(target), "extract_dir": str(out), "capture_layers": CAPTURE,
                                  "device": "cpu", "dtype": "float32", "token_budget": 256, "chunk_mb": 0.02,
                                  "writer_threads": 2, **kw})
    return extract_shard(cfg, spec)


def chunk_bytes(shard_dir: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(shard_dir.glob("chunk-*.safetensors"))}


def cut_after(shard_dir: Path, m: ShardManifest, k: int) -> None:
    """Leave shard_dir as a run killed after committing k chunks would: m (edited or not) saved with those only."""
    for c in m.chunks[k:]:
        (shard_dir / c.file).unlink()
    m.chunks, m.complete = m.chunks[:k], False
    m.save(shard_dir)


def assert_states_equal_reference(model, shard_dir, samples, atol):
    got = {s.row: s for s in HiddenStateReader([shard_dir], verify=True)}
    assert sorted(got) == list(range(len(samples)))
    for row, ids in enumerate(samples):
        aux, final = reference_states(model, ids, CAPTURE)
        torch.testing.assert_close(got[row].aux_hidden, aux, rtol=1e-4, atol=atol)
        torch.testing.assert_close(got[row].final_hidden, final, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("experts", ["auto", "eager", "batched_mm", "triton_fused"])
@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_moe_states_equal_output_hidden_states_per_experts_kernel(model_type, experts, targets, merged, tmp_path):
    """Batched with padding through each experts kernel (auto = the class default, grouped_mm; triton_fused in
    Triton's interpreter), the states equal a plain one-sample forward's; the kernel is a state param of the
    shard."""
    if experts == "triton_fused":
        pytest.importorskip("triton")
    from eagle3.models import load_model

    spec, samples = merged
    out = run(targets[model_type], tmp_path, spec, experts_implementation=experts)
    assert out["complete"] and out["tokens"] == sum(LENGTHS)
    m = ShardManifest.load(Path(out["shard_dir"]))
    assert m.params["states"]["experts_implementation"] == experts and len(m.chunks) >= 3
    assert_states_equal_reference(load_model(targets[model_type]), Path(out["shard_dir"]), samples, atol=1e-4)
    with pytest.raises(ConfigError, match="experts_implementation='auto'" if experts != "auto" else
                       "experts_implementation='eager'"):  # a resume may not switch the kernel
        run(targets[model_type], tmp_path, spec, experts_implementation="eager" if experts == "auto" else "auto")


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_moe_shard_killed_mid_shard_resumes_byte_identical(model_type, targets, merged, tmp_path, monkeypatch):
    spec, _ = merged
    whole = run(targets[model_type], tmp_path / "whole", spec)
    monkeypatch.setenv(FAULT_ENV, f"shard=0,after_chunks=2,once_file={tmp_path / 'once'}")
    with pytest.raises(InjectedFault):
        run(targets[model_type], tmp_path / "cut", spec)
    resumed = run(targets[model_type], tmp_path / "cut", spec)
    assert resumed["resumed_from_chunk"] == 2 and resumed["complete"]
    assert chunk_bytes(Path(resumed["shard_dir"])) == chunk_bytes(Path(whole["shard_dir"]))


def test_resume_refuses_auto_running_other_kernels(targets, merged, tmp_path, monkeypatch):
    """"auto" resolves per version and device: chunks record the kernel it ran, a resume where it would run
    another is refused naming the value, and that explicit value resumes byte-identical."""
    spec, _ = merged
    whole = run(targets["qwen3_moe"], tmp_path / "whole", spec)
    monkeypatch.setenv(FAULT_ENV, f"shard=0,after_chunks=2,once_file={tmp_path / 'once'}")
    with pytest.raises(InjectedFault):
        run(targets["qwen3_moe"], tmp_path / "cut", spec)
    shard = tmp_path / "cut" / "shard-00000"
    assert ShardManifest.load(shard).params["kernels"] == {"experts_implementation": "grouped_mm", "router": None,
                                                           "fp8_linear": None, "experts_kernel": None,
                                                           "mla_joins": None}  # the CPU's fallback; no MLA
    monkeypatch.setattr(moe, "FALLBACK_EXPERTS", "batched_mm")  # as another version's default would
    with pytest.raises(ConfigError, match="2 chunks were extracted with experts_implementation running "
                                          "'grouped_mm'.*re-run with experts_implementation='grouped_mm'"):
        run(targets["qwen3_moe"], tmp_path / "cut", spec)
    resumed = run(targets["qwen3_moe"], tmp_path / "cut", spec, experts_implementation="grouped_mm")
    assert resumed["resumed_from_chunk"] == 2 and resumed["complete"]
    assert chunk_bytes(shard) == chunk_bytes(Path(whole["shard_dir"]))
    m = ShardManifest.load(shard)
    assert m.params["states"]["experts_implementation"] == "auto"  # pinned, not switched
    assert m.fingerprint == ShardManifest.load(Path(whole["shard_dir"])).fingerprint


def test_class_defaults_and_refusals(targets):
    from eagle3.models import load_model

    assert EXPERTS_CHOICES == moe.EXPERTS_CHOICES and COMPILE_SCOPES == moe.COMPILE_SCOPES
    assert EXPERTS_KERNEL_CHOICES == moe.EXPERTS_KERNELS
    ds, llama = load_model(targets["deepseek_v3"]), load_model(targets["llama"])
    assert moe.resolve(ds, "auto", "auto") == {"class": "moe-mla", "experts_implementation": "grouped_mm",
                                               "compile_scope": "layers", "compile_mode": "default"}
    assert moe.resolve(llama, "auto", "auto") == {"class": "dense", "experts_implementation": None,
                                                  "compile_scope": "layers", "compile_mode": "default"}
    assert len(moe.compile_targets(ds.model, "moe-blocks")) == 4  # the first layer is dense
    # a class whose default is the fused kernels runs them on a GPU where they read the layout, else grouped_mm
    experts, cuda = moe.experts_modules(ds), torch.device("cuda")
    assert moe.CLASS_DEFAULTS["moe"]["experts_implementation"] == "triton_fused"
    assert moe.CLASS_DEFAULTS["moe-mla"]["experts_implementation"] == "triton_fused"
    assert moe.auto_experts("triton_fused", experts, cuda) == "triton_fused"
    assert moe.auto_experts("triton_fused", experts, torch.device("cpu")) == "grouped_mm"
    experts[0].has_bias = True
    assert moe.auto_experts("triton_fused", experts, cuda) == "grouped_mm"
    with pytest.raises(ConfigError, match="experts_implementation='eager': the target is dense"):
        moe.resolve(llama, "eager", "auto")
    with pytest.raises(ConfigError, match="compile_scope='moe-blocks': the target has no MoE block"):
        moe.compile_targets(llama.model, "moe-blocks")


@pytest.mark.slow
@pytest.mark.parametrize("scope, experts", [("layers", "auto"), ("moe-blocks", "auto"), ("layers", "triton_fused")])
def test_compiled_moe_states_equal_output_hidden_states(scope, experts, targets, merged, tmp_path, monkeypatch):
    """The MoE default's path on the CPU: compiled (each layer, or only the MoE blocks) with grouped_mm; and the
    fused Triton kernels as a custom op inside the compiled layers."""
    from eagle3.models import load_model

    if experts == "triton_fused":
        pytest.importorskip("triton")
    monkeypatch.setenv("EAGLE3_COMPILE_CACHE", str(tmp_path / "cache"))
    torch._dynamo.reset()
    spec, samples = merged
    out = run(targets["qwen3_moe"], tmp_path, spec, compile=True, compile_scope=scope, experts_implementation=experts)
    assert out["complete"]
    assert_states_equal_reference(load_model(targets["qwen3_moe"]), Path(out["shard_dir"]), samples, atol=5e-4)


def test_padded_v_sdpa_equals_transformers_sdpa_for_narrower_v():
    """MLA's shapes (q/k head dim 24, v 16): v zero-padded then sliced back gives transformers' sdpa output, and
    runs under a pinned flash kernel, which refuses the unequal dims."""
    from types import SimpleNamespace

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from eagle3.extract.attention import padded_v_sdpa_forward

    module = SimpleNamespace(is_causal=True, num_key_value_groups=1)
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 37, 24), torch.randn(2, 4, 37, 24), torch.randn(2, 4, 37, 16)
    for dtype, atol in [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]:
        args = (module, q.to(dtype), k.to(dtype), v.to(dtype), None)
        want, _ = sdpa_attention_forward(*args, scaling=0.3)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            got, _ = padded_v_sdpa_forward(*args, scaling=0.3)
            with pytest.raises(RuntimeError, match="No available kernel"):
                sdpa_attention_forward(*args, scaling=0.3)
        assert got.shape == want.shape == (2, 37, 4, 16)
        torch.testing.assert_close(got, want, rtol=1e-2, atol=atol)


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_flash_on_the_mla_target_states_equal_output_hidden_states(compile, targets, merged, tmp_path, monkeypatch):
    """attention="flash" on DeepSeek-V3 (q/k head dim 24, v 16): torch's flash kernel needs one head dim, so the
    model runs the padded-v attention; eager and compiled, the states equal a plain one-sample forward's."""
    from eagle3.models import load_model

    monkeypatch.setenv("EAGLE3_COMPILE_CACHE", str(tmp_path / "cache"))
    torch._dynamo.reset()
    spec, samples = merged
    out = run(targets["deepseek_v3"], tmp_path, spec, attention="flash", compile=compile)
    assert out["complete"]
    assert_states_equal_reference(load_model(targets["deepseek_v3"]), Path(out["shard_dir"]), samples, atol=5e-4)


def test_flash_switches_only_targets_with_narrower_v(targets):
    """A dense target keeps transformers' sdpa under flash; the MLA target runs the padded-v attention under flash
    only, and a preloaded model goes back to sdpa for another kernel (the benchmark reuses its models)."""
    from eagle3.extract.attention import PADDED_V_SDPA
    from eagle3.extract.backend import HFBackend
    from eagle3.models import load_model

    llama = HFBackend(attention="flash")
    llama.load(str(targets["llama"]), "float32", "cpu", CAPTURE)
    assert llama.attn_implementation == llama.model.config._attn_implementation == "sdpa"
    ds = load_model(targets["deepseek_v3"])
    for attention, want in [("auto", "sdpa"), ("flash", PADDED_V_SDPA), ("math", "sdpa")]:
        backend = HFBackend(model=ds, attention=attention)
        backend.load(str(targets["deepseek_v3"]), "float32", "cpu", CAPTURE)
        assert backend.attn_implementation == ds.config._attn_implementation == want, attention
        backend.capture(torch.randint(3, 1000, (2, 9)))


def test_compile_mode_choices_are_the_backends_and_a_bad_one_is_refused(targets, tmp_path):
    from eagle3.extract.backend import COMPILE_MODES as BACKEND_COMPILE_MODES
    from eagle3.extract.config import COMPILE_MODES

    assert COMPILE_MODES == BACKEND_COMPILE_MODES
    with pytest.raises(ConfigError, match="compile_mode"):
        phase(ExtractConfig, model_path=str(targets["qwen3_moe"]), extract_dir=str(tmp_path), capture_layers=CAPTURE,
              compile_mode="max-autotune")


def test_compile_mode_auto_is_the_target_class_default(targets, tmp_path):
    """compile_mode="auto" resolves before the manifest records it: max-autotune-no-cudagraphs for an MoE target
    that is compiled (1.06x steady on the Qwen3-30B-A3B shape), "default" for dense and MoE-MLA targets and
    wherever nothing is compiled; a named mode stays as named. The hf backend resolves it alike at load."""
    from eagle3.extract.backend import HFBackend
    from eagle3.extract.extractor import resolve_compile_mode

    def mode(target, **kw):
        cfg = phase(ExtractConfig, model_path=str(targets[target]), extract_dir=str(tmp_path), capture_layers=CAPTURE,
                    device="cpu", **kw)
        return resolve_compile_mode(cfg).compile_mode

    assert mode("qwen3_moe", compile=True) == moe.AUTOTUNE
    assert mode("qwen3_moe", compile=False) == mode("llama", compile=True) == "default"
    assert mode("deepseek_v3", compile=True) == "default"  # not measured there
    assert mode("qwen3_moe", compile=True, compile_mode="default") == "default"
    backend = HFBackend(compile=False)
    backend.load(str(targets["qwen3_moe"]), "float32", "cpu", CAPTURE)
    assert backend.resolved["compile_mode"] == moe.AUTOTUNE


@pytest.mark.slow
def test_max_autotune_compiled_moe_states_equal_output_hidden_states(targets, merged, tmp_path, monkeypatch):
    """compile_mode reaches torch.compile (Inductor's max_autotune on in each compiled layer's config); the
    states equal a plain forward's (on the CPU, with dynamic shapes, Inductor keeps aten's GEMMs: the GEMM
    templates it would time are the GPU's); a resume with the other mode is refused, naming the param."""
    from eagle3.extract import backend as backend_module
    from eagle3.models import load_model

    compiled, compile_for = [], backend_module.compile_for

    def recording_compile_for(fn, attention, mode="default"):
        compiled.append((mode, compile_for(fn, attention, mode)))
        return compiled[-1][1]

    monkeypatch.setattr(backend_module, "compile_for", recording_compile_for)
    monkeypatch.setenv("EAGLE3_COMPILE_CACHE", str(tmp_path / "cache"))
    torch._dynamo.reset()
    spec, samples = merged
    out = run(targets["qwen3_moe"], tmp_path, spec, compile=True, compile_mode="max-autotune-no-cudagraphs")
    assert out["complete"]
    assert ShardManifest.load(Path(out["shard_dir"])).params["states"]["compile_mode"] == "max-autotune-no-cudagraphs"
    assert compiled and all(mode == "max-autotune-no-cudagraphs" and fn.get_compiler_config()["max_autotune"]
                            for mode, fn in compiled)
    assert_states_equal_reference(load_model(targets["qwen3_moe"]), Path(out["shard_dir"]), samples, atol=5e-4)
    with pytest.raises(ConfigError, match="compile_mode='max-autotune-no-cudagraphs'"):
        run(targets["qwen3_moe"], tmp_path, spec, compile=True, compile_mode="default")


def test_shard_from_before_the_added_state_params_resumes_with_their_old_values(targets, merged, tmp_path):
    """A shard cut mid-way whose manifest records none of experts_implementation, compile_mode, fp8_linear,
    experts_kernel and mla_joins (written before they existed) resumes with auto, default, auto, auto and auto,
    byte-identical; another value is refused, naming the param."""
    spec, _ = merged
    whole = run(targets["qwen3_moe"], tmp_path / "whole", spec)
    cut = run(targets["qwen3_moe"], tmp_path / "cut", spec)
    shard_dir = Path(cut["shard_dir"])
    m = ShardManifest.load(shard_dir)
    for name in ("experts_implementation", "compile_mode", "fp8_linear", "experts_kernel", "mla_joins"):
        del m.params["states"][name]
    del m.params["kernels"]["experts_kernel"], m.params["kernels"]["mla_joins"]
    cut_after(shard_dir, m, 2)
    with pytest.raises(ConfigError, match="committed with compile_mode='default'"):
        run(targets["qwen3_moe"], tmp_path / "cut", spec, compile_mode="max-autotune-no-cudagraphs")
    resumed = run(targets["qwen3_moe"], tmp_path / "cut", spec)
    assert resumed["resumed_from_chunk"] == 2 and resumed["complete"]
    assert chunk_bytes(shard_dir) == chunk_bytes(Path(whole["shard_dir"]))


class FakeWeight:
    """What experts_kernel's resolution reads of a weight (shape, dtype, device), on a device this machine lacks."""

    def __init__(self, *shape, dtype=torch.bfloat16, device="cuda:0"):
        self.shape, self.dtype, self.device = shape, dtype, torch.device(device)


def fake_experts(hidden: int, width: int, **kw):
    return types.SimpleNamespace(gate_up_proj=FakeWeight(8, 2 * width, hidden, **kw),
                                 down_proj=FakeWeight(8, hidden, width, **kw))


def test_experts_kernel_resolves_per_device_dtype_and_widths(targets, monkeypatch):
    """auto: tma_w on Hopper for bf16/fp16 experts, tiles on older GPUs, on the CPU, for FP8 experts and for widths
    the TMA kernels cannot tile; an explicit TMA kernel runs on the CPU (the interpreter), is refused below sm_90,
    naming the param, and falls back to tiles for FP8 experts; None where the fused experts do not run."""
    pytest.importorskip("triton")
    from eagle3.extract import fused_moe
    from eagle3.models import load_model

    with pytest.raises(ConfigError, match="experts_kernel"):  # the config's own check, naming the param
        phase(ExtractConfig, model_path="m", extract_dir="x", experts_kernel="tma_x")
    resolve, fused = moe.resolve_experts_kernel, fused_moe.NAME
    cpu = moe.experts_modules(load_model(targets["qwen3_moe"]))
    assert [resolve(cpu, fused, k) for k in moe.EXPERTS_KERNELS] == ["tiles", "tiles", "tma", "tma_w"]
    assert resolve(cpu, "grouped_mm", "tma_w") is None and resolve([], fused, "auto") is None
    with pytest.raises(ConfigError, match="extract param experts_kernel='tma_x'"):
        resolve(cpu, fused, "tma_x")
    qwen3, dsv3 = [fake_experts(2048, 768)], [fake_experts(7168, 2048)]  # Qwen3-30B-A3B / DeepSeek-V3 widths
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve(qwen3, fused, "auto") == resolve(dsv3, fused, "auto") == "tma_w"
    assert resolve(qwen3, fused, "tma") == "tma" and resolve(qwen3, fused, "tiles") == "tiles"
    assert resolve([fake_experts(320, 768)], fused, "auto") == "tiles"  # no down tile divides 320
    assert resolve([fake_experts(2048, 768, dtype=torch.float32)], fused, "tma_w") == "tiles"
    assert resolve([fake_experts(2048, 768, dtype=torch.float8_e4m3fn)], fused, "tma_w") == "tiles"  # FP8
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert resolve(qwen3, fused, "auto") == "tiles"
    with pytest.raises(ConfigError, match="extract param experts_kernel='tma_w': the TMA kernels need a Hopper"):
        resolve(qwen3, fused, "tma_w")
    fp8 = load_model(targets["qwen3_moe"])  # float8 experts (widths under one 128 x 128 block: the dtype alone)
    for module in moe.experts_modules(fp8):
        module.gate_up_proj = torch.nn.Parameter(module.gate_up_proj.to(torch.float8_e4m3fn), requires_grad=False)
    assert moe.apply_experts_kernel(fp8, fused, "tma_w") == "tiles"
    assert all(getattr(m, fused_moe.KERNEL_ATTR) == "tiles" for m in moe.experts_modules(fp8))


def test_tma_w_extraction_states_equal_the_reference_and_record_the_kernel(targets, merged, tmp_path, monkeypatch):
    """experts_kernel="tma_w" runs the TMA kernels (in the interpreter) through the whole extractor: the states
    equal output_hidden_states, the manifest records the kernel, and a resume under another is refused. Every
    batch's BLOCK_M is chosen from the planned batch (token_budget x top_k pairs), not from its own tokens (a
    BLOCK_M first met mid-run is autotuned there)."""
    pytest.importorskip("triton")
    from eagle3.extract import fused_moe, fused_moe_tma
    from eagle3.models import load_model

    modes, real = [], fused_moe_tma.expert_pairs
    monkeypatch.setattr(fused_moe_tma, "expert_pairs", lambda *a: modes.append(a[6]) or real(*a))
    pairs, block_m_for = [], fused_moe.block_m_for
    monkeypatch.setattr(fused_moe, "block_m_for", lambda n, *a: pairs.append(n) or block_m_for(n, *a))
    spec, samples = merged
    out = run(targets["qwen3_moe"], tmp_path, spec, experts_implementation="triton_fused", experts_kernel="tma_w")
    m = ShardManifest.load(Path(out["shard_dir"]))
    assert out["complete"] and set(modes) == {"tma_w"} and len(modes) >= len(m.chunks) * 5
    assert len(pairs) == len(modes) and set(pairs) == {256 * TARGETS["qwen3_moe"][1]["num_experts_per_tok"]}
    assert m.params["kernels"]["experts_kernel"] == "tma_w" and m.params["states"]["experts_kernel"] == "tma_w"
    assert_states_equal_reference(load_model(targets["qwen3_moe"]), Path(out["shard_dir"]), samples, atol=1e-4)
    with pytest.raises(ConfigError, match="experts_kernel='tma_w'"):
        run(targets["qwen3_moe"], tmp_path, spec, experts_implementation="triton_fused", experts_kernel="tiles")


def test_shard_that_ran_tiles_before_experts_kernel_is_not_resumed_under_tma(targets, merged, tmp_path,
                                                                              monkeypatch):
    """A shard cut mid-way whose kernel record predates experts_kernel ran the tiles kernels under triton_fused:
    where auto would run tma_w (Hopper), its resume is refused naming experts_kernel='tiles', and that value resumes
    it byte-identical, its fingerprint unchanged."""
    pytest.importorskip("triton")
    spec, _ = merged
    fused = {"experts_implementation": "triton_fused"}
    whole = run(targets["qwen3_moe"], tmp_path / "whole", spec, **fused)
    shard_dir = tmp_path / "cut" / Path(whole["shard_dir"]).name
    shutil.copytree(whole["shard_dir"], shard_dir)
    m = ShardManifest.load(shard_dir)
    assert m.params["kernels"]["experts_kernel"] == "tiles"  # auto on the CPU
    del m.params["states"]["experts_kernel"], m.params["kernels"]["experts_kernel"]
    cut_after(shard_dir, m, 2)
    real = moe.resolve_experts_kernel

    def as_on_hopper(modules, experts, kernel):
        return real(modules, experts, "tma_w" if kernel == "auto" else kernel)

    monkeypatch.setattr(moe, "resolve_experts_kernel", as_on_hopper)
    with pytest.raises(ConfigError, match="2 chunks were extracted with experts_kernel running 'tiles'.*re-run with "
                                          "experts_kernel='tiles'"):
        run(targets["qwen3_moe"], tmp_path / "cut", spec, **fused)
    resumed = run(targets["qwen3_moe"], tmp_path / "cut", spec, experts_kernel="tiles", **fused)
    assert resumed["resumed_from_chunk"] == 2 and resumed["complete"]
    assert chunk_bytes(shard_dir) == chunk_bytes(Path(whole["shard_dir"]))
    m = ShardManifest.load(shard_dir)
    assert "experts_kernel" not in m.params["states"] and m.params["kernels"]["experts_kernel"] == "tiles"
    assert m.fingerprint == ShardManifest.load(Path(whole["shard_dir"])).fingerprint


def test_the_kernel_record_names_the_router_and_a_resume_under_another_is_refused(targets, merged, tmp_path,
                                                                                  monkeypatch):
    """The fused experts bring the fused router, whose ties route apart from torch.topk's: the kernel record names
    it, a resume where the same experts_implementation runs another router (another version) is refused naming
    both, and a record from before the router was named resumes byte-identical."""
    pytest.importorskip("triton")
    from eagle3.extract import fused_router

    spec, _ = merged
    fused = {"experts_implementation": "triton_fused"}
    whole = run(targets["qwen3_moe"], tmp_path / "whole", spec, **fused)
    assert ShardManifest.load(Path(whole["shard_dir"])).params["kernels"]["router"] == fused_router.NAME
    shard_dir = tmp_path / "cut" / Path(whole["shard_dir"]).name
    shutil.copytree(whole["shard_dir"], shard_dir)
    m = ShardManifest.load(shard_dir)
    cut_after(shard_dir, m, 2)
    with monkeypatch.context() as patch:
        patch.setattr(fused_router, "ROUTERS", ())  # a version whose fused experts leave the routers alone
        with pytest.raises(ConfigError, match="2 chunks were extracted with the router running 'softmax_topk', "
                                              "this version runs \"the model's own\""):
            run(targets["qwen3_moe"], tmp_path / "cut", spec, **fused)
    assert ShardManifest.load(shard_dir).chunks == m.chunks  # nothing written is lost
    del m.params["kernels"]["router"]
    m.save(shard_dir)
    resumed = run(targets["qwen3_moe"], tmp_path / "cut", spec, **fused)
    assert resumed["resumed_from_chunk"] == 2 and resumed["complete"]
    assert chunk_bytes(shard_dir) == chunk_bytes(Path(whole["shard_dir"]))
    assert ShardManifest.load(shard_dir).params["kernels"]["router"] == fused_router.NAME


TASK = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    from eagle3.extract.compile_cache import cache_counters
    from eagle3.extract.config import ExtractConfig
    from eagle3.extract.plan import ShardSpec
    from eagle3.extract.run import extract_shard
    from tests.support.configs import phase
    target, out, spec, cache = sys.argv[1:5]
    cfg = phase(ExtractConfig, model_path=target, extract_dir=out, capture_layers=[2, 3, 4], device="cpu",
                dtype="float32", token_budget=256, chunk_mb=1, writer_threads=1, compile=True,
                compile_cache_dir=cache)
    r = extract_shard(cfg, ShardSpec.from_dict(json.loads(spec)))
    print(json.dumps({"wall_s": time.perf_counter() - t0, "complete": r["complete"], **cache_counters()}))
""")


@pytest.mark.slow
def test_second_shard_task_finds_the_workers_compile_cache(targets, merged, tmp_path):
    """Two shard tasks in two fresh processes with the same compile_cache_dir: the first fills the folder, the
    second's compilations are cache hits (FX graph cache) and nothing new is compiled."""
    spec, _ = merged
    cache, runs = tmp_path / "cache", []
    for k in range(2):
        p = subprocess.run([sys.executable, "-c", TASK, str(targets["llama"]), str(tmp_path / f"out{k}"),
                            json.dumps(spec.to_dict()), str(cache)], cwd=ROOT, capture_output=True, text=True,
                           timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        if k == 0:
            files = [f for f in cache.rglob("*") if f.is_file()]
            assert files and any("fxgraph" in str(f) for f in files)
    first, second = runs
    assert first["complete"] and second["complete"]
    assert first["fxgraph_cache_miss"] >= 1 and first["fxgraph_cache_hit"] == 0
    assert second["fxgraph_cache_hit"] >= 1 and second["fxgraph_cache_miss"] == 0, runs


def test_preflight_time_estimate_uses_the_rate_of_the_targets_class(targets, tmp_path):
    from eagle3.extract.rates import H200_SUSTAINED_FLOPS, MEASURED
    from eagle3.fit import load_config
    from eagle3.flops import flops_per_token
    from eagle3.preflight import PreflightConfig, format_report, run_preflight
    from eagle3.sections import TargetConfig

    for model_type, cls, used in [("llama", "dense", "dense"), ("qwen3_moe", "moe", "moe"),
                                  ("deepseek_v3", "moe-mla", "moe-mla")]:
        target = TargetConfig(model_path=str(targets[model_type])).resolved()
        report = run_preflight(PreflightConfig(output_dir=str(tmp_path / model_type), estimated_tokens=10**7,
                                               estimate_mean_length=1024), target, nvidia_smi=None)
        t = report["time"]
        assert (t["class"], t["rate_class"], t["measured"]) == (cls, used, cls == used)
        rate = MEASURED[used]["fraction"] * H200_SUSTAINED_FLOPS / flops_per_token(load_config(target.model_path), 1024)
        assert t["tok_per_s"] == pytest.approx(rate) and t["hours_one_gpu"] == pytest.approx(1e7 / rate / 3600)
        text = format_report(report)
        assert f"{cls} target: {MEASURED[used]['fraction']:.0%} of the roofline, as measured for {used}" in text
        assert ("not measured yet" in text) == (cls != used)
    # an FP8 checkpoint: the MoE classes' at the FP8 forward's measured speedup, a dense one's at the bf16 rate,
    # said so
    from eagle3.extract.rates import MEASURED_FP8, time_estimate

    fp8 = {"quantization_config": {"quant_method": "fp8"}}
    for model_type, cls in [("deepseek_v3", "moe-mla"), ("qwen3_moe", "moe"), ("llama", "dense")]:
        config = load_config(targets[model_type])
        bf16, t = time_estimate(config, 10**7, 1024, 8), time_estimate({**config, **fp8}, 10**7, 1024, 8)
        speedup = MEASURED_FP8[cls]["speedup"] if cls in MEASURED_FP8 else 1.0
        assert t["tok_per_s"] == pytest.approx(bf16["tok_per_s"] * speedup)
        assert t["measured"] == (cls in MEASURED_FP8)
        assert (f"FP8 checkpoint: {speedup:.2f}x that, as measured for {cls}" in t["note"]) == (cls in MEASURED_FP8)
        assert (f"the FP8 forward of {cls} targets is not measured yet" in t["note"]) == (cls not in MEASURED_FP8)
    assert "moe-mla" in MEASURED_FP8 and "moe" in MEASURED_FP8 and "dense" not in MEASURED_FP8
