from __future__ import annotations

from typing import Any, Mapping, Sequence

from airflow.sdk import Context

from eagle3.train.config import EvalConfig, TrainConfig
from operators.base import Eagle3Operator


class TrainDrafterOperator(Eagle3Operator[TrainConfig]):
    """Trains the EAGLE-3 drafter on extracted shards and exports it for SGLang and vLLM (resumes after a kill)."""

    config_class = TrainConfig
    template_fields: Sequence[str] = ("config", "shard_dirs", "overrides")
    ui_color = "#fde2c8"

    def __init__(self, *, shard_dirs: Sequence[str | Mapping[str, Any]] | str,
                 overrides: Mapping[str, Any] | str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shard_dirs = shard_dirs  # shard folders, or the extract tasks' summaries ({"shard_dir": ...})
        self.overrides = overrides  # the form's free TrainConfig fields (train_overrides)

    def mapped_values(self) -> dict[str, Any]:
        from eagle3.config import train_overrides_checked
        from operators._render import rendered

        dirs = sorted(str(d["shard_dir"] if isinstance(d, dict) else d) for d in rendered(self.shard_dirs))
        return {**train_overrides_checked(rendered(self.overrides) or {}), "shard_dirs": dirs}

    def run(self, cfg: TrainConfig, context: Context) -> dict:
        from eagle3.errors import ConfigError
        from eagle3.train.run import train_phase

        if cfg.num_gpus > self.pool_slots:  # more ranks than the GPUs the pool gave this task
            raise ConfigError(f"train_num_gpus={cfg.num_gpus}, but task {self.task_id} holds {self.pool_slots} slot(s) "
                              f"of the {self.pool!r} pool: lower train_num_gpus, or set EAGLE3_TRAIN_GPU_SLOTS="
                              f"{cfg.num_gpus} where the DAG is parsed (docs/train.md)")

        r = train_phase(cfg)
        return {"export_dir": r["export_dir"], "steps": r["steps"], "train_tokens": r["train_tokens"],
                "draft_vocab_size": r["draft_vocab_size"], "last_loss": round(r["last"]["loss"], 4),
                "last_acc_k": [round(a, 3) for a in r["last"]["acc_k"]], "report": f"{cfg.output_dir}/report.json"}


class EvaluateDrafterOperator(Eagle3Operator[EvalConfig]):
    """Real speculative decoding (HF target + exported drafter) on held-out prompts: tau, acceptance, losslessness."""

    config_class = EvalConfig
    ui_color = "#d9e8f4"

    def run(self, cfg: EvalConfig, context: Context) -> dict:
        from eagle3.train.run import evaluate_phase

        r = evaluate_phase(cfg)
        trained = r["results"]["trained"]
        return {"tau": round(r["tau"], 3), "tau_random_init": r["tau_random_init"], "k": trained["k"],
                "prompts": trained["prompts"], "identical_to_greedy": r["identical_to_greedy"],
                "acceptance_rate_by_position": [round(a, 3) for a in trained["acceptance_rate_by_position"]],
                "report": f"{cfg.output_dir}/report.json"}
