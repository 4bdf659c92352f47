"""Provider info: what `pip install eagle3-pipeline` adds to an Airflow deployment (the `apache_airflow_provider`
entry point in pyproject.toml). Airflow lists it in `airflow providers list`, offers its connection types in
the Connections form (with each hook's fields and Test button) and loads the plugin (`airflow.plugins`).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

PACKAGE = "eagle3-pipeline"
INTEGRATION = "EAGLE-3 drafter training"
OPERATOR_MODULES = [f"eagle3_airflow.operators.{m}" for m in ("preflight", "datagen", "merge", "extract", "train")]


def _version() -> str:
    try:
        return version(PACKAGE)
    except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return "0+checkout"


def get_provider_info() -> dict:
    return {
        "package-name": PACKAGE,
        "name": "EAGLE-3 pipeline",
        "description": "Operators, hooks and a shard-view plugin that train an EAGLE-3 speculative-decoding "
                       "drafter: datagen, merge, sharded hidden-state extraction, training, SGLang/vLLM export, "
                       "lossless evaluation.",
        "versions": [_version()],
        "integrations": [{"integration-name": INTEGRATION, "tags": ["software"]}],
        "operators": [{"integration-name": INTEGRATION, "python-modules": OPERATOR_MODULES}],
        "hooks": [{"integration-name": INTEGRATION, "python-modules": ["eagle3_airflow.hooks"]}],
        "connection-types": [
            {"connection-type": "openai", "hook-class-name": "eagle3_airflow.hooks.OpenAICompatibleHook",
             "hook-name": "OpenAI-compatible endpoint"},
            {"connection-type": "mlflow", "hook-class-name": "eagle3_airflow.hooks.MLflowTrackingHook",
             "hook-name": "MLflow tracking server"},
            {"connection-type": "airflow_api", "hook-class-name": "eagle3_airflow.hooks.AirflowApiHook",
             "hook-name": "Airflow REST API"},
        ],
        "plugins": [{"name": "eagle3", "plugin-class": "eagle3_airflow.plugins.shard_view.Eagle3Plugin"}],
    }
