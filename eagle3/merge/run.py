"""run_merge: datasets in (contract 1) -> one capped, deduplicated, shuffled parquet dataset out (contract 2).

Pass 1 streams every input line: parse, validate, cap, spill to hash buckets on disk. Pass 2 sorts one bucket
at a time and writes parquet parts. Everything is written in a hidden temp folder inside output_dir; only
at the end are parts renamed into place, then stats.json, then manifest.json (the commit point). A re-run
whose fingerprint (params + input sizes/mtimes) matches a complete manifest does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

import pyarrow.compute as pc

from eagle3.io import MANIFEST_NAME, DiskFullError, PhaseOutput, atomic_write_json, fingerprint, read_json, sha256_file
from eagle3.merge.config import MergeConfig
from eagle3.merge.dataset import STATS_NAME, manifest_record
from eagle3.merge.inputs import DatasetInput, discover_datasets
from eagle3.merge.parse import BadLine, iter_parsed_blocks
from eagle3.merge.shuffle import BucketSpill, bucket_bits_for, iter_sorted_buckets
from eagle3.merge.stats import BadInputError, MergeStats, extraction_estimate
from eagle3.merge.validate import check_block
from eagle3.merge.writer import PartWriter
from eagle3.prefetch import prefetched

log = logging.getLogger(__name__)

FAILED_STATS_NAME = "stats.failed.json"
TMP_PREFIX = ".merge-tmp-"
TMP_MARKER = ".made-by-eagle3-merge"  # a temp folder without it is not ours: never removed
MIN_JSON_BYTES_PER_TOKEN = 4  # "1,"+"0," is the least JSON a token can take: sizes buckets conservatively
LOG_EVERY_S = 10.0


def merge_fingerprint(cfg: MergeConfig, datasets: list[DatasetInput]) -> str:
    return fingerprint({"params": cfg.output_params(), "inputs": [d.identity() for d in datasets]})


def parts_intact(out_dir: Path, manifest: dict, verify: bool) -> bool:
    """May a complete manifest be trusted for a skip: stats.json is there and every part is (sha256 checked when
    `verify`)?"""
    if not (out_dir / STATS_NAME).is_file():
        return False
    for f in manifest.get("files", []):
        p = out_dir / f["path"]
        if not p.is_file() or (verify and sha256_file(p) != f["sha256"]):
            log.warning("merge: %s missing or changed since the manifest was written: merging again", p)
            return False
    return True


def summary(out_dir: Path, manifest: dict, stats: dict, skipped: bool) -> dict:
    return {"merge_dir": str(out_dir), "manifest": str(out_dir / MANIFEST_NAME), "files": len(manifest["files"]),
            "rows": manifest["rows"], "tokens": manifest["tokens"], "skipped": skipped,
            "bad_input": stats["bad_input"]["total"], "dropped": sum(d["count"] for d in stats["dropped"].values()),
            "truncated": stats["truncated"]["samples"],
            "extraction_estimate": (stats.get("extraction_estimate") or {}).get("text")}


def _keep_large_buffers_off_the_heap() -> None:
    """glibc raises its mmap threshold each time a big mmapped buffer is freed; after that our 8 MB blocks come
    from heap arenas, which fragment and make RSS creep up over a long run. Pinning the threshold (1 MB) keeps
    large buffers mmapped and returned on free, so memory stays flat. Harmless no-op where there is no glibc."""
    try:
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # -3 = M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def run_merge(cfg: MergeConfig) -> dict:
    out_dir = Path(cfg.output_dir)
    datasets = discover_datasets(cfg.inputs, cfg.include or None, cfg.exclude, cfg.require_datagen_complete)
    out = PhaseOutput(out_dir, merge_fingerprint(cfg, datasets))
    done = out.completed(verify=lambda m: parts_intact(out_dir, m, cfg.verify_existing))
    if done is not None:
        log.info("merge: %s is complete for these inputs and params (fingerprint %s): nothing to do", out_dir,
                 out.fingerprint)
        return summary(out_dir, done, read_json(out_dir / STATS_NAME), skipped=True)

    _keep_large_buffers_off_the_heap()
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp_root = Path(cfg.tmp_dir) if cfg.tmp_dir else out_dir
    for folder in {tmp_root, out_dir}:
        for stale in folder.glob(TMP_PREFIX + "*"):  # left by a killed merge: only those a merge made (marked)
            if (stale / TMP_MARKER).is_file():
                shutil.rmtree(stale, ignore_errors=True)
    tmp = tmp_root / f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    parts_tmp = out_dir / tmp.name if cfg.tmp_dir else tmp  # parts must end on out_dir's filesystem
    for folder in (tmp, parts_tmp):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / TMP_MARKER).touch()
    try:
        return _merge(cfg, datasets, out, tmp, parts_tmp)
    except DiskFullError as e:
        raise DiskFullError(f"merge: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(parts_tmp, ignore_errors=True)


def _merge(cfg, datasets, out: PhaseOutput, tmp: Path, parts_tmp: Path) -> dict:
    out_dir = out.folder
    t0 = time.monotonic()
    stats = MergeStats(cfg.max_examples)
    total_bytes = sum(d.size for d in datasets)
    bits = bucket_bits_for(total_bytes // MIN_JSON_BYTES_PER_TOKEN, cfg.bucket_tokens)
    spill = BucketSpill(tmp / "buckets", bits, cfg.seed)
    log.info("merge: %d dataset(s), %.2f GB of JSONL -> %s (%d shuffle buckets)", len(datasets), total_bytes / 1e9,
             out_dir, spill.num_buckets)

    # Pass 1: parse, validate, cap, spill.
    done_bytes, kept_tokens, last_log = 0, 0, time.monotonic()
    for ds in datasets:
        stats.dataset(ds.name)
    for src, parsed in iter_parsed_blocks([d.path for d in datasets], cfg.read_block_bytes, cfg.id_limit):
        ds = datasets[src]
        stats.dataset(ds.name).lines += parsed.lines
        for reason in sorted({b.reason for b in parsed.bad}):
            bad = [b for b in parsed.bad if b.reason == reason]
            stats.add_bad(ds.name, ds.path, reason, len(bad), bad)
        checked = check_block(parsed.table, ds.name, id_limit=cfg.id_limit, max_seq_len=cfg.max_seq_len,
                              cap_policy=cfg.cap_policy, min_assistant_tokens=cfg.min_assistant_tokens,
                              max_examples=cfg.max_examples)
        for reason, k in checked.bad_counts.items():
            stats.add_bad(ds.name, ds.path, reason, k, [b for b in checked.bad_examples if b.reason == reason])
        for reason, d in checked.drops.items():
            stats.add_drop(ds.name, ds.path, reason, d.count, d.tokens, d.examples)
        stats.add_valid(ds.name, checked.valid_lengths, checked.truncated, checked.truncated_tokens)
        spill.add(checked.table, src)
        kept_tokens += int(pc.sum(checked.table.column("length")).as_py() or 0)
        done_bytes += parsed.nbytes
        if time.monotonic() - last_log > LOG_EVERY_S:
            last_log = time.monotonic()
            el = last_log - t0
            log.info("merge pass 1: %.0f%% of input, %.1fM tokens kept, %.2fM tokens/s, ETA pass 1 %.0f s",
                     100 * done_bytes / max(1, total_bytes), kept_tokens / 1e6, kept_tokens / el / 1e6,
                     el * (total_bytes - done_bytes) / max(1, done_bytes))
    for ds in datasets:
        if stats.dataset(ds.name).lines == 0:
            stats.add_bad(ds.name, ds.path, "empty_dataset", 1, [BadLine("empty_dataset", 0, "no lines")])
    spill.close()
    _check_or_fail(stats, cfg, out_dir)
    t1 = time.monotonic()

    # Pass 2: per bucket, sort by hash, drop duplicate sample_ids, write parts.
    tokens_per_file = cfg.tokens_per_file
    if cfg.num_files:
        tokens_per_file = max(1, -(-kept_tokens // cfg.num_files))
    writer = PartWriter(parts_tmp, tokens_per_file, cfg.row_group_tokens)
    written = 0
    for rows, dups in prefetched(iter_sorted_buckets(spill), name="merge-prefetch"):
        if dups.num_rows:
            _count_duplicates(stats, datasets, rows, dups, cfg.max_examples)
        lengths = rows.column("length").to_numpy()
        masks = rows.column("loss_mask").combine_chunks()
        assistant = int(pc.sum(masks.flatten()).as_py() or 0) if len(masks) else 0
        stats.add_output(rows.column("dataset").to_numpy(zero_copy_only=False), lengths, assistant)
        writer.add(rows)
        written += int(lengths.sum())
        if time.monotonic() - last_log > LOG_EVERY_S:
            last_log = time.monotonic()
            el = last_log - t1
            log.info("merge pass 2: %.1fM of %.1fM tokens written, %.2fM tokens/s, ETA %.0f s", written / 1e6,
                     kept_tokens / 1e6, written / max(el, 1e-9) / 1e6, el * (kept_tokens - written) / max(1, written))
    files = writer.close()
    _check_or_fail(stats, cfg, out_dir)
    rows_total = sum(f["rows"] for f in files)
    tokens_total = sum(f["tokens"] for f in files)
    if rows_total == 0:
        atomic_write_json(out_dir / FAILED_STATS_NAME, stats.to_dict(0, 0, None))
        raise BadInputError(f"merge: no sample left to write from {[str(d.path) for d in datasets]}; see the"
                            f" dropped/bad_input counts in {out_dir / FAILED_STATS_NAME}")
    t2 = time.monotonic()

    estimate = extraction_estimate(tokens_total, cfg.target, cfg.storage_dtype, cfg.extraction_tokens_per_s)
    stats_doc = stats.to_dict(rows_total, tokens_total, estimate)
    stats_doc["inputs"] = [{"dataset": d.name, "path": str(d.path), "bytes": d.size,
                            "datagen_complete": d.datagen_complete} for d in datasets]
    stats_doc["timing"] = {"pass1_s": t1 - t0, "pass2_s": t2 - t1, "total_s": t2 - t0,
                           "input_tokens_per_s": stats_doc["tokens_in"] / max(1e-9, t2 - t0)}
    manifest = _commit(out, parts_tmp, files, stats_doc, manifest_record(files, cfg.seed, cfg.output_params()))
    log.info("merge: wrote %d rows, %.2fM tokens in %d part(s) to %s in %.1f s (%.2fM tokens/s)%s", rows_total,
             tokens_total / 1e6, len(files), out_dir, t2 - t0, stats_doc["tokens_in"] / max(1e-9, t2 - t0) / 1e6,
             f"; extraction estimate {estimate['text']}" if estimate else "")
    return summary(out_dir, manifest, stats_doc, skipped=False)


def _count_duplicates(stats: MergeStats, datasets, rows, dups, max_examples: int) -> None:
    """Record duplicate rows (a sample_id seen before) per dataset, naming both places."""
    kept_where = {s: (int(src), int(line)) for s, src, line in zip(
        rows.column("sample_id").to_pylist(), rows.column("src").to_pylist(), rows.column("line").to_pylist())}
    by_src: dict[int, list[BadLine]] = {}
    for s, src, line in zip(dups.column("sample_id").to_pylist(), dups.column("src").to_pylist(),
                            dups.column("line").to_pylist()):
        ksrc, kline = kept_where[s]
        by_src.setdefault(src, []).append(BadLine("duplicate_sample_id", line,
                                                  f"sample_id {s!r} already at {datasets[ksrc].path}:{kline}"))
    for src in sorted(by_src):
        bad = by_src[src]
        stats.add_bad(datasets[src].name, datasets[src].path, "duplicate_sample_id", len(bad), bad[:max_examples])
        # the duplicate was counted as a valid input sample in pass 1
        d = stats.dataset(datasets[src].name)
        d.duplicates += len(bad)


def _check_or_fail(stats: MergeStats, cfg: MergeConfig, out_dir: Path) -> None:
    try:
        stats.check_threshold(cfg.max_bad_fraction)
    except BadInputError:
        # Keep the evidence next to the output; the last good manifest/stats (if any) stay untouched.
        atomic_write_json(out_dir / FAILED_STATS_NAME, stats.to_dict(0, 0, None))
        raise


def _commit(out: PhaseOutput, parts_tmp: Path, files: list[dict], stats_doc: dict, manifest: dict) -> dict:
    """Replace the output: drop the old manifest first (so no manifest ever lists a part that changed), rename
    the new parts in, remove parts of an older run, then stats.json, then manifest.json last."""
    out_dir = out.folder
    out.invalidate()
    names = {f["path"] for f in files}
    for name in sorted(names):
        os.replace(parts_tmp / name, out_dir / name)
    for old in out_dir.glob("part-*.parquet"):
        if old.name not in names:
            old.unlink()
    (out_dir / FAILED_STATS_NAME).unlink(missing_ok=True)
    atomic_write_json(out_dir / STATS_NAME, stats_doc)
    return out.commit(manifest)
