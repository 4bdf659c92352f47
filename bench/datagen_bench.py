"""Datagen client bench: throughput at 2000 in flight, CPU per request, peak memory; and the resume scan.

    python bench/datagen_bench.py [--requests 20000] [--concurrency 2000] [--scan-samples 100000]

The endpoint is a minimal asyncio HTTP server in a SEPARATE process (keep-alive, fixed chat
completion answer after an optional delay), so what is measured is the client. Two clients run
side by side in this process against the same endpoint, both the full datagen path (retries,
accounting, one flushed JSONL line per sample), differing only in the HTTP layer:
  baseline: http_client="openai"  (AsyncOpenAI SDK over httpx2)
  datagen:  http_client="aiohttp" (the default: plain dicts over aiohttp)
The resume scan is timed on 100K done samples vs the naive json.loads-every-line baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ANSWER = {"id": "x", "object": "chat.completion", "created": 0, "model": "bench",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "word " * 64},
                       "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 40, "completion_tokens": 64, "total_tokens": 104}}


# ---------------------------------------------------------------- the fast endpoint (own process)
class _Http(asyncio.Protocol):
    body = json.dumps(ANSWER).encode()
    resp = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)
    delay = 0.0

    def connection_made(self, transport):
        self.t, self.buf = transport, b""

    def data_received(self, data):
        self.buf += data
        while True:
            h = self.buf.find(b"\r\n\r\n")
            if h < 0:
                return
            head = self.buf[:h].lower()
            i = head.find(b"content-length:")
            n = int(head[i + 15:head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None]) if i >= 0 else 0
            if len(self.buf) < h + 4 + n:
                return
            self.buf = self.buf[h + 4 + n:]
            if self.delay:
                asyncio.get_running_loop().call_later(self.delay, self._reply)
            else:
                self._reply()

    def _reply(self):
        if not self.t.is_closing():
            self.t.write(self.resp)


def serve(port: int, delay: float) -> None:
    _Http.delay = delay

    async def main():
        srv = await asyncio.get_running_loop().create_server(_Http, "127.0.0.1", port, backlog=4096)
        print("ready", flush=True)
        await srv.serve_forever()

    asyncio.run(main())


# ---------------------------------------------------------------- measurement helpers
class PeakRSS:
    """Samples this process's RSS every 20 ms; reports the peak seen while active."""

    def __init__(self):
        import psutil

        self.p, self.peak, self._stop = psutil.Process(), 0, threading.Event()

    def __enter__(self):
        self.peak = self.p.memory_info().rss
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.p.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def datagen_client(url: str, n: int, conc: int, folder: Path, http_client: str) -> dict:
    from eagle3.datagen.client import Endpoint
    from eagle3.datagen.prompts import Prompt
    from eagle3.datagen.run import _generate
    from eagle3.datagen.config import ClientConfig, DatasetSpec

    prompts = [Prompt(f"bench-{i:08x}", i + 1, None, [f"prompt {i}"]) for i in range(n)]
    spec = DatasetSpec(name="bench", prompt_file="-", max_tokens=64)
    cfg = ClientConfig(model="bench", concurrency=conc, request_timeout_s=300, log_every_s=5, http_client=http_client)
    folder.mkdir(parents=True, exist_ok=True)
    stats = asyncio.run(_generate(prompts, spec, cfg, Endpoint(url, "k"), folder, n))
    assert stats.done == n, (stats.done, stats.failed, dict(stats.failures))
    lines = (folder / "generations.jsonl").read_bytes().count(b"\n")
    assert lines == n, lines
    return {"retries": dict(stats.retries)}


def measure(name: str, fn, n: int) -> dict:
    cpu0, t0 = _cpu(), time.perf_counter()
    with PeakRSS() as rss:
        extra = fn()
    wall, cpu = time.perf_counter() - t0, _cpu() - cpu0
    res = {"client": name, "requests": n, "wall_s": round(wall, 2), "req_per_s": round(n / wall, 1),
           "cpu_ms_per_req": round(1000 * cpu / n, 3), "peak_rss_mb": round(rss.peak / 2**20, 1)}
    if isinstance(extra, dict):
        res.update(extra)
    print(json.dumps(res), flush=True)
    return res


# ---------------------------------------------------------------- resume scan
def bench_resume_scan(n: int, folder: Path, answer_chars: int) -> dict:
    from eagle3.datagen.store import AppendWriter, scan_and_repair

    path = folder / "generations.jsonl"
    text = ("The quick brown fox jumps over the lazy dog. " * (answer_chars // 45 + 1))[:answer_chars]
    with AppendWriter(path, fsync_every_s=1e9) as w:
        for i in range(n):
            w.write({"sample_id": f"D-{i:016x}", "dataset": "D", "line": i + 1,
                     "messages": [{"role": "user", "content": "question " * 20},
                                  {"role": "assistant", "content": text}],
                     "answer": text, "finish_reason": "stop", "usage": {"prompt_tokens": 40, "completion_tokens": 300}})
    with open(path, "ab") as f:
        f.write(b'{"sample_id": "D-cut", "messa')  # a killed writer's last line
    size = path.stat().st_size
    path.read_bytes()  # warm the page cache for both contenders alike

    t0 = time.perf_counter()
    naive = set()
    with open(path, "rb") as f:
        for line in f:
            try:
                naive.add(json.loads(line)["sample_id"])
            except json.JSONDecodeError:
                pass
    t_naive = time.perf_counter() - t0

    t0 = time.perf_counter()
    res = scan_and_repair(path)
    t_scan = time.perf_counter() - t0
    assert res.done_ids == naive and len(naive) == n and res.truncated_bytes > 0
    out = {"samples": n, "file_mb": round(size / 2**20, 1), "scan_s": round(t_scan, 3),
           "naive_json_s": round(t_naive, 3), "speedup": round(t_naive / t_scan, 1)}
    print(json.dumps({"resume_scan": out}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--delay", type=float, default=0.0, help="endpoint latency per request (s)")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--baseline-requests", type=int, default=2000, help="fewer: the SDK path is ~10x slower")
    ap.add_argument("--concurrency", type=int, default=2000)
    ap.add_argument("--scan-samples", type=int, default=100_000)
    ap.add_argument("--answer-chars", type=int, default=2000)
    ap.add_argument("--out", help="write results JSON here")
    a = ap.parse_args()
    if a.serve:
        return serve(a.serve, a.delay)

    from eagle3.datagen.server import free_port

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    port = free_port()
    srv = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--delay", str(a.delay)],
                           stdout=subprocess.PIPE, text=True)
    assert srv.stdout.readline().strip() == "ready"
    url = f"http://127.0.0.1:{port}/v1"
    results = {"machine": f"{os.cpu_count()} cores", "requests": a.requests,
               "baseline_requests": a.baseline_requests, "concurrency": a.concurrency,
               "endpoint_delay_s": a.delay}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results["baseline"] = measure("datagen over the openai SDK (http_client=openai)", lambda: datagen_client(
                url, a.baseline_requests, a.concurrency, Path(tmp) / "sdk", "openai"), a.baseline_requests)
            results["datagen"] = measure("datagen over aiohttp (default)", lambda: datagen_client(
                url, a.requests, a.concurrency, Path(tmp) / "aio", "aiohttp"), a.requests)
            results["datagen_vs_baseline_req_per_s"] = round(
                results["datagen"]["req_per_s"] / results["baseline"]["req_per_s"], 2)
        with tempfile.TemporaryDirectory() as tmp:
            results["resume_scan"] = bench_resume_scan(a.scan_samples, Path(tmp), a.answer_chars)
    finally:
        srv.terminate()
        srv.wait()
    print(json.dumps(results, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
