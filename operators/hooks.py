"""The endpoint of an OpenAI-compatible server from an Airflow Connection, as the OpenAI provider's hook reads it.

    AIRFLOW_CONN_EAGLE3_LLM='{"conn_type": "openai", "host": "https://openrouter.ai/api/v1", "password": "sk-..."}'

The base URL is `extra.base_url` (or the OpenAI provider's `extra.openai_client_kwargs.base_url`) if set, else
`host` when it is a full URL, else `http(s)://host[:port]/v1` (`schema` picks https). The API key is the
password; it is registered with Airflow's secret masker and eagle3's redaction before anything can print it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from airflow.sdk import BaseHook, Connection
from airflow.sdk.log import mask_secret

from eagle3.datagen.client import Endpoint
from eagle3.datagen.redact import redact, register_secret
from eagle3.errors import ConfigError


class OpenAICompatibleHook(BaseHook):
    """An OpenAI-compatible endpoint (OpenAI, OpenRouter, vLLM, SGLang, llama.cpp) from a Connection.

    :param conn_id: the Airflow Connection with the base URL and the API key (password)
    :param timeout_s: timeout of `test_connection`'s request
    """

    conn_name_attr = "conn_id"
    default_conn_name = "eagle3_llm"
    conn_type = "openai"
    hook_name = "OpenAI-compatible endpoint"

    def __init__(self, conn_id: str = default_conn_name, timeout_s: float = 10.0) -> None:
        super().__init__()
        self.conn_id = conn_id
        self.timeout_s = timeout_s

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {"hidden_fields": ["login"],
                "relabeling": {"host": "Base URL (or host)", "password": "API Key", "schema": "http or https"},
                "placeholders": {"host": "https://api.openai.com/v1", "extra": '{"base_url": "http://h:30000/v1"}'}}

    def get_conn(self) -> Endpoint:
        conn = self.get_connection(self.conn_id)
        return Endpoint(self._base_url(conn), self._key(conn))

    def api_key(self) -> str:
        """The key alone (a local server needs no URL from the Connection)."""
        return self._key(self.get_connection(self.conn_id))

    @staticmethod
    def _key(conn: Connection) -> str:
        if not conn.password:
            return "EMPTY"
        mask_secret(conn.password)
        register_secret(conn.password)
        return conn.password

    def _base_url(self, conn: Connection) -> str:
        extra = conn.extra_dejson or {}
        host = (conn.host or "").strip()
        url = extra.get("base_url") or (extra.get("openai_client_kwargs") or {}).get("base_url")
        if url:
            return url
        if host.startswith(("http://", "https://")):
            return host
        if host:
            scheme = conn.schema if conn.schema in ("http", "https") else "http"
            return f"{scheme}://{host}{f':{conn.port}' if conn.port else ''}/v1"
        raise ConfigError(f"connection {self.conn_id!r} has no host and no extra.base_url: set the endpoint's "
                          f"base URL")

    def test_connection(self) -> tuple[bool, str]:
        """GET {base_url}/models with the key: (True, the models served) or (False, why not)."""
        try:
            endpoint = self.get_conn()
            req = urllib.request.Request(endpoint.base_url + "/models")
            if endpoint.api_key != "EMPTY":
                req.add_header("Authorization", f"Bearer {endpoint.api_key}")
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                models = [m.get("id") for m in json.load(r).get("data", [])]
            return True, f"{endpoint.base_url}/models answered: {models}"
        except urllib.error.HTTPError as e:
            body = redact(e.read().decode(errors="replace"))[:300]  # redacted before the cut, as in the client
            return False, redact(f"HTTP {e.code} from {e.url}: {body}")
        except (OSError, ValueError) as e:
            return False, redact(f"{type(e).__name__}: {e}")
