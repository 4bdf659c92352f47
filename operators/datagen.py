from __future__ import annotations

import logging
from typing import Any, Sequence

from airflow.sdk import BaseOperator

log = logging.getLogger(__name__)


def endpoint_from_connection(conn) -> tuple[str, str]:
    """(base_url, api_key) from an Airflow Connection.

    The base URL is `extra.base_url` if set, else `host` when it is a full URL (used as is), else it is built
    from schema (http/https), host, port and `/v1`. The key is the connection's password.
    """
    extra = conn.extra_dejson or {}
    host = (conn.host or "").strip()
    if extra.get("base_url"):
        url = extra["base_url"]
    elif host.startswith(("http://", "https://")):
        url = host
    elif host:
        scheme = conn.schema if conn.schema in ("http", "https") else "http"
        url = f"{scheme}://{host}{f':{conn.port}' if conn.port else ''}/v1"
    else:
        raise ValueError(f"connection {conn.conn_id!r} has no host and no extra.base_url: set the endpoint's base URL")
    return url.rstrip("/"), conn.password or ""


class DatagenOperator(BaseOperator):
    """Generates the target model's answers for ONE dataset, tokenizes them, writes report + manifest.

    Map it over datasets: `DatagenOperator.partial(task_id="datagen", ...).expand(dataset=[spec, ...])`.
    mode="remote": the endpoint (base URL + API key) comes from the Airflow Connection `conn_id`.
    mode="local":  the task starts `server_command` (templated with {model_path} {port} {host} {gguf}),
                   waits for /v1/models or /health, runs, and always stops it; `conn_id` is optional
                   there (its password is sent as the API key if the server wants one).
    The key is masked in logs and never returned, stored in params or written to any file.
    """

    template_fields: Sequence[str] = ("dataset", "output_dir", "tokenizer_path", "conn_id", "mode", "model",
                                      "client", "server_command", "server_extra_args", "model_path", "gguf")
    ui_color = "#dbeafe"

    def __init__(self, *, dataset: Any, output_dir: str, tokenizer_path: str, conn_id: str | None = None,
                 mode: str = "remote", model: str | None = None, client: Any = None,
                 server_command: str | None = None, server_extra_args: Any = None, model_path: str | None = None,
                 gguf: str | None = None, server_port: int | None = None, server_ready_timeout_s: float = 900.0,
                 **kwargs):
        super().__init__(**kwargs)
        self.dataset = dataset
        self.output_dir = output_dir
        self.tokenizer_path = tokenizer_path
        self.conn_id = conn_id
        self.mode = mode
        self.model = model
        self.client = client
        self.server_command = server_command
        self.server_extra_args = server_extra_args
        self.model_path = model_path
        self.gguf = gguf
        self.server_port = server_port
        self.server_ready_timeout_s = server_ready_timeout_s

    def _connection_endpoint(self) -> tuple[str | None, str]:
        if not self.conn_id:
            return None, ""
        from airflow.sdk import BaseHook
        from airflow.sdk.log import mask_secret

        conn = BaseHook.get_connection(self.conn_id)
        url, key = endpoint_from_connection(conn)
        if key:
            mask_secret(key)  # also masked by Airflow for connection passwords; explicit so it cannot regress
        return url, key

    def execute(self, context) -> dict:
        from eagle3.datagen import (DEFAULT_SERVER_COMMAND, ClientConfig, DatasetSpec, Endpoint, LocalServer,
                                    is_complete, run_dataset)
        from eagle3.errors import ConfigError

        if self.mode not in ("remote", "local"):
            raise ConfigError(f"mode={self.mode!r}: must be 'remote' or 'local'")
        spec = DatasetSpec.from_dict(self.dataset, where=f"dataset spec of task {self.task_id}")
        client = dict(self.client or {})
        if self.model:
            client["model"] = self.model
        cfg = ClientConfig.from_dict(client)
        if is_complete(spec, cfg, self.tokenizer_path, self.output_dir):
            report = run_dataset(spec, cfg, None, self.tokenizer_path, self.output_dir)  # verifies and skips
        elif self.mode == "remote":
            if not self.conn_id:
                raise ConfigError("mode='remote' needs conn_id: an Airflow Connection with the endpoint and API key")
            url, key = self._connection_endpoint()
            report = run_dataset(spec, cfg, Endpoint(url, key), self.tokenizer_path, self.output_dir)
        else:
            _, key = self._connection_endpoint()
            server = LocalServer(self.server_command or DEFAULT_SERVER_COMMAND, self.server_extra_args,
                                 model_path=self.model_path or self.tokenizer_path, gguf=self.gguf or "",
                                 port=self.server_port, ready_timeout_s=self.server_ready_timeout_s)
            with server:  # stops the server on success, failure and Airflow's SIGTERM on task kill
                report = run_dataset(spec, cfg, Endpoint(server.base_url, key or "EMPTY"), self.tokenizer_path,
                                     self.output_dir)
        return {
            "dataset": spec.name,
            "folder": f"{self.output_dir}/{spec.name}",
            "rows": report["rows"],
            "tokens": report["tokens"],
            "loss_tokens": report["loss_tokens"],
            "prompts": report["prompts"],
            "missing": report["missing"],
            "dropped": report["dropped"],
            "cost_usd": report["cost_usd"],
            "skipped": bool(report.get("skipped")),
        }
