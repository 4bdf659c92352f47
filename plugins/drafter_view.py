"""The run page's "Drafter" tab: what the run produced, as the phases wrote it (eagle3.results): the training
curves, the evaluation's table and acceptance plot, the export folder and the commands that serve it with SGLang
and vLLM. A phase that has not run says so. Files are read when the page is asked for, bounded and cached while
unchanged (eagle3.results), so nothing here runs in the scheduler or on a timer.
"""

from __future__ import annotations

import html
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi.responses import FileResponse, HTMLResponse

from airflow.api_fastapi.core_api.security import get_user

from eagle3.results import COMPLETE, drafter_results, lossless_text, plot_path
from eagle3_airflow.plugins.run_info import display_name, run_folder
from eagle3_airflow.plugins.style import page

router = APIRouter()
User = Annotated[Any, Depends(get_user)]
e = html.escape


def _results(dag_id: str, run_id: str) -> dict:
    from airflow.utils.session import create_session

    with create_session() as session:
        folder, run = run_folder(dag_id, run_id, session)
        name = display_name(run_id, run.conf)
    return {"dag_id": dag_id, "run_id": run_id, "run_name": folder.name or name, **drafter_results(folder)}


@router.get("/api/drafter")
def drafter_json(user: User, dag_id: str = Query(...), run_id: str = Query(...)) -> dict:
    return _results(dag_id, run_id)


@router.get("/drafter/plot")
def drafter_plot(user: User, dag_id: str = Query(...), run_id: str = Query(...), name: str = Query(...)):
    from airflow.utils.session import create_session

    with create_session() as session:
        folder, _ = run_folder(dag_id, run_id, session)
    path = plot_path(folder, name)
    if path is None:
        raise HTTPException(404, f"no {name!r} plot in {folder}")
    return FileResponse(path, media_type="image/png", headers={"Cache-Control": "private, max-age=30"})


def _table(rows: list[list[str]], id_: str) -> str:
    if not rows:
        return ""
    head = "".join(f"<th>{e(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td{' class=l' if i == 0 else ''}>{e(c)}</td>" for i, c in enumerate(r))
                   + "</tr>" for r in rows[1:])
    return f"<table id='{id_}'><tr>{head}</tr>{body}</table>"


def _plot(p: dict, name: str | None, alt: str) -> str:
    if not name:
        return ""
    from urllib.parse import urlencode

    q = e(urlencode({"dag_id": p["dag_id"], "run_id": p["run_id"], "name": name}))
    return f"<p><img src='drafter/plot?{q}' alt='{e(alt)}' style='max-width:100%'></p>"


def _state(s: dict) -> str:
    return f"<span class='state {e(s['state'].replace(' ', '-'))}'>{e(s['state'])}</span>"


def _train(p: dict) -> str:
    t = p["train"]
    out = [f"<h3>Training {_state(t)}</h3>"]
    if t["state"] == COMPLETE:
        first, last = t.get("first") or {}, t.get("last") or {}
        acc = ", ".join(f"{a:.2f}" for a in last.get("acc_k") or [])
        out.append(f"<p id='train-summary'>{t['steps']:,} optimizer steps over {t['train_tokens']:,} tokens, draft "
                   f"vocabulary {t['draft_vocab_size']:,}; loss {first.get('loss', 0):.3f} &rarr; "
                   f"{last.get('loss', 0):.3f}; top-1 accuracy per TTT step at the end: {e(acc)}</p>")
        out += [f"<p class='err'>{e(w)}</p>" for w in t.get("serving_problems") or []]
    elif t["state"] != "not run yet" and t.get("last_step"):
        s = t["last_step"]
        out.append(f"<p>step {s.get('step')}: loss {s.get('loss', float('nan')):.3f} (metrics.jsonl)</p>")
    else:
        out.append("<p>The train task has not written a report yet.</p>")
    if t.get("error"):
        out.append(f"<p class='err'>{e(t['error'])}</p>")
    out.append(_plot(p, t.get("plot"), "training curves"))
    out.append(f"<p>Curves in TensorBoard: <code>tensorboard --logdir {e(t['tensorboard'])}</code> "
               "(<code>pip install tensorboard</code>, or the extra <code>eagle3-pipeline[tensorboard]</code>)</p>")
    return "".join(out)


def _evaluate(p: dict) -> str:
    v = p["evaluate"]
    out = [f"<h3>Evaluation {_state(v)}</h3>"]
    if v["state"] == "not run yet":
        out.append("<p>The evaluate task has not written a report yet.</p>")
        if v.get("error"):
            out.append(f"<p class='err'>{e(v['error'])}</p>")
        return "".join(out)
    lossless = lossless_text(v.get("identical_to_greedy"))
    n = v.get("conversations")
    out.append(f"<p>{v.get('answers')} answers to {n} conversation{'' if n == 1 else 's'} ({e(str(v.get('prompts')))}), "
               f"at most {v.get('max_new_tokens')} new tokens each, on {e(str(v.get('device')))}; speculative output "
               f"<b id='lossless'>{e(lossless)}</b>. tau: tokens per target forward (accepted draft tokens + 1).</p>")
    if past := v.get("turns_past_context"):
        out.append(f"<p class='err' id='past-context'>{past} turn{'' if past == 1 else 's'} not asked: prompt + "
                   f"{v.get('max_new_tokens')} new tokens past the target's context (the task log names the "
                   f"first).</p>")
    out.append(_table(v["tables"]["by_k"], "tau"))
    if v["tables"]["by_category"]:
        out.append("<h4>tau per category</h4>" + _table(v["tables"]["by_category"], "tau-by-category"))
    out.append(_plot(p, v.get("plot"), "acceptance by draft position"))
    return "".join(out)


def _export(p: dict) -> str:
    x = p["export"]
    out = [f"<h3>Export {_state(x)}</h3><p>folder <code id='export-dir'>{e(x['dir'])}</code></p>"]
    if x["files"]:
        out.append("<p>" + ", ".join(f"{e(f['name'])} ({e(f['size'])})" for f in x["files"]) + "</p>")
    for engine, cmd in (x.get("commands") or {}).items():
        out.append(f"<p>Serve it with {e(engine)}:</p><pre id='serve-{e(engine.lower())}'>{e(cmd)}</pre>")
    return "".join(out)


@router.get("/drafter", response_class=HTMLResponse)
def drafter_page(user: User, dag_id: str = Query(...), run_id: str = Query(...)) -> str:
    p = _results(dag_id, run_id)
    done = p["evaluate"]["state"] in (COMPLETE, "failed")
    body = (f"<h2>Drafter of run <span id='run-name'>{e(p['run_name'])}</span></h2>"
            f"<p>DAG <b>{e(dag_id)}</b>, run <b>{e(run_id)}</b><br>folder <code>{e(p['run_dir'])}</code></p>"
            + _evaluate(p) + _train(p) + _export(p)
            + "<p class='note'>Read from the phases' reports under the run folder"
            + ("." if done else "; refreshes every 30 s until the evaluation has run.") + "</p>")
    return page(f"eagle3 drafter: {p['run_name']}", body, refresh_s=None if done else 30)
