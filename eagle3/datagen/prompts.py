"""Prompt files: JSONL, one conversation per line, in one of three shapes.

    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}   OpenAI chat
    {"prompt": "..."}                                                              single user turn
    {"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}, ...]}     ShareGPT

Any assistant turns in the file are discarded: the target model regenerates every assistant
turn (its own answers are what the drafter must learn). Other keys on a line are ignored
(datasets carry metadata). A bad line is reported as `file:line: reason` and either fails the
run or is skipped and counted, per the spec's `on_bad_line`.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.errors import ConfigError
from eagle3.io import BadJSONLine, json_line, not_a_file

log = logging.getLogger(__name__)

FORMAT_KEYS = ("messages", "prompt", "conversations")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}
MAX_REPORTED_BAD_LINES = 100


@dataclass
class Prompt:
    sample_id: str
    line_no: int
    system: str | None
    user_turns: list[str]  # the assistant answers one of these each, in order


@dataclass
class PromptSet:
    path: str
    prompts: list[Prompt]
    bad_lines: int = 0
    bad_line_messages: list[str] = field(default_factory=list)
    duplicate_lines: int = 0


class BadLine(ValueError):
    pass


def _text(content, what: str) -> str:
    """OpenAI content is a string or a list of parts; only text parts make sense for a text model."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise BadLine(f"{what}: only text content parts are supported, got {str(p)[:60]!r}")
        return "".join(parts)
    raise BadLine(f"{what}: content must be a string, got {type(content).__name__}")


def _turns_from_messages(msgs, key: str, role_key: str, text_key: str, role_map: dict | None):
    if not isinstance(msgs, list) or not msgs:
        raise BadLine(f"'{key}' must be a non-empty list")
    system, users = None, []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadLine(f"{key}[{i}] must be an object")
        if role_key not in m or text_key not in m:
            raise BadLine(f"{key}[{i}] needs '{role_key}' and '{text_key}'")
        role = m[role_key]
        role = role_map.get(role, role) if role_map else role
        if role not in ("system", "user", "assistant"):
            raise BadLine(f"{key}[{i}]: unsupported role {m[role_key]!r}")
        text = _text(m[text_key], f"{key}[{i}]")
        if role == "system":
            if i != 0:
                raise BadLine(f"{key}[{i}]: a system turn is only allowed first")
            system = text
        elif role == "user":
            if not text.strip():
                raise BadLine(f"{key}[{i}]: empty user turn")
            users.append(text)
    if not users:
        raise BadLine(f"'{key}' has no user turn")
    return system, users


def parse_prompt_line(obj) -> tuple[str | None, list[str]]:
    if not isinstance(obj, dict):
        raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
    present = [k for k in FORMAT_KEYS if k in obj]
    if len(present) != 1:
        raise BadLine(f"needs exactly one of {list(FORMAT_KEYS)}, found {present or 'none'} (keys: {sorted(obj)[:8]})")
    key = present[0]
    if key == "prompt":
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise BadLine("'prompt' must be a non-empty string")
        return None, [obj["prompt"]]
    if key == "messages":
        return _turns_from_messages(obj["messages"], key, "role", "content", None)
    return _turns_from_messages(obj["conversations"], key, "from", "value", SHAREGPT_ROLES)


def sample_id(dataset: str, raw_line: bytes, occurrence: int = 0) -> str:
    """Stable id: dataset + hash of the line's bytes; a repeated identical line gets a suffix."""
    h = hashlib.sha256(raw_line.strip()).hexdigest()[:16]
    return f"{dataset}-{h}" if occurrence == 0 else f"{dataset}-{h}-{occurrence}"


def read_prompts(path: str | Path, dataset: str, on_bad_line: str = "fail", limit: int | None = None) -> PromptSet:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"dataset {dataset!r}: prompt_file {path} {not_a_file(path)}")
    out = PromptSet(path=str(path), prompts=[])
    seen: dict[str, int] = {}
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                system, users = parse_prompt_line(json_line(raw))
            except (BadLine, BadJSONLine) as e:
                msg = f"{path}:{line_no}: {e}"
                if on_bad_line == "fail":
                    raise ConfigError(f"dataset {dataset!r}: bad prompt line {msg} (set on_bad_line='skip' to skip)")
                out.bad_lines += 1
                if len(out.bad_line_messages) < MAX_REPORTED_BAD_LINES:
                    out.bad_line_messages.append(msg)
                log.warning("skipping bad prompt line %s", msg)
                continue
            base = sample_id(dataset, raw)
            k = seen.get(base, 0)
            seen[base] = k + 1
            out.duplicate_lines += k > 0
            out.prompts.append(Prompt(sample_id(dataset, raw, k), line_no, system, users))
            if limit and len(out.prompts) >= limit:
                break
    if not out.prompts:
        what = "is empty" if out.bad_lines == 0 else f"has no valid prompt ({out.bad_lines} bad lines)"
        raise ConfigError(f"dataset {dataset!r}: prompt_file {path} {what}")
    return out
