"""The run configuration's shared sections: what more than one phase reads, declared once.

    target: the target model: its folder, the layers whose states the drafter is trained on, the tensor-parallel
            size it runs at, its compute dtype; after preflight also the facts read from its config.json.
    data:   the sequence-length cap of the run: merge caps samples at it, training trains on them whole.

Every phase config that needs one of these holds the section itself (ExtractConfig.target, TrainConfig.data, ...),
never a copy of its fields. The run configuration (eagle3.config.RunConfig) builds the sections once from the
trigger form, preflight resolves them once (`TargetConfig.resolved`: capture layers to concrete ints, the model's
facts filled in) and every later task gets the resolved, frozen sections: no phase resolves a default again.
Torch-free and Airflow-free: the DAG file imports it at parse time.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from eagle3.errors import ConfigError
from eagle3.knobs import check_knobs, knob

AUTO = "auto"
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")


def default_model_path() -> str:
    cache = Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3"))
    return os.environ.get("EAGLE3_MODEL_PATH", str(cache / "SmolLM2-135M-Instruct"))


@dataclass(frozen=True)
class TargetConfig:
    model_path: str = knob(default_factory=default_model_path, param="model_path", section="Run",
                           schema={"minLength": 1},
                           help="HF-format folder of the target model (config.json, tokenizer, safetensors).")
    # "auto", not null, as the form's default: the form shows an array param's null as "[]" (Airflow 3.3)
    capture_layers: list[int] | str = knob(
        AUTO, min=1, param="capture_layers", section="Run", pattern="^auto$",
        schema={"type": ["string", "array", "null"], "minItems": 1, "maxItems": 8},
        help="HF hidden_states indices to capture, ascending (1..L-1), e.g. [2, 15, 27]; auto (or null) = "
             "EAGLE-3's [2, L//2, L-3].")
    # N ranks via eagle3.launch (one GPU each; gloo ranks on the CPU), transformers' tp_plan="auto": extraction
    # and evaluation load the target this way
    tp_size: int = knob(1, min=1, max=64, param="extract_tp_size", section="Extraction",
                        help="Tensor-parallel ranks (GPUs) the target runs on, in extraction and evaluation: must "
                             "divide the attention heads, kv heads and experts; the shard task takes this many gpu "
                             "pool slots. 1 = one process.")
    dtype: str = knob(AUTO, choices=DTYPE_CHOICES,
                      help="Compute dtype of the target's forward in extraction; auto = bfloat16 on a GPU, float32 "
                           "on the CPU (resolved where the task runs: eagle3.extract.extractor.resolve_for_device).")
    # Facts of the model, filled in by `resolved` (preflight): None before.
    num_layers: int | None = knob(None, min=1, help="Decoder layers (config.json), set by preflight.")
    hidden_size: int | None = knob(None, min=1, help="Hidden size (config.json), set by preflight.")
    vocab_size: int | None = knob(None, min=1, help="Vocabulary size (config.json), set by preflight.")
    architecture: str = knob("", help="config.json's architectures[0], set by preflight (serving engines pick "
                                      "their model class, and SGLang its layer-id rule, by it).")

    def __post_init__(self):
        if self.capture_layers is None:  # null in the form = auto
            object.__setattr__(self, "capture_layers", AUTO)
        check_knobs(self, "target")
        if isinstance(self.capture_layers, str) and self.capture_layers != AUTO:
            raise ConfigError(f"target param capture_layers must be a list of ints or 'auto', "
                              f"got {self.capture_layers!r}")

    def resolved(self) -> TargetConfig:
        """This section with the capture layers checked against the model (auto = [2, L//2, L-3]) and the model's
        facts read from its config.json: what preflight hands every later task."""
        from eagle3.models import model_info, resolve_capture_layers

        info = model_info(self.model_path)
        layers = resolve_capture_layers(None if self.capture_layers == AUTO else self.capture_layers, info)
        return dataclasses.replace(self, capture_layers=layers, num_layers=info.num_layers,
                                   hidden_size=info.hidden_size, vocab_size=info.vocab_size,
                                   architecture=info.architecture)

    def require_resolved(self, where: str) -> TargetConfig:
        """`self`, or a ConfigError: a phase runs on the target preflight resolved (or a caller's explicit one)."""
        if not isinstance(self.capture_layers, list):
            raise ConfigError(f"{where}: target.capture_layers is {self.capture_layers!r}; the phase needs the "
                              f"resolved list (TargetConfig.resolved(), which preflight runs)")
        return self


@dataclass(frozen=True)
class DataConfig:
    max_seq_len: int = knob(8192, min=3, max=1_048_576, param="max_seq_len", section="Merge",
                            help="Sequence-length cap of the run: merge caps samples at it, training trains on "
                                 "them whole.")

    def __post_init__(self):
        check_knobs(self, "data")
