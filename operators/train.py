from __future__ import annotations

from typing import Any, Sequence

from airflow.sdk import BaseOperator


class TrainDrafterOperator(BaseOperator):
    """Trains the EAGLE-3 drafter on extracted shards and exports it for SGLang (resumes after a kill)."""

    template_fields: Sequence[str] = ("shard_dirs", "model_path", "output_dir", "train_config", "train_overrides")
    ui_color = "#fde2c8"

    def __init__(self, *, shard_dirs: Any, model_path: str, output_dir: str, train_config: Any = None,
                 train_overrides: Any = None, **kwargs):
        super().__init__(**kwargs)
        # shard folders, or the extract tasks' summaries ({"shard_dir": ...}, the mapped XCom)
        self.shard_dirs = shard_dirs
        self.model_path = model_path
        self.output_dir = output_dir
        # TrainConfig fields (ttt_steps, lr, epochs...); overrides win (the UI's free-form object)
        self.train_config = train_config or {}
        self.train_overrides = train_overrides or {}

    def execute(self, context) -> dict:
        from eagle3.train.run import train_phase
        from eagle3.train.trainer import TrainConfig

        shard_dirs = sorted(str(d["shard_dir"] if isinstance(d, dict) else d) for d in self.shard_dirs)
        fields = {**dict(self.train_config), **dict(self.train_overrides)}
        cfg = TrainConfig(shard_dirs=shard_dirs, model_path=str(self.model_path), output_dir=str(self.output_dir),
                          **fields)
        r = train_phase(cfg)
        return {"export_dir": r["export_dir"], "steps": r["steps"], "train_tokens": r["train_tokens"],
                "draft_vocab_size": r["draft_vocab_size"], "last_loss": round(r["last"]["loss"], 4),
                "last_acc_k": [round(a, 3) for a in r["last"]["acc_k"]], "report": f"{cfg.output_dir}/report.json"}


class EvaluateDrafterOperator(BaseOperator):
    """Real speculative decoding (HF target + exported drafter) on held-out prompts: tau, acceptance, losslessness."""

    template_fields: Sequence[str] = ("export_dir", "model_path", "output_dir", "prompts", "prompts_file", "k",
                                      "max_new_tokens")
    ui_color = "#d9e8f4"

    def __init__(self, *, export_dir: str, model_path: str, output_dir: str, prompts: Any = None,
                 prompts_file: str = "", k: Any = 5, max_new_tokens: Any = 64, random_floor: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.export_dir = export_dir
        self.model_path = model_path
        self.output_dir = output_dir
        self.prompts = prompts or []
        self.prompts_file = prompts_file
        self.k = k
        self.max_new_tokens = max_new_tokens
        self.random_floor = random_floor

    def execute(self, context) -> dict:
        from eagle3.train.run import EvalConfig, evaluate_phase

        cfg = EvalConfig(export_dir=str(self.export_dir), model_path=str(self.model_path),
                         output_dir=str(self.output_dir), prompts=list(self.prompts),
                         prompts_file=str(self.prompts_file or ""), k=int(self.k),
                         max_new_tokens=int(self.max_new_tokens), random_floor=bool(self.random_floor))
        r = evaluate_phase(cfg)
        trained = r["results"]["trained"]
        return {"tau": round(r["tau"], 3), "tau_random_init": r["tau_random_init"], "k": trained["k"],
                "prompts": trained["prompts"], "identical_to_greedy": r["identical_to_greedy"],
                "acceptance_rate_by_position": [round(a, 3) for a in trained["acceptance_rate_by_position"]],
                "report": f"{cfg.output_dir}/report.json"}
