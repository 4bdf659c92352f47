"""Drafter training benchmark: throughput and MFU on one GPU; with --gpus N, 1 vs N GPUs through the real trainer.

Speed (one GPU, random target states: shapes only matter for speed). One training step = TTT loss over K steps
+ backward + grad clip + fused AdamW, exactly the trainer's `ttt_loss`. Shapes: the SmolLM2-135M drafter and a
Llama-3-8B-shape drafter (hidden 4096). The bf16 matmul peak is measured in the same process (the MFU denominator)
and the datasheet 989 TFLOP/s is reported beside it. Counted FLOPs = 6 x matmul weights x tokens (x K steps; fc once)
+ causal attention (QK and AV over the t+1 visible keys + the k diagonal ones, x3 for backward)
+ 2 x H x Vd for the teacher logits (no grad).

Scaling (--gpus N): eagle3.train.trainer.train, DDP or FSDP2 over NCCL, on 1 and N GPUs: the same global batch
must give the same loss curve, and N GPUs should train ~N x the tokens per second. The target is a random-weight
Llama of SmolLM2's width (4 layers: only its embedding, lm_head and the states it produces matter), the data
512-token random samples whose states the reference extractor writes; batch_size 8 x grad_accum 1.

    python bench/train_bench.py [--shapes small,8b] [--modes eager,compile] [--steps 8] [--out FILE]
    python bench/train_bench.py --gpus 2 [--parallel ddp,fsdp] [--steps 30] [--out FILE]
    python bench/train_bench.py --smoke     # CPU: both, tiny shapes (scaling: 2 gloo ranks)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eagle3.train.model import DrafterConfig, Eagle3Drafter, drafter_matmul_params  # noqa: E402
from eagle3.train.trainer import ttt_loss  # noqa: E402

SHAPES = {
    "small": dict(cfg=DrafterConfig(576, 1536, 9, 3, 64, 32000, 49152, 1e-5, 1e5), batch=8, seq=2048),
    "8b": dict(cfg=DrafterConfig(4096, 14336, 32, 8, 128, 32000, 128256, 1e-5, 5e5), batch=4, seq=2048),
    "tiny": dict(cfg=DrafterConfig(64, 128, 4, 2, 16, 500, 1000), batch=2, seq=64),  # CPU dry run of this script
}
DATASHEET_TFLOPS = 989.0


def step_flops(cfg: DrafterConfig, B: int, S: int, K: int) -> float:
    w = drafter_matmul_params(cfg)
    tokens = B * (S - 1)
    dense = 6 * tokens * (w["fc"] + K * w["step"])
    # causal: slot t sees t+1 step-0 keys; QK^T and AV are 2*d flops each per key per head
    keys = B * S * (S + 1) / 2 * K + tokens * K * (K - 1) / 2
    attn = 3 * 4 * cfg.num_attention_heads * cfg.head_dim * keys
    teacher = 2 * tokens * cfg.hidden_size * cfg.draft_vocab_size
    return dense + attn + teacher


def measure_peak(device) -> float:
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 50
    for _ in range(n):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * n / (time.perf_counter() - t) / 1e12


def run_shape(name: str, mode: str, K: int, steps: int, device) -> dict:
    spec = SHAPES[name]
    cfg, B, S = spec["cfg"], spec["batch"], spec["seq"]
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg).to(device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=device.type == "cuda")
    H = cfg.hidden_size
    sdt = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU dry run has no autocast
    # frozen target pieces and one random batch of "extracted" states in the storage dtype (bf16)
    embed = (torch.randn(cfg.target_vocab_size, H, device=device) * 0.02).to(sdt)
    head = (torch.randn(cfg.draft_vocab_size, H, device=device) * 0.02).to(sdt)
    batch = {
        "input_ids": torch.randint(0, cfg.target_vocab_size, (B, S), device=device),
        "loss_mask": torch.ones(B, S, dtype=torch.bool, device=device),
        "aux": torch.randn(B, S, 3 * H, device=device, dtype=sdt),
        "final": torch.randn(B, S, H, device=device, dtype=sdt),
    }
    loss_fn = torch.compile(ttt_loss) if mode == "compile" else ttt_loss
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss, stats = loss_fn(drafter, batch, embed, head, K, 0.8)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
        opt.step()
        return loss

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(3):
        step()
    sync()
    warm_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    dt = (time.perf_counter() - t) / steps
    flops = step_flops(cfg, B, S, K)
    return {"shape": name, "mode": mode, "K": K, "batch": B, "seq": S, "hidden": H, "draft_vocab": cfg.draft_vocab_size,
            "params_M": sum(p.numel() for p in drafter.parameters()) / 1e6, "step_s": dt,
            "tokens_per_s": B * S / dt, "tflops_per_s": flops / dt / 1e12, "warmup_s": warm_s,
            "loss": float(loss.detach()),
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None}


# -- scaling: 1 vs N GPUs through the real trainer ------------------------------------------

def build_target(out: Path, smoke: bool) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=1000) if smoke else dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                                     num_key_value_heads=3, vocab_size=49152)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=4, tie_word_embeddings=False, **shape))
    model.save_pretrained(str(out))
    return out


SCALING_CAPTURE = [1, 2, 3]  # of the 4-layer scaling target


def build_shards(target: Path, out: Path, samples: int, length: int, device: str) -> list[Path]:
    from eagle3.models import load_model
    from tests.support.selfdistill import write_shards

    model = load_model(target, device=device)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    data = [{"input_ids": torch.randint(3, vocab, (length,), generator=g).tolist(),
             "loss_mask": [0] * (length // 4) + [1] * (length - length // 4)} for _ in range(samples)]
    return write_shards(model, data, out, SCALING_CAPTURE, num_shards=1, chunk_samples=16, model_path=str(target))


def run_trainer(target: Path, shards: list[Path], out: Path, gpus: int, parallel: str, steps: int, device: str) -> dict:
    from eagle3.sections import TargetConfig
    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import read_metrics, train

    section = TargetConfig(model_path=str(target), capture_layers=SCALING_CAPTURE).resolved()
    cfg = TrainConfig(target=section, shard_dirs=[str(s) for s in shards], output_dir=str(out),
                      batch_size=8, max_steps=steps, ttt_steps=7, lr=1e-3, checkpoint_every=steps, seed=0,
                      device=device, num_gpus=gpus, parallel=parallel, draft_vocab_size=8000)
    t0 = time.time()
    train(cfg)
    seconds = time.time() - t0
    m = read_metrics(out / "metrics.jsonl")
    return {"gpus": gpus, "parallel": parallel, "seconds_with_startup": round(seconds, 1),
            "tokens_per_s_last": round(m[-1]["tokens_per_s"]), "loss": [r["loss"] for r in m]}


def scaling(gpus: int, parallels: str, steps: int, smoke: bool) -> dict:
    device = "cpu" if smoke else "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target = build_target(root / "target", smoke)
        shards = build_shards(target, root / "shards", 16 if smoke else 512, 64 if smoke else 512, device)
        results = [run_trainer(target, shards, root / "n1", 1, "ddp", steps, device)]
        for parallel in parallels.split(","):
            results.append(run_trainer(target, shards, root / f"n{gpus}-{parallel}", gpus, parallel, steps, device))
    ref = torch.tensor(results[0]["loss"])
    for r in results[1:]:
        r["max_abs_loss_diff_vs_1"] = (torch.tensor(r["loss"]) - ref).abs().max().item()
        r["speedup_vs_1"] = round(r["tokens_per_s_last"] / max(1, results[0]["tokens_per_s_last"]), 2)
    return {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "steps": steps,
            "results": [{k: v for k, v in r.items() if k != "loss"} | {"first_loss": r["loss"][0],
                                                                      "last_loss": r["loss"][-1]} for r in results]}


def speed(shapes: str, modes: str, K: int, steps: int, out: str) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = measure_peak(device)
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "measured_bf16_tflops": peak, "datasheet_tflops": DATASHEET_TFLOPS, "results": []}
    print(json.dumps({k: v for k, v in info.items() if k != "results"}), flush=True)
    for mode in modes.split(","):
        for name in shapes.split(","):
            try:
                r = run_shape(name, mode, K, steps, device)
                r["mfu_measured_peak"] = r["tflops_per_s"] / peak
                r["mfu_datasheet"] = r["tflops_per_s"] / DATASHEET_TFLOPS
            except Exception as e:  # keep the other measurements if one mode fails (e.g. compile)
                r = {"shape": name, "mode": mode, "error": f"{type(e).__name__}: {str(e)[:400]}"}
            info["results"].append(r)
            print(json.dumps(r), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if out:
                Path(out).write_text(json.dumps(info, indent=1))
    return info


def parser() -> argparse.ArgumentParser:
    """The command line (tests/test_device_runs.py checks docs/device-runs.md's commands against it)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="small,8b", help="speed: drafter shapes (small, 8b, tiny)")
    ap.add_argument("--modes", default="eager,compile", help="speed: eager and/or compiled")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (speed: 8) or trained steps (scaling: 30)")
    ap.add_argument("--K", type=int, default=7, help="speed: TTT steps")
    ap.add_argument("--gpus", type=int, default=1, help="N > 1: the scaling comparison, 1 vs N GPUs")
    ap.add_argument("--parallel", default="ddp,fsdp", help="scaling: the N-GPU strategies")
    ap.add_argument("--smoke", action="store_true", help="CPU: speed on a tiny shape, then scaling on 2 gloo ranks")
    ap.add_argument("--out", default="")
    return ap


def main() -> None:
    a = parser().parse_args()
    if a.smoke:
        speed("tiny", "eager", a.K, a.steps or 2, "")
        print(json.dumps(scaling(2, a.parallel, a.steps or 4, smoke=True), indent=1))
    elif a.gpus > 1:
        summary = scaling(a.gpus, a.parallel, a.steps or 30, smoke=False)
        print(json.dumps(summary, indent=1))
        if a.out:
            Path(a.out).write_text(json.dumps(summary, indent=1))
    else:
        speed(a.shapes, a.modes, a.K, a.steps or 8, a.out)


if __name__ == "__main__":
    main()
