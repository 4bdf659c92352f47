"""What the plugin's pages know about a DAG run from the metadata DB: its folder and name, its shard tasks' states.

The run folder is preflight's XCom `run_dir` (the resolved run configuration's); before preflight has run (or for a
DAG without it) the form's rule gives it: `<output_root>/<run_name or the run id made path-safe>` over the run conf
and the DAG's param defaults (eagle3.config.run_dir). A folder found in the XCom never changes, so it is cached.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import HTTPException

from eagle3.config import run_dir, safe_run_name, with_form_defaults

PREFLIGHT_TASK_ID = "preflight"


def display_name(run_id: str, conf: dict | None) -> str:
    """The run's name as its folder is named: the form's run_name, else the run id made path-safe."""
    return str((conf or {}).get("run_name") or safe_run_name(run_id))


@lru_cache(maxsize=256)
def _folder_from_preflight(dag_id: str, run_id: str) -> str | None:
    """preflight's XCom `run_dir` (cached once found: a finished preflight's value does not change)."""
    from sqlalchemy import select

    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        row = session.scalar(select(XComModel).where(
            XComModel.dag_id == dag_id, XComModel.run_id == run_id, XComModel.task_id == PREFLIGHT_TASK_ID,
            XComModel.key == "return_value", XComModel.map_index == -1))
        value = XComModel.deserialize_value(row) if row is not None else None
    folder = value.get("run_dir") if isinstance(value, dict) else None
    if folder is None:
        raise LookupError  # lru_cache keeps no exception: the next request looks again
    return str(folder)


def run_folder(dag_id: str, run_id: str, session) -> tuple[Path, Any]:
    """(the run's folder, its DagRun row); 404 for a run that does not exist."""
    from sqlalchemy import select

    from airflow.models.dagrun import DagRun
    from airflow.models.serialized_dag import SerializedDagModel

    run = session.scalar(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
    if run is None:
        raise HTTPException(404, f"no run {run_id!r} of DAG {dag_id!r}")
    try:
        return Path(_folder_from_preflight(dag_id, run_id)), run
    except LookupError:
        pass
    params: dict[str, Any] = {}
    try:
        sdm = SerializedDagModel.get(dag_id, session=session)
        params = dict(sdm.dag.params.dump()) if sdm else {}
    except Exception:  # an older/unparsable serialized DAG: the run conf alone may still be enough
        params = {}
    params.update(run.conf or {})
    if "output_root" not in params:  # a DAG without the eagle3 form: the form's default folder
        params["output_root"] = with_form_defaults({})["output_root"]
    return Path(run_dir(params, run_id)), run


def task_states(dag_id: str, run_id: str, task_ids: tuple[str, ...], session) -> dict[int, dict]:
    """{map_index: {state, try_number, hostname}} of the run's mapped tasks `task_ids`."""
    from sqlalchemy import select

    from airflow.models.taskinstance import TaskInstance

    tis = session.scalars(select(TaskInstance).where(
        TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id,
        TaskInstance.task_id.in_(task_ids), TaskInstance.map_index >= 0)).all()
    return {ti.map_index: {"state": ti.state, "try_number": ti.try_number, "hostname": ti.hostname} for ti in tis}
