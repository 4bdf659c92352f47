"""FP8 on load, for bench/extract_bench.py (--fp8-weights, --fp8-blocks) and the quality run's fp8-weights row: the
target quantized in place (torchao, or DeepSeek-V3's FP8 checkpoint layout run by the project's kernels), the error
of its captured states against bf16, and the roofline of an FP8 forward (its linears at the FP8 matmul rate).

    python bench/extract_fp8.py CONFIG.json     # the quality run's fp8w rows: their shards, in a process of its own

As a script it extracts one data variant's shards from the target FP8 on load (extract_fp8_shards): the quality run
(bench/train_quality_gpu.py prepare_data) starts it as a child, so torchao never enters the training process (on an
H100, torch 2.11 + torchao 0.17, the compiled training hung in a process that had quantized a model with torchao).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # as a script: the repository's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.extract_limits import matmul_sustained  # noqa: E402
from eagle3.extract.backend import HFBackend  # noqa: E402
from eagle3.extract.fused_moe import FP8_MAX  # noqa: E402
from eagle3.flops import active_linear_params  # noqa: E402

CHILD_RECORD = "fp8_extract.json"  # beside fp8_state_error.json: which process extracted the shards, their summaries

# torchao's config quantizes nn.Linear modules: attention, dense MLPs, shared experts; transformers keeps the routed
# experts as 3D parameters run by grouped_mm, which it does not reach
_EXPERTS_NOTE = "; routed experts (3D grouped weights) stay in the compute dtype"


def quantize_fp8(model, experts: bool = False) -> str:
    """FP8 on load, in place. On a GPU: torchao's float8 dynamic activations with per-row e4m3 weights on the
    decoder (the `fp8` extra; compute capability >= 8.9); the lm_head is never run. On the CPU, where those
    kernels do not run: every decoder linear weight rounded to e4m3 with one scale per row, kept in the compute
    dtype (checks the code path, not the rate). `experts`: the routed experts too, as float8 in 128 x 128 blocks
    that only experts_implementation='triton_fused' reads (eagle3.extract.fused_moe.quantize_experts)."""
    from eagle3.extract.moe import experts_modules

    routed = experts_modules(model)
    if model.device.type == "cuda":
        import torchao
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

        quantize_(model.model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
        method = f"torchao {torchao.__version__} Float8DynamicActivationFloat8Weight PerRow"
    else:
        with torch.no_grad():
            for mod in model.model.layers.modules():
                if isinstance(mod, torch.nn.Linear):
                    w = mod.weight.float()
                    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX
                    mod.weight.copy_(((w / scale).to(torch.float8_e4m3fn).float() * scale).to(mod.weight.dtype))
        method = "simulated: decoder linear weights rounded to e4m3, per-row scales"
    if routed and experts:
        from eagle3.extract.fused_moe import quantize_experts

        for module in routed:
            quantize_experts(module)
        return method + "; routed experts float8 in 128 x 128 blocks, run in FP8 by triton_fused"
    return method + _EXPERTS_NOTE * bool(routed)


def quantize_fp8_blocks(model) -> str:
    """FP8 on load in DeepSeek-V3's FP8 checkpoint layout, in place: every decoder linear whose in_features is whole
    blocks as transformers' FP8Linear, and the routed experts, in float8 with a float32 scale per 128 x 128 block,
    run by the project's kernels (extract fp8_linear='triton', experts_implementation='triton_fused'; no torchao,
    no hub kernel). The path the reference job's real target takes; on the CPU the kernels run interpreted."""
    from eagle3.extract.fp8_linear import quantize_linears
    from eagle3.extract.fused_moe import quantize_experts
    from eagle3.extract.moe import experts_modules

    linears = quantize_linears(model)
    routed = experts_modules(model) if fp8_experts_fit(model) else []
    for module in routed:
        quantize_experts(module)
    return (f"float8 128 x 128 blocks (DeepSeek-V3's FP8 checkpoint layout): {linears} decoder linears through "
            f"fp8_linear='triton'" + (", routed experts through triton_fused" if routed else "")
            + _EXPERTS_NOTE * bool(experts_modules(model) and not routed))


def fp8_experts_fit(model) -> bool:
    """Can the routed experts go to 128 x 128 FP8 blocks (hidden and expert width whole blocks)?"""
    from eagle3.extract.fused_moe import whole_fp8_blocks
    from eagle3.extract.moe import experts_modules

    routed = experts_modules(model)
    return bool(routed) and whole_fp8_blocks(routed[0])


@torch.inference_mode()
def states_error(ref_model, model, layers: list[int], dtype_name: str, ids: torch.Tensor,
                 experts: str = "auto") -> list[dict]:
    """Per capture layer and the final state: relative L2 error and mean cosine of `model`'s states (through the
    `experts` kernel) against `ref_model`'s on the same ids. Random weights say how fast, not how accurate a
    trained model would be."""
    backends = [HFBackend(model=ref_model), HFBackend(model=model, experts=experts)]
    for b in backends:
        b.load("random", dtype_name, str(ids.device), layers)
    (ra, rf), (qa, qf) = (b.capture(ids) for b in backends)
    out = []
    for name, r, q in [*[(f"hidden_states[{i}]", a, b) for i, a, b in zip(layers, ra, qa)], ("final", rf, qf)]:
        r, q = r.float().flatten(0, 1), q.float().flatten(0, 1)
        out.append({"layer": name, "rel_l2": ((q - r).norm() / r.norm()).item(),
                    "cosine_mean": torch.nn.functional.cosine_similarity(q, r, dim=-1).mean().item(),
                    "ref_abs_max": r.abs().max().item()})
    return out


def fp8_extraction_backend(model_path, capture: list[int], folder: Path):
    """The real target quantized to FP8 on load (quantize_fp8), as an extraction backend (the quality run's
    fp8-weights row); beside it, the relative error of its captured states against bf16 per capture layer on 8
    prompts of real text, written once to <folder>/fp8_state_error.json (with the pid of the process that
    quantized)."""
    from eagle3.models import load_model, load_tokenizer
    from tests.support.selfdistill import make_prompts

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    model, ref = (load_model(model_path, dtype=dtype).to(device) for _ in range(2))
    method = quantize_fp8(model)
    path = Path(folder) / "fp8_state_error.json"
    if not path.exists():
        tok = load_tokenizer(model_path)
        ids = [tok(p)["input_ids"] for p in make_prompts(8)]
        n = min(map(len, ids))
        err = states_error(ref, model, capture, dtype, torch.tensor([x[:n] for x in ids], device=device))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"method": method, "tokens": 8 * n, "layers": err, "pid": os.getpid()}, indent=2))
        print(f"fp8 weights ({method}): " + ", ".join(f"{e['layer']} rel L2 {e['rel_l2']:.4f}" for e in err),
              flush=True)
    return HFBackend(model=model)


def extract_fp8_shards(config_path) -> list[dict]:
    """Every shard of one data variant (a RunConfig's to_dict, as JSON at `config_path`: its plan and extract
    sections) extracted from the target FP8 on load (fp8_extraction_backend), in this process; the target is loaded
    only when a shard is left to do. Writes <extract_dir>/../fp8_extract.json: this process's pid and its parent's,
    the shards' summaries. The quality run's child (its parent checks the shards complete and reads them)."""
    from eagle3.config import RunConfig
    from eagle3.extract.extractor import ShardExtractor
    from eagle3.extract.plan import plan_shards
    from eagle3.extract.run import extract_shard

    cfg = RunConfig.from_dict(json.loads(Path(config_path).read_text()))
    folder, t = Path(cfg.extract.extract_dir).parent, cfg.extract.target
    specs = plan_shards(cfg.plan)
    backend = None
    if any(ShardExtractor(cfg.extract, spec).completed_summary() is None for spec in specs):
        backend = fp8_extraction_backend(t.model_path, t.capture_layers, folder)
    shards = [extract_shard(cfg.extract, spec, backend=backend) for spec in specs]
    record = {"pid": os.getpid(), "parent_pid": os.getppid(), "loaded_target": backend is not None,
              "torchao": "torchao" in sys.modules, "shards": shards}
    (folder / CHILD_RECORD).write_text(json.dumps(record, indent=1))
    return shards


def fp8_roofline(device, dtype, n: int, seconds: float, cfg, tokens: int, flops: float) -> dict:
    """The roofline of a forward whose linears run in FP8 (`--fp8-blocks`): their FLOPs (2 x active linear params a
    token) at the sustained FP8 matmul rate, the rest (attention) at the compute dtype's, both probed here back to
    back for `seconds` each (n x n x n, float8 e4m3 operands with float32 scales: torch._scaled_mm)."""
    fp8 = matmul_sustained(device, dtype, n, seconds, fp8=True)
    dense = matmul_sustained(device, dtype, n, seconds)
    linear = 2.0 * active_linear_params(cfg.to_dict()) * tokens
    seconds_at_roofline = linear / fp8["sustained"] + max(flops - linear, 0.0) / dense["sustained"]
    return {"fp8_matmul": fp8, "dense_matmul": dense, "fp8_over_dense": fp8["sustained"] / dense["sustained"],
            "roofline_tok_per_s": tokens / seconds_at_roofline}


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s fp8-extract %(name)s %(message)s", stream=sys.stdout)
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} CONFIG.json (a RunConfig's to_dict)")
    extract_fp8_shards(sys.argv[1])
