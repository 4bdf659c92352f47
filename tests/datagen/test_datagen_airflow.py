"""The operator inside a real Airflow run: one mapped task instance per dataset, via `dag.test()`.

Runs on the test SQLite metadata DB (tests/conftest.py sets it) with the task runner, so the
Connection lookup, secret masking and mapped expansion are Airflow's own, against the real server.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dg_helpers import write_jsonl

ROOT = Path(__file__).resolve().parents[2]

DAG_FILE = """
import json, os
from airflow.sdk import DAG
from eagle3_airflow.operators.datagen import DatagenOperator

cfg = json.loads(os.environ.get("DG_TEST_CONFIG", '{"out": "/tmp", "tokenizer": "/tmp", "datasets": []}'))
with DAG("datagen_mapped_test", schedule=None):
    DatagenOperator.partial(task_id="datagen", config={
        "output_dir": cfg["out"], "target": {"model_path": cfg["tokenizer"]}, "mode": "remote", "conn_id": "eagle3_dg_dag",
        "served_model_name": "smollm2", "client": {"concurrency": 2, "log_every_s": 1}}).expand(dataset=cfg["datasets"])
"""


@pytest.mark.slow
def test_mapped_datagen_in_a_dag_run(llama_server, smollm2_path, tmp_path, monkeypatch):
    from airflow.utils import db
    from airflow.utils.state import DagRunState, TaskInstanceState

    db.resetdb()
    key = "sk-dagtest-0a1b2c3d4e5f"
    monkeypatch.setenv("AIRFLOW_CONN_EAGLE3_DG_DAG",
                       json.dumps({"conn_type": "openai", "host": llama_server["url"], "password": key}))
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "Say hi."}, {"prompt": "Say yes."}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"conversations": [{"from": "human", "value": "Say no."}]}])
    out = tmp_path / "datagen"
    # dag.test() runs DAGs from a bundle: a one-file bundle with this test's DAG
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "datagen_mapped_test.py").write_text(DAG_FILE)
    monkeypatch.setenv("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", json.dumps([{
        "name": "datagen_test", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
        "kwargs": {"path": str(bundle), "refresh_interval": 0}}]))
    monkeypatch.setenv("DG_TEST_CONFIG", json.dumps({
        "out": str(out), "tokenizer": str(smollm2_path),
        "datasets": [{"name": "A", "prompt_file": str(a), "max_tokens": 8, "drop_truncated": False},
                     {"name": "B", "prompt_file": str(b), "max_tokens": 8, "drop_truncated": False}]}))
    monkeypatch.syspath_prepend(str(ROOT))
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(bundle))
    assert not bag.import_errors, bag.import_errors
    dag = bag.dags["datagen_mapped_test"]
    run = dag.test()
    assert run.state == DagRunState.SUCCESS
    tis = sorted(run.get_task_instances(), key=lambda ti: ti.map_index)
    assert [(ti.map_index, ti.state) for ti in tis] == [(0, TaskInstanceState.SUCCESS), (1, TaskInstanceState.SUCCESS)]
    for name, n in (("A", 2), ("B", 1)):
        man = json.loads((out / name / "manifest.json").read_text())
        assert man["complete"] and man["prompts"] == n and man["missing"] == 0
    for p in out.rglob("*"):
        if p.is_file():
            assert key.encode() not in p.read_bytes(), p
