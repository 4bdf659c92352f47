"""Drafter training throughput and MFU on random target states (shapes only matter for speed).

One training step = TTT loss over K steps + backward + grad clip + fused AdamW, exactly the trainer's
`ttt_loss`. Shapes: the SmolLM2-135M drafter and a Llama-3-8B-shape drafter (hidden 4096). The
bf16 matmul peak is measured in the same process (the MFU denominator) and the datasheet 989 TFLOP/s
is reported beside it. Counted FLOPs = 6 x matmul weights x tokens (x K steps; fc once)
+ causal attention (QK and AV over the t+1 visible keys + the k diagonal ones, x3 for backward)
+ 2 x H x Vd for the teacher logits (no grad).

    python bench/train_speed_gpu.py [--shapes small,8b] [--modes eager,compile] [--steps 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
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
            "tokens_per_s": B * S / dt, "tflops_per_s": flops / dt / 1e12, "warmup_s": warm_s, "loss": float(loss.detach()),
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="small,8b")
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--K", type=int, default=7)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = measure_peak(device)
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "measured_bf16_tflops": peak, "datasheet_tflops": DATASHEET_TFLOPS, "results": []}
    print(json.dumps({k: v for k, v in info.items() if k != "results"}), flush=True)
    for mode in args.modes.split(","):
        for name in args.shapes.split(","):
            try:
                r = run_shape(name, mode, args.K, args.steps, device)
                r["mfu_measured_peak"] = r["tflops_per_s"] / peak
                r["mfu_datasheet"] = r["tflops_per_s"] / DATASHEET_TFLOPS
            except Exception as e:  # keep the other measurements if one mode fails (e.g. compile)
                r = {"shape": name, "mode": mode, "error": f"{type(e).__name__}: {str(e)[:400]}"}
            info["results"].append(r)
            print(json.dumps(r), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if args.out:
                Path(args.out).write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
