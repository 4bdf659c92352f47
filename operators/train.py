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
        from eagle3.train.run import train_phase

        r = train_phase(cfg)
        return {"export_dir": r["export_dir"], "steps": r["steps"], "train_tokens": r["train_tokens"],
                "draft_vocab_size": r["draft_vocab_size"], "last_loss": round(r["last"]["loss"], 4),
                "last_acc_k": [round(a, 3) for a in r["last"]["acc_k"]], "report": f"{cfg.output_dir}/report.json"}


class EvaluateDrafterOperator(Eagle3Operator[EvalConfig]):
    """Real speculative decoding (HF target + exported drafter) on held-out conversations (MT-bench): tau per k,
    per turn and category, over answers ending with eos, the share hitting max_new_tokens; losslessness."""

    config_class = EvalConfig
    ui_color = "#d9e8f4"

    def run(self, cfg: EvalConfig, context: Context) -> dict:
        from eagle3.train.run import evaluate_phase

        r = evaluate_phase(cfg)

        def rounded(by_k: dict | None) -> dict | None:  # {k: figure}, a figure None where no answer counts
            return None if by_k is None else {k: None if v is None else round(v, 3) for k, v in by_k.items()}

        return {"tau": rounded(r["tau"]), "tau_ended_with_eos": rounded(r["tau_ended_with_eos"]),
                "share_hit_cap": rounded(r["share_hit_cap"]), "tau_random_init": rounded(r["tau_random_init"]),
                "conversations": r["conversations"], "answers": r["answers"],
                "identical_to_greedy": r["identical_to_greedy"], "report": f"{cfg.output_dir}/report.json"}
