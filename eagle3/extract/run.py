"""The extraction phase's entry: one shard, in this process or in tp_size ranks.

    extract_shard(ExtractConfig(...), spec)   # spec: eagle3.extract.plan.ShardSpec (the plan_shards task's output)

The work is eagle3.extract.extractor.ShardExtractor (one process) or eagle3.extract.tp (tensor-parallel ranks);
a failure is recorded for the shard view (eagle3.extract.status).
"""

from __future__ import annotations

from pathlib import Path

from eagle3.extract.backend import ExtractionBackend
from eagle3.extract.config import ExtractConfig
from eagle3.extract.extractor import ShardExtractor
from eagle3.extract.plan import ShardSpec
from eagle3.extract.status import clear_failure, record_failure
from eagle3.extract.tp import extract_shard_tp


def extract_shard(cfg: ExtractConfig, spec: ShardSpec | dict, backend: ExtractionBackend | None = None,
                  model_config: dict | None = None, try_number: int | None = None) -> dict:
    """Extract one shard (resumable, a no-op when complete) and return a small JSON-able summary.
    tp_size > 1: in tp_size ranks (eagle3.extract.tp). A failure leaves last_error.json (its first line,
    `try_number`) in the shard folder for the shard view (eagle3.extract.status); the next attempt removes it."""
    spec = spec if isinstance(spec, ShardSpec) else ShardSpec.from_dict(spec)
    shard_dir = Path(cfg.extract_dir) / f"shard-{spec.shard:05d}"
    clear_failure(shard_dir)
    try:
        if cfg.target.tp_size > 1 and backend is None:
            return extract_shard_tp(cfg, spec)
        return ShardExtractor(cfg, spec, backend=backend, model_config=model_config).run()
    except BaseException as e:  # a kill by Airflow (SIGTERM) too; SIGKILL leaves nothing, the view then asks Airflow
        shard_dir.mkdir(parents=True, exist_ok=True)
        record_failure(shard_dir, e, try_number)
        raise
