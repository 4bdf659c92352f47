"""What one datagen task is: the dataset spec (user input, JSON-schema checked), the client settings and
the task config (DatagenConfig: output, endpoint, local server).

A dataset spec names the prompt file and how to sample answers for it. It arrives from a DAG
param or a JSON file, so it is validated with a JSON schema whose error names the field at fault;
an unknown field is an error (a typo like `max_token` must not be silently ignored).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import jsonschema

from eagle3.errors import ConfigError
from eagle3.knobs import build, check_knobs, knob
from eagle3.sections import TargetConfig

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
    """How the async client drives the endpoint (not part of the answers' identity, except `model`)."""

    model: str = knob("default", help="model name sent in each request (what the endpoint serves)")
    http_client: str = knob("aiohttp", choices=("aiohttp", "openai"),
                            help="aiohttp: the fast path (~0.5 ms CPU/request); openai: the AsyncOpenAI SDK")
    concurrency: int = knob(256, min=1, help="requests in flight")
    request_timeout_s: float = knob(600.0, gt=0, help="one request's timeout")
    max_retries: int = knob(6, min=0, help="retries of a retryable failure (429, 5xx, timeout, connection)")
    backoff_base_s: float = knob(1.0, gt=0, help="first retry delay; doubles per retry, with jitter")
    backoff_max_s: float = knob(60.0, gt=0, help="longest retry delay")
    max_failed_fraction: float = knob(0.01, min=0, max=1,
                                      help="more failed samples than this fraction of the prompts fails the run")
    price_prompt_per_m: float = knob(0.0, min=0, help="USD per million prompt tokens")
    price_completion_per_m: float = knob(0.0, min=0, help="USD per million completion tokens")
    log_every_s: float = knob(10.0, gt=0, help="seconds between progress lines")

    def __post_init__(self):
        check_knobs(self, "datagen client")

    @classmethod
    def from_dict(cls, obj: dict | None, where: str = "datagen client") -> "ClientConfig":
        return build(cls, dict(obj or {}), where)


DEFAULT_CLIENT = {"concurrency": 256, "max_failed_fraction": 0.01}


@dataclass
class DatagenConfig:
    """The datagen task's config: where to write, and which endpoint answers (remote, or a local server the
    task starts). The dataset itself is the task's own mapped argument (DatasetSpec)."""

    target: TargetConfig = knob(help="The run's target section: its folder gives the tokenizer and chat template, "
                                     "and {model_path} of the local server command.")
    output_dir: str = knob(help="datagen output folder; <output_dir>/<dataset>/ is written")
    mode: str = knob("local", choices=("local", "remote"), param="datagen_mode", section="Data generation",
                     help="local: the task starts server_command; remote: the endpoint of datagen_conn_id")
    conn_id: str | None = knob(None, param="datagen_conn_id", section="Data generation",
                               help="Airflow Connection with the endpoint URL and API key (needed in remote mode)")
    served_model_name: str = knob("auto", param="served_model_name", section="Data generation", pattern=r"\S",
                                  help="model name sent in each request (what the endpoint serves); auto = what "
                                       "the auto-chosen local server serves")
    server_command: str | None = knob("auto", param="server_command", section="Data generation",
                                      help="local server: auto = SGLang on a GPU, else llama.cpp on the model's GGUF "
                                           "(preflight says which); sglang, vllm or llama.cpp; null = SGLang; a "
                                           "command template ({model_path} {port} {host} {gguf}) only where the "
                                           "deployment allows free-form commands (docs/operations.md)")
    server_extra_args: str | None = knob(None, param="server_extra_args", section="Data generation",
                                         help="extra flags for the local server, e.g. '--tp 8' (serving flags only, "
                                              "unless the deployment allows free-form commands)")
    gguf: str | None = knob("auto", param="gguf", section="Data generation",
                            help="GGUF file for servers that take one ({gguf} in server_command); auto = a *.gguf "
                                 "in model_path, or the packaged one of the demo model")
    client: dict = knob(default_factory=lambda: dict(DEFAULT_CLIENT), param="datagen_client",
                        section="Data generation",
                        help="client params: concurrency, request_timeout_s, max_retries, max_failed_fraction, "
                             "price_prompt_per_m, price_completion_per_m, http_client, log_every_s")
    server_port: int | None = knob(None, min=1, max=65535, help="local server port; null = a free one")
    server_ready_timeout_s: float = knob(900.0, gt=0, help="how long the local server may take to answer")

    def __post_init__(self):
        check_knobs(self, "datagen")
        if self.mode == "remote" and not self.conn_id:
            raise ConfigError("datagen: mode 'remote' needs conn_id (trigger-form param datagen_conn_id): "
                              "an Airflow Connection with the endpoint and API key")
        if not self.served_model_name.strip():
            raise ConfigError("datagen param served_model_name must name the served model, got an empty string")
        if "model" in self.client:
            raise ConfigError("datagen param client (trigger-form param datagen_client): 'model' is set by "
                              "served_model_name, not in the client params")
        self.client_config()  # an unknown or bad client key fails here, naming itself

    def client_config(self) -> ClientConfig:
        return ClientConfig.from_dict({**self.client, "model": self.served_model_name},
                                      where="datagen param client (trigger-form param datagen_client)")
