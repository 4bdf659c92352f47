"""The provider's hooks: each owns one Airflow Connection type, its fields in the Connections form and its Test button.

    openai       OpenAICompatibleHook  an OpenAI-compatible server (datagen's endpoint)
    mlflow       MLflowTrackingHook    an MLflow tracking server (the train task's metrics)
    airflow_api  AirflowApiHook        this Airflow's REST API (preflight's pool check)

    AIRFLOW_CONN_EAGLE3_LLM='{"conn_type": "openai", "host": "https://openrouter.ai/api/v1", "password": "sk-..."}'

The OpenAI-compatible endpoint is read as the OpenAI provider's hook reads it: the base URL is `extra.base_url`
(or the OpenAI provider's `extra.openai_client_kwargs.base_url`) if set, else `host` when it is a full URL, else
`http(s)://host[:port]/v1` (`schema` picks https). The API key is the password; it is registered with Airflow's
secret masker and eagle3's redaction before anything can print it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import requests

from airflow.sdk import BaseHook, Connection
from airflow.sdk.log import mask_secret

from eagle3.datagen.client import Endpoint
from eagle3.datagen.redact import redact, register_secret
from eagle3.errors import ConfigError


def _http_url(conn: Connection) -> str:
    """The URL of a Connection given as host (+ port, + schema http/https)."""
    scheme = conn.schema if conn.schema in ("http", "https") else "http"
    return f"{scheme}://{conn.host.strip()}{f':{conn.port}' if conn.port else ''}"


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
            return _http_url(conn) + "/v1"
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


class MLflowTrackingHook(BaseHook):
    """An MLflow tracking server (or store) from a Connection; the training task logs its metrics there.

        AIRFLOW_CONN_EAGLE3_MLFLOW='{"conn_type": "mlflow", "host": "http://mlflow:5000",
                                     "extra": {"experiment_name": "drafters"}}'

    The tracking URI is `extra.tracking_uri` if set (any MLflow URI: sqlite:///..., databricks), else `host`
    when it is a full URL, else `http(s)://host[:port]` (`schema` picks https). Login/password become MLflow's
    basic-auth variables, `extra.token` its bearer token; all are masked in logs.

    :param conn_id: the Airflow Connection of the tracking server
    """

    conn_name_attr = "conn_id"
    default_conn_name = "eagle3_mlflow"
    conn_type = "mlflow"
    hook_name = "MLflow tracking server"

    def __init__(self, conn_id: str = default_conn_name) -> None:
        super().__init__()
        self.conn_id = conn_id

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {"hidden_fields": [],
                "relabeling": {"host": "Tracking URI (or host)", "schema": "http or https"},
                "placeholders": {"host": "http://mlflow:5000",
                                 "extra": '{"tracking_uri": "sqlite:////data/mlflow.db", "experiment_name": "eagle3"}'}}

    def get_conn(self) -> dict[str, str]:
        """{"tracking_uri", "experiment"} with the credentials put where MLflow's client reads them."""
        import os

        conn = self.get_connection(self.conn_id)
        extra = conn.extra_dejson or {}
        for env, value in (("MLFLOW_TRACKING_USERNAME", conn.login), ("MLFLOW_TRACKING_PASSWORD", conn.password),
                           ("MLFLOW_TRACKING_TOKEN", extra.get("token"))):
            if value:
                if env != "MLFLOW_TRACKING_USERNAME":
                    mask_secret(value)
                os.environ[env] = value
        out = {"tracking_uri": self._uri(conn, extra)}
        if extra.get("experiment_name"):
            out["experiment"] = str(extra["experiment_name"])
        return out

    def _uri(self, conn: Connection, extra: dict) -> str:
        host = (conn.host or "").strip()
        if extra.get("tracking_uri"):
            return str(extra["tracking_uri"])
        if "://" in host:
            return host
        if host:
            return _http_url(conn)
        raise ConfigError(f"connection {self.conn_id!r} has no host and no extra.tracking_uri: set the MLflow "
                          f"tracking URI")

    def test_connection(self) -> tuple[bool, str]:
        """List one experiment: (True, what answered) or (False, why not)."""
        try:
            from mlflow import MlflowClient
        except ImportError:
            return False, "mlflow is not installed where this runs: pip install 'eagle3-pipeline[mlflow]'"
        try:
            uri = self.get_conn()["tracking_uri"]
            found = MlflowClient(tracking_uri=uri).search_experiments(max_results=5)
            return True, f"{uri} answered: experiments {[e.name for e in found]}"
        except Exception as e:  # noqa: BLE001 - the UI's Test button shows any failure as text
            return False, f"{type(e).__name__}: {e}"


class AirflowApiHook(BaseHook):
    """This Airflow's REST API, logged in as the Connection's user (preflight reads the pools through it: task code
    cannot read the metadata DB in Airflow 3).

        AIRFLOW_CONN_EAGLE3_AIRFLOW_API='{"conn_type": "airflow_api", "host": "http://api-server:8080",
                                          "login": "admin", "password": "..."}'

    The base URL is `host` when it is a full URL, else `http(s)://host[:port]` (`schema` picks https). A
    Connection of another type (e.g. "http") with the same fields works too.

    :param conn_id: the Airflow Connection of the API server
    :param timeout_s: timeout of each request
    """

    conn_name_attr = "conn_id"
    default_conn_name = "eagle3_airflow_api"
    conn_type = "airflow_api"
    hook_name = "Airflow REST API"

    def __init__(self, conn_id: str = default_conn_name, timeout_s: float = 15.0) -> None:
        super().__init__()
        self.conn_id = conn_id
        self.timeout_s = timeout_s
        self.base_url: str | None = None  # known once get_conn has read the Connection
        self._session: requests.Session | None = None

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {"hidden_fields": ["extra"],
                "relabeling": {"host": "API base URL (or host)", "schema": "http or https"},
                "placeholders": {"host": "http://localhost:8080", "login": "admin"}}

    def get_conn(self) -> requests.Session:
        """A session with a bearer token from `POST {base_url}/auth/token` (the Connection's login and password)."""
        if self._session is None:
            conn = self.get_connection(self.conn_id)
            host = (conn.host or "").strip().rstrip("/")
            if not host:
                raise ConfigError(f"connection {self.conn_id!r} has no host: set the API's base URL")
            self.base_url = host if host.startswith(("http://", "https://")) else _http_url(conn)
            if conn.password:
                mask_secret(conn.password)
            r = requests.post(f"{self.base_url}/auth/token", json={"username": conn.login, "password": conn.password},
                              timeout=self.timeout_s)
            r.raise_for_status()
            session = requests.Session()
            session.headers["Authorization"] = f"Bearer {r.json()['access_token']}"
            self._session = session
        return self._session

    def get_json(self, path: str, **params: Any) -> Any:
        """GET {base_url}{path} (e.g. "/api/v2/pools") with the token; the decoded JSON body."""
        session = self.get_conn()
        r = session.get(f"{self.base_url}{path}", params=params, timeout=self.timeout_s)
        r.raise_for_status()
        return r.json()

    def patch_json(self, path: str, body: dict, **params: Any) -> Any:
        """PATCH {base_url}{path} with a JSON body (e.g. a run's note); the decoded JSON answer."""
        session = self.get_conn()
        r = session.patch(f"{self.base_url}{path}", json=body, params=params, timeout=self.timeout_s)
        r.raise_for_status()
        return r.json()

    def test_connection(self) -> tuple[bool, str]:
        """Log in and read the API's version: (True, what answered) or (False, why not)."""
        try:
            version = self.get_json("/api/v2/version").get("version")
            return True, f"{self.base_url} answered: Airflow {version}"
        except (requests.RequestException, KeyError, ValueError) as e:
            return False, f"{type(e).__name__}: {e}"[:300]
