from __future__ import annotations

from typing import Any, Sequence

from airflow.sdk import BaseOperator

from operators._render import rendered


class PlanShardsOperator(BaseOperator):
    """Splits the merged dataset into `num_shards` shards of about equal tokens; returns the shard specs.

    The returned list is the XCom that `ExtractShardOperator.partial(...).expand(shard=...)` maps over.
    """

    template_fields: Sequence[str] = ("merge_dir", "num_shards")
    ui_color = "#f4e3d9"

    def __init__(self, *, merge_dir: str, num_shards: Any = 1, **kwargs):
        super().__init__(**kwargs)
        self.merge_dir = merge_dir
        self.num_shards = num_shards

    def execute(self, context) -> list[dict]:
        from eagle3.extract.plan import plan_shards

        specs = plan_shards(str(self.merge_dir), int(self.num_shards))
        for s in specs:
            self.log.info("shard %d: %d rows, %d tokens, %d row ranges", s.shard, s.rows, s.tokens, len(s.ranges))
        return [s.to_dict() for s in specs]


class ExtractShardOperator(BaseOperator):
    """Extracts the hidden states of one shard (resumable; a finished shard is a no-op).

    Use as `ExtractShardOperator.partial(task_id="extract", queue="gpu", pool="gpu", ...).expand(shard=plan.output)`.
    """

    template_fields: Sequence[str] = ("shard", "model_path", "extract_dir", "capture_layers", "dtype",
                                      "token_budget", "chunk_mb", "device", "writer_threads", "storage_dtype",
                                      "compile", "backend", "attention", "pad_multiple")
    ui_color = "#f9d9d9"

    def __init__(self, *, shard: Any, model_path: str, extract_dir: str, capture_layers: Any = None,
                 dtype: str = "auto", token_budget: Any = 16384, chunk_mb: Any = 1024, device: str = "auto",
                 writer_threads: Any = 6, storage_dtype: str = "auto", compile: Any = "auto", backend: str = "hf",
                 attention: str = "auto", pad_multiple: Any = "auto", **kwargs):
        super().__init__(**kwargs)
        self.shard = shard
        self.model_path = model_path
        self.extract_dir = extract_dir
        self.capture_layers = capture_layers
        self.dtype = dtype
        self.token_budget = token_budget
        self.chunk_mb = chunk_mb
        self.device = device
        self.writer_threads = writer_threads
        self.storage_dtype = storage_dtype
        self.compile = compile
        self.backend = backend
        self.attention = attention
        self.pad_multiple = pad_multiple

    def execute(self, context) -> dict:
        from eagle3.extract.extractor import ExtractConfig, extract_shard

        cfg = ExtractConfig(
            model_path=str(self.model_path),
            extract_dir=str(self.extract_dir),
            capture_layers=[int(x) for x in rendered(self.capture_layers)] if self.capture_layers else None,
            dtype=str(self.dtype),
            token_budget=int(self.token_budget),
            chunk_mb=float(self.chunk_mb),
            device=str(self.device),
            writer_threads=int(self.writer_threads),
            storage_dtype=str(self.storage_dtype),
            compile=self.compile if isinstance(self.compile, bool) else str(self.compile),
            backend=str(self.backend),
            attention=str(self.attention),
            pad_multiple=str(self.pad_multiple),  # "auto" or digits (a rendered template); the config checks it
        )
        out = extract_shard(cfg, dict(rendered(self.shard)))
        self.log.info("shard %d: %d chunks, %d tokens, %.2f GB, %.0f tok/s%s", out["shard"], out["chunks"],
                      out["tokens"], out["bytes"] / 1e9, out["tok_per_s"], " (already complete)" if out["skipped"] else "")
        return {k: out[k] for k in ("shard", "shard_dir", "chunks", "tokens", "samples", "bytes", "tok_per_s",
                                    "skipped", "resumed_from_chunk")}
