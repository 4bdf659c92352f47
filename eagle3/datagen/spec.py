"""What one dataset run is: the dataset spec (user input, JSON-schema checked) and the client settings.

A dataset spec names the prompt file and how to sample answers for it. It arrives from a DAG
param or a JSON file, so it is validated with a JSON schema whose error names the field at fault;
an unknown field is an error (a typo like `max_token` must not be silently ignored).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import jsonschema

from eagle3.errors import ConfigError

DEFAULT_REFUSAL_PATTERNS = (
    r"^\s*I'?m sorry,? but I (can'?t|cannot|won'?t)",
    r"^\s*I (can'?t|cannot|won'?t) (help|assist|comply|provide)",
    r"^\s*I apologi[sz]e,? but I (can'?t|cannot)",
)

DATASET_SCHEMA: dict = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "prompt_file"],
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
                 "description": "dataset name; also its output folder and sample id prefix"},
        "prompt_file": {"type": "string", "minLength": 1, "description": "JSONL of messages/prompt/conversations"},
        "system_prompt": {"type": ["string", "null"], "description": "prepended when a prompt has no system turn"},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "seed": {"type": ["integer", "null"]},
        "extra_body": {"type": "object", "description": "passed as-is to the endpoint (e.g. top_k)"},
        "limit": {"type": ["integer", "null"], "minimum": 1, "description": "use only the first N prompts"},
        "on_bad_line": {"enum": ["fail", "skip"], "description": "a malformed JSONL line fails the run or is skipped"},
        "drop_truncated": {"type": "boolean", "description": "drop answers cut by max_tokens (finish_reason=length)"},
        "refusal_patterns": {"type": "array", "items": {"type": "string"}},
    },
}


@dataclass
class DatasetSpec:
    name: str
    prompt_file: str
    system_prompt: str | None = None
    max_tokens: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    extra_body: dict = field(default_factory=dict)
    limit: int | None = None
    on_bad_line: str = "fail"
    drop_truncated: bool = True
    refusal_patterns: list[str] = field(default_factory=lambda: list(DEFAULT_REFUSAL_PATTERNS))

    @classmethod
    def from_dict(cls, obj: Any, where: str = "dataset spec") -> "DatasetSpec":
        if not isinstance(obj, dict):
            raise ConfigError(f"{where}: must be an object with at least name and prompt_file, got {type(obj).__name__}")
        errors = sorted(jsonschema.Draft202012Validator(DATASET_SCHEMA).iter_errors(obj), key=lambda e: list(e.path))
        if errors:
            msgs = []
            for e in errors:
                at = ".".join(str(p) for p in e.path) or "(top level)"
                msgs.append(f"{at}: {e.message}")
            name = obj.get("name", "?")
            raise ConfigError(f"{where} {name!r} is invalid: " + "; ".join(msgs))
        return cls(**obj)

    def sampling_params(self) -> dict:
        """The params that change the answers: part of the run fingerprint."""
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed, "extra_body": self.extra_body, "system_prompt": self.system_prompt}

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ClientConfig:
    """How the async client drives the endpoint (not part of the answers' identity)."""

    model: str = "default"
    http_client: str = "aiohttp"  # "aiohttp" (fast path, ~0.5 ms CPU/request) or "openai" (AsyncOpenAI SDK)
    concurrency: int = 256
    request_timeout_s: float = 600.0
    max_retries: int = 6
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    max_failed_fraction: float = 0.01  # more failed samples than this fails the run
    price_prompt_per_m: float = 0.0  # USD per million prompt tokens
    price_completion_per_m: float = 0.0
    log_every_s: float = 10.0

    def __post_init__(self):
        for f in ("concurrency", "max_retries"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < (1 if f == "concurrency" else 0):
                raise ConfigError(f"client param {f}={v!r} must be an integer >= {1 if f == 'concurrency' else 0}")
        for f in ("request_timeout_s", "backoff_base_s", "backoff_max_s", "log_every_s"):
            if not getattr(self, f) > 0:
                raise ConfigError(f"client param {f}={getattr(self, f)!r} must be > 0")
        if self.http_client not in ("aiohttp", "openai"):
            raise ConfigError(f"client param http_client={self.http_client!r} must be 'aiohttp' or 'openai'")
        if not 0.0 <= self.max_failed_fraction <= 1.0:
            raise ConfigError(f"client param max_failed_fraction={self.max_failed_fraction!r} must be in [0, 1]")
        if self.price_prompt_per_m < 0 or self.price_completion_per_m < 0:
            raise ConfigError("client params price_*_per_m must be >= 0")

    @classmethod
    def from_dict(cls, obj: dict | None) -> "ClientConfig":
        obj = dict(obj or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise ConfigError(f"unknown client param(s) {unknown}; known: {sorted(known)}")
        return cls(**obj)
