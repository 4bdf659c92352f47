from __future__ import annotations

from typing import Any, Mapping, Sequence

from airflow.sdk import Asset, Context
from airflow.sdk.exceptions import AirflowNotFoundException

from eagle3.evaluate.config import EvalConfig
from eagle3.train.config import TrainConfig
from eagle3_airflow.operators.base import Eagle3Operator

# The exported drafter, as an Airflow Asset: the train task is its producer (outlet), so a DAG scheduled on it
# (`schedule=[DRAFTER_ASSET]`) runs after every training; the event's extra says where the export is.
DRAFTER_ASSET = Asset(name="eagle3_drafter", uri="x-eagle3://drafter", group="model")


class TrainDrafterOperator(Eagle3Operator[TrainConfig]):
    """Trains the EAGLE-3 drafter on extracted shards and exports it for SGLang and vLLM (resumes after a kill).

    Metrics go to metrics.jsonl and TensorBoard event files (<output_dir>/tensorboard), and to MLflow when the
    Connection `mlflow_conn_id` exists (MLflowTrackingHook). Each Asset among the task's outlets gets an event
    whose extra holds the export folder, the run and the last loss.
    """

    config_class = TrainConfig
    template_fields: Sequence[str] = ("config", "shard_dirs")
    ui_color = "#fde2c8"

    def __init__(self, *, shard_dirs: Sequence[str | Mapping[str, Any]] | str, mlflow_conn_id: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shard_dirs = shard_dirs  # shard folders, or the extract tasks' summaries ({"shard_dir": ...})
        self.mlflow_conn_id = mlflow_conn_id

    def mapped_values(self) -> dict[str, Any]:
        from eagle3_airflow.operators._render import rendered

        dirs = sorted(str(d["shard_dir"] if isinstance(d, dict) else d) for d in rendered(self.shard_dirs))
        return {"shard_dirs": dirs, **self._mlflow()}

    def _mlflow(self) -> dict[str, str]:
        """The MLflow config fields from the Connection; none (TensorBoard only) when it is not defined."""
        if not self.mlflow_conn_id:
            return {}
        from eagle3_airflow.hooks import MLflowTrackingHook

        try:
            conn = MLflowTrackingHook(self.mlflow_conn_id).get_conn()
        except AirflowNotFoundException:
            self.log.info("no Connection %r: training metrics go to TensorBoard event files only",
                          self.mlflow_conn_id)
            return {}
        self.log.info("training metrics also go to MLflow at %s (Connection %r)", conn["tracking_uri"],
                      self.mlflow_conn_id)
        out = {"mlflow_tracking_uri": conn["tracking_uri"]}
        if "experiment" in conn:
            out["mlflow_experiment"] = conn["experiment"]
        return out

    def run(self, cfg: TrainConfig, context: Context) -> dict:
        from eagle3.errors import ConfigError
        from eagle3.train.run import train_phase

        if cfg.num_gpus > self.pool_slots:  # more ranks than the GPUs the pool gave this task
            raise ConfigError(f"train_num_gpus={cfg.num_gpus}, but task {self.task_id} holds {self.pool_slots} slot(s) "
                              f"of the {self.pool!r} pool: lower train_num_gpus, or set EAGLE3_TRAIN_GPU_SLOTS="
                              f"{cfg.num_gpus} where the DAG is parsed (docs/train.md)")

        r = train_phase(cfg)
        summary = {"export_dir": r["export_dir"], "steps": r["steps"], "train_tokens": r["train_tokens"],
                   "draft_vocab_size": r["draft_vocab_size"], "last_loss": round(r["last"]["loss"], 4),
                   "last_acc_k": [round(a, 3) for a in r["last"]["acc_k"]], "report": f"{cfg.output_dir}/report.json",
                   "tensorboard": f"{cfg.output_dir}/tensorboard"}
        events = context.get("outlet_events")
        for asset in (a for a in self.outlets if isinstance(a, Asset)) if events is not None else ():
            events[asset].extra = {**summary, "dag_id": self.dag_id, "run_id": context["run_id"],
                                   "capture_layers": r["capture_layers"]}
        return summary


class EvaluateDrafterOperator(Eagle3Operator[EvalConfig]):
    """Real speculative decoding (HF target + exported drafter) on held-out conversations (MT-bench): tau per k,
    per turn and category, over answers ending with eos, the share hitting max_new_tokens; losslessness."""

    config_class = EvalConfig
    ui_color = "#d9e8f4"

    def run(self, cfg: EvalConfig, context: Context) -> dict:
        from eagle3.evaluate.run import evaluate_phase

        r = evaluate_phase(cfg)

        def rounded(by_k: dict | None) -> dict | None:  # {k: figure}, a figure None where no answer counts
            return None if by_k is None else {k: None if v is None else round(v, 3) for k, v in by_k.items()}

        return {"tau": rounded(r["tau"]), "tau_ended_with_eos": rounded(r["tau_ended_with_eos"]),
                "share_hit_cap": rounded(r["share_hit_cap"]), "tau_random_init": rounded(r["tau_random_init"]),
                "conversations": r["conversations"], "answers": r["answers"],
                "identical_to_greedy": r["identical_to_greedy"], "report": f"{cfg.output_dir}/report.json"}
