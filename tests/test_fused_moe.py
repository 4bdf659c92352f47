"""The project's fused MoE experts kernels (experts_implementation="triton_fused") on the CPU, where they run in
Triton's interpreter: the expert-sorted, block-padded pair list, the experts' sum against a float64 loop over the
pairs (uniform, skewed and empty experts, token counts off the block size), and the layouts it refuses."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from eagle3.errors import ConfigError  # noqa: E402
from eagle3.extract import fused_moe  # noqa: E402
from tests.support.fp8 import dequantize, quantize_groups  # noqa: E402

E, H, WIDTH, TOP_K = 6, 64, 48, 2


def routing(t: int, skew: bool, generator) -> torch.Tensor:
    idx = torch.stack([torch.randperm(E, generator=generator)[:TOP_K] for _ in range(t)])
    if skew:  # most tokens on experts 1 and 3, expert 5 on none
        idx[: (3 * t) // 4] = torch.tensor([1, 3])
        idx[idx == 5] = 0
        idx[:, 1] = torch.where(idx[:, 0] == idx[:, 1], (idx[:, 0] + 2) % 5, idx[:, 1])
    return idx


def experts_by_pair(x, idx, weights, gate_up, down) -> torch.Tensor:
    """The definition, one (token, expert) pair at a time in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
            out[t] += weights[t, j].double() * (down[e].double() @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("skew", [False, True])
def test_align_pairs_groups_each_expert_in_whole_blocks(block_m, skew):
    g = torch.Generator().manual_seed(block_m)
    idx = routing(37, skew, g)
    pairs, block_expert = fused_moe.align_pairs(idx, E, block_m)
    s = idx.numel()
    assert pairs.numel() == block_m * block_expert.numel() >= s
    live = pairs[pairs < s]
    assert sorted(live.tolist()) == list(range(s))  # every pair once
    flat = idx.reshape(-1)
    rows = pairs.view(-1, block_m)
    for b, e in enumerate(block_expert.tolist()):
        members = rows[b][rows[b] < s]
        if e == E:  # past the last group: only padding
            assert members.numel() == 0
        else:
            assert members.numel() > 0 and (flat[members.long()] == e).all()
    # the groups come in expert order, and an expert without pairs has no block
    used = [e for e in block_expert.tolist() if e < E]
    assert used == sorted(used) and set(used) == set(flat.tolist())


@pytest.mark.parametrize("tokens, experts, top_k, block_m, elsewhere", [
    (37, 6, 2, 4, False), (200, 16, 4, 16, True), (1, 8, 2, 1, False), (0, 8, 2, 4, False),
    (1500, 128, 8, 64, False), (700, 256, 8, 128, True)])
def test_the_gpus_counting_sort_writes_the_torch_ops_bytes(tokens, experts, top_k, block_m, elsewhere):
    """fused_moe_align's two kernels (interpreted here; what align_pairs runs on a GPU) give the torch ops'
    pairs and blocks byte for byte: skewed, empty and other ranks' experts (expert parallelism), token counts off
    the chunk and step sizes, 128 and 256 experts."""
    from eagle3.extract import fused_moe_align

    g = torch.Generator().manual_seed(tokens + experts)
    hi = experts + 5 if elsewhere else experts  # ids past the experts: other ranks' (transformers' sentinel)
    idx = torch.randint(0, hi, (tokens, top_k), generator=g)
    idx[: tokens // 3] = torch.arange(top_k)  # skew: a third of the tokens on the first experts
    idx[:, -1] = torch.where(idx[:, -1] == experts - 1, 0, idx[:, -1])  # an expert with (almost) no pairs
    got = fused_moe_align.align_pairs(idx, experts, block_m, elsewhere)
    want = fused_moe.align_pairs_torch(idx, experts, block_m, elsewhere)
    assert all(a.dtype == b.dtype == torch.int32 and torch.equal(a, b) for a, b in zip(got, want))


def test_the_counting_sort_compiles_for_hopper_without_spilling(tmp_path):
    """Both kernels at each step size a launch takes (128 experts; 256, and 257 groups under expert parallelism):
    ptxas for sm_90 reports no spill stores."""
    from eagle3.extract import fused_moe_align
    from tests.support.hopper import spill_report

    kinds = {"ids_ptr": "*i64", "counts_ptr": "*i32", "first_ptr": "*i32", "pairs_ptr": "*i32"}
    for groups in (128, 256, 257):
        g, chunk, block = fused_moe_align.steps(groups, "cuda")
        for fn in fused_moe_align.KERNELS["cuda"]:
            report = spill_report(fn, {"CHUNK": chunk, "BLOCK": block, "G": g}, kinds, tmp_path)
            assert " 0 bytes spill stores" in report, (fn.fn.__name__, groups, report)
    assert " 0 bytes spill stores" not in spill_report(fused_moe_align.KERNELS["cuda"][1],
                                                      {"CHUNK": 1024, "BLOCK": 128, "G": 512}, kinds, tmp_path)


@pytest.mark.parametrize("tiles", ["cpu-default", "small", "small-grouped", "even"])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("tokens, skew", [(1, False), (37, False), (200, True)])
def test_fused_experts_equal_the_sum_over_pairs(tokens, skew, dtype, atol, tiles, monkeypatch):
    """Tiles: cpu-default's are wider than H and WIDTH (every load masked); small: several blocks an expert,
    several column tiles, K in several steps, gate_up's K whole tiles (EVEN_K) and its N not, down's the other way;
    grouped: programs in groups of 3 row blocks, the last short; even: every width whole tiles (no K or N mask)."""
    if tiles != "cpu-default":
        from eagle3.extract import fused_moe_kernels

        size = 16 if tiles == "even" else 32
        monkeypatch.setattr(fused_moe, "block_m_for", lambda *a: 16)
        monkeypatch.setattr(fused_moe_kernels, "CPU_TILES",
                            {"BLOCK_N": size, "BLOCK_K": size, "GROUP_M": 3 if tiles == "small-grouped" else 1})
    g = torch.Generator().manual_seed(tokens)
    gate_up = (torch.randn(E, 2 * WIDTH, H, generator=g) * 0.1).to(dtype)
    down = (torch.randn(E, H, WIDTH, generator=g) * 0.1).to(dtype)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    idx = routing(tokens, skew, g)
    weights = torch.rand(tokens, TOP_K, generator=g)
    got = fused_moe.fused_experts(x, idx, weights, gate_up, down)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), experts_by_pair(x, idx, weights, gate_up, down), rtol=1e-2, atol=atol)
    again = fused_moe.fused_experts(x, idx, weights, gate_up, down)
    assert torch.equal(again, got)  # no atomics: the same bytes run to run


def test_the_top_k_sum_runs_inside_the_custom_op():
    """Compiled, the experts' sum comes out of the opaque op whole (aten's reduction inside it: the sum outside,
    fused by Inductor with the residual add, measured slower on the H100); the result equals eager's, and the
    pairs' rows summed outside give the same sum."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    t, h, w, e, k = 40, 64, 32, 4, 2
    x, idx, res = torch.randn(t, h), torch.stack([torch.randperm(e)[:k] for _ in range(t)]), torch.randn(t, h)
    up, down, weights = torch.randn(e, 2 * w, h) * 0.05, torch.randn(e, h, w) * 0.05, torch.rand(t, k)

    def block(x, idx, weights, res):
        return res + fused_moe.fused_experts(x, idx, weights, up, down)

    got, (code,) = run_and_get_code(torch.compile(block), x, idx, weights, res)
    torch.testing.assert_close(got, block(x, idx, weights, res))
    assert "eagle3.triton_fused_experts" in code and "fused_add_sum" not in code, code[-3000:]
    pairs = fused_moe.expert_pairs(x, idx, weights, up, down).view(t, k, h).sum(dim=1)
    assert torch.equal(pairs + res, block(x, idx, weights, res))


@pytest.mark.parametrize("fp8", [False, True])
def test_expert_parallel_pairs_of_other_ranks_add_nothing(fp8):
    """Under transformers' expert parallelism a rank holds E of the experts and an id >= E marks a pair routed to
    another rank (its weight zeroed): those pairs form a group no kernel runs, and their rows are zeros, so the
    rank's sum is that of its own experts' pairs (the ranks' sums are all-reduced after)."""
    g = torch.Generator().manual_seed(5)
    e, hidden, width, tokens = 3, 128, 128, 41
    gate_up = torch.randn(e, 2 * width, hidden, generator=g) * 0.05
    down = torch.randn(e, hidden, width, generator=g) * 0.05
    x = torch.randn(tokens, hidden, generator=g)
    global_idx = torch.stack([torch.randperm(2 * e, generator=g)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=g)
    here = global_idx < e
    local_idx = torch.where(here, global_idx, e + global_idx % e)  # transformers' sentinels: any id >= E
    weights_here = weights * here
    pairs, block_expert = fused_moe.align_pairs(local_idx, e, 16, elsewhere=True)
    assert sorted(pairs[pairs < local_idx.numel()].tolist()) == list(range(local_idx.numel()))
    assert set(block_expert.tolist()) <= set(range(e + 2)) and (block_expert == e).any()  # the other ranks' group
    scales = ()
    if fp8:
        (gate_up, s1), (down, s2) = fused_moe.quantize_blocks(gate_up), fused_moe.quantize_blocks(down)
        scales = (s1, s2)
    got = fused_moe.fused_experts(x, local_idx, weights_here, gate_up, down, *scales, expert_parallel=True)
    assert torch.isfinite(got).all()
    only_here = fused_moe.fused_experts(x, torch.where(here, local_idx, 0), weights_here, gate_up, down, *scales)
    torch.testing.assert_close(got, only_here, rtol=1e-5, atol=1e-6)  # id 0 at weight 0 adds nothing either


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.double() * scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 37, 1500])
def test_the_quantize_kernel_writes_the_bytes_of_the_activation_scheme(rows, dtype):
    """The one-pass Triton kernel's float8 values and scales are those of the scheme's definition in torch's ops,
    bit for bit: rows off and over the program's block (1,024 on the CPU), a zero group, a group at e4m3's edge."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 384, generator=g) * torch.logspace(-3, 3, 384)).to(dtype)
    if rows > 1:
        x[1, 128:256] = 0  # amax 0: scale at its floor, values 0
        x[0, :128] = 448.0
    q, scale = fused_moe.quantize_groups(x)
    want_q, want_scale = quantize_groups(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (rows, 3)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_block_weights_equal_the_sum_over_pairs_of_the_quantized_values(dtype):
    """An FP8 checkpoint's experts (128 x 128 weight blocks; activations quantized per token and 128 values, as
    they come): the kernels' result is the definition over the dequantized weights and quantized inputs."""
    g = torch.Generator().manual_seed(3)
    e, hidden, width, tokens = 4, 256, 128, 37
    w1, s1 = fused_moe.quantize_blocks(torch.randn(e, 2 * width, hidden, generator=g) * 0.05)
    w2, s2 = fused_moe.quantize_blocks(torch.randn(e, hidden, width, generator=g) * 0.05)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(e, generator=g)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=g)
    got = fused_moe.fused_experts(x, idx, weights, w1, w2, s1, s2)

    def quantized(v):  # the activation scheme, on values already in the run's dtype
        return dequantize(*quantize_groups(v))

    xq, d1, d2 = quantized(x), dequantized(w1, s1), dequantized(w2, s2)
    want = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(TOP_K):
            gate, up = (d1[idx[t, j]] @ xq[t]).chunk(2)
            h = (torch.nn.functional.silu(gate) * up).to(dtype)[None]  # stored in the run's dtype, then quantized
            want[t] += weights[t, j].double() * (d2[idx[t, j]] @ quantized(h)[0])
    # one fp8 step (1/16) where the two sums round an intermediate value to the other side; overall well under the
    # activations' quantization error itself (~4% here), so a lost or doubled scale cannot pass
    torch.testing.assert_close(got.double(), want, rtol=0.05, atol=0.02 * want.abs().max().item())
    assert (got.double() - want).norm() / want.norm() < 0.02


def test_an_fp8_checkpoints_experts_module_runs_through_the_kernels():
    """transformers' FP8Experts (what an FP8 checkpoint loads as) passes the checks and dispatches to the kernels
    through transformers' FP8 experts interface."""
    from transformers import Qwen3MoeConfig
    from transformers.integrations import use_experts_implementation
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts

    cfg = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=TOP_K,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    # as transformers' FP8 quantizer builds it in place of a checkpoint's experts
    fp8_experts = use_experts_implementation(experts_class=FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    module = fp8_experts(cfg, block_size=(128, 128))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            q, scale = fused_moe.quantize_blocks(torch.randn(getattr(module, name).shape, generator=g) * 0.05)
            getattr(module, name).data, getattr(module, f"{name}_scale_inv").data = q, scale
    fused_moe.register([module])
    assert ALL_FP8_EXPERTS_FUNCTIONS.get_interface(fused_moe.NAME, None) is fused_moe.experts_forward
    x = torch.randn(9, 256, generator=g)
    idx = torch.stack([torch.randperm(4, generator=g)[:TOP_K] for _ in range(9)])
    weights = torch.rand(9, TOP_K, generator=g)
    want = fused_moe.fused_experts(x, idx, weights, module.gate_up_proj, module.down_proj,
                                   module.gate_up_proj_scale_inv, module.down_proj_scale_inv)
    assert torch.equal(fused_moe.experts_forward(module, x, idx, weights), want)
    module.activation_scheme = "static"  # per-expert activation scales read from the checkpoint: not this path
    with pytest.raises(ConfigError, match="float8 in 128 x 128 blocks"):
        fused_moe.check_experts(module)
    module.activation_scheme, module.limit = "dynamic", 7.0  # a clamped SwiGLU (gpt-oss style): not this path
    with pytest.raises(ConfigError, match="a plain SwiGLU"):
        fused_moe.check_experts(module)


def test_refuses_layouts_the_kernels_do_not_read():
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=H, intermediate_size=128, moe_intermediate_size=WIDTH, num_experts=E,
                         num_experts_per_tok=TOP_K, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=256)
    experts = AutoModelForCausalLM.from_config(cfg).model.layers[0].mlp.experts
    fused_moe.check_experts(experts)  # Qwen3-MoE's experts are what the kernels read
    experts.act_fn = torch.nn.GELU()
    experts.has_bias = True
    with pytest.raises(ConfigError, match=r"experts_implementation='triton_fused'.*no bias, the SiLU activation"):
        fused_moe.check_experts(experts)
    experts.act_fn, experts.has_bias = torch.nn.SiLU(), False
    experts.down_proj.data = experts.down_proj.data.to(torch.float8_e4m3fn)  # as an FP8 checkpoint holds them
    with pytest.raises(ConfigError, match=r"lacks what the kernels read: bf16/fp16/fp32 weights, or float8 in 128 x "
                                          r"128 blocks; use 'grouped_mm'"):  # float8 without block scales
        fused_moe.check_experts(experts)


HOPPER_SHARED_BYTES = 232448  # the most shared memory a block may use on sm_90 (227 KiB)


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("fp8", [False, True])
def test_every_autotune_config_compiles_for_hopper_and_pipelines_into_wgmma(fp8, block_m):
    """No GPU needed: each config the autotuner may pick compiles for sm_90 as a launch at the MoE shapes
    specializes it (16-byte aligned pointers; strides, widths and hidden sizes multiples of 16), fits the shared
    memory, and its K loop runs on asynchronous copies into warpgroup MMAs (what a Hopper GEMM needs to be fast;
    without the alignment facts Triton pipelines nothing); in FP8 the MMAs take float8 operands."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from eagle3.extract import fused_moe_kernels as kernels

    values = "*fp8e4nv" if fp8 else "*bf16"
    pointer_types = {"pairs_ptr": "*i32", "block_expert_ptr": "*i32", "weights_ptr": "*fp32", "out_ptr": "*bf16",
                     "x_scale_ptr": "*fp32", "h_scale_ptr": "*fp32", "w_scale_ptr": "*fp32"}
    for name, autotuner in zip(("gate_up", "down"), kernels.GPU[fp8]):
        fn = autotuner.fn.fn  # under the heuristics that set EVEN_N / EVEN_K from the launch and its config
        flag = autotuner.fn.values
        widths = {"N": 768, "K": 2048, "BLOCK_N": 128, "BLOCK_K": 64}  # Qwen3-30B-A3B's gate_up
        assert flag["EVEN_N"](widths) and flag["EVEN_K"](widths)
        assert not flag["EVEN_N"]({**widths, "N": 720}) and not flag["EVEN_K"]({**widths, "K": 2000})
        aligned = [a for a in fn.arg_names if a.endswith("_ptr") or a.startswith("stride") or a in ("N", "K")]
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
        # each config at the real targets' widths (whole tiles: no K or N mask), one config with both masks
        configs = kernels.configs(f"{name}_fp8" if fp8 else name)
        for config, even in [(c, True) for c in configs] + [(configs[0], False)]:
            flags = {"EVEN_N": even, "EVEN_K": even}
            constants = {"BLOCK_M": block_m, "UPCAST": False, "FP8": fp8, **flags, **config.kwargs}
            signature = {a: pointer_types.get(a, values) if a.endswith("_ptr") else "constexpr" if a in constants
                         else "i32" for a in fn.arg_names}
            source = ASTSource(fn=fn, signature=signature, attrs=attrs,
                               constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
            compiled = compile(source, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": config.num_warps, "num_stages": config.num_stages})
            ir = compiled.asm["ttgir"]
            where = f"{name} {config} {flags}"
            assert compiled.metadata.shared <= HOPPER_SHARED_BYTES, where
            assert "async_copy_global_to_local" in ir and "warp_group_dot" in ir, where
            assert ("f8E4M3FN" in ir) == fp8, where


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_quantize_kernel_compiles_for_hopper_into_one_pass_of_wide_loads(dtype):
    """The activation quantization as it launches on sm_90: it compiles, loads and stores in 128-bit vectors (one
    read of x), divides as IEEE does and converts to float8 with the hardware's instruction."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from eagle3.extract import fused_moe_kernels as kernels

    fn, block_r = kernels.QUANTIZE["cuda"]
    types = {"x_ptr": f"*{dtype}", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
    constants = {"BLOCK_R": block_r, "GROUP": 128}
    signature = {a: types.get(a, "constexpr" if a in constants else "i32") for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in fn.arg_names
             if a.endswith("_ptr") or a.startswith("stride") or a == "K"}
    source = ASTSource(fn=fn, signature=signature, attrs=attrs,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    ptx = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert "ld.global.v4" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "div.rn.f32" in ptx and "div.full" not in ptx  # x / scale exactly, as torch divides


GPU_CHAIN = """
import torch
from eagle3.extract import fused_moe, fused_moe_kernels as fk
torch.manual_seed(0)
t, h, w, e, k = 40, 256, 128, 4, 2
x, idx = torch.randn(t, h), torch.stack([torch.randperm(e)[:k] for _ in range(t)])
up, down, weights = torch.randn(e, 2 * w, h) * 0.05, torch.randn(e, h, w) * 0.05, torch.rand(t, k)
want = fused_moe.fused_experts(x, idx, weights, up, down)
tile = {"BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1}  # an autotune config's kwargs, without the EVEN flags
fused_moe.kernels = lambda device, fp8=False: (fk.GPU[fp8][0].fn, fk.GPU[fp8][1].fn, lambda n, k: tile)
print(float((fused_moe.fused_experts(x, idx, weights, up, down) - want).abs().max()))
"""


def test_the_gpus_heuristics_set_the_even_flags_of_a_real_launch():
    """On a GPU the kernels launch through the autotuner, whose config then passes through the heuristics that set
    EVEN_N / EVEN_K from the launch's widths and the config's tiles. The CPU path never takes that chain: here
    the GPU's own kernel objects (below the autotuner, which needs a driver) launch in Triton's interpreter, which
    must be switched on before triton is imported: a process of its own."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", GPU_CHAIN], env=env, capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout.split()[-1]) < 1e-5
