"""MergeConfig: every knob of the merge + shuffle phase, validated up front (errors name the param)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from eagle3.errors import ConfigError

CAP_POLICIES = ("truncate", "drop")


@dataclass
class MergeConfig:
    inputs: list[str]  # dataset folders (<dir>/tokenized.jsonl) and/or parent folders holding them
    output_dir: str
    include: list[str] | None = None  # dataset names to keep (None = all found)
    exclude: list[str] = field(default_factory=list)
    max_seq_len: int = 8192
    cap_policy: str = "truncate"  # "truncate": keep the first max_seq_len tokens; "drop": drop the sample
    min_assistant_tokens: int = 1  # after the cap; a sample with no loss tokens teaches nothing
    seed: int = 0
    num_files: int | None = None  # at most this many parquet parts (balanced by tokens); overrides tokens_per_file
    tokens_per_file: int = 50_000_000
    row_group_tokens: int = 1_000_000
    vocab_size: int | None = None  # ids outside [0, vocab_size) are bad input
    max_bad_fraction: float = 0.01  # fail when bad lines / lines exceeds this
    require_datagen_complete: bool = False  # fail when a dataset's datagen manifest.json is missing/incomplete
    # Extraction estimate printed in stats: tokens x (num_capture_layers + 1) x hidden_size x bytes_per_value.
    num_capture_layers: int = 3
    hidden_size: int | None = None
    bytes_per_value: int = 2
    extraction_tokens_per_s: float | None = None
    # Tuning only: none of these change the output bytes.
    bucket_tokens: int = 4_000_000  # aim for this many tokens per on-disk shuffle bucket (memory of pass 2)
    read_block_bytes: int = 8 << 20  # JSONL bytes parsed at a time (memory of pass 1: about 2 blocks in flight)
    tmp_dir: str | None = None  # default: a hidden folder inside output_dir (same filesystem: atomic renames)
    verify_existing: bool = True  # re-run: check sha256 of existing parts before skipping
    max_examples: int = 5  # file:line examples kept per bad-input reason

    def __post_init__(self):
        if isinstance(self.inputs, str):
            self.inputs = [self.inputs]
        self.inputs = [str(p) for p in self.inputs]
        if self.include is not None:
            self.include = [self.include] if isinstance(self.include, str) else list(self.include)
        self.exclude = [self.exclude] if isinstance(self.exclude, str) else list(self.exclude or [])
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, msg: str):
            if not cond:
                raise ConfigError(msg)

        need(len(self.inputs) > 0, "inputs: give at least one dataset folder or parent folder")
        need(bool(self.output_dir), "output_dir: required")
        need(self.max_seq_len >= 1, f"max_seq_len must be >= 1, got {self.max_seq_len}")
        need(self.cap_policy in CAP_POLICIES, f"cap_policy must be one of {CAP_POLICIES}, got {self.cap_policy!r}")
        need(self.min_assistant_tokens >= 0, f"min_assistant_tokens must be >= 0, got {self.min_assistant_tokens}")
        need(isinstance(self.seed, int) and not isinstance(self.seed, bool), f"seed must be an int, got {self.seed!r}")
        need(self.num_files is None or self.num_files >= 1, f"num_files must be >= 1, got {self.num_files}")
        need(self.tokens_per_file >= 1, f"tokens_per_file must be >= 1, got {self.tokens_per_file}")
        need(self.row_group_tokens >= 1, f"row_group_tokens must be >= 1, got {self.row_group_tokens}")
        need(self.vocab_size is None or 1 <= self.vocab_size <= 2**31 - 1,
             f"vocab_size must be in [1, 2^31-1], got {self.vocab_size}")
        need(0.0 <= self.max_bad_fraction <= 1.0, f"max_bad_fraction must be in [0, 1], got {self.max_bad_fraction}")
        need(self.num_capture_layers >= 1, f"num_capture_layers must be >= 1, got {self.num_capture_layers}")
        need(self.hidden_size is None or self.hidden_size >= 1, f"hidden_size must be >= 1, got {self.hidden_size}")
        need(self.bytes_per_value >= 1, f"bytes_per_value must be >= 1, got {self.bytes_per_value}")
        need(self.extraction_tokens_per_s is None or self.extraction_tokens_per_s > 0,
             f"extraction_tokens_per_s must be > 0, got {self.extraction_tokens_per_s}")
        need(self.bucket_tokens >= 1, f"bucket_tokens must be >= 1, got {self.bucket_tokens}")
        need(self.read_block_bytes >= 1024, f"read_block_bytes must be >= 1024, got {self.read_block_bytes}")
        overlap = set(self.include or []) & set(self.exclude)
        need(not overlap, f"include and exclude both name {sorted(overlap)}")

    @property
    def id_limit(self) -> int:
        """Token ids must lie in [0, id_limit): the vocab, or what int32 (the parquet column type) holds."""
        return self.vocab_size if self.vocab_size is not None else 2**31 - 1

    def output_params(self) -> dict:
        """The params that decide the output (and stats): recorded in the manifest and fingerprinted."""
        tuning = {"inputs", "output_dir", "bucket_tokens", "read_block_bytes", "tmp_dir", "verify_existing"}
        d = {k: v for k, v in asdict(self).items() if k not in tuning}
        d["include"] = sorted(d["include"]) if d["include"] is not None else None
        d["exclude"] = sorted(d["exclude"])
        return d
