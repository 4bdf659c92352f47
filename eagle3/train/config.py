"""The training phase config: each field declared once (default, bounds, help), torch-free.

Fields with a `param` name are trigger-form params (eagle3.knobs.form_params); the rest are set through the
form's free `train_overrides` object, where an unknown key is a ConfigError naming it (eagle3.knobs.build).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3.errors import ConfigError
from eagle3.identity import model_identity
from eagle3.io import MANIFEST_NAME, fingerprint, read_json
from eagle3.knobs import check_knobs, knob
from eagle3.sections import DataConfig, TargetConfig

TRAINING = "Training"

# Params that change how a run goes, not what it produces: a finished run with other values is reused.
# num_gpus and parallel too: the global batch and its loss are the same at any N, so a run resumes at another N.
_NOT_IN_FINGERPRINT = ("device", "log_every", "log_every_s", "checkpoint_every", "keep_checkpoints", "compile",
                       "mlflow_tracking_uri", "mlflow_experiment", "num_gpus", "parallel", "dist_timeout_s",
                       "micro_batch_tokens")
PARALLEL_CHOICES = ("ddp", "fsdp")


@dataclass
class TrainConfig:
    target: TargetConfig = knob(help="The run's target section: its embedding and lm_head are read, not trained.")
    output_dir: str = knob(help="The training folder: vocab, checkpoints, metrics, export/, report.json.")
    data: DataConfig = knob(default_factory=DataConfig,
                            help="The run's data section: samples are trained on up to max_seq_len tokens (merge's "
                                 "cap); longer ones are cut and counted in report.json.")
    shard_dirs: list[str] = knob(default_factory=list,
                                 help="Shard folders of extracted hidden states (the extraction tasks' outputs).")
    # The five defaults below are the recipe the ablations in docs/benchmarks.md support (docs/train.md, "Defaults")
    draft_vocab_size: int = knob(32000, min=2, param="draft_vocab_size", section=TRAINING,
                                 help="Draft vocabulary (capped at the distinct tokens seen).")
    ttt_steps: int = knob(3, min=1, max=32, param="ttt_steps", section=TRAINING,
                          help="Training-time-test depth K.")
    step_decay: float = knob(0.8, gt=0, max=1, help="Weight of TTT step k is step_decay^k.")
    lr: float = knob(8e-4, gt=0, param="lr", section=TRAINING, help="Peak learning rate.")
    min_lr_ratio: float = knob(0.0, min=0, max=1, help="Cosine schedule floor, as a fraction of lr.")
    warmup_ratio: float = knob(0.015, min=0, max=0.9, help="Fraction of the steps spent in linear warmup.")
    weight_decay: float = knob(0.0, min=0, help="AdamW weight decay.")
    grad_clip: float = knob(0.5, gt=0, help="Gradient norm clip.")
    batch_size: int = knob(32, min=1, param="batch_size", section=TRAINING,
                           help="Samples per micro-batch (all ranks together); a forward takes at most "
                                "micro_batch_tokens of them, so long samples need no smaller batch.")
    grad_accum: int = knob(1, min=1, help="Micro-batches per optimizer step.")
    # the loss's float32 [rows, tokens, draft vocab] terms outgrow a GPU first: 32 x 2,048 at draft vocab 28,487
    # (7.5 GB a term) ran out of an H100's 80 GB, 16 x 2,048 fitted (2026-12-06)
    micro_batch_tokens: int = knob(32768, min=0,
                                   help="Most rows x padded tokens one forward and backward takes: a micro-batch of "
                                        "longer samples runs in parts of fewer rows, each rank the same number of "
                                        "parts (the same samples and the same loss, so a run resumes across a "
                                        "change of it). 0 = no limit.")
    epochs: int = knob(12, min=1, param="epochs", section=TRAINING,
                       help="Passes over the data (12: the best of 4, 6, 8 and 12 on 14.6K conversations; far "
                            "more data wants fewer: docs/train.md, \"Defaults\").")
    max_steps: int = knob(0, min=0, param="max_steps", section=TRAINING,
                          help="Optimizer steps; 0 = run the epochs.")
    checkpoint_every: int = knob(100, min=1, help="Optimizer steps between checkpoints (a killed run resumes there).")
    keep_checkpoints: int = knob(2, min=1, help="Checkpoints kept on disk (the best validation's weights are "
                                                 "kept apart: eagle3.train.validation).")
    # Off by default until a device run measures it against the last checkpoint (docs/train.md, "Choosing the
    # checkpoint"); 0 keeps today's defaults and their figure.
    holdout_fraction: float = knob(0.0, min=0, max=0.5,
                                   help="Share of the samples held out of training to choose the checkpoint: the "
                                        "drafter's simulated acceptance on them (TTT chain, teacher-forced, no "
                                        "target forward) is measured every validate_every steps and the best "
                                        "weights are exported. 0 = no validation, the last weights are exported.")
    validate_every: int = knob(0, min=0, help="Optimizer steps between validations on the held-out slice (each "
                                              "also writes a checkpoint); 0 = every checkpoint_every steps. The "
                                              "last step is always validated.")
    seed: int = knob(0, min=0, help="Data order and initialisation seed.")
    device: str = knob("auto", help="auto = cuda when available, else cpu; or a torch device name.")
    init_lm_head_from_target: bool = knob(True, help="Start the drafter's lm_head from the target's rows.")
    log_every: int = knob(1, min=1, help="A metrics.jsonl line every N optimizer steps.")
    log_every_s: float = knob(10.0, min=0, help="A progress line in the task log at most this often (seconds).")
    compile: bool = knob(True, help="torch.compile the TTT loss on GPU.")
    pad_multiple: int = knob(256, min=1, help="Compiled: pad batch lengths to pad_multiple * 2^j (few graphs).")
    mlflow_tracking_uri: str = knob("", help="Also log the metrics to MLflow here (the operator sets it from an "
                                             "Airflow Connection); TensorBoard event files are always written.")
    mlflow_experiment: str = knob("eagle3", help="The MLflow experiment of the run.")
    num_gpus: int = knob(1, min=1, max=64, param="train_num_gpus", section=TRAINING,
                         help="GPUs (ranks) training uses; each micro-batch's samples are spread over them, so the "
                              "global batch (batch_size x grad_accum) is the same at any N. On the CPU: gloo ranks.")
    parallel: str = knob("ddp", choices=PARALLEL_CHOICES,
                         help="With num_gpus > 1: ddp (a whole drafter and its optimizer state on every GPU) or fsdp "
                              "(FSDP2: parameters, gradients and optimizer state sharded over the GPUs, for a "
                              "drafter that does not fit one).")
    dist_timeout_s: float = knob(1800.0, gt=0, help="With num_gpus > 1: a rank that waits this long on the others "
                                                    "fails the run (a dead or hung rank cannot stall it for longer).")

    def __post_init__(self) -> None:
        check_knobs(self, "train")
        if self.max_seq_len < self.ttt_steps + 2:
            raise ConfigError(f"data param max_seq_len {self.max_seq_len} must be >= train param ttt_steps + 2 = "
                              f"{self.ttt_steps + 2}: step K predicts the token K+1 places ahead")
        if self.num_gpus > self.batch_size:
            raise ConfigError(f"train param batch_size {self.batch_size} cannot be spread over train_num_gpus "
                              f"{self.num_gpus}: every rank takes a share of each micro-batch's samples; use "
                              f"batch_size >= {self.num_gpus} (and grad_accum for a larger global batch), or fewer GPUs")

    @property
    def model_path(self) -> str:
        return self.target.model_path

    @property
    def max_seq_len(self) -> int:
        return self.data.max_seq_len

    @property
    def validation_interval(self) -> int:
        return self.validate_every or self.checkpoint_every

    def fingerprint(self) -> str:
        """The params (checkpoints carry it) and what the run reads, by content: the target and the shards; not
        where they or the output live (a run folder copied elsewhere resumes). The phase's record adds the data
        (eagle3.train.run)."""
        d = {k: v for k, v in asdict(self).items()
             if k not in _NOT_IN_FINGERPRINT + ("target", "data", "output_dir", "shard_dirs")}
        if not self.holdout_fraction:  # no validation: the fingerprint of a run from before these knobs existed
            d.pop("holdout_fraction")
            d.pop("validate_every")
        else:  # which steps are compared decides the export
            d["validate_every"] = self.validation_interval
        return fingerprint({**d, "model": model_identity(self.model_path), "max_seq_len": self.max_seq_len,
                            "shards": data_fingerprint(self.shard_dirs)})


def shard_chunk_hashes(shard_dirs: list[str]) -> dict[str, list[str] | None]:
    """{shard folder: its committed chunks' sha256 as its manifest records them} (None: no readable manifest).
    Read from the manifests: no chunk file is hashed again."""
    out: dict[str, list[str] | None] = {}
    for d in shard_dirs:
        try:
            chunks = read_json(Path(d) / MANIFEST_NAME).get("chunks") or []
            out[str(d)] = [str(c.get("sha256")) for c in chunks]
        except (OSError, ValueError, AttributeError):
            out[str(d)] = None
    return out


def data_fingerprint(shard_dirs: list[str]) -> str:
    """What training reads, by content: the chunks' sha256 of every shard (sorted by folder)."""
    hashes = shard_chunk_hashes(shard_dirs)
    return fingerprint([[Path(d).name, hashes[d]] for d in sorted(hashes)])
