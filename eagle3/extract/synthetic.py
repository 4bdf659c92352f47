"""Write a merged dataset in the merge phase's output format (BRIEF contract 2) from token lists.

Used by the extraction tests and benchmark to build inputs without running the earlier phases;
the files are exactly what the merge phase writes (parquet columns, manifest.json, stats.json).
"""

from __future__ import annotations

from pathlib import Path

from eagle3.io import atomic_write_json, fingerprint, sha256_file


def write_merged_dataset(merge_dir: str | Path, samples: list[list[int]], rows_per_file: int = 1000,
                         loss_masks: list[list[int]] | None = None, dataset: str = "synthetic", seed: int = 0) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    merge_dir = Path(merge_dir)
    merge_dir.mkdir(parents=True, exist_ok=True)
    if loss_masks is None:
        # a plausible mask: the second half of each sample is the "assistant" part
        loss_masks = [[0] * (len(s) // 2) + [1] * (len(s) - len(s) // 2) for s in samples]
    files = []
    for fi, a in enumerate(range(0, len(samples), rows_per_file)):
        part = samples[a:a + rows_per_file]
        masks = loss_masks[a:a + rows_per_file]
        table = pa.table({
            "sample_id": pa.array([f"{dataset}-{a + i}" for i in range(len(part))], pa.string()),
            "dataset": pa.array([dataset] * len(part), pa.string()),
            "input_ids": pa.array(part, pa.list_(pa.int32())),
            "loss_mask": pa.array(masks, pa.list_(pa.int8())),
            "length": pa.array([len(s) for s in part], pa.int32()),
        })
        name = f"part-{fi:05d}.parquet"
        pq.write_table(table, merge_dir / name)
        files.append({"path": name, "rows": len(part), "tokens": sum(len(s) for s in part),
                      "sha256": sha256_file(merge_dir / name)})
    params = {"source": "synthetic", "rows_per_file": rows_per_file}
    manifest = {"complete": True, "files": files, "rows": len(samples), "tokens": sum(f["tokens"] for f in files),
                "seed": seed, "params": params, "fingerprint": fingerprint([files, params])}
    atomic_write_json(merge_dir / "stats.json", {"rows": manifest["rows"], "tokens": manifest["tokens"]})
    atomic_write_json(merge_dir / "manifest.json", manifest)
    return manifest
