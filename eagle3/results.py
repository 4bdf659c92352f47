"""What a run produced, for people: the training curves, the evaluation's figures, the export and the commands that
serve it. Read from what the phases already wrote under the run folder (eagle3.config's layout):

    train/report.json, train/metrics.jsonl (its tail while training runs), train/training.png, train/export/
    evaluate/report.json (or report.failed.json: not lossless), evaluate/acceptance.png

A phase whose files are absent is "not run yet". No Airflow import: the UI plugin (plugins/drafter_view.py) renders
what `drafter_results` returns, and the evaluate phase logs `evaluation_table` as text. Reads are bounded (a JSON
file over MAX_JSON_BYTES is not parsed, a metrics tail is at most TAIL_BYTES) and cached by (path, mtime, size):
a page refresh on a finished run costs a few stat calls, not a re-parse.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from eagle3.extract.status import human_bytes

MAX_JSON_BYTES = 32 << 20  # an evaluation report with every answer of MT-bench is a few MB
TAIL_BYTES = 64 << 10
NOT_RUN, RUNNING, COMPLETE, FAILED = "not run yet", "in progress", "complete", "failed"


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


@lru_cache(maxsize=64)
def _slim_report(path: str, stamp: tuple[int, int]) -> dict:
    """A phase report without its per-answer records (what a page shows), parsed once per file version."""
    if stamp[1] > MAX_JSON_BYTES:
        return {"error": f"{path}: {human_bytes(stamp[1])}, over the {human_bytes(MAX_JSON_BYTES)} a page reads"}
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return {"error": f"{path}: unreadable ({type(e).__name__}: {e})"[:300]}
    if not isinstance(d, dict):
        return {"error": f"{path}: not a JSON object"}
    d.pop("results", None)  # every answer's rounds: the tables below come from the headline fields
    return d


def read_report(path: Path) -> dict | None:
    """The report at `path` (cached while the file is unchanged), None when there is none."""
    stamp = _stamp(path)
    return None if stamp is None else _slim_report(str(path), stamp)


def metrics_tail(path: Path, max_bytes: int = TAIL_BYTES) -> dict | None:
    """The last complete line of metrics.jsonl (training's progress), reading at most `max_bytes` of its end."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written, or cut by the seek
        if isinstance(rec, dict) and "step" in rec:
            return rec
    return None


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def evaluation_table(report: dict) -> dict[str, list[list[str]]]:
    """The evaluation's figures as text rows (header first): "by_k" (tau, over eos-ended answers, share at the cap,
    random floor, tau per turn), "by_category" (tau per k)."""
    ks = [str(k) for k in report.get("ks") or sorted(report.get("tau") or {}, key=int)]
    floor = report.get("tau_random_init") or {}
    per_turn = report.get("tau_per_turn") or {}
    turns = sorted({t for k in ks for t in (per_turn.get(k) or {})}, key=int)
    by_k = [["k", "tau", "tau (answers ended by eos)", "share at max_new_tokens", "tau, random drafter",
             *[f"tau turn {t}" for t in turns]]]
    for k in ks:
        share = (report.get("share_hit_cap") or {}).get(k)
        by_k.append([k, _fmt((report.get("tau") or {}).get(k)), _fmt((report.get("tau_ended_with_eos") or {}).get(k)),
                     "-" if share is None else f"{share:.0%}", _fmt(floor.get(k)),
                     *[_fmt((per_turn.get(k) or {}).get(t)) for t in turns]])
    per_cat = report.get("tau_per_category") or {}
    cats = sorted({c for k in ks for c in (per_cat.get(k) or {})})
    by_category = [["category", *[f"tau k={k}" for k in ks]]]
    by_category += [[c, *[_fmt((per_cat.get(k) or {}).get(c)) for k in ks]] for c in cats]
    return {"by_k": by_k, "by_category": by_category if cats else []}


def lossless_text(identical_to_greedy: bool | None) -> str:
    return {True: "identical to greedy decoding (lossless)", False: "NOT identical to greedy decoding",
            None: "not checked"}[identical_to_greedy]


def text_table(rows: list[list[str]]) -> str:
    """Rows as aligned text columns (for a task log)."""
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def serving_commands(export_dir: str, target: str, steps: int) -> dict[str, str]:
    """The commands that serve the export as the drafter of `target` (docs/train.md, "Serve it")."""
    vllm_config = json.dumps({"method": "eagle3", "model": export_dir, "num_speculative_tokens": steps})
    return {
        "SGLang": (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
                   f"--speculative-draft-model-path {export_dir} --speculative-num-steps {steps} "
                   f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {steps + 1}"),
        "vLLM": f"vllm serve {target} --speculative-config '{vllm_config}'",
    }


def _export(export_dir: Path, train_report: dict | None) -> dict:
    files = []
    if export_dir.is_dir():
        for p in sorted(export_dir.iterdir())[:50]:  # an export holds a handful of files
            if p.is_file():
                files.append({"name": p.name, "size": human_bytes(p.stat().st_size)})
    params = (train_report or {}).get("params") or {}
    target = ((params.get("target") or {}).get("model_path")) or "<target model>"
    out = {"dir": str(export_dir), "files": files, "state": COMPLETE if train_report and files else NOT_RUN}
    if out["state"] == COMPLETE:
        out["commands"] = serving_commands(str(export_dir), str(target), int(params.get("ttt_steps") or 3))
    return out


def drafter_results(run_dir: str | Path) -> dict:
    """Everything the run's drafter page shows; each phase with its state (complete / in progress / failed /
    not run yet). Never raises for a missing or odd file: the problem is in the phase's "error"."""
    run = Path(run_dir)
    tdir, edir = run / "train", run / "evaluate"
    train_report = read_report(tdir / "report.json")
    train: dict[str, Any] = {"dir": str(tdir), "plot": None, "tensorboard": str(tdir / "tensorboard")}
    if train_report and train_report.get("complete"):
        train.update(state=COMPLETE, steps=train_report.get("steps"), train_tokens=train_report.get("train_tokens"),
                     draft_vocab_size=train_report.get("draft_vocab_size"), first=train_report.get("first"),
                     last=train_report.get("last"), serving_problems=train_report.get("serving_problems") or [],
                     seconds=train_report.get("seconds_this_run"))
    else:
        last = metrics_tail(tdir / "metrics.jsonl")
        train.update(state=RUNNING if last else NOT_RUN, last_step=last, error=(train_report or {}).get("error"))
    if (tdir / "training.png").is_file():
        train["plot"] = "training"
    eval_report = read_report(edir / "report.json")
    failed = read_report(edir / "report.failed.json") if not eval_report else None
    evaluate: dict[str, Any] = {"dir": str(edir), "plot": "acceptance" if (edir / "acceptance.png").is_file() else None}
    shown = eval_report if eval_report and eval_report.get("complete") else failed
    if shown and "error" not in shown:
        params = shown.get("params") or {}
        evaluate.update(state=COMPLETE if shown is eval_report else FAILED, tables=evaluation_table(shown),
                        conversations=shown.get("conversations"), answers=shown.get("answers"),
                        max_new_tokens=params.get("max_new_tokens"), prompts=params.get("prompts_file") or "prompts",
                        identical_to_greedy=shown.get("identical_to_greedy"), device=shown.get("device"),
                        turns_past_context=shown.get("turns_past_context"))
    else:
        evaluate.update(state=NOT_RUN, error=(shown or {}).get("error"))
    return {"run_dir": str(run), "train": train, "evaluate": evaluate,
            "export": _export(tdir / "export", train_report if train.get("state") == COMPLETE else None)}


PLOTS = {"training": ("train", "training.png"), "acceptance": ("evaluate", "acceptance.png")}


def plot_path(run_dir: str | Path, name: str) -> Path | None:
    """The file of a named plot of the run (only these names: no path from a request reaches the disk)."""
    if name not in PLOTS:
        return None
    path = Path(run_dir).joinpath(*PLOTS[name])
    return path if path.is_file() else None
