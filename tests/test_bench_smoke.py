"""The benchmarks' CPU modes still run the code paths the GPU figures come from (bench/; docs/benchmarks.md)."""

import json

import pytest
import torch

from bench import extract_bench, generate_bench, train_bench


def test_extract_bench_smoke_measures_every_option_on_the_cpu(tmp_path):
    out = tmp_path / "extract.json"
    assert extract_bench.main(["--smoke", "--work-dir", str(tmp_path / "work"), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    models = res["models"]
    assert res["chunk_write"]["chunk_mb"] == 1 and res["chunk_write"]["bytes_per_s"] > 0  # write_chunk's own rate
    tiny = models["tiny"]
    assert tiny["capture_layers"] == [2, 4, 5] and tiny["extractor"]["tokens"] == tiny["tokens"]
    assert 0 < tiny["fraction_of_limit"] and tiny["ratio_to_naive"] > 0
    assert models["tiny-fp8"]["storage"] == "float8_e4m3fn"
    fp8 = tiny["fp8_weights"]
    assert fp8["method"].startswith("simulated") and fp8["extractor"]["tokens"] == tiny["tokens"]
    assert [e["layer"] for e in fp8["state_error"]] == ["hidden_states[2]", "hidden_states[4]", "hidden_states[5]",
                                                       "final"]
    assert all(0 < e["rel_l2"] < 0.5 and e["cosine_mean"] > 0.9 for e in fp8["state_error"])
    assert set(tiny["interleaved"]["variants"]) == {"extractor-pad1", "extractor-padauto"}
    whole = tiny["extractor_profile"]  # the whole extractor profiled, warm: its compute per token, by kind
    assert whole["tokens"] == tiny["tokens"] and whole["kernel_s_per_mtok"] > 0 and whole["kinds"]["gemm"] > 0
    assert whole["compute_busy_share"] is None and whole["gaps"] is None  # a GPU's figures only
    assert "moe" not in tiny
    for name in ("tiny-moe", "tiny-mla"):  # the MoE rows: experts' GEMM ceiling, both ratios, a skewed router
        m = models[name]["moe"]
        assert m["expert_ceiling"]["rows"] == 512 * 4 and m["expert_ceiling"]["ceiling"] > 0
        # the whole experts step, copies included, through transformers' path and the fused Triton kernels
        blocks = m["expert_ceiling"]["blocks"]
        assert blocks["grouped_mm"] > 0 and blocks["triton_fused"] > 0
        assert blocks["triton_fused_rel_l2_vs_grouped_mm"] < 1e-5  # fp32 on the CPU: the same sums
        assert 0 < m["fraction_of_active_roofline"] and 0 < m["fraction_of_ceiling_roofline"]
        assert m["skewed"]["routing"]["max_over_mean"] > m["routing_uniform"]["max_over_mean"]
        assert models[name]["extractor"]["tokens"] == models[name]["tokens"]
    side = models["tiny-moe"]["side_by_side"]
    # every lever reads against the base run again (warm, as the levers run), not the process's first run
    assert side["base-again"]["over_base"]["against"] == "the base's first run"
    assert side["batched"]["over_base"]["against"] == "the base run again"
    assert side["batched"]["over_base"]["wall"] == pytest.approx(
        side["batched"]["tok_per_s_wall"] / side["base-again"]["tok_per_s_wall"])
    assert side["batched"]["params"]["experts_implementation"] == "batched_mm" and side["budget256"]["tok_per_s_wall"]
    assert side["fused"]["tok_per_s_wall"] > 0  # the fused Triton kernels, interpreted on the CPU
    assert "experts_implementation" in side["bad"]["error"]  # a lever that fails costs its row, not the run
    for name in ("tiny", "tiny-moe"):  # the forward alone, profiled: its rate and where the kernel time went
        prof = models[name]["forward_profile"]
        assert prof["batches"] == 3 and prof["forward_tok_per_s"] > 0 and sum(prof["kinds"].values()) == \
            pytest.approx(1.0)
        assert prof["kinds"]["gemm"] > 0 and prof["kinds"].get("attention", 0) > 0
    # the routing is the MoE target's own work (a dense model's embedding lookup is an index op too, a small one)
    assert models["tiny-moe"]["forward_profile"]["kinds"]["routing"] > \
        models["tiny"]["forward_profile"]["kinds"].get("routing", 0.0)
    moe_fp8 = models["tiny-moe"]["fp8_weights"]  # the experts too: FP8 blocks through the fused kernels
    assert "routed experts float8 in 128 x 128 blocks" in moe_fp8["method"]
    assert moe_fp8["extractor"]["tokens"] == models["tiny-moe"]["tokens"]
    assert all(0 < e["rel_l2"] < 0.5 and e["cosine_mean"] > 0.9 for e in moe_fp8["state_error"])
    blocks = models["tiny-moe"]["fp8_blocks"]  # DeepSeek-V3's FP8 checkpoint layout: every linear and the experts
    assert blocks["method"].startswith("float8 128 x 128 blocks") and "32 decoder linears" in blocks["method"]
    assert "routed experts through triton_fused" in blocks["method"]
    assert blocks["extractor"]["tokens"] == models["tiny-moe"]["tokens"]
    assert all(0 < e["rel_l2"] < 0.5 and e["cosine_mean"] > 0.9 for e in blocks["state_error"])
    roof = blocks["fp8_roofline"]  # the FP8 forward against FP8 GEMMs (torch._scaled_mm runs on the CPU too)
    assert roof["fp8_matmul"]["sustained"] > 0 and roof["dense_matmul"]["sustained"] > 0
    assert roof["roofline_tok_per_s"] > 0 and 0 < roof["fraction_steady"] and 0 < roof["fraction_wall"]


def test_train_bench_speed_runs_a_tiny_drafter_on_the_cpu(tmp_path):
    out = tmp_path / "speed.json"
    info = train_bench.speed("tiny", "eager", 3, 2, str(out))
    (r,) = json.loads(out.read_text())["results"]
    assert len(info["results"]) == 1 and r["shape"] == "tiny" and "error" not in r and r["tokens_per_s"] > 0


def test_chunk_reaper_deletes_committed_chunks_only(tmp_path):
    from bench.extract_limits import ChunkReaper

    shard = tmp_path / "out" / "shard-00000"
    shard.mkdir(parents=True)
    (shard / ".chunk-000001.safetensors.tmp-1-ab").write_bytes(b"x" * 5)  # being written: kept
    (shard / "manifest.json").write_text("{}")
    with ChunkReaper(tmp_path / "out", period_s=0.01) as reaper:
        (shard / "chunk-000000.safetensors").write_bytes(b"x" * 7)
    assert sorted(p.name for p in shard.iterdir()) == [".chunk-000001.safetensors.tmp-1-ab", "manifest.json"]
    assert (reaper.files, reaper.bytes) == (1, 7)


def test_routing_load_reads_every_moe_block_of_a_compiled_target():
    """The GPU run compiles whole layers, and a compiled layer runs no hook of a module inside it (seen on the
    H200, 2026-12-05: no routing was read); routing_load runs the layers' eager forwards for its one pass."""
    import torch

    from bench.extract_moe import build_moe_model, moe_blocks, routing_load
    from eagle3.extract.backend import HFBackend

    model, path = build_moe_model("tiny-moe", "cpu", torch.float32)
    backend = HFBackend(model=model, compile=True)
    backend.load(path, "float32", "cpu", [1, 2])
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    before = backend.capture(ids)[1]
    load = routing_load(model, ids)
    assert load["layers"] == len(moe_blocks(model.model.layers)) and sum(load["first_layer_counts"]) == 2 * 32 * \
        model.config.num_experts_per_tok
    assert torch.equal(backend.capture(ids)[1], before)  # the compiled forwards are back


def test_extract_gpus_smoke_runs_tensor_parallel_shard_per_device_and_the_rank_kill(tmp_path):
    """bench/extract_gpus.py (several GPUs, issue 28 item 8) on the CPU with gloo: tp 1 and 2 on one shard, two
    shard tasks at once in their own processes, rank 1 killed mid-shard and the re-run byte-identical."""
    from bench import extract_gpus

    out = tmp_path / "gpus.json"
    assert extract_gpus.main(["--smoke", "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [x["tp_size"] for x in r["tp"]] == [1, 2] and all(x["tokens"] == r["tokens"] for x in r["tp"])
    kill = r["kill"]
    assert kill["failed"]["rank"] == 1 and "SIGKILL" in kill["failed"]["error"]
    assert kill["resumed_from_chunk"] == kill["committed_before_rerun"] >= 2 and kill["byte_identical"]
    per_gpu = r["per_gpu"]
    assert len(per_gpu["tasks"]) == 2 and sum(t["tokens"] for t in per_gpu["tasks"]) == r["tokens"]
    assert per_gpu["tok_per_s_aggregate"] > 0 and per_gpu["disk_bytes_per_s"] > 0


def test_profile_sorts_gpu_kernel_names_by_kind():
    """CUDA kernels' names as torch's kernels are named (the grouped GEMM's CUTLASS GroupProblemShape, cuBLAS's
    nvjet/xmma, Inductor's triton_poi/triton_tem, FlashAttention, the routing's histogram and sort); not yet read
    from an H200 profile: the first --profile-batches run checks the share left in "other"."""
    from bench.extract_profile import kind_of

    assert [kind_of(n) for n in (
        "cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<",
        "nvjet_tst_192x192", "sm90_xmma_gemm_bf16bf16_bf16f32", "triton_tem_fused_mm_0",
        "triton_poi_fused_add_mul_silu_0",
        "pytorch_flash::flash_fwd_kernel<", "at::native::kernelHistogram1D<", "cub::DeviceRadixSortOnesweepKernel",
        "at::native::indexSelectLargeIndex<", "Memcpy DtoH (Device -> Pinned)", "at::native::reduce_kernel<",
        "gate_up_kernel", "down_kernel", "quantize_kernel",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0")] == [
        "experts_gemm", "gemm", "gemm", "gemm", "fused_elementwise", "attention", "routing", "routing", "routing",
        "copy", "other", "experts_gemm", "experts_gemm", "fp8_quantize", "attention"]


def test_extractor_profile_measures_the_compute_streams_idle_gaps_by_length():
    """The gaps between compute kernels (copies on their own stream left out, overlapping kernels merged), bucketed
    by length: the ~33 ms stall a batch of 2026-12-07's DeepSeek-V3 profile is what this finds."""
    from types import SimpleNamespace

    from bench.extract_profile import compute_gaps

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, start_ms, end_ms, device=cuda):
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(start=start_ms * 1e3, end=end_ms * 1e3))

    events = [ev("gemm", 0, 10), ev("attention", 5, 12),  # overlapping: one busy span 0-12 ms
              ev("Memcpy DtoH (Device -> Pinned)", 12, 45),  # the copy-out fills the gap, but is not compute
              ev("aten::mm", 20, 40, device=cpu),  # a host operator, not a kernel
              ev("gemm", 45, 50), ev("triton_poi_fused_add_0", 50.05, 60)]
    g = compute_gaps(SimpleNamespace(events=lambda: events))
    assert g["span_s"] == pytest.approx(0.060)
    assert g["idle_by_gap"]["10-100ms"] == {"s": pytest.approx(0.033), "n": 1}
    assert g["idle_by_gap"]["<0.1ms"] == {"s": pytest.approx(0.00005), "n": 1}
    assert g["idle_by_gap"][">100ms"]["n"] == 0 and g["longest_gaps_s"][0] == pytest.approx(0.033)


def test_host_waits_finds_the_blocking_cuda_calls_of_the_compute_thread():
    """bench/extract_profile.py's host_waits: runtime calls over 1 ms, by name, on the thread that launched the most
    kernels and on the others; kernels and short calls are left out."""
    from types import SimpleNamespace

    from bench.extract_profile import host_waits

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, thread, start_ms, end_ms, device=cpu):
        return SimpleNamespace(name=name, device_type=device, thread=thread,
                               time_range=SimpleNamespace(start=start_ms * 1e3, end=end_ms * 1e3))

    events = [ev("cudaLaunchKernel", 7, 0, 0.01), ev("cudaLaunchKernel", 7, 1, 1.01),
              ev("cudaStreamSynchronize", 7, 2, 35), ev("cudaStreamSynchronize", 7, 40, 40.5),  # 0.5 ms: short
              ev("cudaHostAlloc", 7, 50, 52),
              ev("cudaLaunchKernel", 9, 0, 0.01), ev("cudaEventSynchronize", 9, 3, 300),  # a writer's wait
              ev("cudaStreamSynchronize", 9, 5, 9, device=cuda),  # a device record, not a host call
              ev("aten::pin_memory", 7, 50, 60)]  # an operator, not a runtime call
    w = host_waits(SimpleNamespace(events=lambda: events))
    assert w["compute_thread"] == {"cudaStreamSynchronize": {"n": 1, "s": pytest.approx(0.033)},
                                   "cudaHostAlloc": {"n": 1, "s": pytest.approx(0.002)}}
    assert w["other_threads"] == {"cudaEventSynchronize": {"n": 1, "s": pytest.approx(0.297)}}
    assert w["calls_seen"] == 7  # the runtime calls on the host, short ones included
    assert w["threads_seen"] == 2


def test_mla_check_smoke_builds_the_same_queries_and_keys_in_every_layout(tmp_path):
    """bench/mla_check.py: MLA's q/k joined token-major, and q/k/v left in place (kv_b's rows gapped), are the
    values transformers' heads-major order makes, and the attention over them gives the same output; each layout
    timed, and kv_b's GEMM plain and gapped."""
    from bench import mla_check

    out = tmp_path / "mla.json"
    assert mla_check.main(["--smoke", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert set(mla_check.LAYOUTS) == {"heads_major", "token_major", "in_place"}
    for name in ("token_major", "in_place"):
        r = row[name]
        assert r["q_equal"] and r["k_equal"] and r["v_equal"] and r["out_rel_l2"] < 1e-6, (name, r)
    assert all(row[k]["assembly_ms"] > 0 and row[k]["attention_ms"] > 0 for k in mla_check.LAYOUTS)
    assert row["kv_b_gemm_ms"]["plain"] > 0 and row["kv_b_gemm_ms"]["gapped"] > 0
    # in place: q and k are views of the projections' own rows, roped and written there (no joined copy)
    x = mla_check.mla_inputs(8, {"heads": 2, "nope": 4, "rope": 4, "v": 4}, "cpu", torch.float32)
    q, k, v = mla_check.assemble_in_place(x)
    assert q.data_ptr() == x["q_in_place"].data_ptr() and k.data_ptr() == x["kv_gapped"].data_ptr()
    assert v.data_ptr() == k.data_ptr() + (4 + 4) * 4  # after the head's k_nope and gap, float32
    want = mla_check.assemble_heads_major(x)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), want))
    # the rope is applied: the rotary part differs from the projection's own values
    x = mla_check.mla_inputs(8, {"heads": 2, "nope": 4, "rope": 4, "v": 4}, "cpu", torch.float32)
    q, _, _ = mla_check.assemble_token_major(x)
    q0 = x["q"].view(8, 2, 8)[0]  # position 0, a zero angle: the rotary pairs only de-interleaved (as transformers)
    assert torch.equal(q[0, :, 0], torch.cat([q0[:, :4], q0[:, 4::2], q0[:, 5::2]], dim=-1))
    assert not torch.allclose(q[0, :, 3, 4:], x["q"].view(8, 2, 8)[3, :, 4:])


def test_kernels_check_smoke_checks_each_kernel_against_its_definition(tmp_path):
    """bench/kernels_check.py's CPU mode: the same checks the GPU figures come from, in Triton's interpreter."""
    pytest.importorskip("triton")
    from bench import kernels_check

    out = tmp_path / "kernels.json"
    assert kernels_check.main(["--smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for row in res["experts"].values():
        assert row["bf16_rel_l2"] < 0.02 and row["fp8_rel_l2"] < 0.05 and not row["bf16_nan"] and not row["fp8_nan"]
        for mode in ("tma", "tma_w"):  # the TMA / persistent kernels (fused_experts experts_kernel=), the same batch
            assert row[f"{mode}_rel_l2"] < 0.02 and not row[f"{mode}_nan"], row
    assert all(r["rel_l2"] < 0.01 and not r["nan"] for r in res["linears"].values()) and res["linears"]
    # compiled `residual + experts`: the top-k sum outside the op against inside it, the same sums, both timed
    combine = res["combine"]["smoke"]
    assert combine["experts_kernel"] == "tiles" and combine["rel_l2_outside_vs_inside"] < 0.01
    assert combine["inside_ms"] > 0 and combine["outside_ms"] > 0 and combine["outside_over_inside"] > 0
    assert all(q["bytes_equal"] and q["values_equal_at_kernel_scales"] for q in res["quantize"].values())
    # the router: the same probabilities picked (experts differ only among equal ones), the same weights
    router = res["router"]["smoke"]
    assert router["picked_probabilities_equal"] and router["experts_equal_share"] > 0.9, router
    assert router["weights_rel_l2"] < 1e-6 and router["fused_ms"] > 0 and router["transformers_ms"] > 0
    assert router["align_bytes_equal"] and router["align_kernels_ms"] > 0 and router["align_torch_ms"] > 0


def test_kernels_check_rates_each_tile_from_the_autotuners_timings(monkeypatch):
    """The per-config rates come from the autotuner's own timings (ms) of the call just made: the GEMM's FLOPs over
    each, best first; a config that failed to run (inf) is left out, and no timings (a cache hit) give none."""
    triton = pytest.importorskip("triton")
    from bench import kernels_check
    from eagle3.extract.fused_moe_kernels import GPU

    fast, slow, broken = (triton.Config({"BLOCK_N": n}, num_warps=4) for n in (64, 128, 256))
    monkeypatch.setattr(GPU[False][0], "configs_timings", {slow: [2.0, 1.9, 2.1], fast: [1.0, 0.9, 1.1],
                                                            broken: float("inf")}, raising=False)
    monkeypatch.setattr(GPU[False][1], "configs_timings", None, raising=False)
    rates = kernels_check.tile_rates(False, pairs=1000, hidden=2048, width=768)
    gate_up_flops = 2.0 * 1000 * 2048 * 2 * 768
    assert list(rates["gate_up"].values()) == [gate_up_flops / 1.0 / 1e9, gate_up_flops / 2.0 / 1e9]
    assert list(rates["gate_up"]) == [str(fast), str(slow)] and rates["down"] == {}


def test_kernels_check_names_each_tma_config_compactly_with_its_rate():
    """The TMA kernels' config rates: one short name a config (tiles, group, flattened, stages, warps), best first,
    a failed config (inf) left out."""
    triton = pytest.importorskip("triton")
    from bench import kernels_check

    fast = triton.Config({"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "FLATTEN": True}, num_stages=4, num_warps=8)
    slow = triton.Config({"BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "FLATTEN": False}, num_stages=3, num_warps=4)
    broken = triton.Config({"BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 1}, num_stages=4, num_warps=8)
    tuner = type("Tuner", (), {"configs_timings": {slow: [2.0, 1.9, 2.1], fast: [1.0], broken: float("inf")}})
    assert kernels_check.config_rates(tuner, 2e9) == {"n128k64g8fs4w8": 2.0, "n64k64g1s3w4": 1.0}


def test_generate_bench_smoke_times_each_attention_and_checks_its_step_against_fp32(tmp_path):
    """bench/generate_bench.py's CPU mode: grouped attention folds the decoding step (fp32 here: the same logits as
    the reference, so the same tokens), and every attention x cache row is timed."""
    out = tmp_path / "generate.json"
    generate_bench.main(["--smoke", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["grouped_same_tokens"] == {"dynamic": True, "static-eager": True}
    for attention in ("sdpa", "grouped"):
        step = res["step_error_vs_fp32"][attention]
        assert step["max_error"] < 1e-5 and step["top1_agreement"] == 1.0
    assert {(r["attention"], r["cache"]) for r in res["rows"] if r["step_ms"] > 0 and r["prefill_s"] > 0} == {
        (a, c) for a in ("sdpa", "grouped") for c in ("dynamic", "static-eager")}


def test_generate_bench_takes_the_median_step_so_one_slow_step_does_not_move_it():
    """A decoding step is the median gap between the streamer's later stamps (the first gap is the prefill): a step
    the CPU stalled on does not move it, where a difference of two whole generate calls' times went negative."""
    clock = generate_bench.TokenClock()
    clock.stamps = [10.0, 10.5, 10.51, 10.52, 11.52, 11.53]  # prompt, first token, four steps, one of them 1 s
    prefill, step = generate_bench.prefill_and_step_s(clock)
    assert prefill == pytest.approx(0.5) and step == pytest.approx(0.01)


@pytest.mark.slow
def test_quality_bench_trains_on_a_second_sampled_answer_set(tmp_path, smollm2_path):
    """bench/train_quality_gpu.py's CPU mode, the data_x2 row: every turn answered twice (greedy, then sampled at
    --temperature), both sets merged under their own dataset names, trained and evaluated."""
    import subprocess
    import sys

    work, out = tmp_path / "q", tmp_path / "out"
    subprocess.run([sys.executable, "bench/train_quality_gpu.py", "--smoke", "--work", str(work), "--out", str(out),
                    "--ablations", "none", "--no-main", "--gen-turns", "all", "--study-data", "all",
                    "--studies", "data_x2"], check=True, capture_output=True, timeout=600)
    row = json.loads((out / "ablations.json").read_text())["rows"][0]
    assert row["name"] == "data_x2" and row["status"] == "done" and row["tau"]
    greedy = [ln for p in sorted((work / "datagen" / "greedy").glob("P*/tokenized.jsonl"))
              for ln in p.read_text().splitlines()]
    sampled = [json.loads(ln) for p in sorted((work / "datagen" / "sampled").glob("S*/tokenized.jsonl"))
               for ln in p.read_text().splitlines()]
    assert len(sampled) == len(greedy) > 0 and row["merged_rows"] == 2 * len(greedy)
    # sampled, not the greedy answers again
    assert [s["input_ids"] for s in sampled] != [json.loads(ln)["input_ids"] for ln in greedy]


# run in a fresh interpreter on the fp8w row's finished data: the training process's side of prepare_data
_FP8W_PARENT = """
import json, sys
from pathlib import Path
from eagle3.extract.backend import HFBackend
def no_load(*a, **k):
    raise AssertionError("prepare_data loaded the target for shards already complete")
HFBackend.load = no_load
from bench.quality_plan import Clock
from bench.train_quality_gpu import prepare_data
from eagle3.config import RunConfig
folder = Path(sys.argv[1])
cfg = RunConfig.from_dict(json.loads((folder / "fp8_extract_config.json").read_text()))
dirs, merged = prepare_data(cfg, Clock(1e12, folder / "clock.json"), "fp8")
print(json.dumps({"dirs": dirs, "modules": sorted(m for m in ("torchao", "bench.extract_fp8") if m in sys.modules)}))
"""


@pytest.mark.slow
def test_quality_bench_extracts_the_fp8_weights_row_in_a_child_process(tmp_path, smollm2_path):
    """bench/train_quality_gpu.py's fp8w_first row: its shards come from bench/extract_fp8.py in a child process
    (torchao never enters the training process: a compiled training hung in one that had quantized with it, H100);
    with every shard complete, no child starts and no target loads; a child's failure fails with its output."""
    import subprocess
    import sys
    from dataclasses import replace

    from bench.train_quality_gpu import extract_fp8_child
    from eagle3.config import RunConfig
    from eagle3.errors import PipelineError

    work, out = tmp_path / "q", tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "bench/train_quality_gpu.py", "--smoke", "--work", str(work), "--out",
                             str(out), "--ablations", "none", "--no-main", "--studies", "fp8w_first"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = proc.communicate(timeout=600)[0].decode(errors="replace")
    assert proc.returncode == 0, output[-3000:]
    row = json.loads((out / "ablations.json").read_text())["rows"][0]
    assert row["name"] == "fp8w_first" and row["status"] == "done" and row["tau"]
    folder = next(work.glob("data-*-fp8w"))
    record = json.loads((folder / "fp8_extract.json").read_text())
    # the extraction ran in a child of the training process, which loaded (and quantized) the target
    assert record["parent_pid"] == proc.pid and record["pid"] != proc.pid and record["loaded_target"]
    assert json.loads((folder / "fp8_state_error.json").read_text())["pid"] == record["pid"]
    assert [s["complete"] for s in record["shards"]] == [True]
    assert "fp8 extraction in a child process" in output

    # the training process's side again, the shards complete: no child, no target, neither torchao nor extract_fp8
    log_size = (folder / "fp8_extract.log").stat().st_size
    res = subprocess.run([sys.executable, "-c", _FP8W_PARENT, str(folder)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"dirs": [s["shard_dir"] for s in record["shards"]], "modules": []}
    assert (folder / "fp8_extract.log").stat().st_size == log_size

    # a child that fails (no merged data to plan shards from) fails the row with the end of its output
    cfg = RunConfig.from_dict(json.loads((folder / "fp8_extract_config.json").read_text()))
    bad = tmp_path / "bad"
    cfg = replace(cfg, plan=replace(cfg.plan, merge_dir=str(bad / "no-merge")),
                  extract=replace(cfg.extract, extract_dir=str(bad / "extract")))
    with pytest.raises(PipelineError, match=r"exited 1: .*no-merge") as e:
        extract_fp8_child(cfg)
    assert "fp8_extract.log); its output ends:\n" in str(e.value) and (bad / "fp8_extract_config.json").is_file()
