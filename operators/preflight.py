from __future__ import annotations

from typing import Any, Mapping, Sequence

from airflow.sdk import BaseOperator, Context
from eagle3_airflow.operators.base import hf_output_to_task_log, retry_policy


class PreflightOperator(BaseOperator):
    """Builds the run configuration from the trigger form, checks it across phases and resolves it once
    (eagle3.config.check_run), then checks the machine: GPUs, packages, the model, what fits, free disk; before
    the run spends GPU time. Returns the resolved configuration (`run_config`, every later task's config:
    eagle3.config.phase_config) and a short summary."""

    template_fields: Sequence[str] = ("run_params",)
    ui_color = "#e8f4d9"

    def __init__(self, *, run_params: Mapping[str, Any] | str, gpu_slots: Mapping[str, int] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run_params = run_params  # the whole trigger form ("{{ params }}")
        self.gpu_slots = gpu_slots  # the DAG's gpu pool slots per task (eagle3.config.gpu_slots)

    def execute(self, context: Context) -> dict:
        from eagle3.config import check_run
        from eagle3.errors import ConfigError
        from eagle3.preflight import run_preflight
        from eagle3_airflow.deployment import deployment_problems

        hf_output_to_task_log()
        with retry_policy(self.task_id):
            # first: a pool or queue this Airflow lacks would leave tasks waiting forever, hours from now
            problems = deployment_problems(context["dag"].tasks)
            if problems:
                raise ConfigError("this Airflow cannot run every task of the DAG:\n  - " + "\n  - ".join(problems))
            if not isinstance(self.run_params, dict):
                raise ConfigError(f"run_params rendered to {type(self.run_params).__name__}, not the form's object")
            cfg, notes = check_run(self.run_params, context["run_id"], self.gpu_slots)
            for note in notes:
                self.log.info("%s", note)
            from eagle3_airflow.deployment import name_the_run

            # the run page shows the note beside the run id: the name a user gave (or the id's folder name) and
            # folder
            name_the_run(self.dag_id, context["run_id"], cfg.run.run_name, cfg.run.dir)
            self.log.info("run %s: its files go to %s", cfg.run.run_name, cfg.run.dir)
            report = run_preflight(cfg.preflight, cfg.target, cfg.extract.storage_dtype, notes=notes)
        t = cfg.target
        return {
            "run_config": cfg.to_dict(),
            "run_dir": cfg.run.dir,
            "capture_layers": t.capture_layers,
            "hidden_size": t.hidden_size,
            "num_layers": t.num_layers,
            "device": report["device"],
            "gpus": len(report["gpu"]["gpus"]),
            "free_gb": round(report["disk"]["free_bytes"] / 1e9, 1),
            "notes": notes,
            "report": f"{cfg.preflight.output_dir}/preflight.json",
        }
