"""MergeConfig: every knob of the merge + shuffle phase, validated up front (errors name the param)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from eagle3.errors import ConfigError
from eagle3.knobs import check_knobs, knob
from eagle3.sections import DataConfig, TargetConfig

CAP_POLICIES = ("truncate", "drop")


@dataclass
class MergeConfig:
    inputs: list[str] = knob(help="dataset folders (<dir>/tokenized.jsonl) and/or parent folders holding them")
    output_dir: str = knob(help="the merged dataset's folder")
    include: list[str] | None = knob(None, param="include", section="Merge",
                                     help="Datasets to keep (empty = all).")
    exclude: list[str] | None = knob(None, param="exclude", section="Merge",
                                     help="Datasets to drop (by name); empty = none.")
    data: DataConfig = knob(default_factory=DataConfig, help="The run's data section: max_seq_len, the cap.")
    target: TargetConfig | None = knob(None, help="The run's target, resolved (its vocab bounds the token ids, its "
                                                  "hidden size sizes the extraction estimate); None = no such check.")
    cap_policy: str = knob("truncate", choices=CAP_POLICIES, param="cap_policy", section="Merge",
                           help="What to do with a longer sample: keep its first max_seq_len tokens, or drop it.")
    min_assistant_tokens: int = knob(1, min=0, help="after the cap; a sample with no loss tokens teaches nothing")
    seed: int = knob(0, min=0, param="seed", section="Merge", help="Shuffle seed.")
    num_files: int | None = knob(None, min=1, help="at most this many parquet parts (balanced by tokens); "
                                                   "overrides tokens_per_file")
    tokens_per_file: int = knob(50_000_000, min=1, help="tokens per parquet part")
    row_group_tokens: int = knob(1_000_000, min=1, help="tokens per parquet row group")
    max_bad_fraction: float = knob(0.01, min=0.0, max=1.0, help="fail when bad lines / lines exceeds this")
    require_datagen_complete: bool = knob(False, help="fail when a dataset's datagen manifest.json is "
                                                      "missing/incomplete")
    # Extraction estimate printed in stats: tokens x eagle3.fit.bytes_per_token (the run configuration
    # gives extraction's storage dtype; with no target there is no estimate).
    storage_dtype: str = knob("auto", help="extraction's storage dtype (for the extraction estimate)")
    extraction_tokens_per_s: float | None = knob(None, gt=0, help="extraction rate for the time estimate")
    # Tuning only: none of these change the output bytes.
    bucket_tokens: int = knob(4_000_000, min=1, help="tokens per on-disk shuffle bucket (memory of pass 2)")
    read_block_bytes: int = knob(8 << 20, min=1024, help="JSONL bytes parsed at a time (memory of pass 1)")
    tmp_dir: str | None = knob(None, help="default: a hidden folder inside output_dir (same filesystem: atomic "
                                          "renames)")
    verify_existing: bool = knob(True, help="re-run: check sha256 of existing parts before skipping")
    max_examples: int = knob(5, min=0, help="file:line examples kept per bad-input reason")

    def __post_init__(self):
        if isinstance(self.inputs, str):
            self.inputs = [self.inputs]
        self.inputs = [str(p) for p in self.inputs]
        if self.include is not None:
            self.include = [self.include] if isinstance(self.include, str) else list(self.include)
        self.exclude = [self.exclude] if isinstance(self.exclude, str) else list(self.exclude or [])
        check_knobs(self, "merge")
        if not self.inputs:
            raise ConfigError("merge param inputs: give at least one dataset folder or parent folder")
        overlap = set(self.include or []) & set(self.exclude)
        if overlap:
            raise ConfigError(f"merge params include and exclude both name {sorted(overlap)}")

    @property
    def max_seq_len(self) -> int:
        return self.data.max_seq_len

    @property
    def id_limit(self) -> int:
        """Token ids must lie in [0, id_limit): the vocab, or what int32 (the parquet column type) holds."""
        vocab = self.target.vocab_size if self.target is not None else None
        return vocab if vocab is not None else 2**31 - 1

    def output_params(self) -> dict:
        """The params that decide the output (and stats): recorded in the manifest and fingerprinted."""
        tuning = {"inputs", "output_dir", "bucket_tokens", "read_block_bytes", "tmp_dir", "verify_existing", "data",
                  "target", "storage_dtype", "extraction_tokens_per_s"}  # (the last two: the estimate only)
        d = {k: v for k, v in asdict(self).items() if k not in tuning}
        d.update(max_seq_len=self.max_seq_len, vocab_size=self.target.vocab_size if self.target else None)
        d["include"] = sorted(d["include"]) if d["include"] else None  # [] and None both keep every dataset
        d["exclude"] = sorted(d["exclude"])
        return d
