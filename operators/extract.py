from __future__ import annotations

from typing import Any, Mapping, Sequence

from airflow.sdk import Context

from eagle3.extract.config import ExtractConfig, ShardPlanConfig
from eagle3_airflow.operators.base import Eagle3Operator


class PlanShardsOperator(Eagle3Operator[ShardPlanConfig]):
    """Splits the merged dataset into `num_shards` shards of about equal tokens; returns the shard specs.

    The returned list is the XCom that `ExtractShardOperator.partial(...).expand(shard=...)` maps over.
    """

    config_class = ShardPlanConfig
    ui_color = "#f4e3d9"

    def run(self, cfg: ShardPlanConfig, context: Context) -> list[dict]:
        from eagle3.extract.plan import plan_shards

        specs = plan_shards(cfg)
        for s in specs:
            self.log.info("shard %d: %d rows, %d tokens, %d row ranges", s.shard, s.rows, s.tokens, len(s.ranges))
        return [s.to_dict() for s in specs]


class ExtractShardOperator(Eagle3Operator[ExtractConfig]):
    """Extracts the hidden states of one shard (resumable; a finished shard is a no-op).

    Use as `ExtractShardOperator.partial(task_id="extract", queue="gpu", pool="gpu", config=...)
    .expand(shard=plan.output)`.
    """

    config_class = ExtractConfig
    template_fields: Sequence[str] = ("config", "shard")
    ui_color = "#f9d9d9"

    def __init__(self, *, shard: Mapping[str, Any] | str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shard = shard

    def run(self, cfg: ExtractConfig, context: Context) -> dict:
        from eagle3.extract.run import extract_shard
        from eagle3.extract.plan import ShardSpec
        from eagle3_airflow.operators._render import rendered

        out = extract_shard(cfg, ShardSpec.from_dict(rendered(self.shard)), try_number=context["ti"].try_number)
        self.log.info("shard %d: %d chunks, %d tokens, %.2f GB, %.0f tok/s%s", out["shard"], out["chunks"],
                      out["tokens"], out["bytes"] / 1e9, out["tok_per_s"], " (already complete)" if out["skipped"] else "")
        return {k: out[k] for k in ("shard", "shard_dir", "chunks", "tokens", "samples", "bytes", "tok_per_s",
                                    "skipped", "resumed_from_chunk")}
