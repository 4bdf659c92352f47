"""Thin Airflow operators (installed as eagle3_airflow.operators): parse params, call the `eagle3` core, return a
small JSON-able summary."""

import logging

# The core logs progress (rate, ETA) through the "eagle3" loggers; Airflow's task log shows INFO and up
# only for loggers set to that level.
logging.getLogger("eagle3").setLevel(logging.INFO)
