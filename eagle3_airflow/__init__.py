"""eagle3-pipeline's Airflow provider: the import name everything Airflow-side installs under.

    eagle3_airflow.operators      the operators (the top-level folder operators/)
    eagle3_airflow.plugins        the UI plugin's code (the top-level folder plugins/)
    eagle3_airflow.hooks          Connections: OpenAI-compatible endpoint, MLflow, the Airflow REST API
    eagle3_airflow.deployment     can this Airflow run the DAG's tasks (pools, Celery queues)
    eagle3_airflow.celery_config  Celery config with one GPU per worker child (eagle3_airflow.worker)
    eagle3_airflow.get_provider_info  what `airflow providers list` shows (the apache_airflow_provider entry point)

No Airflow import here: the worker's GPU pinning and hostname callable import this package in every process.
"""

from pathlib import Path

# The design keeps operators/ and plugins/ at the top of the repository; an install maps them into this package
# (pyproject's package-dir), so there they sit inside it. Run from a checkout (PYTHONPATH = the repository root,
# nothing installed), they sit beside it instead: let the submodule search look in the repository root too.
_here = Path(__file__).resolve().parent
if not (_here / "operators").is_dir() and (_here.parent / "operators" / "base.py").is_file():
    __path__.append(str(_here.parent))  # noqa: F821  (a package's __path__, set by the import system)
