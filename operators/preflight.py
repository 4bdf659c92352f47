from __future__ import annotations

from typing import Any, Sequence

from airflow.sdk import BaseOperator


class PreflightOperator(BaseOperator):
    """Checks GPUs, packages, the model, the capture layers and free disk before the run spends GPU time."""

    template_fields: Sequence[str] = ("model_path", "output_dir", "capture_layers", "estimated_tokens", "allow_cpu")
    ui_color = "#e8f4d9"

    def __init__(self, *, model_path: str, output_dir: str, capture_layers: Any = None,
                 estimated_tokens: Any = 0, allow_cpu: Any = False, **kwargs):
        super().__init__(**kwargs)
        self.model_path = model_path
        self.output_dir = output_dir
        self.capture_layers = capture_layers
        self.estimated_tokens = estimated_tokens
        self.allow_cpu = allow_cpu

    def execute(self, context) -> dict:
        from eagle3.preflight import PreflightConfig, run_preflight

        cfg = PreflightConfig(
            model_path=str(self.model_path),
            output_dir=str(self.output_dir),
            capture_layers=list(self.capture_layers) if self.capture_layers else None,
            estimated_tokens=int(self.estimated_tokens or 0),
            allow_cpu=bool(self.allow_cpu),
        )
        report = run_preflight(cfg)
        return {
            "device": report["device"],
            "gpus": len(report["gpu"]["gpus"]),
            "capture_layers": report["model"]["capture_layers"],
            # model facts later tasks template in (merge's vocab check and size estimate)
            "hidden_size": report["model"]["info"]["hidden_size"],
            "vocab_size": report["model"]["info"]["vocab_size"],
            "num_layers": report["model"]["info"]["num_layers"],
            "free_gb": round(report["disk"]["free_bytes"] / 1e9, 1),
            "report": f"{cfg.output_dir}/preflight.json",
        }
