"""Write a merged dataset in the merge phase's output format (contract 2, eagle3.merge.dataset) from token lists.

Used by the extraction tests and benchmark to build inputs without running the earlier phases;
the files are what the merge phase writes (PART_SCHEMA parquet parts, stats.json, manifest.json last).
"""

from __future__ import annotations

from pathlib import Path

from eagle3.io import PhaseOutput, atomic_write_json, fingerprint, sha256_file


def write_merged_dataset(merge_dir: str | Path, samples: list[list[int]], rows_per_file: int = 1000,
                         loss_masks: list[list[int]] | None = None, dataset: str = "synthetic", seed: int = 0) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3.merge.dataset import PART_SCHEMA, STATS_NAME, manifest_record, part_name

    merge_dir = Path(merge_dir)
    merge_dir.mkdir(parents=True, exist_ok=True)
    if loss_masks is None:
        # a plausible mask: the second half of each sample is the "assistant" part
        loss_masks = [[0] * (len(s) // 2) + [1] * (len(s) - len(s) // 2) for s in samples]
    files = []
    for fi, a in enumerate(range(0, len(samples), rows_per_file)):
        part = samples[a:a + rows_per_file]
        table = pa.table({
            "sample_id": [f"{dataset}-{a + i}" for i in range(len(part))],
            "dataset": [dataset] * len(part),
            "input_ids": part,
            "loss_mask": loss_masks[a:a + rows_per_file],
            "length": [len(s) for s in part],
        }, schema=PART_SCHEMA)
        name = part_name(fi)
        pq.write_table(table, merge_dir / name)
        files.append({"path": name, "rows": len(part), "tokens": sum(len(s) for s in part),
                      "sha256": sha256_file(merge_dir / name)})
    params = {"source": "synthetic", "rows_per_file": rows_per_file}
    manifest = manifest_record(files, seed, params)
    atomic_write_json(merge_dir / STATS_NAME, {"rows": manifest["rows"], "tokens": manifest["tokens"]})
    return PhaseOutput(merge_dir, fingerprint([files, params])).commit(manifest)


def one_shard_of_random_samples(merge_dir: str | Path, lengths: list[int], rows_per_file: int, vocab: int = 49152,
                                seed: int = 0) -> tuple:
    """(the ShardSpec of one shard over all of them, the samples): random token ids of `lengths`, written as a
    merged dataset."""
    import numpy as np

    from eagle3.extract.config import ShardPlanConfig
    from eagle3.extract.plan import plan_shards

    rng = np.random.default_rng(seed)
    samples = [rng.integers(3, vocab, n).tolist() for n in lengths]
    write_merged_dataset(merge_dir, samples, rows_per_file=rows_per_file)
    return plan_shards(ShardPlanConfig(str(merge_dir), 1))[0], samples
