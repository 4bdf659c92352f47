from __future__ import annotations

from airflow.sdk import Context

from eagle3.merge.config import MergeConfig
from eagle3_airflow.operators.base import Eagle3Operator


class MergeOperator(Eagle3Operator[MergeConfig]):
    """Merges the datagen datasets into one capped, deduplicated, shuffled parquet dataset (eagle3.merge)."""

    config_class = MergeConfig
    ui_color = "#fdf0d5"

    def run(self, cfg: MergeConfig, context: Context) -> dict:
        from eagle3.merge import run_merge

        return run_merge(cfg)
