"""What bench/extract_bench.py measures the extractor against: the targets it extracts from (random-weight Llama
shapes, their FLOPs a token; FP8 on load: bench/extract_fp8.py) and the machine's limits (matmul rate, fsynced
disk rate).

Roofline = matmul rate / model FLOPs a token; disk limit = disk rate / stored bytes a token.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import os
import shutil
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch

from bench.extract_moe import MOE_BUDGET, MOE_SHAPES, build_moe_model
from eagle3.flops import sample_flops
from eagle3.extract.format import _start_writeback, write_chunk


class ChunkReaper:
    """Deletes each committed chunk file under `root` soon after the extractor renames it into place, so that a
    shard larger than the machine's disk can run (`--discard-chunks`). With `root` on tmpfs the run then measures
    the extractor without the disk: a reduced-depth target writes as many bytes a token as the full one in a
    fraction of its compute, so there the disk, not the kernels, would bind."""

    def __init__(self, root: Path, period_s: float = 0.2):
        self.root, self.period_s, self.bytes, self.files = root, period_s, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chunk-reaper", daemon=True)

    def _sweep(self) -> None:
        for path in self.root.rglob("chunk-*.safetensors"):  # committed names only; temp files start with "."
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            self.bytes, self.files = self.bytes + size, self.files + 1

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sweep()

    def __enter__(self) -> "ChunkReaper":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sweep()


SHAPES = {
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                 tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
               tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
               tie_word_embeddings=False),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,  # --smoke
                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=2048, rope_theta=10000.0,
                 tie_word_embeddings=True),
}
DEFAULT_BUDGET = {"real": 65536, "135m": 65536, "1b": 65536, "8b": 32768, "tiny": 1024, **MOE_BUDGET}


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- targets ----------------------------------------------------------------------------------

def build_model(name: str, device, dtype, real_path: str | None, dsv3_layers: int | None = None):
    """(model, model_path): the real SmolLM2 from its HF folder, or a random-weight shape (seed 0: a second call
    builds the same weights): Llama (SHAPES) or MoE (bench/extract_moe.py; dsv3 at `dsv3_layers` layers, or as
    many as fit)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if name in MOE_SHAPES:
        return build_moe_model(name, device, dtype, dsv3_layers)
    if name == "real":
        model = AutoModelForCausalLM.from_pretrained(real_path, dtype=dtype).to(device).eval()
        return model, str(real_path)
    cfg = LlamaConfig(**SHAPES[name], rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    return model.eval(), f"random-{name}"


def model_flops_per_sample(cfg, lengths: np.ndarray) -> float:
    """Forward FLOPs of the samples, lm_head excluded: active linear weights and causal attention (eagle3.flops:
    MLA and routed experts counted as a token runs them)."""
    d = cfg.to_dict()
    return float(sum(sample_flops(d, int(n)) for n in lengths))


def make_samples(n_tokens: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < n_tokens:
        n = int(rng.integers(lo, hi + 1))
        out.append(rng.integers(3, vocab, n).tolist())
        total += n
    return out


# -- the machine's limits ---------------------------------------------------------------------

def matmul_probe(device, dtype, n: int, reps: int) -> float:
    """Median FLOP/s of an n x n x n matmul on random data."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / statistics.median(times)


def matmul_sustained(device, dtype, n: int, seconds: float, fp8: bool = False) -> dict:
    """n^3 matmuls back to back for `seconds`, timed in groups of ~0.1 s: the rate the GPU holds once its
    clocks settle under load (an H200 at its power limit clocks down within seconds of dense GEMM work), which
    is what a minutes-long extraction gets, beside the first group's (burst) rate. `fp8`: float8 e4m3 operands
    with float32 scales, output in `dtype` (torch._scaled_mm; compute capability >= 8.9)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    if fp8:
        one = torch.ones((), device=device)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # _scaled_mm takes b column-major

        def matmul():
            return torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=dtype)
    else:
        def matmul():
            return a @ b
    matmul()
    sync(device)
    t = time.perf_counter()
    matmul()
    sync(device)
    per_group = max(1, int(0.1 / (time.perf_counter() - t)))  # ~0.1 s a group
    rates, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        for _ in range(per_group):
            matmul()
        sync(device)
        rates.append(per_group * 2 * n ** 3 / (time.perf_counter() - t))
    half = rates[len(rates) // 2:]
    return {"seconds": seconds, "groups": len(rates), "first_group": rates[0], "max_group": max(rates),
            "sustained": statistics.median(half), "rates": [round(r / 1e12, 1) for r in rates]}


def disk_probe(folder: Path, total_bytes: int, file_bytes: int, writers: int, early_writeback: bool = False) -> float:
    """Sustained bytes/s writing files of `file_bytes`, each fsynced (which defeats the page cache), with
    `writers` threads at once; with `early_writeback`, each 64 MB written is queued for the disk at once, as the
    extractor's chunk writer does."""
    folder.mkdir(parents=True, exist_ok=True)
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    n_files = max(writers, total_bytes // file_bytes)
    counter = iter(range(n_files))
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            with open(folder / f"probe-{i}.bin", "wb") as f:
                left = file_bytes
                while left > 0:
                    f.write(block[:min(left, len(block))])
                    left -= len(block)
                    if early_writeback:
                        _start_writeback(f)
                f.flush()
                os.fsync(f.fileno())

    t = time.perf_counter()
    threads = [threading.Thread(target=work) for _ in range(writers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    dt = time.perf_counter() - t
    shutil.rmtree(folder, ignore_errors=True)
    return n_files * file_bytes / dt


def sha256_rate() -> float:
    """Bytes/s of one thread hashing (the extractor hashes every chunk it writes)."""
    blob = np.random.default_rng(1).integers(0, 255, 256 << 20, dtype=np.uint8).tobytes()
    t = time.perf_counter()
    hashlib.sha256(blob).hexdigest()
    return len(blob) / (time.perf_counter() - t)


def chunk_write_rate(folder: Path, chunk_bytes: int, reps: int = 2) -> float:
    """Bytes/s of one chunk of about `chunk_bytes` through the extractor's write_chunk (fsynced, hashed beside the
    write), the best of `reps`: what one writer, and the shard's last chunk after its last forward, take."""
    H = 1024
    T = max(1, chunk_bytes // (4 * H * 2))  # three capture layers and the final state in bf16
    raw = np.random.default_rng(2).integers(0, 255, T * 4 * H * 2, dtype=np.uint8)
    states = torch.from_numpy(raw).view(torch.bfloat16).view(T, 4 * H)
    tensors = {"input_ids": torch.zeros(T, dtype=torch.int32), "loss_mask": torch.ones(T, dtype=torch.uint8),
               "aux_hidden": states[:, :3 * H].contiguous(), "final_hidden": states[:, 3 * H:].contiguous(),
               "sample_offsets": torch.tensor([0, T]), "sample_rows": torch.tensor([0])}
    best = float("inf")
    for i in range(reps):
        t = time.perf_counter()
        rec = write_chunk(folder, i, tensors, fsync=True)
        best = min(best, time.perf_counter() - t)
    shutil.rmtree(folder, ignore_errors=True)
    return rec.bytes / best


def probe_key(writers: int, mb: int, early: bool, one_size: bool) -> str:
    """The name of a disk probe in `disk_bytes_per_s` (the chunk size named only where a run measures several)."""
    return f"{writers}_writers" + ("" if one_size else f"_{mb}mb") + ("_early_writeback" if early else "")


def machine_limits(device, dtype, work: Path, writers: list[int], chunk_mbs: list[int], disk_gb: float,
                   matmul_n: int | None) -> dict:
    """The matmul rate, and the disk: the best of 1, 2 and as many fsynced writers as the extractor uses (a cloud
    block device gives more with more streams in flight), with and without early writeback, per chunk size."""
    cuda = device.type == "cuda"
    n = matmul_n or (8192 if cuda else 1024)
    res = {"matmul_n": n, "matmul_flops": matmul_probe(device, dtype, n, reps=20 if cuda else 5)}
    print(f"matmul {dtype} {n}^3: {res['matmul_flops'] / 1e12:.1f} TFLOP/s", flush=True)
    probes, one_size = {}, len(set(chunk_mbs)) == 1
    for mb in sorted(set(chunk_mbs)):
        for w, early in itertools.product(sorted({1, 2, max(writers)}), (False, True)):
            probes[probe_key(w, mb, early, one_size)] = disk_probe(work / "disk", int(disk_gb * 1e9), mb << 20,
                                                                   writers=w, early_writeback=early)
    res["disk_bytes_per_s"] = probes
    res["sha256_bytes_per_s"] = sha256_rate()
    print(f"sha256 (one thread): {res['sha256_bytes_per_s'] / 1e9:.2f} GB/s", flush=True)
    # one writer's chunk against its two parts alone: in turn they take the sum of their times, beside each other at
    # best the longer one (write_chunk hashes on a second thread)
    mb = max(chunk_mbs)
    write = probes[probe_key(1, mb, True, one_size)]
    sha = res["sha256_bytes_per_s"]
    chunk = chunk_write_rate(work / "chunk", mb << 20)
    res["chunk_write"] = {"chunk_mb": mb, "bytes_per_s": chunk, "parts_in_turn": 1 / (1 / write + 1 / sha),
                          "parts_beside_at_best": min(write, sha)}
    print(f"one {mb} MB chunk through write_chunk: {chunk / 1e9:.2f} GB/s; its parts alone, write {write / 1e9:.2f} "
          f"and sha256 {sha / 1e9:.2f}: in turn {res['chunk_write']['parts_in_turn'] / 1e9:.2f}, beside at best "
          f"{res['chunk_write']['parts_beside_at_best'] / 1e9:.2f}", flush=True)
    print("disk write+fsync: " + ", ".join(f"{v / 1e9:.2f} GB/s ({k})" for k, v in probes.items()), flush=True)
    return res


def interleaved_rounds(rounds: int, probe, extracts: dict, bytes_per_token: int) -> dict:
    """probe, extract, probe, extract, ..., probe: each extraction run is measured against the mean of the disk
    probes just before and after it, so a block device whose rate drifts within minutes (this one: 1.67-2.24
    GB/s) is compared with itself at that time, not with a probe taken once at the start. With several variants
    (`extracts`: label -> run), each round runs each of them in turn, every run between two probes."""
    probes, runs = [probe()], []
    for i in range(rounds):
        for label, extract in extracts.items():
            r = extract()
            probes.append(probe())
            limit = (probes[-2] + probes[-1]) / 2 / bytes_per_token
            runs.append({"variant": label, "tok_per_s_wall": r["tok_per_s_wall"],
                         "steady_tok_per_s": r["steady_tok_per_s"], "wall_s": r["wall_s"], "tokens": r["tokens"],
                         "bytes": r["bytes"], "disk_before": probes[-2], "disk_after": probes[-1],
                         "disk_limit_tok_per_s": limit, "fraction_of_disk_limit": r["tok_per_s_wall"] / limit,
                         **{k: r.get(k) for k in ("compute_waited_for_writers_s", "writer_busy_fraction",
                                                  "host_buffer_alloc_s", "host_buffers_made_ahead_s", "setup_s",
                                                  "tail_s")}})
            print(f"round {i} {label}: {r['tok_per_s_wall']:.0f} tok/s wall ({r['bytes'] / r['wall_s'] / 1e9:.2f} "
                  f"GB/s), disk {probes[-2] / 1e9:.2f} -> {probes[-1] / 1e9:.2f} GB/s, "
                  f"{100 * runs[-1]['fraction_of_disk_limit']:.0f}% of the disk limit; compute waited for writers "
                  f"{r.get('compute_waited_for_writers_s')} s, writers busy {r.get('writer_busy_fraction')}", flush=True)
    by_variant = {}
    for label in extracts:
        mine = [r for r in runs if r["variant"] == label]
        tokens, wall = sum(r["tokens"] for r in mine), sum(r["wall_s"] for r in mine)
        # the disk limit of a variant: its runs' neighbouring probes, weighted by each run's wall time
        limit = sum(r["disk_limit_tok_per_s"] * r["wall_s"] for r in mine) / wall
        by_variant[label] = {"tok_per_s_wall": tokens / wall, "disk_limit_tok_per_s": limit,
                             "fraction_of_disk_limit": tokens / wall / limit}
        print(f"{label}: {tokens / wall:.0f} tok/s over {len(mine)} runs, "
              f"{100 * tokens / wall / limit:.1f}% of the disk limit around them", flush=True)
    return {"probes_bytes_per_s": probes, "runs": runs, "variants": by_variant}


def empty_pinned_host_cache(device=None) -> None:
    """Free the pinned host blocks torch keeps for reuse, so the next pin pays as in a fresh process (without it a
    run after the first pins nothing). torch 2.11 has no public call for it."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch._C._host_emptyCache()


def against_sustained(name: str, r: dict, sustained: list[dict], tokens: int, flops: float) -> None:
    """The figures against min(sustained roofline, disk limit): the mean of the sustained probes before and after."""
    rate = statistics.mean(x["sustained"] for x in sustained)
    roof = tokens / (flops / rate)
    ext, lim = r["extractor"], min(roof, r["disk_limit_tok_per_s"])
    r["matmul_sustained"] = {"probes": sustained, "flops": rate, "roofline_tok_per_s": roof,
                             "fraction_of_limit": ext["tok_per_s_wall"] / lim,
                             "steady_fraction_of_limit": ext["steady_tok_per_s"] / lim}
    print(f"[{name}] against the sustained matmul rate ({sustained[0]['sustained'] / 1e12:.0f} before, "
          f"{sustained[1]['sustained'] / 1e12:.0f} TFLOP/s after): roofline {roof:.0f} tok/s -> "
          f"{100 * ext['tok_per_s_wall'] / lim:.0f}% of min(roofline, disk limit)", flush=True)
    for rr in r.get("interleaved", {}).get("runs", []):  # the rounds against the disk around each run
        lim_r = min(roof, rr["disk_limit_tok_per_s"])
        rr["fraction_of_limit_sustained"] = rr["tok_per_s_wall"] / lim_r
        rr["steady_fraction_of_limit_sustained"] = rr["steady_tok_per_s"] / lim_r
        rr["ratio_to_naive"] = rr["tok_per_s_wall"] / r["naive"]["tok_per_s"]
        print(f"[{name}] {rr['variant']}: {rr['tok_per_s_wall']:.0f} tok/s wall ({rr['steady_tok_per_s']:.0f} "
              f"between first and last commit) = {100 * rr['fraction_of_limit_sustained']:.1f}% "
              f"({100 * rr['steady_fraction_of_limit_sustained']:.1f}%) of min(sustained roofline, disk), "
              f"{rr['ratio_to_naive']:.2f}x naive; setup {rr.get('setup_s')} s, tail {rr.get('tail_s')} s, host "
              f"buffers made in {rr.get('host_buffer_alloc_s')} s (ahead: {rr.get('host_buffers_made_ahead_s')} s)",
              flush=True)


def limits_entry(extractor: dict, naive: dict, roofline: float, disk_limit: float, bytes_per_token: int) -> dict:
    limit = min(roofline, disk_limit)
    return {"bytes_per_token": bytes_per_token, "roofline_tok_per_s": roofline, "disk_limit_tok_per_s": disk_limit,
            "binding_limit": "compute" if roofline < disk_limit else "disk", "naive": naive, "extractor": extractor,
            "fraction_of_limit": extractor["tok_per_s_wall"] / limit,
            "steady_fraction_of_limit": extractor["steady_tok_per_s"] / limit,
            "ratio_to_naive": extractor["tok_per_s_wall"] / naive["tok_per_s"]}


def print_summary(res: dict) -> None:
    print("\nmodel   naive tok/s  extractor tok/s (commit window*)  roofline  disk limit  %limit (*)  x naive\n"
          "(* first to last chunk commit: an upper bound, it leaves out the pipeline fill)")
    for name, r in res["models"].items():
        if "error" in r:
            print(f"{name:5s}  ERROR {r['error']}")
            continue
        print(f"{name:6s}  {r['naive']['tok_per_s']:11.0f}  {r['extractor']['tok_per_s_wall']:15.0f} "
              f"({r['extractor']['steady_tok_per_s']:7.0f})  {r['roofline_tok_per_s']:8.0f}  "
              f"{r['disk_limit_tok_per_s']:10.0f}  {100 * r['fraction_of_limit']:5.0f}% "
              f"({100 * r['steady_fraction_of_limit']:3.0f}%)  {r['ratio_to_naive']:6.1f}")
