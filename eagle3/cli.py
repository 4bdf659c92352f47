"""Command line: `python -m eagle3 <command>`, for what is handy outside Airflow."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Callable

from eagle3.errors import PipelineError


def guarded(prog: str, command: Callable[[], int], debug: bool) -> int:
    """Run a command-line entry: a failure prints one line on stderr, `<prog>: <what is wrong, where>`, and exits
    1 (130 on Ctrl-C); the traceback only with --debug (raised as it is). Every entry goes through here."""
    try:
        return command()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        what = str(e) if isinstance(e, PipelineError) else f"{type(e).__name__}: {e}"
        print(f"{prog}: {what} (--debug shows the traceback)", file=sys.stderr)
        return 1


def add_debug(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="on a failure, show the traceback")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eagle3")
    add_debug(p)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("prepare-model", help="convert the shipped SmolLM2 GGUF into a cached HF folder; print its path")
    m.add_argument("--cache-dir", default=None)
    pf = sub.add_parser("preflight", help="run the preflight checks")
    pf.add_argument("--model-path", required=True)
    pf.add_argument("--output-dir", required=True)
    pf.add_argument("--capture-layers", type=lambda s: [int(x) for x in s.split(",")], default=None)
    pf.add_argument("--estimated-tokens", type=int, default=0)
    pf.add_argument("--allow-cpu", action="store_true")
    sub.add_parser("dags-folder", help="print the folder holding the pipeline's DAG file (installed or this checkout)")
    pr = sub.add_parser("prompts", help="write a public prompt set (public-data extra) as the pipeline's prompt JSONL")
    pr.add_argument("which", choices=("sharegpt", "mtbench"))
    pr.add_argument("out", help="the prompt JSONL to write")
    pr.add_argument("--limit", type=int, default=0, help="write at most N conversations (0 = all)")
    pr.add_argument("--source", default=None, help="read this file instead of the installed wheel's")
    pr.add_argument("--mtbench-source", default=None,
                    help="sharegpt: the MT-bench question.jsonl whose questions are removed (default: the wheel's)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cmd == "prompts" and args.limit < 0:
        p.error("--limit must be >= 0")
    return guarded(f"eagle3 {args.cmd}", lambda: run_command(args), args.debug)


def run_command(args: argparse.Namespace) -> int:
    if args.cmd == "prepare-model":
        from eagle3.models import ensure_smollm2

        print(ensure_smollm2(args.cache_dir))
        return 0
    if args.cmd == "preflight":
        from eagle3.preflight import PreflightConfig, run_preflight
        from eagle3.sections import TargetConfig

        target = TargetConfig(model_path=args.model_path, capture_layers=args.capture_layers).resolved()
        report = run_preflight(PreflightConfig(args.output_dir, args.estimated_tokens, allow_cpu=args.allow_cpu),
                               target)
        print(json.dumps({"ok": report["ok"], "device": report["device"]}))
        return 0
    if args.cmd == "dags-folder":
        print(dags_folder())
        return 0
    if args.cmd == "prompts":
        from eagle3.datagen.public_prompts import write_mtbench, write_sharegpt

        if args.which == "sharegpt":
            report = write_sharegpt(args.out, args.limit, args.source, args.mtbench_source)
        else:
            report = write_mtbench(args.out, args.limit, args.source)
        print(json.dumps(report, indent=1, ensure_ascii=False))
        return 0
    return 2


def dags_folder() -> str:
    """Where eagle3_drafter.py is: the installed eagle3_dags package, else the checkout's dags/. An existing
    Airflow picks it up through a symlink in its dags folder (or the folder as AIRFLOW__CORE__DAGS_FOLDER)."""
    from importlib.util import find_spec
    from pathlib import Path

    spec = find_spec("eagle3_dags")
    if spec is not None and spec.submodule_search_locations:
        return str(Path(next(iter(spec.submodule_search_locations))).resolve())
    return str(Path(__file__).resolve().parents[1] / "dags")


if __name__ == "__main__":
    sys.exit(main())
