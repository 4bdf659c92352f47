"""An FP8 checkpoint's linears through the project's kernel (extract fp8_linear="triton"), on the CPU, where it runs
in Triton's interpreter: the GEMM against its definition over the quantized values, a tiny DeepSeek-V3 built as
transformers' FP8 quantizer builds DeepSeek-V3's checkpoint (FP8Linear, FP8Experts) extracted end to end, and the
layouts it refuses."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from eagle3.errors import ConfigError  # noqa: E402
from eagle3.extract import fp8_linear  # noqa: E402
from eagle3.extract.config import FP8_LINEAR_CHOICES, ExtractConfig  # noqa: E402
from eagle3.extract.format import ShardManifest  # noqa: E402
from eagle3.extract.fused_moe import FP8_BLOCK, quantize_blocks  # noqa: E402
from eagle3.extract.reader import HiddenStateReader  # noqa: E402
from eagle3.extract.run import extract_shard  # noqa: E402
from eagle3.faults import ENV_VAR as FAULT_ENV, InjectedFault  # noqa: E402
from tests.support.configs import phase  # noqa: E402
from tests.support.fp8 import dequantize, quantize_groups  # noqa: E402
from tests.support.reference import reference_states  # noqa: E402
from tests.support.synthetic import one_shard_of_random_samples  # noqa: E402

CAPTURE = [1, 2, 3]
LENGTHS = [50, 40, 60, 30, 55, 45, 35]  # budget 256: 2 batches, a batch a chunk (the interpreter's time is dear)
# DeepSeek-V3's layout at the smallest widths its FP8 blocks allow: every K a whole number of 128-blocks, and
# partial last row blocks where DeepSeek-V3 has them (kv_a_proj_with_mqa: 576 there, 160 here; q_b_proj 192)
FP8_DSV3 = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, vocab_size=49152,
                intermediate_size=256, moe_intermediate_size=128, q_lora_rank=128, kv_lora_rank=128,
                qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=4, num_experts_per_tok=2,
                n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.0,
                rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=False)
SHAPE = {"num_layers": 4, "hidden_size": 128, "intermediate_size": 256}


def linear_definition(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What an FP8 checkpoint's linear computes: x quantized per token and 128 values, times the dequantized
    weight, in float64."""
    k = x.shape[-1]
    xd = dequantize(*quantize_groups(x.reshape(-1, k)))
    return (xd @ dequantize(weight, scale).T).view(*x.shape[:-1], -1)


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("lead, n, group_m", [((1,), 128, 1), ((37,), 160, 1), ((2, 70), 192, 1), ((300,), 576, 1),
                                             ((600,), 576, 2)])
def test_fp8_block_linear_equals_the_definition_over_the_quantized_values(lead, n, group_m, dtype, rtol,
                                                                           monkeypatch):
    """Rows off the row block, several row blocks (256 rows a block on the CPU), a partial last column block (MLA's
    576), batch dimensions; programs in groups of row blocks (3 blocks in groups of 2)."""
    from eagle3.extract import fused_moe_kernels

    monkeypatch.setitem(fused_moe_kernels.CPU_TILES, "GROUP_M", group_m)
    g = torch.Generator().manual_seed(n)
    k = 256
    weight, scale = fp8_linear.quantize_weight(torch.randn(n, k, generator=g) / k ** 0.5)
    x = torch.randn(*lead, k, generator=g).to(dtype)
    got = fp8_linear.fp8_block_linear(x, weight, scale)
    assert got.shape == (*lead, n) and got.dtype == dtype
    assert rel_l2(got, linear_definition(x, weight, scale)) < rtol
    assert torch.equal(fp8_linear.fp8_block_linear(x, weight, scale), got)  # the same bytes run to run


def fp8_checkpoint_model(seed: int = 0):
    """(the model in float32, the same weights as transformers builds DeepSeek-V3's FP8 checkpoint:
    FP8Linear and FP8Experts modules holding float8 weights in 128 x 128 blocks with float32 scales)."""
    import transformers
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    torch.manual_seed(seed)  # (a config each: the experts kernel is set on a model's config)
    full = AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**FP8_DSV3), dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**FP8_DSV3), dtype=torch.float32)
    replace_with_fp8_linear(model, modules_to_not_convert=["lm_head"], pre_quantized=True,
                            quantization_config=FineGrainedFP8Config(weight_block_size=[FP8_BLOCK, FP8_BLOCK]))
    state, modules = {}, dict(model.named_modules())
    for name, w in full.state_dict().items():
        path, _, leaf = name.rpartition(".")
        if type(modules[path]).__name__ == "FP8Linear" and leaf == "weight":
            state[name], state[name + "_scale_inv"] = fp8_linear.quantize_weight(w)
        elif leaf in ("gate_up_proj", "down_proj"):
            state[name], state[name + "_scale_inv"] = quantize_blocks(w)
        else:
            state[name] = w
    model.load_state_dict(state, assign=True, strict=True)
    return full, model.eval()


class DefinitionFP8Linear(torch.nn.Module):
    """An FP8Linear computing `linear_definition` (mixed into the reference model's modules)."""

    def forward(self, x):
        return linear_definition(x, self.weight, self.weight_scale_inv).to(x.dtype)


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    return one_shard_of_random_samples(tmp_path_factory.mktemp("merge"), LENGTHS, rows_per_file=3)


def run(model, out: Path, spec, **kw) -> dict:
    """extract_shard of the preloaded model, the backend built from the config as the task builds it."""
    from eagle3.extract.backend import HFBackend
    from eagle3.extract.extractor import backend_options

    # 3 x 128 + 128 fp32 values a token, chunk_mb 0.05: ~25 tokens, so every batch is a chunk
    cfg = phase(ExtractConfig, **{"model_path": "fp8-dsv3", "extract_dir": str(out), "capture_layers": CAPTURE,
                                  "device": "cpu", "dtype": "float32", "token_budget": 256, "chunk_mb": 0.05,
                                  "writer_threads": 2, "compile": False, **kw})
    return extract_shard(cfg, spec, backend=HFBackend(model=model, **backend_options(cfg)), model_config=SHAPE)


def test_an_fp8_checkpoint_extracts_offline_equal_to_its_definition_and_resumes_byte_identical(
        merged, tmp_path, monkeypatch):
    """A DeepSeek-V3 as its FP8 checkpoint loads (FP8Linear, FP8Experts) extracts without any hub kernel: by
    default the linears run the project's FP8 GEMM and the experts its fused kernels. Its states equal those of
    the same modules computing the definition (one sample at a time, output_hidden_states) and stay close to the
    unquantized model's; fp8_linear is a state param; a shard cut mid-way resumes to the same bytes."""
    spec, samples = merged
    full, model = fp8_checkpoint_model()
    whole = run(model, tmp_path / "whole", spec)
    m = ShardManifest.load(Path(whole["shard_dir"]))
    assert whole["complete"] and m.params["states"]["fp8_linear"] == "auto" and len(m.chunks) >= 2
    runs = {type(mod).__name__ for mod in model.modules()}
    assert "TritonFP8Linear" in runs and model.config._experts_implementation == "triton_fused"

    _, reference = fp8_checkpoint_model()
    for mod in fp8_linear.fp8_linears(reference).values():
        mod.__class__ = type("DefinitionFP8Linear", (DefinitionFP8Linear, type(mod)), {})
    reference.set_experts_implementation("triton_fused")  # (the fused kernels' own tests check them)
    got = {s.row: s for s in HiddenStateReader([Path(whole["shard_dir"])], verify=True)}
    errors = []
    for row, ids in enumerate(samples):
        aux, final = reference_states(reference, ids, CAPTURE)
        errors.append(max(rel_l2(got[row].aux_hidden, aux), rel_l2(got[row].final_hidden, final)))
        aux_full, _ = reference_states(full, ids, CAPTURE)
        assert rel_l2(got[row].aux_hidden, aux_full) < 0.1  # FP8's rounding of weights and activations only
    # float32's summation order (float64 in the definition) moves a value across an e4m3 rounding boundary or a
    # token's top-k routing tie now and then, and the layers after carry it: a sample off by ~1% at most
    assert max(errors) < 0.02 and sorted(errors)[len(errors) // 2] < 1e-5, errors

    with pytest.raises(ConfigError, match="fp8_linear='auto'"):  # a resume may not switch the kernel
        run(model, tmp_path / "whole", spec, fp8_linear="transformers")
    monkeypatch.setenv(FAULT_ENV, f"shard=0,after_chunks=1,once_file={tmp_path / 'once'}")
    with pytest.raises(InjectedFault):
        run(model, tmp_path / "cut", spec)
    resumed = run(model, tmp_path / "cut", spec)
    assert resumed["resumed_from_chunk"] == 1 and resumed["complete"]
    assert chunk_bytes(Path(resumed["shard_dir"])) == chunk_bytes(Path(whole["shard_dir"]))


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def chunk_bytes(shard_dir: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(shard_dir.glob("chunk-*.safetensors"))}


def test_choices_switch_back_and_forth_and_bad_layouts_are_refused():
    from transformers.integrations.finegrained_fp8 import FP8Linear

    assert FP8_LINEAR_CHOICES == fp8_linear.CHOICES
    _, model = fp8_checkpoint_model()
    linears = fp8_linear.fp8_linears(model)
    assert len(linears) == 4 * 5 + 3 * 1 + 3 * 3  # MLA's 5 a layer, the dense MLP, the shared experts
    assert fp8_linear.apply(model, "triton") == "triton"
    assert all(isinstance(m, fp8_linear.TritonFP8Linear) for m in linears.values())
    assert fp8_linear.apply(model, "transformers") == "transformers"  # back to transformers' own forward
    assert all(type(m) is FP8Linear for m in linears.values())
    with pytest.raises(ConfigError, match="fp8_linear='cutlass'"):
        fp8_linear.apply(model, "cutlass")
    name, first = next(iter(linears.items()))
    first.activation_scheme = "static"
    with pytest.raises(ConfigError, match=rf"fp8_linear='triton': {name} lacks what the kernel reads: dynamic"):
        fp8_linear.apply(model, "auto")
    first.activation_scheme, first.block_size = "dynamic", (64, 64)
    with pytest.raises(ConfigError, match="128 x 128 weight blocks; use 'transformers'"):
        fp8_linear.apply(model, "auto")
    dense = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert fp8_linear.apply(dense, "auto") is None  # nothing in FP8: nothing to do


def test_torch_block_scaled_gemm_is_refused_where_it_cannot_run():
    """torch's block-scaled FP8 GEMM, asked for where it cannot run (the CPU), is refused naming the param; the
    linears it would not take as they are keep the Triton kernel. Its numbers are the GPU's (bench/kernels_check.py:
    2e-5 from the Triton kernel's on an H100)."""
    _, model = fp8_checkpoint_model()
    assert not fp8_linear.scaled_mm_runs(torch.device("cpu"))
    with pytest.raises(ConfigError, match="fp8_linear='scaled_mm': torch's block-scaled FP8 GEMM runs on a Hopper "
                                          "GPU with torch 2.10\\+, not on cpu; use 'auto' or 'triton'"):
        fp8_linear.apply(model, "scaled_mm")
    # the shapes cuBLASLt takes as they are: DeepSeek-V3's q_a (7168 -> 1536), kv_a (7168 -> 576), o (16384 -> 7168)
    shape = SimpleNamespace
    assert all(fp8_linear.scaled_mm_takes(shape(in_features=k, out_features=n))
               for k, n in [(7168, 1536), (7168, 576), (16384, 7168), (512, 32768)])
    # a K of 6 blocks (Qwen3-30B-A3B's expert width 768) or an N off 16 run the Triton kernel
    assert not fp8_linear.scaled_mm_takes(shape(in_features=768, out_features=2048))
    assert not fp8_linear.scaled_mm_takes(shape(in_features=7168, out_features=100))


def test_auto_takes_torch_block_scaled_gemm_where_it_runs(monkeypatch):
    """fp8_linear="auto" runs torch's block-scaled GEMM where it runs (1.35x the Triton linears on the whole
    extractor, docs/benchmarks.md), each linear it does not take as it is on the Triton kernel; elsewhere the
    Triton kernel."""
    _, model = fp8_checkpoint_model()
    linears = fp8_linear.fp8_linears(model)
    assert fp8_linear.apply(model, "auto") == "triton"  # the CPU
    monkeypatch.setattr(fp8_linear, "scaled_mm_runs", lambda device: True)
    assert fp8_linear.apply(model, "auto") == "scaled_mm"
    # this tiny target's widths are all under cuBLASLt's 4 K blocks: every linear keeps the Triton kernel
    assert all(type(m).__mro__[1] is fp8_linear.TritonFP8Linear for m in linears.values())
    # where the shape rule takes some (here: those reading the hidden size), those and only those run torch's GEMM
    monkeypatch.setattr(fp8_linear, "scaled_mm_takes", lambda m: m.in_features == FP8_DSV3["hidden_size"])
    assert fp8_linear.apply(model, "auto") == "scaled_mm"
    took = {n for n, m in linears.items() if isinstance(m, fp8_linear.ScaledMMFP8Linear)}
    assert took and took == {n for n, m in linears.items() if m.in_features == FP8_DSV3["hidden_size"]} != set(linears)


def test_quantize_linears_builds_the_modules_of_an_fp8_checkpoint():
    """FP8 on load of a bf16 target (the benchmark's `--fp8-weights` on an MLA/MoE target) gives the module tree and
    the tensors an FP8 checkpoint of the same weights loads as, so it measures the checkpoint's path."""
    import transformers
    from transformers import AutoModelForCausalLM

    full, checkpoint = fp8_checkpoint_model()
    model = AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**FP8_DSV3), dtype=torch.float32)
    model.load_state_dict(full.state_dict())
    assert fp8_linear.quantize_linears(model) == len(fp8_linear.fp8_linears(checkpoint))
    want = {k: v for k, v in checkpoint.state_dict().items() if ".experts." not in k}
    got = {k: v for k, v in model.state_dict().items() if ".experts." not in k}
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].float(), v.float()), k


@pytest.mark.slow
def test_compiled_layers_call_the_fp8_kernels_and_capture_the_eager_states():
    """The kernels sit behind torch custom ops, so a compiled decoder layer calls them; the states equal eager's to
    float32's rounding, up to FP8's sensitivity: Inductor's fused norms sum in another order (1e-7), and a value that
    crosses an e4m3 rounding boundary or a routing tie carries it into every later token through attention (here
    the last layer turns a 1e-7 difference of its input into 0.5%, run eagerly on either input too)."""
    from eagle3.extract.backend import HFBackend

    _, model = fp8_checkpoint_model()
    ids = torch.randint(3, 49152, (2, 70), generator=torch.Generator().manual_seed(0))
    captured = []
    for compile in (False, True):
        backend = HFBackend(model=model, compile=compile)
        backend.load("fp8-dsv3", "float32", "cpu", CAPTURE)
        aux, final = backend.capture(ids)
        captured.append((torch.stack(aux), final))
    assert isinstance(model.model.layers[1].self_attn.q_a_proj, fp8_linear.TritonFP8Linear)
    (eager_aux, eager_final), (aux, final) = captured
    per_token = (aux - eager_aux).norm(dim=-1) / eager_aux.norm(dim=-1)
    assert per_token.median() < 1e-5 and rel_l2(aux, eager_aux) < 0.02 and rel_l2(final, eager_final) < 0.02


@pytest.mark.parametrize("rows", [1, 37, 48, 16377 % 64])
def test_torch_block_scaled_gemm_pads_rows_to_what_cublaslt_takes(rows, monkeypatch):
    """cuBLASLt refuses a column-major activation scale whose leading dimension (the rows) is not 16-byte aligned
    (CUBLAS_STATUS_NOT_SUPPORTED at 16,377 rows on an H100), and a batch holds any number of tokens: the rows go in
    padded to 16 and come back as many as went in, equal to the Triton twin's product. The CPU has no block-scaled
    GEMM, so a stand-in holds cuBLASLt's rule and computes the product's definition from the scales it is given."""
    from torch.nn import functional as F

    def blockwise(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype):
        assert a.shape[0] % 16 == 0 and scale_a.stride(0) == 1 and scale_a.stride(1) % 4 == 0, "cuBLASLt refuses"
        a_deq = a.float() * scale_a.repeat_interleave(FP8_BLOCK, 1)
        b_deq = b.float() * scale_b.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
        return (a_deq @ b_deq).to(output_dtype)

    monkeypatch.setattr(F, "scaled_mm", blockwise, raising=False)
    monkeypatch.setattr(F, "ScalingType", SimpleNamespace(BlockWise1x128=1, BlockWise128x128=2), raising=False)
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 256), torch.randn(1, 256, 256)
    wq, ws = (t[0] for t in quantize_blocks(w))
    xq, xs = quantize_groups(x)
    got = fp8_linear.fp8_block_scaled_gemm(xq, xs, wq, ws, torch.float32)
    assert got.shape == (rows, 256)
    torch.testing.assert_close(got, fp8_linear.fp8_block_gemm(xq, xs, wq, ws, torch.float32), rtol=1e-5, atol=1e-4)
