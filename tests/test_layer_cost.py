"""bench/layer_cost.py: one MoE layer's cost from extract_bench runs of the DeepSeek-V3 shape at several depths."""

import json

import pytest

from bench import layer_cost


def bench_result(layers: int, us_rest: float, us_layer: float, roof_rest: float, roof_layer: float,
                 kinds_layer: dict | None = None, device: str = "NVIDIA H100 80GB HBM3") -> dict:
    """An extract_bench result (the fields layer_cost reads) of a target whose token costs `us_rest + n * us_layer`
    (n MoE layers) measured and `roof_rest + n * roof_layer` at the roofline; profiled when kinds_layer is given
    (the rest's kernels all "gemm", and a copy-out beside them)."""
    n = layers - layer_cost.DENSE_LAYERS
    tokens = 2_000_000
    us = us_rest + n * us_layer
    model = {"extractor": {"tokens": tokens, "steady_tok_per_s": 1e6 / us},
             "matmul_sustained": {"roofline_tok_per_s": 1e6 / (roof_rest + n * roof_layer)}}
    if kinds_layer is not None:
        kinds_us = {k: n * v for k, v in kinds_layer.items()}
        kinds_us["gemm"] = kinds_us.get("gemm", 0.0) + us_rest
        kernel_s, copy_s = us * tokens / 1e6, 2.0
        every = kernel_s + copy_s
        shares = {k: v * tokens / 1e6 / every for k, v in kinds_us.items()}
        model["extractor_profile"] = {"tokens": tokens, "compute_kernel_s": kernel_s, "copy_s": copy_s,
                                      "compute_busy_share": 0.9, "kinds": {**shares, "copy": copy_s / every}}
    return {"argv": ["--models", "dsv3", f"--dsv3-layers={layers}"], "device": device, "models": {"dsv3": model}}


def test_layer_cost_recovers_the_moe_layer_and_the_full_depth_fraction():
    kinds = {"experts_gemm": 1.2, "gemm": 0.8, "attention": 0.5}  # 2.5 us a MoE layer
    runs = [bench_result(4, 7.0, 2.5, 6.0, 2.0, kinds), bench_result(5, 7.0, 2.5, 6.0, 2.0, kinds),
            bench_result(5, 7.0, 2.5, 6.0, 2.0)]  # an unprofiled run counts for the steady line only
    costs = layer_cost.layer_costs(runs)
    assert costs["moe_layers"] == [1, 2] and costs["full_moe_layers"] == 58
    assert costs["roofline"]["moe_layer_us"] == pytest.approx(2.0)
    for metric in ("steady", "kernels"):
        c = costs[metric]
        assert c["moe_layer_us"] == pytest.approx(2.5) and c["rest_us"] == pytest.approx(7.0)
        assert c["moe_layer_fraction"] == pytest.approx(0.8) and c["rest_fraction"] == pytest.approx(6 / 7)
        assert c["full_depth_fraction"] == pytest.approx((6 + 58 * 2) / (7 + 58 * 2.5))
    assert costs["kernels"]["moe_layer_by_kind_us"] == pytest.approx(kinds)


def test_layer_cost_keeps_the_two_measures_apart_and_refuses_what_it_cannot_difference(tmp_path, capsys):
    # the steady rates say 2.5 us a MoE layer, the kernels 3.0: each line is fitted on its own
    runs = [bench_result(4, 7.0, 2.5, 6.0, 2.0), bench_result(5, 7.0, 2.5, 6.0, 2.0)]
    for r, layers in zip(runs, (4, 5)):
        r["models"]["dsv3"]["extractor_profile"] = bench_result(layers, 7.0, 3.0, 6.0, 2.0, {"gemm": 3.0})[
            "models"]["dsv3"]["extractor_profile"]
    paths = []
    for i, r in enumerate(runs):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(r))
    assert layer_cost.main([*map(str, paths), "--out", str(tmp_path / "costs.json")]) == 0
    costs = json.loads((tmp_path / "costs.json").read_text())
    assert costs["steady"]["moe_layer_fraction"] == pytest.approx(0.8)
    assert costs["kernels"]["moe_layer_fraction"] == pytest.approx(2 / 3)
    assert "one MoE layer 3.000 us a token against 2.000 at the roofline = 67%" in capsys.readouterr().out

    with pytest.raises(ValueError, match="several devices"):
        layer_cost.layer_costs([runs[0], bench_result(5, 7.0, 2.5, 6.0, 2.0, device="NVIDIA H200")])
    unnamed = bench_result(4, 7.0, 2.5, 6.0, 2.0)
    unnamed["argv"] = ["--models", "dsv3"]
    with pytest.raises(ValueError, match="--dsv3-layers"):
        layer_cost.layer_costs([unnamed, runs[1]])
    other_shard = bench_result(5, 7.0, 2.5, 6.0, 2.0)
    other_shard["models"]["dsv3"]["extractor"]["tokens"] = 1_000_000
    with pytest.raises(ValueError, match="the same shard's only"):
        layer_cost.layer_costs([runs[0], other_shard])
    with pytest.raises(ValueError, match=r"runs at \[5\] layers only"):
        layer_cost.layer_costs([runs[1], bench_result(5, 7.0, 2.5, 6.0, 2.0)])
    # two depths, one of them profiled: the kernels' line needs both, so only the steady one is given
    partial = layer_cost.layer_costs([bench_result(4, 7.0, 2.5, 6.0, 2.0), runs[1]])
    assert "kernels" not in partial and partial["steady"]["moe_layer_us"] == pytest.approx(2.5)
