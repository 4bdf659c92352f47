"""The shard view (plugins/shard_view.py, the package eagle3_airflow.plugins) for an Airflow whose plugins folder is
this checkout's plugins/ (scripts/env.sh, docker-compose.yml); .airflowignore keeps Airflow to this file.

An install (`pip install .`) registers the same plugin through the `airflow.plugins` entry point; then this file
defines nothing, so Airflow does not load the plugin twice (it would report "already registered").
"""

from importlib.metadata import entry_points

PLUGIN_MODULE = "eagle3_airflow.plugins.shard_view"

if not any(ep.value.startswith(PLUGIN_MODULE) for ep in entry_points(group="airflow.plugins")):
    from eagle3_airflow.plugins.shard_view import Eagle3Plugin  # noqa: F401  (Airflow finds plugin classes here)
