from __future__ import annotations

from typing import Any, Sequence

from airflow.sdk import BaseOperator

from operators._render import rendered


class MergeOperator(BaseOperator):
    """Merges the datagen datasets into one capped, deduplicated, shuffled parquet dataset (eagle3.merge)."""

    template_fields: Sequence[str] = ("inputs", "output_dir", "include", "exclude", "max_seq_len", "cap_policy",
                                      "min_assistant_tokens", "seed", "num_files", "tokens_per_file", "vocab_size",
                                      "max_bad_fraction", "num_capture_layers", "hidden_size",
                                      "extraction_tokens_per_s")
    ui_color = "#fdf0d5"

    def __init__(self, *, inputs: Any, output_dir: str, include: Any = None, exclude: Any = None,
                 max_seq_len: Any = 8192, cap_policy: str = "truncate", min_assistant_tokens: Any = 1, seed: Any = 0,
                 num_files: Any = None, tokens_per_file: Any = 50_000_000, vocab_size: Any = None,
                 max_bad_fraction: Any = 0.01, num_capture_layers: Any = 3, hidden_size: Any = None,
                 extraction_tokens_per_s: Any = None, **kwargs):
        super().__init__(**kwargs)
        self.inputs = inputs
        self.output_dir = output_dir
        self.include = include
        self.exclude = exclude
        self.max_seq_len = max_seq_len
        self.cap_policy = cap_policy
        self.min_assistant_tokens = min_assistant_tokens
        self.seed = seed
        self.num_files = num_files
        self.tokens_per_file = tokens_per_file
        self.vocab_size = vocab_size
        self.max_bad_fraction = max_bad_fraction
        self.num_capture_layers = num_capture_layers
        self.hidden_size = hidden_size
        self.extraction_tokens_per_s = extraction_tokens_per_s

    def execute(self, context) -> dict:
        from eagle3.merge import MergeConfig, run_merge

        def as_list(v):
            v = rendered(v)
            if isinstance(v, str):
                return [v.strip()] if v.strip() else []
            return [str(x) for x in v] if v else []

        def opt_int(v):
            return None if v in (None, "", "None") else int(v)

        cfg = MergeConfig(
            inputs=as_list(self.inputs),
            output_dir=str(self.output_dir),
            include=as_list(self.include) or None,
            exclude=as_list(self.exclude),
            max_seq_len=int(self.max_seq_len),
            cap_policy=str(self.cap_policy),
            min_assistant_tokens=int(self.min_assistant_tokens),
            seed=int(self.seed),
            num_files=opt_int(self.num_files),
            tokens_per_file=int(self.tokens_per_file),
            vocab_size=opt_int(self.vocab_size),
            max_bad_fraction=float(self.max_bad_fraction),
            num_capture_layers=int(self.num_capture_layers),
            hidden_size=opt_int(self.hidden_size),
            extraction_tokens_per_s=float(self.extraction_tokens_per_s) if self.extraction_tokens_per_s else None,
        )
        return run_merge(cfg)
