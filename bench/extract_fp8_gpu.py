"""FP8 target benchmark: extraction rate of an 8B-shape target quantized to FP8 on load vs bf16, and how far the
captured states move.

On the GPU: a random-weight Llama-3.1-8B shape in bf16, then the same weights quantized with torchao
(`Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())` on the decoder: e4m3 weights with one scale
per row, activations quantized per row on the fly; the lm_head is never run). Both go through the real extractor
(eagle3.extract.extractor, hf backend, compiled) on the same samples; then one batch is captured by both and the
fp8 states are compared with bf16's per capture layer (relative L2 error, mean cosine). Random weights say how
fast, not how accurate a trained model would be: measure the error on real weights before trusting FP8 states.

    python bench/extract_fp8_gpu.py --tokens 6e5 --out fp8.json         # the device: needs the torchao wheel
    python bench/extract_fp8_gpu.py --smoke                               # CPU: tiny shape, simulated fp8

--smoke runs on the CPU with a tiny shape, in fp32, and simulates FP8 by rounding every decoder weight to e4m3
with one scale per row (torchao's float8 kernels need a GPU of compute capability >= 8.9): it checks the code
path, not the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.extract_bench import SHAPES, build_model, make_samples, run_extractor  # noqa: E402
from eagle3.extract.backend import HFBackend  # noqa: E402

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024, max_position_embeddings=2048, rope_theta=10000.0,
            tie_word_embeddings=True)
FP8_MAX = 448.0


def quantize_torchao(model) -> str:
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    quantize_(model.model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    import torchao

    return f"torchao {torchao.__version__} Float8DynamicActivationFloat8Weight PerRow"


@torch.no_grad()
def quantize_simulated(model) -> str:
    """Every decoder linear weight rounded to e4m3 with one scale per output row, kept in the compute dtype."""
    for name, mod in model.model.layers.named_modules():
        if isinstance(mod, torch.nn.Linear):
            w = mod.weight.float()
            scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX
            mod.weight.copy_(((w / scale).to(torch.float8_e4m3fn).float() * scale).to(mod.weight.dtype))
    return "simulated: decoder weights rounded to e4m3, per-row scales"


@torch.inference_mode()
def states_error(ref_model, fp8_model, layers, ids: torch.Tensor) -> list[dict]:
    """Per capture layer (and the final state): relative L2 error and mean cosine of fp8's states vs bf16's."""
    out = []
    ref_b, q_b = HFBackend(model=ref_model), HFBackend(model=fp8_model)
    dev, dtype = str(ids.device), {torch.bfloat16: "bfloat16", torch.float32: "float32"}[ref_model.dtype]
    for b in (ref_b, q_b):
        b.load("random", dtype, dev, layers)
    (ra, rf), (qa, qf) = ref_b.capture(ids), q_b.capture(ids)
    for name, r, q in [*[(f"hidden_states[{i}]", a, b) for i, a, b in zip(layers, ra, qa)], ("final", rf, qf)]:
        r, q = r.float().flatten(0, 1), q.float().flatten(0, 1)
        out.append({"layer": name, "rel_l2": ((q - r).norm() / r.norm()).item(),
                    "cosine_mean": torch.nn.functional.cosine_similarity(q, r, dim=-1).mean().item(),
                    "ref_abs_max": r.abs().max().item()})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=float, default=6e5)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--writers", type=int, default=6)
    ap.add_argument("--chunk-mb", type=int, default=1024)
    ap.add_argument("--compile", default="true", choices=("true", "false"))
    ap.add_argument("--work-dir", default="bench_work_fp8")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, simulated fp8 (see the docstring)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    smoke = a.smoke or not torch.cuda.is_available()
    if smoke:
        device, dtype, shape, quantize, compile = torch.device("cpu"), torch.float32, "tiny", quantize_simulated, False
        a.tokens, a.min_len, a.max_len, a.budget, a.writers, a.chunk_mb = 3000, 64, 400, 1024, 2, 1
        SHAPES["tiny"] = TINY
    else:
        device, dtype, shape, quantize, compile = torch.device("cuda"), torch.bfloat16, "8b", quantize_torchao, \
            a.compile == "true"
    dtype_name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    ref, _ = build_model(shape, device, dtype, None)
    L = ref.config.num_hidden_layers
    layers = [2, L // 2, L - 3]
    samples = make_samples(int(a.tokens), a.min_len, a.max_len, ref.config.vocab_size, seed=1)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "shape": shape,
              "smoke": smoke, "tokens": int(a.tokens), "compute_dtype": dtype_name, "compile": compile, "torch": torch.__version__}
    work = Path(a.work_dir)
    t = time.perf_counter()
    result["bf16"] = run_extractor(ref, f"random-{shape}", samples, layers, device, dtype_name, work / "bf16",
                                   a.budget, a.writers, a.chunk_mb, compile=compile)
    print(f"bf16 (compute {dtype_name}): {result['bf16']['tok_per_s']:.0f} tok/s ({time.perf_counter() - t:.0f} s)", flush=True)
    fp8, _ = build_model(shape, device, dtype, None)  # the same seed: the same weights
    result["fp8_method"] = quantize(fp8)
    t = time.perf_counter()
    result["fp8"] = run_extractor(fp8, f"random-{shape}-fp8", samples, layers, device, dtype_name, work / "fp8",
                                  a.budget, a.writers, a.chunk_mb, compile=compile)
    print(f"fp8:  {result['fp8']['tok_per_s']:.0f} tok/s ({time.perf_counter() - t:.0f} s)", flush=True)
    result["fp8_over_bf16"] = result["fp8"]["tok_per_s"] / max(result["bf16"]["tok_per_s"], 1e-9)
    n = min(256, len(samples[0]), len(samples[1]))
    ids = torch.tensor([samples[0][:n], samples[1][:n]], device=device)
    result["state_error"] = states_error(ref, fp8, layers, ids)
    for e in result["state_error"]:
        print(f"  {e['layer']:>18}: rel L2 {e['rel_l2']:.4f}, cosine {e['cosine_mean']:.4f}")
    print(f"fp8 / bf16 rate: {result['fp8_over_bf16']:.2f}x")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
