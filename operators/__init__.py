"""Thin Airflow operators: parse params, call the `eagle3` core, return a small JSON-able summary."""
