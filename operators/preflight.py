from __future__ import annotations

from typing import Any, Mapping, Sequence

from airflow.sdk import Context

from eagle3.preflight import PreflightConfig
from eagle3_airflow.operators.base import Eagle3Operator


class PreflightOperator(Eagle3Operator[PreflightConfig]):
    """Checks the run's params across phases, then GPUs, packages, the model, the capture layers and free disk,
    before the run spends GPU time. Returns the model facts later tasks template in (eagle3.config.ModelFact)."""

    config_class = PreflightConfig
    template_fields: Sequence[str] = ("config", "run_params")
    ui_color = "#e8f4d9"

    def __init__(self, *, run_params: Mapping[str, Any] | str | None = None,
                 gpu_slots: Mapping[str, int] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run_params = run_params  # the whole trigger form ("{{ params }}"): checked across phases first
        self.gpu_slots = gpu_slots  # the DAG's gpu pool slots per task (eagle3.config.gpu_slots)

    def run(self, cfg: PreflightConfig, context: Context) -> dict:
        from eagle3.config import check_run
        from eagle3.errors import ConfigError
        from eagle3.preflight import run_preflight
        from eagle3_airflow.operators._render import rendered
        from eagle3_airflow.deployment import deployment_problems

        # first: a pool or queue this Airflow lacks would leave tasks waiting forever, hours from now
        problems = deployment_problems(context["dag"].tasks)
        if problems:
            raise ConfigError("this Airflow cannot run every task of the DAG:\n  - " + "\n  - ".join(problems))
        facts = check_run(rendered(self.run_params), context["run_id"], self.gpu_slots) if self.run_params else {}
        notes = [facts["datagen_server"]] if "datagen_server" in facts else []
        for note in notes:
            self.log.info("%s", note)
        report = run_preflight(cfg, notes=notes)
        model = report["model"]
        return {
            **facts,
            "capture_layers": model["capture_layers"],
            "num_capture_layers": len(model["capture_layers"]),
            "hidden_size": model["info"]["hidden_size"],
            "vocab_size": model["info"]["vocab_size"],
            "num_layers": model["info"]["num_layers"],
            "device": report["device"],
            "gpus": len(report["gpu"]["gpus"]),
            "free_gb": round(report["disk"]["free_bytes"] / 1e9, 1),
            "report": f"{cfg.output_dir}/preflight.json",
        }
