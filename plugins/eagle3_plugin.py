"""The shard view (operators/plugin.py) for an Airflow whose plugins folder is this checkout's plugins/
(scripts/env.sh, docker-compose.yml).

An install (`pip install .`) registers the same plugin through the `airflow.plugins` entry point; then this file
defines nothing, so Airflow does not load the plugin twice (it would report "already registered").
"""

from importlib.metadata import entry_points

if not any(ep.value.startswith("operators.plugin") for ep in entry_points(group="airflow.plugins")):
    from operators.plugin import Eagle3Plugin  # noqa: F401  (Airflow finds AirflowPlugin subclasses here)
