"""The operators' shared behaviour: what reaches the task log, and how templated values arrive."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from eagle3_airflow.operators._render import rendered
from eagle3_airflow.operators.base import hf_output_to_task_log


def test_hf_output_goes_to_the_task_log_not_stderr(capfd, caplog):
    """Airflow logs a task's stderr as ERROR: after the operators' set-up, transformers' progress bar prints
    nothing and its warnings reach the root logger (the task log) as WARNING records."""
    from transformers.utils import logging as hf_logging

    hf_output_to_task_log()
    with caplog.at_level(logging.INFO):
        assert sum(hf_logging.tqdm(range(50), desc="Loading weights")) == 1225
        hf_logging.get_logger("transformers.modeling_utils").warning("a deprecation notice")
    out, err = capfd.readouterr()
    assert "Loading weights" not in out + err and "deprecation" not in err
    rec = [r for r in caplog.records if r.getMessage() == "a deprecation notice"]
    assert len(rec) == 1 and rec[0].levelno == logging.WARNING and rec[0].name == "transformers.modeling_utils"


class CountingSequence(Sequence):
    """A sequence that answers item and slice requests like Airflow's LazyXComSequence (IndexError past the end)
    and counts them, so the test sees how the operator read it."""

    def __init__(self, items):
        self.items, self.requests = list(items), []

    def __len__(self):
        return len(self.items)

    def __getitem__(self, key):
        self.requests.append(key)
        return self.items[key]


def test_mapped_results_are_read_in_one_request_without_a_probe_past_the_end():
    seq = CountingSequence([{"shard_dir": "a"}, {"shard_dir": "b"}])
    assert rendered(seq) == [{"shard_dir": "a"}, {"shard_dir": "b"}]
    assert seq.requests == [slice(None, None, None)]  # iterating would ask for index 2 (404, an ERROR line)
    # the DAG renders natively: a string stays a string (no literal_eval round trip)
    assert rendered("[2, 15, 27]") == "[2, 15, 27]" and rendered([1]) == [1] and rendered({"a": 1}) == {"a": 1}


def test_mlflow_hook_reads_the_tracking_uri_and_tests_it(monkeypatch, tmp_path):
    """The Connection's URI rules, credentials into MLflow's variables, the Test button against a real local
    store, and the train operator's config fields: from the Connection, or none when it does not exist."""
    import json

    from eagle3.errors import ConfigError
    from eagle3_airflow.hooks import MLflowTrackingHook
    from eagle3_airflow.operators.train import TrainDrafterOperator

    def conn(**c):
        monkeypatch.setenv("AIRFLOW_CONN_EAGLE3_MLFLOW", json.dumps({"conn_type": "mlflow", **c}))
        return MLflowTrackingHook().get_conn()

    assert conn(host="http://mlflow:5000") == {"tracking_uri": "http://mlflow:5000"}
    assert conn(host="mlflow", port=5000, schema="https")["tracking_uri"] == "https://mlflow:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    got = conn(host="h", login="u", password="pw-7c1e", extra={"experiment_name": "drafters"})
    assert got == {"tracking_uri": "http://h", "experiment": "drafters"}
    import os

    assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == ("u", "pw-7c1e")
    with pytest.raises(ConfigError, match="no host and no extra.tracking_uri"):
        conn(login="x")

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert conn(extra={"tracking_uri": uri}) == {"tracking_uri": uri}
    ok, message = MLflowTrackingHook().test_connection()
    assert ok and message.startswith(f"{uri} answered: experiments"), message
    conn(host="http://127.0.0.1:9", extra={})  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    ok, message = MLflowTrackingHook().test_connection()
    assert not ok and message, message

    op = TrainDrafterOperator(task_id="train", shard_dirs=["/s/0"], config={}, mlflow_conn_id="eagle3_mlflow")
    conn(extra={"tracking_uri": uri, "experiment_name": "drafters"})
    assert op.mapped_values() == {"shard_dirs": ["/s/0"], "mlflow_tracking_uri": uri, "mlflow_experiment": "drafters"}
    monkeypatch.delenv("AIRFLOW_CONN_EAGLE3_MLFLOW")
    assert op.mapped_values() == {"shard_dirs": ["/s/0"]}  # no Connection: TensorBoard only


def test_retry_policy_is_the_failure_class_s():
    """Failures no retry changes fail the task at once (AirflowFailException naming the kind); faults keep the
    task's retries (the exception passes unchanged). One table of it: docs/operations.md."""
    from airflow.sdk.exceptions import AirflowFailException

    from eagle3.datagen.run import EmptyDatasetError, FailureBudgetExceeded
    from eagle3.errors import ConfigError
    from eagle3.extract.memory import ExtractOOMError
    from eagle3.io import DiskFullError
    from eagle3.launch import RankFailed
    from eagle3.merge import BadInputError
    from eagle3.preflight import PreflightError
    from eagle3_airflow.operators.base import retry_policy

    def outcome(error: BaseException):
        try:
            with retry_policy("t"):
                raise error
        except AirflowFailException as e:
            assert e.__cause__ is error
            return str(e).rsplit("(", 1)[1]
        except BaseException as e:
            assert e is error
            return "retried"

    assert outcome(ConfigError("x")) == "a config error: not retried)"
    assert outcome(BadInputError("x")) == "bad input over its threshold: not retried)"
    assert outcome(PreflightError(["no GPU"], {})) == "a pre-check refusal: not retried)"
    assert outcome(ExtractOOMError("x", retried=False)) == "out of memory: not retried)"  # the memory pre-check
    assert outcome(EmptyDatasetError("x")) == "no usable sample: not retried)"
    assert outcome(DiskFullError("x")) == "a full disk: not retried)"
    assert outcome(FailureBudgetExceeded("x", ["401", "401"])) == "authentication refused: not retried)"
    assert outcome(FailureBudgetExceeded("x", ["403", "400"])) == "authentication refused: not retried)"
    assert outcome(FailureBudgetExceeded("x", ["404"])) == "requests the endpoint refuses: not retried)"
    for fault in (FailureBudgetExceeded("x", ["500"]), FailureBudgetExceeded("x", ["401", "timeout"]),
                  FailureBudgetExceeded("x", ["connection"]), FailureBudgetExceeded("x", ["429"]),
                  ExtractOOMError("x"), RankFailed(1, "killed", {1: "killed"}), TimeoutError(),
                  ConnectionResetError(), OSError("I/O error"), RuntimeError("CUDA error")):
        assert outcome(fault) == "retried", fault
