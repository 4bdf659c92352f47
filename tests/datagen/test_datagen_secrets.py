"""No API key reaches disk, an exception or a log line; the endpoint comes from a Connection through the hook.

The endpoint is a real HTTP server that echoes the Authorization header in its 401 body (as some gateways do),
and base URLs carry `user:key@`.
"""

from __future__ import annotations

import json

import pytest

from dg_helpers import EchoAuthServer, assert_not_in_files, write_jsonl
from eagle3.datagen import ClientConfig, DatasetSpec, Endpoint, FailureBudgetExceeded, run_dataset
from eagle3.datagen.redact import redact, register_secret


def test_redact_masks_keys_bearer_authorization_and_url_userinfo():
    register_secret("sk-registered-123456")
    text = ("key sk-registered-123456 | Authorization: Bearer abc.DEF-123 | authorization=Basic dXNlcjpwYXNz | "
            "bearer tok_987 | https://user:pw-42@host:8000/v1 and http://only-token@h/v1")
    out = redact(text)
    for secret in ("sk-registered-123456", "abc.DEF-123", "dXNlcjpwYXNz", "tok_987", "pw-42", "only-token"):
        assert secret not in out
    assert out.startswith("key *** | Authorization: Bearer *** | authorization=Basic *** | bearer *** | ")
    assert "https://***@host:8000/v1" in out and "http://***@h/v1" in out
    assert redact("EMPTY answers stay") == "EMPTY answers stay"  # placeholders are not secrets


def test_endpoint_takes_the_key_out_of_the_url():
    ep = Endpoint("http://user:sk-in-url-0001@127.0.0.1:9/v1/")
    assert ep.base_url == "http://127.0.0.1:9/v1" and ep.api_key == "sk-in-url-0001"
    assert "sk-in-url" not in repr(ep)
    assert Endpoint("https://u:p-url-000002@h/v1", "sk-given-000003").api_key == "sk-given-000003"


def test_no_key_reaches_disk_exception_or_log(smollm2_path, smollm2_tokenizer, tmp_path, caplog):
    """A 401 that echoes the key, and a base URL with user:key@: errors.jsonl, report.json, the exception and the
    log lines carry no key (before: errors.jsonl held the echoed key and report.json the URL in full)."""
    key = "sk-url-key-7c1e9a44d2"
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Say hi."}, {"prompt": "Say yes."}])
    spec = DatasetSpec(name="S", prompt_file=str(f), max_tokens=4)
    out = tmp_path / "out"
    caplog.set_level("DEBUG")
    with EchoAuthServer(good_key="another-key") as srv:
        with pytest.raises(FailureBudgetExceeded) as err:
            run_dataset(spec, ClientConfig(model="m", concurrency=1, max_failed_fraction=0.0),
                        Endpoint(f"http://user:{key}@127.0.0.1:{srv.port}/v1"), smollm2_path, out,
                        tokenizer=smollm2_tokenizer)
    errors = [json.loads(x) for x in (out / "S" / "errors.jsonl").read_text().splitlines()]
    assert [e["reason"] for e in errors] == ["401"] and "Authorization: Bearer ***" in errors[0]["message"]
    report = json.loads((out / "S" / "report.json").read_text())
    assert report["endpoint"] == f"http://127.0.0.1:{srv.port}/v1"
    assert assert_not_in_files(out, key) >= 3
    assert key not in str(err.value) and key not in caplog.text


def test_hook_and_operator_keep_the_key_off_disk(smollm2_path, tmp_path, monkeypatch, caplog):
    """The operator in remote mode: endpoint and key from an AIRFLOW_CONN_ Connection (a host with user:key@ and a
    password); the echoed key is in no file, no log line and not in the task's failure."""
    from airflow.sdk.exceptions import AirflowFailException

    from eagle3_airflow.operators.datagen import DatagenOperator
    from eagle3_airflow.hooks import OpenAICompatibleHook

    key, url_key = "sk-conn-password-5b2d0e", "sk-conn-userinfo-93af11"
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Say hi."}])
    out = tmp_path / "out"
    caplog.set_level("DEBUG")
    with EchoAuthServer(good_key=key) as srv:
        monkeypatch.setenv("AIRFLOW_CONN_EAGLE3_ECHO", json.dumps({
            "conn_type": "openai", "host": f"http://user:{url_key}@127.0.0.1:{srv.port}/v1", "password": key}))
        hook = OpenAICompatibleHook("eagle3_echo")
        ep = hook.get_conn()
        assert (ep.base_url, ep.api_key) == (f"http://127.0.0.1:{srv.port}/v1", key)
        assert hook.test_connection() == (True, f"{ep.base_url}/models answered: ['echo-model']")
        monkeypatch.setenv("AIRFLOW_CONN_EAGLE3_ECHO_BAD", json.dumps({
            "conn_type": "openai", "host": f"http://127.0.0.1:{srv.port}/v1", "password": "sk-wrong-key-000042"}))
        ok, message = OpenAICompatibleHook("eagle3_echo_bad").test_connection()
        assert not ok and message.startswith("HTTP 401") and "sk-wrong-key" not in message
        op = DatagenOperator(task_id="datagen", dataset={"name": "H", "prompt_file": str(f), "max_tokens": 4},
                             config={"output_dir": str(out), "target": {"model_path": str(smollm2_path)}, "mode": "remote",
                                     "served_model_name": "echo-model", "conn_id": "eagle3_echo", "client": {"concurrency": 1, "max_retries": 0}})
        # the endpoint refuses the chat request: a 401 that echoes the key, so the failure budget blows, and the
        # task fails without the retries that would meet the same 401
        with pytest.raises(AirflowFailException, match=r"HTTP 401: the endpoint refuses the API key .*"
                                                       r"\(authentication refused: not retried\)") as err:
            op.execute({})
        assert isinstance(err.value.__cause__, FailureBudgetExceeded)
    assert "Bearer ***" in (out / "H" / "errors.jsonl").read_text()
    assert assert_not_in_files(out, key, url_key) >= 3
    assert key not in str(err.value) and key not in caplog.text and url_key not in caplog.text


def test_hook_base_url_rules(monkeypatch):
    from eagle3.errors import ConfigError
    from eagle3_airflow.hooks import OpenAICompatibleHook

    def endpoint(**conn) -> Endpoint:
        monkeypatch.setenv("AIRFLOW_CONN_EAGLE3_RULES", json.dumps({"conn_type": "openai", **conn}))
        return OpenAICompatibleHook("eagle3_rules").get_conn()

    ep = endpoint(host="https://openrouter.ai/api/v1", password="sk-rules-000001")
    assert (ep.base_url, ep.api_key) == ("https://openrouter.ai/api/v1", "sk-rules-000001")
    assert endpoint(host="10.0.0.5", port=30000, schema="http").base_url == "http://10.0.0.5:30000/v1"
    assert endpoint(extra={"base_url": "http://h:1/v1/"}).base_url == "http://h:1/v1"
    assert endpoint(extra={"openai_client_kwargs": {"base_url": "http://h:2/v1"}}).base_url == "http://h:2/v1"
    assert endpoint(host="h", password="").api_key == "EMPTY"
    with pytest.raises(ConfigError, match="no host and no extra.base_url"):
        endpoint(login="x")


def test_a_key_inside_a_200_answer_is_masked_in_the_stored_answers_and_counted(smollm2_path, smollm2_tokenizer,
                                                                               tmp_path):
    """An endpoint that answers with the request's key: generations.jsonl, tokenized.jsonl (its tokens too) and
    the report hold no key; the report counts the redactions."""
    key = "sk-answered-back-31d7c2"
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "What is my key?"}, {"prompt": "Repeat my key."}])
    spec = DatasetSpec(name="A", prompt_file=str(f), max_tokens=16)
    out = tmp_path / "out"
    with EchoAuthServer(good_key=key, answer_with_key=True) as srv:
        rep = run_dataset(spec, ClientConfig(model="m", concurrency=1), Endpoint(f"http://127.0.0.1:{srv.port}/v1", key),
                          smollm2_path, out, tokenizer=smollm2_tokenizer)
    assert rep["rows"] == 2 and rep["this_run"]["redacted_secrets"] == 4
    assert assert_not_in_files(out, key) >= 4
    rows = [json.loads(x) for x in (out / "A" / "tokenized.jsonl").read_text().splitlines()]
    text = smollm2_tokenizer.decode(rows[0]["input_ids"])
    assert "Your key is ***, twice: ***." in text and key not in text
