"""eagle3: the core of the EAGLE-3 drafter pipeline.

Nothing in this package imports Airflow: every phase is a plain module that can be
called, tested and benchmarked on its own. `operators/` wraps them for Airflow.
"""

__version__ = "0.1.0"
