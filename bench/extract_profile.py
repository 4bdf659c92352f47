"""Where a forward pass's time goes (bench/extract_bench.py `--profile-batches N`): the target's forward alone, on N
batches planned as the extractor plans them (eagle3.extract.batches), with the fastest variant's kernels.

Reports the forward-only rate (no writers, no host copies: what the extractor's pipeline could reach at most), the
share of the profiled wall time the GPU ran a kernel (the rest is launch and host work: what CUDA graphs could
win back), and the kernel time by kind: the routed experts' GEMMs, other GEMMs, attention, the routing and
permutation (top-k, sort, gather/scatter, index), Inductor's fused element-wise kernels, copies, the rest. On the
CPU the same table is read from the CPU operators (a smoke test of the code path, not a figure).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict

import numpy as np
import torch

from bench.extract_limits import sync
from eagle3.extract.batches import padded_length, plan_batches

# first match wins: a grouped GEMM is a GEMM, and an index kernel inside the experts is routing work
KINDS = [
    # gate_up_kernel / down_kernel: the project's fused experts (eagle3/extract/fused_moe_kernels.py); down_kernel
    # also runs an FP8 checkpoint's linears, which then count here too
    ("experts_gemm", re.compile(r"group|_grouped_mm|ptr_array|gate_up_kernel|down_kernel", re.I)),
    ("fp8_quantize", re.compile(r"quantize_kernel", re.I)),
    # before gemm: cuDNN's attention kernels are named like GEMMs (..._sdpa_sm90_flash_fprop_wgmma_...)
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|xmma|nvjet|cutlass|cublas|triton_tem|aten::(mm|bmm|addmm|linear|matmul)\b|sm90_",
                        re.I)),  # triton_tem: Inductor's GEMM templates
    ("routing", re.compile(r"sort|topk|radix|scatter|gather|index|histc|histogram|bincount|cumsum|scan|masked|"
                           r"nonzero", re.I)),
    ("fused_elementwise", re.compile(r"^triton_", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|\bcat\b|contiguous|fill", re.I)),
]

COPY_KERNEL = re.compile(r"memcpy|memset", re.I)  # the copy engines' work, not the compute stream's
# the caching allocator's device-wide synchronisations (a retry frees the cache: every stream waits)
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free", "num_ooms")
HOST_WAIT_S = 1e-3  # a CUDA runtime call this long blocked its thread (a launch takes microseconds)
GAP_BUCKETS = ((1e-4, "<0.1ms"), (1e-3, "0.1-1ms"), (1e-2, "1-10ms"), (1e-1, "10-100ms"), (float("inf"), ">100ms"))


def kind_of(kernel: str) -> str:
    return next((k for k, rx in KINDS if rx.search(kernel)), "other")


def kind_shares(times: dict[str, float]) -> dict[str, float]:
    """Each kind's share of the kernel time in `times` (kernel_times), largest first."""
    by_kind: dict[str, float] = defaultdict(float)
    for name, s in times.items():
        by_kind[kind_of(name)] += s
    total = sum(by_kind.values())
    return {k: v / total for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}


def pick_batches(t, pad_multiple, n: int) -> list[np.ndarray]:
    """n batches spread over the shard's plan (longest first, so the spread covers long and short lengths)."""
    lengths = np.array([len(s) for s in t.samples])
    batches = [b for chunk in plan_batches(lengths, np.arange(len(lengths)), t.budget, 1 << 62, pad_multiple)
               for b in chunk]
    picks = np.unique(np.linspace(0, len(batches) - 1, num=min(n, len(batches))).round().astype(int))
    return [batches[i] for i in picks]


def batch_ids(t, rows: np.ndarray, pad_multiple, device) -> tuple[torch.Tensor, int]:
    L = padded_length(max(len(t.samples[i]) for i in rows), pad_multiple)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    for j, i in enumerate(rows):
        ids[j, :len(t.samples[i])] = torch.tensor(t.samples[i])
    return ids.to(device), sum(len(t.samples[i]) for i in rows)


def kernel_times(prof, device) -> dict[str, float]:
    """Self time (seconds) per kernel (GPU) or operator (CPU) name."""
    out: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if device.type == "cuda":
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        else:
            us = e.self_cpu_time_total
        if us > 0:
            out[e.key] += us / 1e6
    return out


@torch.inference_mode()
def forward_profile(b, t, backend, n_batches: int, pad_multiple) -> dict:
    """`backend`: loaded (and compiled) as the fastest variant runs; its capture() is the forward timed."""
    from torch.profiler import ProfilerActivity, profile

    batches = [batch_ids(t, rows, pad_multiple, b.device) for rows in pick_batches(t, pad_multiple, n_batches)]

    def forward_all() -> float:
        start = time.perf_counter()
        for ids, _ in batches:
            backend.capture(ids)
        sync(b.device)
        return time.perf_counter() - start

    forward_all()  # compile and autotune each shape first
    wall = forward_all()
    real = sum(n for _, n in batches)
    padded = sum(ids.numel() for ids, _ in batches)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if b.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        wall_p = forward_all()
    times = kernel_times(prof, b.device)
    total = sum(times.values())
    top = sorted(times.items(), key=lambda kv: -kv[1])[:12]
    return {"batches": len(batches), "tokens": real, "padded_tokens": padded, "forward_wall_s": round(wall, 4),
            "kernel_s_per_mtok": 1e6 * total / real,
            "forward_tok_per_s": real / wall, "padding_share": 1 - real / padded,
            "busy_share": (total / wall_p) if b.device.type == "cuda" else None,
            "kinds": kind_shares(times),
            "top": [{"name": n[:160], "s": round(s, 5), "share": s / total, "kind": kind_of(n)} for n, s in top]}


def print_profile(name: str, p: dict, roofline: float) -> None:
    kinds = ", ".join(f"{k} {100 * v:.0f}%" for k, v in p["kinds"].items())
    busy = f"GPU busy {100 * p['busy_share']:.0f}% of the wall time; " if p["busy_share"] is not None else ""
    print(f"[{name}] forward alone on {p['batches']} planned batches: {p['forward_tok_per_s']:.0f} tok/s "
          f"({100 * p['forward_tok_per_s'] / roofline:.0f}% of the roofline), padding "
          f"{100 * p['padding_share']:.1f}%; {busy}kernel time: {kinds}", flush=True)
    for k in p["top"][:6]:
        print(f"[{name}]   {100 * k['share']:5.1f}%  {k['kind']:<17} {k['name'][:110]}", flush=True)


def run_profile(b, name: str, t, backend, pad_multiple, roofline: float) -> dict:
    """`forward_profile` through a backend built as the fastest variant (loaded here, closed after);
    `pad_multiple` resolved for the device (eagle3.extract.extractor.resolve_for_device)."""
    backend.load(t.model_path, b.dtype_name, str(b.device), t.layers)
    try:
        p = forward_profile(b, t, backend, b.args.profile_batches, pad_multiple)
    finally:
        backend.close()
    print_profile(name, p, roofline)
    return p


def extractor_profile(b, name: str, measured_run) -> dict:
    """The whole extractor profiled (host pipeline, writers and copy-out included), beside the forward alone: where
    the two part. `measured_run(around)` runs the warm extractor with its measured run inside `around()`.

    On a GPU only the device is traced (a CPU trace of the writer threads would slow the run it measures): the share
    of the run's wall time the compute kernels ran (the rest is the GPU waiting on the host), the copy-out's own
    time (another stream, beside the compute), and the compute kernel time per 1M tokens, to set against the forward
    alone's: more there is work the forward alone does not do, or the same kernels run slower beside the copies."""
    from contextlib import contextmanager

    from torch.profiler import ProfilerActivity, profile

    cuda = b.device.type == "cuda"
    held = {}

    @contextmanager
    def around():
        before = torch.cuda.memory_stats(b.device) if cuda else {}
        with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
            yield
        held["prof"] = prof
        after = torch.cuda.memory_stats(b.device) if cuda else {}
        held["allocator"] = {k: after.get(k, 0) - before.get(k, 0) for k in ALLOCATOR_COUNTERS}

    run = measured_run(around)
    times = kernel_times(held["prof"], b.device)
    memcpy = sum(s for n, s in times.items() if COPY_KERNEL.search(n))
    compute = sum(times.values()) - memcpy
    top = sorted(times.items(), key=lambda kv: -kv[1])[:12]
    gaps = compute_gaps(held["prof"]) if cuda else None
    waits = host_waits(held["prof"]) if cuda else None
    p = {"tokens": run["tokens"], "wall_s": run["wall_s"], "tok_per_s_wall": run["tok_per_s_wall"],
         "steady_tok_per_s": run.get("steady_tok_per_s"), "copy_s": round(memcpy, 3),
         "compute_kernel_s": round(compute, 3), "kernel_s_per_mtok": 1e6 * compute / run["tokens"],
         "compute_busy_share": compute / run["wall_s"] if cuda else None,
         "kinds": kind_shares(times),
         "top": [{"name": n[:160], "s": round(s, 5), "kind": kind_of(n)} for n, s in top], "gaps": gaps,
         "allocator": held["allocator"], "host_waits": waits}
    busy = f", compute kernels busy {100 * p['compute_busy_share']:.0f}% of it" if cuda else ""
    print(f"[{name}] extractor profiled: {p['tok_per_s_wall']:.0f} tok/s over {p['wall_s']:.1f} s{busy}; copy-out "
          f"{p['copy_s']:.1f} s beside; compute kernels {p['kernel_s_per_mtok']:.2f} s per 1M tokens", flush=True)
    if gaps:
        print(f"[{name}] compute idle between its first and last kernel ({gaps['span_s']:.1f} s): " + ", ".join(
            f"{k} {v['s']:.2f} s in {v['n']}" for k, v in gaps["idle_by_gap"].items()) + f"; outside it "
            f"{run['wall_s'] - gaps['span_s']:.2f} s; longest {gaps['longest_gaps_s'][:5]}", flush=True)
    if cuda:
        print(f"[{name}] caching allocator during the run: {p['allocator']}", flush=True)
        where = ("one thread id in the trace, every thread's calls: " if waits["threads_seen"] == 1 else
                 "compute thread: ")
        print(f"[{name}] CUDA calls over {HOST_WAIT_S * 1e3:.0f} ms (of {waits['calls_seen']} traced), {where}"
              f"{waits['compute_thread']}; other threads: {waits['other_threads']}", flush=True)
    for k in p["top"][:6]:
        print(f"[{name}]   {k['s']:8.3f} s  {k['kind']:<17} {k['name'][:110]}", flush=True)
    return p


def compute_gaps(prof) -> dict:
    """The compute kernels' (copies left out) idle time between the first and the last of them, by gap length:
    many short gaps are launch or synchronisation gaps, a few long ones the host pipeline holding the GPU."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and not COPY_KERNEL.search(e.name))
    idle = {label: {"s": 0.0, "n": 0} for _, label in GAP_BUCKETS}
    longest, end = [], spans[0][1] if spans else 0
    for start, stop in spans[1:]:
        if start > end:
            gap = (start - end) / 1e6
            label = next(lb for bound, lb in GAP_BUCKETS if gap < bound)
            idle[label]["s"] += gap
            idle[label]["n"] += 1
            longest.append(round(gap, 4))
        end = max(end, stop)
    span = (end - spans[0][0]) / 1e6 if spans else 0.0
    return {"span_s": round(span, 3), "idle_by_gap": {k: {"s": round(v["s"], 6), "n": v["n"]} for k, v in idle.items()},
            "longest_gaps_s": sorted(longest, reverse=True)[:10]}


def host_waits(prof) -> dict:
    """CUDA runtime calls (`cuda...`, `cu...`, recorded with the device trace) that held their host thread over
    HOST_WAIT_S, by name: on the compute thread (the one that launched the most kernels), where a synchronising call
    is the next forward not queued while it waits, and on the others (the writers wait on copy-out events by design).
    """
    calls = [e for e in prof.events()
             if e.device_type != torch.autograd.DeviceType.CUDA and e.name.startswith("cu")]
    launches: dict = defaultdict(int)
    for e in calls:
        launches[e.thread] += "LaunchKernel" in e.name
    compute = max(launches, key=launches.get, default=None)
    # calls_seen 0: the trace recorded no runtime calls, so empty rows say nothing (not "no call held a thread");
    # threads_seen 1 with writers running: the trace gave every call one thread id (the H100/H200 device-only traces
    # of 2026-12-07 did: the writers' event waits landed on "compute_thread"), so only the rows by name hold
    out: dict = {"calls_seen": len(calls), "threads_seen": len(launches), "compute_thread": {}, "other_threads": {}}
    for e in calls:
        s = (e.time_range.end - e.time_range.start) / 1e6
        if s >= HOST_WAIT_S:
            row = out["compute_thread" if e.thread == compute else "other_threads"].setdefault(e.name, {"n": 0, "s": 0})
            row["n"] += 1
            row["s"] = round(row["s"] + s, 4)
    return out
