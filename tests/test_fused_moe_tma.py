"""The TMA / persistent experts kernels (eagle3/extract/fused_moe_tma.py, experts_kernel "tma" and "tma_w") on
the CPU: in Triton's interpreter against the float64 sum over pairs (empty experts, experts whose rows are not whole
blocks, several column tiles, programs looping over several tiles, expert parallel sentinels), the fallbacks, and
every autotune config compiled for sm_90 without a GPU (TMA loads, warpgroup MMAs, shared memory, registers)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from eagle3.extract import fused_moe  # noqa: E402
from tests.test_fused_moe import E, H, TOP_K, WIDTH, experts_by_pair, routing  # noqa: E402

fused_moe_tma = pytest.importorskip("eagle3.extract.fused_moe_tma")


def spy(monkeypatch) -> list:
    """The modes fused_moe_tma.expert_pairs ran with (so a test knows the new path ran, not the fallback)."""
    calls, real = [], fused_moe_tma.expert_pairs

    def wrapped(*args, **kwargs):
        calls.append(args[6])
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_moe_tma, "expert_pairs", wrapped)
    return calls


def inputs(tokens: int, skew: bool, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * WIDTH, H, generator=g) * 0.1).to(dtype)
    down = (torch.randn(E, H, WIDTH, generator=g) * 0.1).to(dtype)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    return x, routing(tokens, skew, g), torch.rand(tokens, TOP_K, generator=g), gate_up, down


@pytest.mark.parametrize("tiles", ["cpu-default", "small-looping"])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("tokens, skew", [(1, False), (37, False), (200, True)])
@pytest.mark.parametrize("mode", fused_moe_tma.MODES)
def test_tma_kernels_equal_the_sum_over_pairs(mode, tokens, skew, dtype, atol, tiles, monkeypatch):
    """cpu-default: one block a 256-row expert group, BLOCK_K 128 wider than H and WIDTH (the descriptors' zero
    padding past K; the pointer gather's K mask); small-looping: 16-row blocks (several an expert, the last one
    short, expert 5 empty under skew), BLOCK_K 32 (several K steps; H whole ones, WIDTH not), column tiles of 16
    (gate_up: 3), grouped by 3 row blocks, and 2 programs walking all the tiles (the persistent loop)."""
    if tiles == "small-looping":
        monkeypatch.setattr(fused_moe, "block_m_for", lambda *a: 16)
        monkeypatch.setattr(fused_moe_tma, "CPU_TILES", {"BLOCK_K": 32, "GROUP_M": 3, "PROGRAMS": 2})
        monkeypatch.setattr(fused_moe_tma, "cpu_block_n", lambda n: 16)
    ran = spy(monkeypatch)
    x, idx, weights, gate_up, down = inputs(tokens, skew, dtype, tokens)
    got = fused_moe.fused_experts(x, idx, weights, gate_up, down, experts_kernel=mode)
    assert ran == [mode] and got.dtype == dtype and got.shape == x.shape
    want = experts_by_pair(x, idx, weights, gate_up, down)
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=atol)
    again = fused_moe.fused_experts(x, idx, weights, gate_up, down, experts_kernel=mode)
    assert torch.equal(again, got)  # no atomics


@pytest.mark.parametrize("mode", fused_moe_tma.MODES)
def test_tma_kernels_pairs_of_other_ranks_add_nothing(mode, monkeypatch):
    """transformers' expert parallel sentinels (ids >= E): their group comes after the last expert's, no tile runs
    it (the live block count stops before), and their rows of the pair-order output stay zero."""
    monkeypatch.setattr(fused_moe, "block_m_for", lambda *a: 16)
    g = torch.Generator().manual_seed(7)
    x, _, weights, gate_up, down = inputs(41, False, torch.float32, 7)
    global_idx = torch.stack([torch.randperm(2 * E, generator=g)[:TOP_K] for _ in range(41)])
    here = global_idx < E
    local_idx = torch.where(here, global_idx, E + global_idx % E)
    ran = spy(monkeypatch)
    got = fused_moe.fused_experts(x, local_idx, weights * here, gate_up, down, expert_parallel=True,
                                  experts_kernel=mode)
    assert ran == [mode] and torch.isfinite(got).all()
    pairs, block_expert, live = fused_moe_tma.plan(local_idx, E, 16, True)
    assert (block_expert[: int(live)] < E).all() and (block_expert[int(live):] >= E).all()
    want = experts_by_pair(x, torch.where(here, local_idx, 0), weights * here, gate_up, down)
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-5)


def test_fp8_and_untileable_widths_stay_on_the_tiles_kernels(monkeypatch):
    """kernel "tma" leaves FP8 weights and widths that are not whole 16-column tiles (64 on a GPU) to the old
    kernels, and names the values it takes when given another."""
    ran = spy(monkeypatch)
    g = torch.Generator().manual_seed(2)
    w1, s1 = fused_moe.quantize_blocks(torch.randn(3, 256, 128, generator=g) * 0.05)
    w2, s2 = fused_moe.quantize_blocks(torch.randn(3, 128, 128, generator=g) * 0.05)
    x, idx = torch.randn(9, 128, generator=g), torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=g)
    got = fused_moe.fused_experts(x, idx, weights, w1, w2, s1, s2, experts_kernel="tma")
    x2, idx2, weights2, up2, down2 = x[:, :40], idx, weights, torch.randn(3, 2 * 24, 40), torch.randn(3, 40, 24)
    got2 = fused_moe.fused_experts(x2, idx2, weights2, up2, down2, experts_kernel="tma")
    assert ran == []
    assert torch.equal(got, fused_moe.fused_experts(x, idx, weights, w1, w2, s1, s2))  # "tiles", the default
    assert torch.equal(got2, fused_moe.fused_experts(x2, idx2, weights2, up2, down2))
    with pytest.raises(ValueError, match="'tiles', 'tma', 'tma_w'"):
        fused_moe.fused_experts(*inputs(3, False, torch.float32, 1), experts_kernel="tmaa")


def test_gpu_widths_the_column_tiles_divide():
    """A tile must not cross from gate to up or from one expert to the next: the autotuner keeps only configs whose
    BLOCK_N divides the width, and `runs` refuses widths that no config divides (those go to the tiles kernels)."""
    down = fused_moe_tma.configs("down")
    assert {c.kwargs["BLOCK_N"] for c in fused_moe_tma.whole_column_tiles(down, {"N": 384})} == {128}
    assert len(fused_moe_tma.whole_column_tiles(down, {"N": 7168})) == len(down)  # DeepSeek-V3's hidden

    def widths(hidden, width, dtype=torch.bfloat16):
        return (torch.empty(1, hidden, dtype=dtype, device="meta"),
                torch.empty(4, 2 * width, hidden, dtype=dtype, device="meta"),
                torch.empty(4, hidden, width, dtype=dtype, device="meta"))

    assert fused_moe_tma.runs(*widths(2048, 768), on_gpu=True)  # Qwen3-30B-A3B
    assert fused_moe_tma.runs(*widths(384, 64), on_gpu=True)
    assert not fused_moe_tma.runs(*widths(320, 64), on_gpu=True)  # hidden: no down tile (128, 256) divides it
    assert not fused_moe_tma.runs(*widths(384, 96), on_gpu=True)  # width: no gate_up tile (64, 128) divides it
    assert not fused_moe_tma.runs(*widths(384, 64, torch.float32), on_gpu=True)  # bf16/fp16 only on a GPU
    assert fused_moe_tma.runs(*widths(320, 48, torch.float32), on_gpu=False)  # the interpreter's 16-column tiles


HOPPER_SHARED_BYTES = 232448  # the most shared memory a block may use on sm_90 (227 KiB)


def compiled_for_hopper(kernel: str, config, block_m: int, gather_a: bool):
    """One autotune config as a launch at the MoE shapes specializes it: bf16 descriptors of its block shapes,
    16-byte aligned pointers, widths multiples of 16."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile
    from triton.runtime.jit import JITFunction

    fn = fused_moe_tma.gpu_kernels()[kernel == "down"]
    while not isinstance(fn, JITFunction):  # below the autotuner and the heuristics
        fn = fn.fn
    bn, bk = config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
    descs = {"a_desc": [block_m, bk], "w_desc": [bn, bk], "h_desc": [block_m, bn if kernel == "gate_up" else bk]}
    pointers = {"pairs_ptr": "*i32", "block_expert_ptr": "*i32", "live_blocks_ptr": "*i32", "weights_ptr": "*fp32"}
    constants = {"BLOCK_M": block_m, "NUM_SMS": 132, "UPCAST": False, "GATHER_A": gather_a, "EVEN_K": True,
                 **config.kwargs}
    constants = {k: v for k, v in constants.items() if k in fn.arg_names}
    signature = {a: f"tensordesc<bf16[{descs[a][0]},{descs[a][1]}]>" if a in descs else
                 pointers.get(a, "*bf16") if a.endswith("_ptr") else "constexpr" if a in constants else "i32"
                 for a in fn.arg_names}
    aligned = [a for a in fn.arg_names if a.endswith("_ptr") or a.startswith("stride") or a in ("N", "K")]
    source = ASTSource(fn=fn, signature=signature, attrs={(fn.arg_names.index(a),): [["tt.divisibility", 16]]
                                                         for a in aligned},
                       constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    return compile(source, target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": config.num_warps, "num_stages": config.num_stages})


def ptxas_report(ptx: str, tmp_path) -> str:
    """ptxas -v on the PTX (Triton's own ptxas): registers, spills, and its warnings."""
    import subprocess

    from triton.backends.nvidia.compiler import get_ptxas

    path = tmp_path / "k.ptx"
    path.write_text(ptx)
    run = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(path), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stderr


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("kernel, gather_a", [("gate_up", False), ("gate_up", True), ("down", False)])
def test_every_tma_config_compiles_for_hopper_into_bulk_tensor_copies_and_wgmma(kernel, gather_a, block_m,
                                                                                  tmp_path):
    """No GPU needed: each config the autotuner may pick compiles for sm_90, fits its shared memory, loads its
    tiles with TMA (cp.async.bulk.tensor; the pointer-gathered A of "tma_w" with cp.async), multiplies with
    asynchronous warpgroup MMAs that ptxas keeps asynchronous (no C7515 serialization) and spills no register."""
    for config in fused_moe_tma.configs(kernel):
        compiled = compiled_for_hopper(kernel, config, block_m, gather_a)
        where = f"{kernel} gather_a={gather_a} BLOCK_M={block_m} {config}"
        ptx = compiled.asm["ptx"]
        assert compiled.metadata.shared <= HOPPER_SHARED_BYTES, where
        assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx, where
        assert ("cp.async.cg" in ptx) == gather_a, where
        report = ptxas_report(ptx, tmp_path)
        assert "C7515" not in report, f"{where}: {report}"
        assert " 0 bytes spill stores" in report, f"{where}: {report}"


GPU_CHAIN = """
import torch
from eagle3.extract import fused_moe, fused_moe_tma as ft
tuners = ft.gpu_kernels()
for tuner in tuners:  # every config runs once (no timer without a GPU); the first is kept
    tuner._do_bench = lambda call, quantiles: (call(), [float(len(ran)), 0.0, 0.0])[1]
ran = []
def persistent(kernel, fn, grid_tiles, args, descs, n, k, block_m, device, **flags):
    ran.append(kernel)
    ft.launch_persistent(ft.gpu_kernels()[kernel == "down"], grid_tiles, args, block_m, 3, **flags)
ft.launch = persistent
torch.manual_seed(0)
t, h, w, e, k = 40, 256, 128, 4, 2
x, idx = torch.randn(t, h), torch.stack([torch.randperm(e)[:k] for _ in range(t)])
up, down, weights = torch.randn(e, 2 * w, h) * 0.05, torch.randn(e, h, w) * 0.05, torch.rand(t, k)
want = fused_moe.fused_experts(x, idx, weights, up, down)
for mode in ft.MODES:
    got = ft.expert_pairs(x, idx, weights, up, down, False, mode, 64).view(t, k, h).sum(dim=1)
    print(mode, len(ran), float((got - want).abs().max()))
print("timed", [len(getattr(tuner, "configs_timings", {})) for tuner in tuners], [len(t.cache) for t in tuners])
"""


def test_the_gpus_launch_chain_autotunes_sets_the_blocks_and_walks_every_tile():
    """On a GPU the kernels launch through the autotuner (configs pruned to whole column tiles, `BlocksSet` setting
    the descriptors' block shapes for each, the heuristic's EVEN_K, "tma" and "tma_w" tuned apart) on a
    persistent grid. The CPU path never takes that chain: here the GPU's own autotuned kernel objects run in
    Triton's interpreter (switched on before triton is imported: a process of its own) on a grid of 3 programs,
    float32 (no upcast), every config once."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", GPU_CHAIN], env=env, capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[1], check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.split("\n")
    for mode, line in zip(fused_moe_tma.MODES, lines):
        name, launches, err = line.split()
        assert name == mode and float(err) < 1e-5, line
    assert lines[1].split()[1] == "4"  # two launches a call
    # every config timed (BLOCK_N divides both widths here); gate_up tuned for each mode, down once
    counts = [len(fused_moe_tma.configs("gate_up")), len(fused_moe_tma.configs("down"))]
    assert lines[2] == f"timed {counts} [2, 1]", lines[2]


def test_the_autotuners_keep_their_timings_on_disk():
    """A shard task on a worker that already tuned these kernels times nothing: Triton caches an autotuner's
    timings on disk only with cache_results on and no config carrying a pre_hook (the block shapes are set by
    `BlocksSet`, the layer under the autotuner, which the interpreted chain above runs)."""
    for tuner in fused_moe_tma.gpu_kernels():
        assert tuner.cache_results
        assert tuner.configs and all(config.pre_hook is None for config in tuner.configs)
        assert isinstance(tuner.fn, fused_moe_tma.BlocksSet)
