"""What one MoE layer of the DeepSeek-V3 shape costs, from extract_bench runs of it at two or more depths.

The reduced shape (bench/extract_moe.py: the first 3 layers dense, the rest MoE) weights its dense layers 3/4 at 4
layers and 3/7 at 7, the reference job's 61-layer target 3/61. Runs at several depths on one machine give, by a
least-squares line over the MoE layer count, what one MoE layer adds to a token: microseconds at the steady rate,
at the active-parameter roofline and, for runs with --profile-extractor, in compute kernels (by kind). The line's
intercept is the rest (the dense layers, the embedding, the final norm, the states' gather); the full depth's
fraction of the roofline is then (rest + 58 MoE layers) at the roofline over the same measured.

The kernel figures are the direct ones: the steady rate is timed between the first and the last chunk commit, whose
write lags need not cancel, and a difference of two rates magnifies that error by the depth ratio.

    python bench/layer_cost.py bench/results/moe-dsv3-{4,5}layers{,-profiled}-h100-2026-12-07-L.json \
        bench/results/moe-dsv3-5layers-again-h100-2026-12-07-L.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import extract_bench  # noqa: E402
from bench.extract_moe import _DSV3  # noqa: E402

MODEL = "dsv3"
FULL_LAYERS = 61  # DeepSeek-V3's num_hidden_layers
DENSE_LAYERS = _DSV3["first_k_dense_replace"]


def run_costs(result: dict) -> dict:
    """One extract_bench result's MoE layer count and microseconds a token: steady, roofline, and kernels by kind
    where profiled."""
    layers = extract_bench.parser().parse_args(result["argv"]).dsv3_layers  # the run's own command line
    if layers is None:
        raise ValueError("layer_cost needs runs that name --dsv3-layers (the depth the result was measured at)")
    m = result["models"][MODEL]
    tokens = m["extractor"]["tokens"]
    row = {"tokens": tokens, "moe_layers": layers - DENSE_LAYERS,
           "steady": 1e6 / m["extractor"]["steady_tok_per_s"],
           "roofline": 1e6 / m["matmul_sustained"]["roofline_tok_per_s"], "device": result["device"]}
    prof = m.get("extractor_profile")
    if prof and prof.get("compute_busy_share") is not None:  # a GPU profile: kernel times, copies beside
        row["kernels"] = 1e6 * prof["compute_kernel_s"] / prof["tokens"]
        every = prof["compute_kernel_s"] + prof["copy_s"]  # the kinds' shares are of both
        row["kinds"] = {k: 1e6 * share * every / prof["tokens"] for k, share in prof["kinds"].items() if k != "copy"}
    return row


def line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (xs, ys)."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(intercept), float(slope)


def layer_costs(results: list[dict]) -> dict:
    """Per metric: the rest and one MoE layer in microseconds a token, the MoE layer's fraction of its roofline,
    and the full depth's."""
    rows = [run_costs(r) for r in results]
    if len({r["device"] for r in rows}) > 1:
        raise ValueError(f"runs from several devices ({sorted({r['device'] for r in rows})}): one machine's only")
    if len({r["tokens"] for r in rows}) > 1:  # another shard: another mix of lengths, another cost a token
        raise ValueError(f"runs over {sorted({r['tokens'] for r in rows})} tokens: the same shard's only "
                         "(extract_bench's --tokens, the same for every run)")
    if len({r["moe_layers"] for r in rows}) < 2:
        depths = sorted({r["moe_layers"] + DENSE_LAYERS for r in rows})
        raise ValueError(f"runs at {depths} layers only: a layer's cost is a difference, it needs runs at two depths "
                         "or more")
    n_full = FULL_LAYERS - DENSE_LAYERS
    out: dict = {"device": rows[0]["device"], "runs": len(rows), "moe_layers": sorted({r["moe_layers"] for r in rows}),
                 "full_moe_layers": n_full}
    roof = line([r["moe_layers"] for r in rows], [r["roofline"] for r in rows])
    out["roofline"] = {"rest_us": roof[0], "moe_layer_us": roof[1]}
    for metric in ("steady", "kernels"):
        have = [r for r in rows if metric in r]
        if len({r["moe_layers"] for r in have}) < 2:
            continue
        rest, layer = line([r["moe_layers"] for r in have], [r[metric] for r in have])
        out[metric] = {"rest_us": rest, "moe_layer_us": layer, "moe_layer_fraction": roof[1] / layer,
                       "rest_fraction": roof[0] / rest,
                       "full_depth_fraction": (roof[0] + n_full * roof[1]) / (rest + n_full * layer)}
    profiled = [r for r in rows if "kinds" in r]
    if len({r["moe_layers"] for r in profiled}) >= 2:
        kinds = sorted({k for r in profiled for k in r["kinds"]})
        out["kernels"]["moe_layer_by_kind_us"] = {
            k: line([r["moe_layers"] for r in profiled], [r["kinds"].get(k, 0.0) for r in profiled])[1] for k in kinds}
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path,
                    help="JSONs of `extract_bench.py --models dsv3 --dsv3-layers N`, one shard (--tokens), one machine")
    ap.add_argument("--out", type=Path, help="where the figures go as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    costs = layer_costs([json.loads(p.read_text()) for p in a.results])
    for metric in ("steady", "kernels"):
        c = costs.get(metric)
        if c:
            roof = costs["roofline"]["moe_layer_us"]
            print(f"{metric}: one MoE layer {c['moe_layer_us']:.3f} us a token against {roof:.3f} at the roofline = "
                  f"{100 * c['moe_layer_fraction']:.0f}%; the rest {100 * c['rest_fraction']:.0f}%; at {FULL_LAYERS} "
                  f"layers {100 * c['full_depth_fraction']:.0f}%")
    for k, us in costs.get("kernels", {}).get("moe_layer_by_kind_us", {}).items():
        print(f"  one MoE layer's {k}: {us:.3f} us a token")
    if a.out:
        a.out.write_text(json.dumps(costs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
