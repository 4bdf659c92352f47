"""The commands docs/device-runs.md stages for the device machine parse with their scripts' own parsers.

A device session is 30 minutes, and a misspelt flag costs a whole call: every `python3 bench/X.py ...` in the doc
(code spans, table cells, ```bash blocks, `$B` expanded) is checked against bench/X.py's argparse parser without
running it, and the `--variants`, `--studies` and `--ablations` values against the names the bench knows.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "device-runs.md"
# a joined line break (a `\` continuation, a code span across lines): whitespace that still counts as a line
JOINED = "\x0b"
INVOCATION = re.compile(r"\bpython3?\s+bench/(\w+)\.py\b")
# a quoted assignment of a bench command in the prose, e.g. B="python3 bench/extract_bench.py --writers 6 ..."
ASSIGNMENT = re.compile(r"\b([A-Za-z_]\w*)=\"((?:python3?\s+)?bench/[^\"]*)\"")
# what the shell would put in place of a variable; others stay as written (argparse then sees `$X`)
VARIABLES = {"OUT": "/tmp/out", "PWD": "/repo"}
ELIDED = "..."  # `python3 bench/extract_bench.py ... --out $OUT/extract.json`: the doc leaves flags out


@dataclass
class Invocation:
    script: str  # bench/<script>.py
    argv: list[str]
    line: int  # of the doc

    @property
    def id(self) -> str:
        return f"{self.script}@L{self.line}"


# ---- the doc's shell text


def code_pieces(text: str) -> list[tuple[int, str]]:
    """(first line, code) of every fenced block (line continuations joined) and inline code span (a span across
    lines is one line; `\\|` in a table row is the cell's `|`); a joined line break is JOINED."""
    pieces, prose, fence = [], [], None
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if fence is None:
                fence = (n + 1, [])
            else:
                pieces.append((fence[0], "\n".join(fence[1]).replace("\\\n", " " + JOINED)))
                fence = None
            prose.append((n, ""))
        elif fence is not None:
            fence[1].append(line)
            prose.append((n, ""))
        else:
            prose.append((n, line.replace("\\|", "|") if line.lstrip().startswith("|") else line))
    joined = "\n".join(line for _, line in prose)
    for m in re.finditer(r"`([^`]+)`", joined):
        pieces.append((joined.count("\n", 0, m.start()) + 1, m.group(1).replace("\n", JOINED)))
    return sorted(pieces)


def expand(code: str, assigned: dict[str, str]) -> str:
    """$NAME / ${NAME} of the doc's bench-command assignments, and of VARIABLES."""
    for name, value in {**assigned, **VARIABLES}.items():
        code = re.sub(r"\$(?:%s\b|\{%s\})" % (name, name), lambda _: value, code)
    return code


def words(tail: str) -> list[str]:
    """The arguments a shell would pass, from the text after `bench/X.py` to the end of that command: an unquoted
    `|`, `&`, `;`, `<`, `>` (`2>&1` too), `#`, newline, or a quote that does not close here (the end of a
    `bash -c '...'` around the command). Quotes are removed; `$(...)` and `$((...))` become `1`."""
    out, word, i, n = [], None, 0, len(tail)

    def add(s: str) -> None:
        nonlocal word
        word = (word or "") + s

    while i < n:
        c = tail[i]
        if c in " \t" + JOINED:
            if word is not None:
                out.append(word)
            word, i = None, i + 1
            continue
        if c in "|&;<>#\n" or (word is None and re.match(r"\d+[<>]", tail[i:])):
            break
        if c in "'\"":
            close = tail.find(c, i + 1)
            if close < 0:
                break
            add(tail[i + 1:close])
            i = close + 1
        elif tail.startswith("$(", i):
            depth, j = 0, i + 1
            while j < n:
                depth += {"(": 1, ")": -1}.get(tail[j], 0)
                if depth == 0:
                    break
                j += 1
            add("1")
            i = j + 1
        elif c == "\\" and i + 1 < n:
            add(tail[i + 1])
            i += 2
        else:
            add(c)
            i += 1
    if word is not None:
        out.append(word)
    return [w for w in out if w != ELIDED]


def invocations(text: str) -> list[Invocation]:
    """Every `python3 bench/X.py ...` of a markdown text, with its arguments."""
    assigned = {m.group(1): " ".join(m.group(2).split()) for m in ASSIGNMENT.finditer(text)}
    out = []
    for line, code in code_pieces(text):
        code = expand(code, assigned)
        for m in INVOCATION.finditer(code):
            at = line + code.count("\n", 0, m.start()) + code.count(JOINED, 0, m.start())
            out.append(Invocation(m.group(1), words(code[m.end():]), at))
    return out


# ---- the scripts' parsers


def parser_of(script: str) -> argparse.ArgumentParser:
    module = importlib.import_module(f"bench.{script}")
    if hasattr(module, "parser"):
        return module.parser()
    raise AssertionError(f"bench/{script}.py exposes no parser() (def parser() -> argparse.ArgumentParser)")


def _parse(parse, argv: list[str]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return parse(argv), None
        except SystemExit as e:  # argparse prints its message; the bench's own checks exit with it
            said = err.getvalue().strip()
            return None, said.splitlines()[-1] if said else str(e.code)


def problems(script: str, argv: list[str]) -> list[str]:
    """What is wrong with `bench/<script>.py argv`: a flag the parser does not spell so (argparse would take an
    abbreviation), an argument parse_known_args leaves unknown, a parse_args that exits; then the values of
    --variants / --studies / --ablations / the model names that the bench would refuse."""
    p = parser_of(script)
    found = []
    options = set(p._option_string_actions)
    flags = argv[:argv.index("--")] if "--" in argv else argv
    found += [f"{f}: not a flag of bench/{script}.py" for f in (a.split("=", 1)[0] for a in flags)
              if f.startswith("--") and f not in options]
    known, error = _parse(p.parse_known_args, argv)
    if error:
        found.append(f"parse_known_args: {error}")
    elif known[1]:
        found.append(f"unknown arguments {known[1]}")
    args, error = _parse(p.parse_args, argv)
    if error:
        found.append(f"parse_args: {error}")
    if args is not None:
        found += value_problems(script, args)
    return found


def value_problems(script: str, args: argparse.Namespace) -> list[str]:
    found = []
    if script == "extract_bench":
        from bench.extract_limits import DEFAULT_BUDGET

        models = args.models.split(",")
        found += [f"--models: unknown model {m!r}" for m in models if m not in DEFAULT_BUDGET]
        for flag in ("compile", "fused", "fp8", "fp8_weights", "fp8_blocks", "variant_models"):
            found += [f"--{flag.replace('_', '-')}: {m!r} is not in --models (it would not run)"
                      for m in filter(None, getattr(args, flag).split(",")) if m not in models]
        if args.variants:
            found += variant_problems(args.variants)
    if script in ("extract_tasks", "extract_gpus"):
        from bench.extract_limits import DEFAULT_BUDGET

        found += [f"--model: unknown model {args.model!r}"] if args.model not in DEFAULT_BUDGET else []
    if script == "train_quality_gpu":
        found += quality_problems(args)
    return found


def variant_problems(spec: str) -> list[str]:
    """parse_variants' keys (bench/extract_levers.py), then each value against its ExtractConfig field's choices
    and pattern (eagle3/extract/config.py)."""
    from bench.extract_levers import parse_variants
    from eagle3.extract.config import ExtractConfig
    from eagle3.knobs import knob_meta

    variants, error = _parse(parse_variants, spec)
    if error:
        return [error]
    meta = {f.name: knob_meta(f) or {} for f in dataclasses.fields(ExtractConfig)}
    found = []
    for name, params in variants.items():
        for field, value in params.items():
            m = meta[field]
            if m.get("choices") and value not in m["choices"]:
                found.append(f"--variants {name}: {field}={value!r} is not one of {list(m['choices'])}")
            elif m.get("pattern") and not re.fullmatch(m["pattern"], str(value)):
                found.append(f"--variants {name}: {field}={value!r} does not match {m['pattern']}")
    return found


def quality_problems(args: argparse.Namespace) -> list[str]:
    """--studies and --ablations through bench/quality_plan.py's own row tables (each exits naming an unknown)."""
    from bench import quality_plan

    errors = (_parse(lambda a: quality_plan.studies(a, 15), args)[1],
              _parse(lambda a: quality_plan.plan(a, 3), args)[1])
    return [e for e in errors if e]


def doc_problems(text: str) -> dict[str, list[str]]:
    """{invocation id: problems} of a markdown text's bench commands, and of every `--studies X` / `--ablations X`
    in it (prose included, e.g. `--studies data_all,epochs4,epochs8`)."""
    out = {}
    for inv in invocations(text):
        if found := problems(inv.script, inv.argv):
            out.setdefault(inv.id, []).extend(found)  # two commands of one line share an id
    for m in re.finditer(r"--(studies|ablations)[ =]([\w.,-]+)", text):
        line = text.count("\n", 0, m.start()) + 1
        argv = ["--work", "w", "--out", "o", f"--{m.group(1)}", m.group(2)]
        if found := problems("train_quality_gpu", argv):
            out[f"--{m.group(1)}@L{line}"] = found
    return out


# ---- the tests

TEXT = DOC.read_text()


@pytest.mark.parametrize("inv", invocations(TEXT), ids=lambda inv: inv.id)
def test_every_staged_command_parses_with_its_script(inv):
    assert problems(inv.script, inv.argv) == [], f"docs/device-runs.md line {inv.line}: {inv.script} {inv.argv}"


def test_every_studies_and_ablations_name_in_the_doc_is_known():
    found = {k: v for k, v in doc_problems(TEXT).items() if k.startswith("--")}
    assert found == {}


def test_the_doc_still_stages_the_scripts_this_test_reads():
    """An extraction that quietly finds nothing would pass: the doc's commands are all there."""
    found = invocations(TEXT)
    scripts = {inv.script for inv in found}
    assert {"extract_bench", "train_quality_gpu", "evaluate_bench", "extract_tasks", "extract_gpus",
            "train_bench", "quality_prompts"} <= scripts
    via_b = [inv for inv in found if inv.script == "extract_bench" and "--profile-batches" in inv.argv]
    assert len(via_b) >= 2 and all(inv.argv[:2] == ["--writers", "6"] for inv in via_b)  # $B expanded (calls 1, 2, ...)
    assert sum(inv.script == "extract_bench" for inv in found) >= 8


def test_a_misspelt_flag_in_a_copy_of_the_doc_is_reported():
    assert "--skew 1.0 --profile-batches 8 --out $OUT/moe-qwen3.json" in TEXT
    broken = TEXT.replace("--skew 1.0 --profile-batches 8 --out $OUT/moe-qwen3.json",
                          "--skew 1.0 --profile-batches 8 --no-such-flag --out $OUT/moe-qwen3.json")
    found = [p for ps in doc_problems(broken).values() for p in ps]
    assert any("--no-such-flag: not a flag of bench/extract_bench.py" in p for p in found), found
    assert any("unknown arguments ['--no-such-flag']" in p for p in found), found
    assert doc_problems(TEXT) == {}


def test_an_abbreviated_flag_or_a_bad_value_is_reported():
    text = ('`B="python3 bench/extract_bench.py --writers 6"`\n\n'
            "| call | command |\n|---|---|\n"
            "| 1 | `timeout 580 $B --models 8b --profile-batch 8 --out $OUT/x.json 2>&1 \\| tail -n 60` |\n"
            "| 2 | `timeout 580 bash -c 'python3 bench/extract_tasks.py --tasks two && python3 bench/extract_tasks.py "
            "--model nope'` |\n")
    found = doc_problems(text)
    assert found["extract_bench@L5"] == ["--profile-batch: not a flag of bench/extract_bench.py"]
    tasks = found["extract_tasks@L6"]
    assert [p.split(":")[0] for p in tasks] == ["parse_known_args", "parse_args", "--model"], tasks
    assert "--tasks" in tasks[0] and "'two'" in tasks[0] and tasks[2] == "--model: unknown model 'nope'"
    assert len(found) == 2


def test_bad_variants_studies_and_ablations_are_reported():
    assert variant_problems("fused:experts=triton_fused;blocks:scope=moe-blocks;budget64k:budget=65536") == []
    assert variant_problems("tokmajor:mla=token-major;inplace:mla=in-place") == []  # mla_joins' choices
    assert variant_problems("x:mla=in_place") == [
        "--variants x: mla_joins='in_place' is not one of ['auto', 'heads-major', 'token-major', 'in-place']"]
    assert variant_problems("a:expert=triton_fused")[0].startswith("--variants 'a:expert=triton_fused': 'expert=")
    assert variant_problems("a:experts=triton;b:mode=max-autotune") == [
        "--variants a: experts_implementation='triton' is not one of "
        "['auto', 'eager', 'batched_mm', 'grouped_mm', 'triton_fused']",
        "--variants b: compile_mode='max-autotune' is not one of ['auto', 'default', 'max-autotune-no-cudagraphs']"]
    assert variant_problems("p:pad=0x40") == ["--variants p: pad_multiple='0x40' does not match ^(auto|[1-9][0-9]*)$"]
    found = doc_problems("`--studies data3k,data_firts` and `--ablations batch64,batch61`")
    assert list(found) == ["--studies@L1", "--ablations@L1"]
    assert found["--studies@L1"][0].startswith("--studies: unknown ['data_firts']; groups")
    assert found["--ablations@L1"][0].startswith("--ablations: unknown ['batch61']; known")


def test_words_stop_where_the_shell_command_does():
    assert words(' --a "x;y" --b=\'p q\' 2>&1 | tail') == ["--a", "x;y", "--b=p q"]
    assert words(" --x $((T - 10)) --y $(( $(date +%s) + 1380 )) && echo") == ["--x", "1", "--y", "1"]
    assert words(" --x 1; echo") == ["--x", "1"] and words(" --x 1 > log") == ["--x", "1"]
    assert words(" --x 1 # a comment") == ["--x", "1"] and words(" --x 1\n  python3 next") == ["--x", "1"]
    assert words(" ... --out o.json'") == ["--out", "o.json"]  # the end of a bash -c '...' around the command


def test_invocations_join_continuations_and_expand_variables():
    text = ('`B="python3 bench/train_bench.py\n--gpus 2"`, then:\n\n```bash\n'
            "PYTHONPATH=/root/site:$PWD timeout $((T - 10)) python3 bench/extract_gpus.py --tp 1,2 \\\n"
            "  --out $OUT/g.json 2>&1 | tail\n```\n\n| 1 | `$B --out $OUT/t.json \\| tail` |\n")
    assert [(i.script, i.argv, i.line) for i in invocations(text)] == [
        ("train_bench", ["--gpus", "2"], 1),
        ("extract_gpus", ["--tp", "1,2", "--out", "/tmp/out/g.json"], 5),
        ("train_bench", ["--gpus", "2", "--out", "/tmp/out/t.json"], 9)]
