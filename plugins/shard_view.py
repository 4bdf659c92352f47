"""Airflow UI plugin: an eagle3 run's extraction shards (read from their manifests) and its drafter.

Registered by the `airflow.plugins` entry point of an install, or by plugins/eagle3_plugin.py from a
checkout's plugins folder. Adds a FastAPI app under /eagle3 (served by the api-server) and three UI entries:
  - "Extraction shards" on every DAG run page (destination dag_run; the UI fills {DAG_ID}/{RUN_ID}),
  - "Drafter" on every DAG run page: training curves, evaluation, export and serving commands (drafter_view.py),
  - "EAGLE-3 runs" in the Browse menu: recent runs of eagle3 DAGs by name, each linking to both pages.
Pages need a logged-in user (the UI's JWT cookie, or a Bearer token). The data logic is in
eagle3/extract/status.py and eagle3/results.py; here we only find the run folder (run_info.py) and the planned
shard count (the mapped shard task's instances), and render HTML.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query
from fastapi.responses import HTMLResponse

from airflow.api_fastapi.core_api.security import get_user
from airflow.plugins_manager import AirflowPlugin

from eagle3.extract.status import human_bytes, run_progress
from eagle3_airflow.plugins.drafter_view import router as drafter_router
from eagle3_airflow.plugins.run_info import display_name, run_folder, task_states
from eagle3_airflow.plugins.style import page

SHARD_TASK_IDS = ("extract", "extract_shard")  # the mapped per-shard task of eagle3_drafter / the demo DAG
PREFIX = "/eagle3"

app = FastAPI(title="eagle3 monitor", docs_url=None, redoc_url=None, openapi_url=None)
app.include_router(drafter_router)
User = Annotated[Any, Depends(get_user)]


def _progress(dag_id: str, run_id: str) -> dict:
    from airflow.utils.session import create_session

    with create_session() as session:
        run_dir, run = run_folder(dag_id, run_id, session)
        ti_state = task_states(dag_id, run_id, SHARD_TASK_IDS, session)
    progress = run_progress(run_dir, expected_shards=len(ti_state) or None, tasks=ti_state).to_dict()
    for s in progress["shards"]:
        s["airflow"] = ti_state.get(s["shard"], {})
    return {"dag_id": dag_id, "run_id": run_id, "run_name": run_dir.name or display_name(run_id, run.conf),
            "run_dir": str(run_dir), **progress}


@app.get("/api/shards")
def shards_json(user: User, dag_id: str = Query(...), run_id: str = Query(...)) -> dict:
    return _progress(dag_id, run_id)


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
    return page(f"eagle3 shards: {p['run_name']}", f"""<h2>Extraction shards</h2>
<p>run <b id="run-name">{e(p['run_name'])}</b> of DAG <b>{e(dag_id)}</b> (run id {e(run_id)})<br>folder <code>{e(p['extract_dir'])}</code></p>
<p id="totals">{t['shards']} shards: {t['complete']} complete, {t['in_progress']} in progress,
{t['not_started']} not started, {t['failed']} failed{f", {t['damaged']} damaged" if t['damaged'] else ""} &middot; {t['chunks']} chunks &middot; {t['tokens']:,} tokens &middot; {e(human_bytes(t['bytes_written']))} written
&middot; {t['tokens_per_s']:,.0f} tokens/s now</p>
<table id="shards"><tr><th>shard</th><th>state</th><th>Airflow task</th><th>chunks</th><th>samples</th><th>tokens</th>
<th>written</th><th>tokens/s</th><th>updated</th><th>worker</th><th>error</th></tr>
{''.join(rows) or '<tr><td colspan=11>no shards planned yet</td></tr>'}</table>
<p>Read from each shard's manifest.json (the source of truth), each committed chunk file checked for its size;
refreshes every 10 s. A damaged or failed shard: clear its task (grid square of <code>extract</code>, its row's
Clear Task Instance) to extract again what is missing.</p>""", refresh_s=10)


def _error_cell(s: dict) -> str:
    if s["failed_try"] is not None:
        return f"try {s['failed_try']}: {s['error'] or 'failed'}"
    return s["error"] or ""


@app.get("/", response_class=HTMLResponse)
def index(user: User, limit: int = Query(20, ge=1, le=200)) -> str:
    """Recent runs of eagle3 DAGs by name (the run folder's), with their pages."""
    from urllib.parse import urlencode

    from sqlalchemy import select

    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        runs = session.execute(select(DagRun.dag_id, DagRun.run_id, DagRun.conf, DagRun.state, DagRun.start_date)
                               .where(DagRun.dag_id.like("eagle3%"))
                               .order_by(DagRun.id.desc()).limit(limit)).all()
    e = html.escape
    rows = []
    for d, r, conf, st, sd in runs:
        q = e(urlencode({"dag_id": d, "run_id": r}))
        rows.append(f"<tr><td class='l'><b>{e(display_name(r, conf))}</b></td><td class='l'>{e(d)}</td>"
                    f"<td class='l'>{e(r)}</td><td class='l'>{e(str(st))}</td><td class='l'>{e(str(sd or '-'))}</td>"
                    f"<td class='l'><a href='drafter?{q}'>drafter</a> &middot; <a href='shards?{q}'>shards</a></td></tr>")
    return page("eagle3 runs", "<h2>EAGLE-3 runs</h2><table id='runs'><tr><th>name</th><th>DAG</th><th>run id</th>"
                "<th>state</th><th>started</th><th>pages</th></tr>" + "".join(rows) + "</table>")


class Eagle3Plugin(AirflowPlugin):
    name = "eagle3"
    fastapi_apps = [{"app": app, "url_prefix": PREFIX, "name": "eagle3 extraction monitor"}]
    external_views = [
        {"name": "Extraction shards", "href": PREFIX + "/shards?dag_id={DAG_ID}&run_id={RUN_ID}",
         "destination": "dag_run", "url_route": "eagle3-shards"},
        {"name": "Drafter", "href": PREFIX + "/drafter?dag_id={DAG_ID}&run_id={RUN_ID}",
         "destination": "dag_run", "url_route": "eagle3-drafter"},
        {"name": "EAGLE-3 runs", "href": PREFIX + "/", "destination": "nav", "category": "browse",
         "url_route": "eagle3-runs"},
    ]
