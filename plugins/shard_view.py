"""Airflow UI plugin: the extraction shards of an eagle3 run, read from their manifests.

Registered by the `airflow.plugins` entry point of an install, or by plugins/eagle3_plugin.py from a
checkout's plugins folder. Adds a FastAPI app under /eagle3 (served by the api-server) and two UI entries:
  - "Extraction shards" on every DAG run page (destination dag_run; the UI fills {DAG_ID}/{RUN_ID}),
  - "EAGLE-3 runs" in the Browse menu: recent runs of eagle3 DAGs, each linking to its shard page.
Pages need a logged-in user (the UI's JWT cookie, or a Bearer token). The data logic is in
eagle3/monitor.py; here we only find the run folder (run conf over the DAG's param defaults) and the
planned shard count (the mapped shard task's instances), and render HTML.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query
from fastapi.responses import HTMLResponse

from airflow.api_fastapi.core_api.security import get_user
from airflow.plugins_manager import AirflowPlugin

from eagle3.config import run_dir, with_form_defaults
from eagle3.extract.status import human_bytes, run_progress

SHARD_TASK_IDS = ("extract", "extract_shard")  # the mapped per-shard task of eagle3_drafter / the demo DAG
PREFIX = "/eagle3"

app = FastAPI(title="eagle3 monitor", docs_url=None, redoc_url=None, openapi_url=None)
User = Annotated[Any, Depends(get_user)]


def _run_info(dag_id: str, run_id: str) -> tuple[Path, dict[int, dict]]:
    """(run folder, {map_index: {state, try_number, hostname}}) from the metadata DB."""
    from sqlalchemy import select

    from airflow.models.dagrun import DagRun
    from airflow.models.serialized_dag import SerializedDagModel
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    with create_session() as session:
        run = session.scalar(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
        if run is None:
            raise HTTPException(404, f"no run {run_id!r} of DAG {dag_id!r}")
        params: dict[str, Any] = {}
        try:
            sdm = SerializedDagModel.get(dag_id, session=session)
            params = dict(sdm.dag.params.dump()) if sdm else {}
        except Exception:  # an older/unparsable serialized DAG: the run conf alone may still be enough
            params = {}
        params.update(run.conf or {})
        if "output_root" not in params:  # a DAG without the eagle3 form: the form's default folder
            params["output_root"] = with_form_defaults({})["output_root"]
        tis = session.scalars(select(TaskInstance).where(
            TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id,
            TaskInstance.task_id.in_(SHARD_TASK_IDS), TaskInstance.map_index >= 0)).all()
        airflow_state = {ti.map_index: {"state": ti.state, "try_number": ti.try_number, "hostname": ti.hostname}
                         for ti in tis}
    return Path(run_dir(params, run_id)), airflow_state


def _progress(dag_id: str, run_id: str) -> dict:
    run_dir, ti_state = _run_info(dag_id, run_id)
    progress = run_progress(run_dir, expected_shards=len(ti_state) or None, tasks=ti_state).to_dict()
    for s in progress["shards"]:
        s["airflow"] = ti_state.get(s["shard"], {})
    return {"dag_id": dag_id, "run_id": run_id, "run_dir": str(run_dir), **progress}


@app.get("/api/shards")
def shards_json(user: User, dag_id: str = Query(...), run_id: str = Query(...)) -> dict:
    return _progress(dag_id, run_id)


STYLE = """body{font-family:system-ui,sans-serif;margin:1.5rem;color:#1a202c}table{border-collapse:collapse}
td,th{border:1px solid #cbd5e0;padding:.3rem .6rem;text-align:right}th{background:#edf2f7}td.l{text-align:left}
.complete{background:#c6f6d5}.in.progress{background:#fefcbf}.not.started{background:#edf2f7}
.failed{background:#fed7d7}.err{color:#c53030}"""


@app.get("/shards", response_class=HTMLResponse)
def shards_page(user: User, dag_id: str = Query(...), run_id: str = Query(...)) -> str:
    p = _progress(dag_id, run_id)
    t = p["totals"]
    e = html.escape
    rows = []
    for s in p["shards"]:
        af = s["airflow"]
        rate = f"{s['tokens_per_s']:,.0f}" if s["tokens_per_s"] is not None else "-"
        rows.append(
            f"<tr class='{e(s['state'])}' data-shard='{s['shard']}'><td>{s['shard']}</td><td class='l'>{e(s['state'])}</td>"
            f"<td class='l'>{e(str(af.get('state') or '-'))} (try {af.get('try_number', '-')})</td>"
            f"<td>{s['chunks']}</td><td>{s['samples']:,}</td><td>{s['tokens']:,}</td>"
            f"<td>{e(human_bytes(s['bytes_written']))}</td><td>{rate}</td>"
            f"<td class='l'>{e(s['updated_at'] or '-')}</td><td class='l'>{e(str(af.get('hostname') or '-'))}</td>"
            f"<td class='l err'>{e(_error_cell(s))}</td></tr>")
    return f"""<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="10">
<title>eagle3 shards: {e(run_id)}</title><style>{STYLE}</style></head><body>
<h2>Extraction shards</h2>
<p>DAG <b>{e(dag_id)}</b>, run <b>{e(run_id)}</b><br>folder <code>{e(p['extract_dir'])}</code></p>
<p id="totals">{t['shards']} shards: {t['complete']} complete, {t['in_progress']} in progress,
{t['not_started']} not started, {t['failed']} failed &middot; {t['chunks']} chunks &middot; {t['tokens']:,} tokens &middot; {e(human_bytes(t['bytes_written']))} written
&middot; {t['tokens_per_s']:,.0f} tokens/s now</p>
<table id="shards"><tr><th>shard</th><th>state</th><th>Airflow task</th><th>chunks</th><th>samples</th><th>tokens</th>
<th>written</th><th>tokens/s</th><th>updated</th><th>worker</th><th>error</th></tr>
{''.join(rows) or '<tr><td colspan=11>no shards planned yet</td></tr>'}</table>
<p>Read from each shard's manifest.json (the source of truth); refreshes every 10 s.</p></body></html>"""


def _error_cell(s: dict) -> str:
    if s["failed_try"] is not None:
        return f"try {s['failed_try']}: {s['error'] or 'failed'}"
    return s["error"] or ""


@app.get("/", response_class=HTMLResponse)
def index(user: User, limit: int = Query(20, ge=1, le=200)) -> str:
    from sqlalchemy import select

    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        runs = session.execute(select(DagRun.dag_id, DagRun.run_id, DagRun.state, DagRun.start_date)
                               .where(DagRun.dag_id.like("eagle3%"))
                               .order_by(DagRun.id.desc()).limit(limit)).all()
    e = html.escape
    from urllib.parse import urlencode

    items = "".join(
        f"<tr><td class='l'>{e(d)}</td><td class='l'><a href='{PREFIX}/shards?{e(urlencode({'dag_id': d, 'run_id': r}))}'>"
        f"{e(r)}</a></td><td class='l'>{e(str(st))}</td><td class='l'>{e(str(sd or '-'))}</td></tr>"
        for d, r, st, sd in runs)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>eagle3 runs</title><style>{STYLE}</style></head>
<body><h2>EAGLE-3 runs</h2><table><tr><th>DAG</th><th>run</th><th>state</th><th>started</th></tr>{items}</table></body></html>"""


class Eagle3Plugin(AirflowPlugin):
    name = "eagle3"
    fastapi_apps = [{"app": app, "url_prefix": PREFIX, "name": "eagle3 extraction monitor"}]
    external_views = [
        {"name": "Extraction shards", "href": PREFIX + "/shards?dag_id={DAG_ID}&run_id={RUN_ID}",
         "destination": "dag_run", "url_route": "eagle3-shards"},
        {"name": "EAGLE-3 runs", "href": PREFIX + "/", "destination": "nav", "category": "browse",
         "url_route": "eagle3-runs"},
    ]
