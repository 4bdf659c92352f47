"""eagle3_shard_demo: the extraction part of eagle3_drafter in miniature, for the Airflow integration tests.

Same shape as the real DAG: plan -> extract (one mapped task per shard, queue "gpu", pool "gpu",
retries) -> verify (reads every shard with eagle3.extract.reader). Each shard writes real chunks in the
eagle3.extract.format layout with a committed-chunk resume, but its "hidden states" are a cheap function of
the row (so verify can check every value) and `chunk_seconds` stands in for GPU time.

Fault injection (read by the shard task from its environment):
  EAGLE3_INJECT_FAULT="shard=<i>,after_chunks=<k>,once_file=<path>"
shard i raises after committing k chunks, unless once_file exists; it creates once_file first, so the
fault fires once and the cleared/retried task then succeeds.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from airflow.sdk import DAG, Param, get_current_context, task

from eagle3.config import default_output_root, run_dir

DEFAULT_OUTPUT_ROOT = default_output_root()
HIDDEN, N_CAPTURE = 8, 3
# Retries of a shard task; the fault-injection test sets 0 so the injected failure stays visible
# until the user clears that map index (with retries, Airflow would re-run it by itself).
SHARD_RETRIES = int(os.environ.get("EAGLE3_SHARD_RETRIES", "2"))


def sample_tokens(row: int) -> int:
    return 3 + row % 5


def chunk_tensors(rows: list[int]) -> dict:
    import torch

    lens = [sample_tokens(r) for r in rows]
    row_of_token = torch.tensor([r for r, n in zip(rows, lens) for _ in range(n)], dtype=torch.float32)
    return {
        "input_ids": torch.tensor([r * 10 + j for r, n in zip(rows, lens) for j in range(n)], dtype=torch.int32),
        "loss_mask": torch.ones(sum(lens), dtype=torch.uint8),
        "aux_hidden": row_of_token[:, None].repeat(1, N_CAPTURE * HIDDEN).to(torch.bfloat16),
        "final_hidden": (-row_of_token)[:, None].repeat(1, HIDDEN).to(torch.bfloat16),
        "sample_offsets": torch.tensor([0] + lens, dtype=torch.int64).cumsum(0),
        "sample_rows": torch.tensor(rows, dtype=torch.int64),
    }


with DAG(
    dag_id="eagle3_shard_demo",
    description="Test DAG shaped like eagle3_drafter's extraction: mapped shards on the gpu queue/pool",
    schedule=None,
    catchup=False,
    max_active_runs=2,
    params={
        "output_root": Param(DEFAULT_OUTPUT_ROOT, type="string", minLength=1, description="Runs go under here."),
        # null, not "": the UI trigger form treats an empty string as a missing required value
        "run_name": Param(None, type=["null", "string"], pattern="^[A-Za-z0-9._-]+$",
                          description="Run folder; empty = the run id. Reuse a name to resume a run."),
        "shards": Param(3, type="integer", minimum=1, maximum=16, description="Number of extraction shards."),
        "rows": Param(24, type="integer", minimum=1, description="Samples in the (pretend) merged dataset."),
        "samples_per_chunk": Param(2, type="integer", minimum=1, description="Samples per committed chunk."),
        "chunk_seconds": Param(0.5, type="number", minimum=0, maximum=60, description="Pretend GPU time per chunk."),
    },
    default_args={"retries": 0},
    tags=["eagle3", "test"],
    doc_md=__doc__,
) as dag:

    @task
    def plan() -> list[dict]:
        ctx = get_current_context()
        p, run_id = ctx["params"], ctx["run_id"]
        extract_dir = f"{run_dir(p, run_id)}/extract"
        n, rows = p["shards"], p["rows"]
        bounds = [rows * i // n for i in range(n + 1)]
        return [{"shard": i, "extract_dir": extract_dir, "rows": [bounds[i], bounds[i + 1]]} for i in range(n)]

    @task(queue="gpu", pool="gpu", retries=SHARD_RETRIES, retry_delay=timedelta(seconds=2), max_active_tis_per_dagrun=4,
          execution_timeout=timedelta(minutes=5))
    def extract(spec: dict) -> dict:
        from eagle3.extract.format import ShardManifest, write_chunk
        from eagle3.faults import maybe_inject_fault
        from eagle3.io import remove_stale_temps
        from eagle3_airflow.worker import worker_hostname

        ctx = get_current_context()
        p, ti = ctx["params"], ctx["ti"]
        shard, (start, end) = spec["shard"], spec["rows"]
        shard_dir = Path(spec["extract_dir"]) / f"shard-{shard:05d}"
        shard_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(shard_dir)
        try:
            m = ShardManifest.load(shard_dir)
        except Exception:
            m = ShardManifest(shard=shard, model_path="demo", capture_layers=[1, 2, 3], hidden_size=HIDDEN,
                              dtype="bfloat16", rows=[[start, end]])
        now = datetime.now(timezone.utc).isoformat()
        attempt = {"try": ti.try_number, "host": worker_hostname(), "pid": os.getpid(), "at": now,
                   "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "resumed_chunks": len(m.chunks)}
        m.params.setdefault("started_at", now)
        m.params.setdefault("attempts", []).append(attempt)
        m.save(shard_dir)
        if m.complete:
            return {"shard": shard, "skipped": True, "tokens": m.tokens}
        next_row = m.chunks[-1].last_row + 1 if m.chunks else start
        t0, tokens0 = time.monotonic(), m.tokens
        while next_row < end:
            maybe_inject_fault(shard, len(m.chunks))  # EAGLE3_INJECT_FAULT, see eagle3/faults.py
            rows = list(range(next_row, min(next_row + p["samples_per_chunk"], end)))
            time.sleep(p["chunk_seconds"])
            m.chunks.append(write_chunk(shard_dir, len(m.chunks), chunk_tensors(rows), fsync=False))
            m.params["updated_at"] = datetime.now(timezone.utc).isoformat()
            m.params["tokens_per_s"] = round((m.tokens - tokens0) / max(time.monotonic() - t0, 1e-6), 1)
            m.save(shard_dir)
            print(f"shard {shard}: {len(m.chunks)} chunks, {m.tokens} tokens, {m.params['tokens_per_s']} tok/s")
            next_row = rows[-1] + 1
        m.complete = True
        m.save(shard_dir)
        return {"shard": shard, "chunks": len(m.chunks), "tokens": m.tokens, "host": attempt["host"]}

    @task
    def verify(specs: list[dict], results: list[dict]) -> dict:
        import torch

        from eagle3.extract.reader import HiddenStateReader

        dirs = [Path(s["extract_dir"]) / f"shard-{s['shard']:05d}" for s in specs]
        reader = HiddenStateReader(dirs, verify=True)
        rows = []
        for s in reader:
            assert s.input_ids.tolist() == [s.row * 10 + j for j in range(sample_tokens(s.row))], s.row
            assert torch.all(s.aux_hidden.float() == s.row) and torch.all(s.final_hidden.float() == -s.row), s.row
            rows.append(s.row)
        expected = list(range(specs[0]["rows"][0], specs[-1]["rows"][1]))
        if rows != expected:
            raise ValueError(f"rows read back {rows} != planned {expected} (lost or duplicated samples)")
        for d, m in zip(dirs, reader.manifests):
            files = sorted(f.name for f in d.glob("chunk-*.safetensors"))
            if files != [c.file for c in m.chunks]:
                raise ValueError(f"{d}: chunk files {files} != manifest {[c.file for c in m.chunks]}")
        return {"samples": len(rows), "tokens": reader.num_tokens, "shards": len(dirs)}

    specs = plan()
    verify(specs, extract.expand(spec=specs))
