"""The datagen task: the target model's answers for ONE dataset (eagle3.datagen), mapped over datasets."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from airflow.sdk import Context

from eagle3.datagen.config import DatagenConfig, DatasetSpec
from eagle3_airflow.operators._render import rendered
from eagle3_airflow.operators.base import Eagle3Operator
from eagle3_airflow.hooks import OpenAICompatibleHook


class DatagenOperator(Eagle3Operator[DatagenConfig]):
    """Generates, tokenizes and reports one dataset; map it over datasets:

        DatagenOperator.partial(task_id="datagen", config={...DatagenConfig...}).expand(dataset=[spec, ...])

    mode "remote": the endpoint (base URL + API key) comes from the Connection `conn_id` (OpenAICompatibleHook).
    mode "local":  the task starts `server_command` when prompts are left to generate, and always stops it;
                   `conn_id` is optional there (its password is sent as the API key).
    The key is masked in logs and redacted from every file, exception and returned value.
    """

    config_class = DatagenConfig
    template_fields: Sequence[str] = ("config", "dataset")
    ui_color = "#dbeafe"

    def __init__(self, *, dataset: Mapping[str, Any] | str, config: Mapping[str, Any] | str, **kwargs: Any) -> None:
        super().__init__(config=config, **kwargs)
        self.dataset = dataset

    def run(self, cfg: DatagenConfig, context: Context) -> dict[str, Any]:
        from eagle3.datagen.run import run_datagen

        spec = DatasetSpec.from_dict(rendered(self.dataset), where=f"dataset spec of task {self.task_id}")
        hook = OpenAICompatibleHook(cfg.conn_id) if cfg.conn_id else None
        if cfg.mode == "remote":
            endpoint = hook.get_conn()
            report = run_datagen(spec, cfg, base_url=endpoint.base_url, api_key=endpoint.api_key)
        else:
            report = run_datagen(spec, cfg, api_key=hook.api_key() if hook else "EMPTY")
        return {
            "dataset": spec.name,
            "folder": f"{cfg.output_dir}/{spec.name}",
            "rows": report["rows"],
            "tokens": report["tokens"],
            "loss_tokens": report["loss_tokens"],
            "prompts": report["prompts"],
            "missing": report["missing"],
            "too_long": report.get("too_long", 0),  # absent from a report written before it was counted
            "dropped": report["dropped"],
            "cost_usd": report["cost_usd"],
            "skipped": bool(report.get("skipped")),
        }
