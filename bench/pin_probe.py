"""What pinning a host chunk buffer costs, and whether it holds up the GPU work of another thread.

For each way torch can pin (`cudaHostAlloc`, its default; or `malloc` + page faults in N threads +
`cudaHostRegister`, the allocator settings `pinned_use_cuda_host_register:True,pinned_num_register_threads:N`):
  - alone: seconds to pin `--gb` buffers of 1 GB, one after another (torch's cache of pinned blocks emptied first);
  - beside GPU work: a thread pins the same while the main thread launches 8B-sized matmuls and a sync after each;
    reported as the main thread's slowest step and its total time against the same steps with no pinning.

    python bench/pin_probe.py --gb 4 --modes alloc,register-1,register-8,alloc --out pin.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from extract_bench import empty_pinned_host_cache  # noqa: E402


def set_mode(mode: str) -> None:
    if mode == "alloc":
        conf = "pinned_use_cuda_host_register:False"
    else:
        conf = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{int(mode.split('-')[1])}"
    # torch 2.11 has no public call for it; the older name warns that it is deprecated
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(conf)


def pin(n_gb: int, out: list) -> float:
    t = time.perf_counter()
    for _ in range(n_gb):
        out.append(torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True))
    return time.perf_counter() - t


def gpu_steps(a, b, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        torch.matmul(a, b)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=int, default=4)
    ap.add_argument("--modes", default="alloc,register-1,register-8")
    ap.add_argument("--steps", type=int, default=150,
                    help="matmul steps the GPU thread takes at least (8192 x 4096 x 14336 bf16, ~1.5 ms each)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
    gpu_steps(a, b, 20)
    quiet = gpu_steps(a, b, args.steps)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "gb": args.gb, "quiet_steps_s": sum(quiet), "quiet_max_step_s": max(quiet), "modes": {}}
    print(f"matmul steps alone: {sum(quiet):.3f} s, slowest {1e3 * max(quiet):.1f} ms", flush=True)
    for mode in args.modes.split(","):
        set_mode(mode)
        empty_pinned_host_cache()
        bufs: list = []
        alone = pin(args.gb, bufs)
        del bufs
        empty_pinned_host_cache()
        bufs = []
        took = {}
        th = threading.Thread(target=lambda: took.setdefault("s", pin(args.gb, bufs)))
        t = time.perf_counter()
        th.start()
        steps = []
        while th.is_alive() or len(steps) < args.steps:
            steps += gpu_steps(a, b, 1)
        th.join()
        busy = time.perf_counter() - t
        n = len(steps)
        expect = sum(quiet) / len(quiet) * n
        key = mode if mode not in res["modes"] else f"{mode} (again)"
        res["modes"][key] = {"pin_alone_s": alone, "pin_beside_gpu_s": took["s"], "steps": n,
                             "steps_s": sum(steps), "steps_expected_s": expect, "max_step_s": max(steps),
                             "wall_s": busy}
        print(f"{mode}: pin {args.gb} GB alone {alone:.2f} s ({args.gb / alone:.2f} GB/s); beside the GPU work "
              f"{took['s']:.2f} s, the GPU thread's {n} steps took {sum(steps):.2f} s against {expect:.2f} s "
              f"without pinning, slowest step {1e3 * max(steps):.0f} ms", flush=True)
        del bufs
        empty_pinned_host_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
