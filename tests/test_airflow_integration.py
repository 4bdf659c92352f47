"""The DAG as users run it, against a real Airflow (Postgres metadata DB; LocalExecutor, then Celery + Redis).

Until the real extraction tasks are wired into dags/eagle3_drafter.py these tests drive
tests/dags/eagle3_shard_demo.py, which has the same shape (mapped shards on queue/pool "gpu",
chunk-level resume, a downstream reader). To point them at the real DAG, set EAGLE3_IT_DAGS_FOLDER,
EAGLE3_IT_DAG_ID and EAGLE3_IT_CONF (JSON) - see docs/operations.md.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from urllib.parse import urlencode
from datetime import datetime
from pathlib import Path

import pytest

from airflow_harness import AirflowCluster, ApiError, MetadataDB

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
DAGS = Path(os.environ.get("EAGLE3_IT_DAGS_FOLDER", ROOT / "tests" / "dags"))
DAG_ID = os.environ.get("EAGLE3_IT_DAG_ID", "eagle3_shard_demo")
EXTRA_CONF = json.loads(os.environ.get("EAGLE3_IT_CONF", "{}"))
SHARD_TASK = os.environ.get("EAGLE3_IT_SHARD_TASK", "extract")
ARTIFACTS = Path(os.environ.get("EAGLE3_TEST_ARTIFACTS", ROOT / "artifacts" / "tests"))


def when(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def shard_manifests(run_dir: Path) -> dict[int, dict]:
    return {int(p.name.split("-")[1]): json.loads((p / "manifest.json").read_text())
            for p in sorted((run_dir / "extract").glob("shard-*")) if (p / "manifest.json").is_file()}


@pytest.fixture(scope="session")
def metadata_db(tmp_path_factory):
    db = MetadataDB.create(tmp_path_factory.mktemp("airflow-migrate"))
    yield db
    db.drop()


@pytest.fixture(scope="module")
def local_airflow(metadata_db, tmp_path_factory):
    work = tmp_path_factory.mktemp("af-local")
    fault_once = work / "fault-fired"
    db = metadata_db.clone()
    cluster = AirflowCluster(db, work, executor="LocalExecutor", dags_folder=DAGS, pools={"gpu": 2},
                             extra_env={"EAGLE3_INJECT_FAULT": f"shard=1,after_chunks=2,once_file={fault_once}",
                                        "EAGLE3_SHARD_RETRIES": "0",
                                        # the DAG's default output_root, used by the run triggered from the UI form
                                        "EAGLE3_OUTPUT_ROOT": str(work / "ui-runs")})
    try:
        with cluster:
            cluster.fault_once = fault_once
            yield cluster
    finally:
        db.drop()
    for name in cluster.procs:
        (ARTIFACTS / "airflow-local").mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "airflow-local" / f"{name}.log").write_text(cluster.tail(name, 200_000))


def test_bad_param_is_rejected_at_trigger_time(local_airflow):
    api = local_airflow.client()
    api.wait_dag(DAG_ID)
    with pytest.raises(ApiError) as e:
        api.trigger(DAG_ID, conf={**EXTRA_CONF, "shards": 0})
    assert e.value.status_code == 400
    assert "0 is less than the minimum of 1" in e.value.body
    with pytest.raises(ApiError, match="does not match"):
        api.trigger(DAG_ID, conf={**EXTRA_CONF, "run_name": "../escape"})


def test_failed_shard_is_cleared_alone_and_resumes(local_airflow, tmp_path):
    api = local_airflow.client()
    api.wait_dag(DAG_ID)
    api.unpause(DAG_ID)
    conf = {**EXTRA_CONF, "output_root": str(tmp_path), "run_name": "local", "shards": 3, "rows": 18,
            "samples_per_chunk": 2, "chunk_seconds": 0.2}
    run_id = api.trigger(DAG_ID, conf=conf)["dag_run_id"]

    # shard 1 fails after 2 committed chunks (this cluster runs shards without retries, so it stays failed)
    failed = api.wait_task(DAG_ID, run_id, SHARD_TASK, 1, states=("failed",), timeout=120)
    assert failed["try_number"] == 1 and local_airflow.fault_once.exists()
    run = api.wait_run(DAG_ID, run_id, states=("failed",), timeout=120)
    states = api.task_states(DAG_ID, run_id)
    assert states[(SHARD_TASK, 0)] == states[(SHARD_TASK, 2)] == "success"
    assert states[("verify", -1)] == "upstream_failed"
    m = shard_manifests(tmp_path / "local")[1]
    assert len(m["chunks"]) == 2 and not m["complete"]

    api.clear_map_index(DAG_ID, run_id, SHARD_TASK, 1)
    run = api.wait_run(DAG_ID, run_id, timeout=150)
    assert run["state"] == "success", local_airflow.all_logs()

    tis = {(t["task_id"], t["map_index"]): t for t in api.task_instances(DAG_ID, run_id)}
    assert all(t["state"] == "success" for t in tis.values())
    # the other shards did not re-run; shard 1 ran again and resumed after its 2 committed chunks
    assert tis[(SHARD_TASK, 0)]["try_number"] == tis[(SHARD_TASK, 2)]["try_number"] == 1
    manifests = shard_manifests(tmp_path / "local")
    assert [len(m["params"]["attempts"]) for m in manifests.values()] == [1, len(manifests[1]["params"]["attempts"]), 1]
    assert manifests[1]["params"]["attempts"][-1]["resumed_chunks"] == 2
    assert all(m["complete"] for m in manifests.values())
    summary = api.xcom(DAG_ID, run_id, "verify")
    summary = json.loads(summary) if isinstance(summary, str) else summary
    assert summary["samples"] == 18 and summary["shards"] == 3
    local_airflow.finished_run = run_id

    # the plugin page, served by the running api-server, shows the three shards from their manifests
    page = api.session.get(f"{api.base_url}/eagle3/shards", params={"dag_id": DAG_ID, "run_id": run_id}, timeout=30)
    assert page.status_code == 200, page.text
    assert "3 shards: 3 complete, 0 in progress, 0 not" in page.text
    assert page.text.count("<tr class='complete'") == 3 and str(tmp_path / "local" / "extract") in page.text
    data = api.get("/eagle3/api/shards", dag_id=DAG_ID, run_id=run_id)
    assert [(s["shard"], s["chunks"], s["airflow"]["try_number"]) for s in data["shards"]] == [(0, 3, 1), (1, 3, 2), (2, 3, 1)]
    assert data["totals"]["tokens"] == sum(m["tokens"] for m in manifests.values())
    index = api.session.get(f"{api.base_url}/eagle3/", timeout=30)
    assert index.status_code == 200 and run_id in index.text  # Browse > EAGLE-3 runs lists the run
    import requests

    assert requests.get(page.url, timeout=30).status_code in (401, 403)  # no login, no page


CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser():
    if not CHROMEDRIVER or not (shutil.which("chromium") or shutil.which("chromium-browser")):
        pytest.fail("chromium/chromedriver missing: run `bash scripts/setup.sh test` (installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1000"):
        opts.add_argument(a)
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


def wait_for(driver, css: str, timeout: float = 40, visible_text: str | None = None):
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        els = [e for e in driver.find_elements(By.CSS_SELECTOR, css) if e.is_displayed()]
        if visible_text is not None:
            els = [e for e in els if visible_text in e.text]
        if els:
            return els[0]
        time.sleep(0.3)
    raise TimeoutError(f"{css!r} ({visible_text!r}) not shown on {driver.current_url}")


def test_browser_login_trigger_form_and_plugin_page(local_airflow, browser, tmp_path):
    """Headless Chromium (Debian chromium + chromium-driver via selenium; scripts/setup.sh installs them for
    the test path, the test installs nothing): log in, open the trigger form, open the plugin page of a run.
    Screenshots: artifacts/tests/browser/."""
    from selenium.webdriver.common.by import By

    out = ARTIFACTS / "browser"
    out.mkdir(parents=True, exist_ok=True)
    api = local_airflow.client()
    api.wait_dag(DAG_ID)
    run_id = getattr(local_airflow, "finished_run", None)  # the backfill test's run, when it ran first
    if run_id is None:
        api.unpause(DAG_ID)
        run_id = api.trigger(DAG_ID, conf={**EXTRA_CONF, "output_root": str(tmp_path), "run_name": "ui",
                                           "shards": 3, "rows": 9, "chunk_seconds": 0})["dag_run_id"]
        assert api.wait_run(DAG_ID, run_id, timeout=120)["state"] == "success"
    base = local_airflow.base_url

    # log in through the Simple auth manager's form
    browser.get(base + "/")
    wait_for(browser, "input[type=password]")
    browser.save_screenshot(str(out / "01-login.png"))
    user = browser.find_elements(By.CSS_SELECTOR, "input:not([type=password])")[0]
    user.send_keys("admin")
    browser.find_element(By.CSS_SELECTOR, "input[type=password]").send_keys("admin")
    browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    deadline = time.monotonic() + 40
    while "/auth/" in browser.current_url and time.monotonic() < deadline:
        time.sleep(0.3)
    assert "/auth/" not in browser.current_url, "login did not leave the login page"
    assert browser.get_cookie("_token"), "no session cookie after login"

    # the DAG page and its trigger form (built from the DAG's params)
    browser.get(f"{base}/dags/{DAG_ID}")
    wait_for(browser, "button", visible_text="Trigger").click()
    dialog = wait_for(browser, "[role=dialog]", visible_text="shards")
    time.sleep(1)
    browser.save_screenshot(str(out / "02-trigger-form.png"))
    for name in ("output_root", "run_name", "shards", "chunk_seconds", "Number of extraction shards."):
        assert name in dialog.text, name
    # submit the form with its defaults: a run must start, with the DAG's default params
    before = {r["dag_run_id"] for r in api.get(f"/api/v2/dags/{DAG_ID}/dagRuns")["dag_runs"]}
    submit = [b for b in dialog.find_elements(By.CSS_SELECTOR, "button") if b.text.strip() == "Trigger"][-1]
    assert submit.is_enabled(), "the trigger form reports invalid defaults"
    browser.execute_script("arguments[0].scrollIntoView();", submit)
    submit.click()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        new = [r for r in api.get(f"/api/v2/dags/{DAG_ID}/dagRuns")["dag_runs"] if r["dag_run_id"] not in before]
        if new:
            break
        time.sleep(0.5)
    assert new and new[0]["conf"].get("shards", 3) == 3, new
    browser.save_screenshot(str(out / "02b-after-trigger.png"))

    # the plugin's shard view inside the UI (run page entry), then the page itself
    q = urlencode({"dag_id": DAG_ID, "run_id": run_id})
    browser.get(f"{base}/dags/{DAG_ID}/runs/{run_id}/plugin/eagle3-shards")
    time.sleep(4)
    browser.save_screenshot(str(out / "03-run-plugin-tab.png"))
    browser.get(f"{base}/eagle3/shards?{q}")
    table = wait_for(browser, "#shards")
    browser.save_screenshot(str(out / "04-plugin-shards.png"))
    assert "3 shards: 3 complete" in browser.find_element(By.ID, "totals").text
    assert len(table.find_elements(By.CSS_SELECTOR, "tr.complete")) == 3
    assert all((out / f).stat().st_size > 5000 for f in
               ("01-login.png", "02-trigger-form.png", "03-run-plugin-tab.png", "04-plugin-shards.png"))


@pytest.fixture(scope="module")
def celery_airflow(metadata_db, tmp_path_factory):
    work = tmp_path_factory.mktemp("af-celery")
    db = metadata_db.clone()
    cluster = AirflowCluster(db, work, executor="CeleryExecutor", dags_folder=DAGS, pools={"gpu": 2},
                             extra_env={"EAGLE3_SHARD_RETRIES": "2"})
    try:
        with cluster:
            cluster.start_worker("default-worker", queues="default", concurrency=2)
            cluster.start_worker("gpu-worker", queues="gpu", concurrency=2, extra_env=GPU_WORKER_ENV)
            yield cluster
            (ARTIFACTS / "airflow-celery").mkdir(parents=True, exist_ok=True)
            for name in cluster.procs:
                (ARTIFACTS / "airflow-celery" / f"{name}.log").write_text(cluster.tail(name, 200_000))
    finally:
        db.drop()


GPU_WORKER_ENV = {"EAGLE3_PIN_GPUS": "1", "EAGLE3_GPUS": "0,1"}  # no GPU here: pinning is checked by the env it sets


def test_celery_gpu_queue_concurrency_and_worker_kill(celery_airflow, tmp_path):
    af = celery_airflow
    api = af.client()
    api.wait_dag(DAG_ID)
    api.unpause(DAG_ID)
    conf = {**EXTRA_CONF, "output_root": str(tmp_path), "run_name": "celery", "shards": 4, "rows": 32,
            "samples_per_chunk": 2, "chunk_seconds": 1.0}
    run_id = api.trigger(DAG_ID, conf=conf)["dag_run_id"]
    extract_dir = tmp_path / "celery" / "extract"

    # wait until a shard has committed a chunk but is not finished, then take the gpu worker down hard
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ms = shard_manifests(tmp_path / "celery") if extract_dir.is_dir() else {}
        busy = {i: len(m["chunks"]) for i, m in ms.items() if m["chunks"] and not m["complete"]}
        if busy:
            break
        time.sleep(0.3)
    else:
        pytest.fail("no shard started on the gpu worker\n" + af.all_logs())
    af.kill_worker("gpu-worker")
    # shards cut mid-way: started (manifest stamped) but not complete when the worker died
    at_kill = {i: len(m["chunks"]) for i, m in shard_manifests(tmp_path / "celery").items() if not m["complete"]}
    assert any(at_kill.values()), at_kill
    time.sleep(3)
    # nothing of the dead worker writes on: the cut shards did not move while no gpu worker was up
    after = {i: len(m["chunks"]) for i, m in shard_manifests(tmp_path / "celery").items() if i in at_kill}
    assert after == at_kill, (at_kill, after)
    af.start_worker("gpu-worker", queues="gpu", concurrency=2, extra_env=GPU_WORKER_ENV)

    run = api.wait_run(DAG_ID, run_id, timeout=240)
    assert run["state"] == "success", af.all_logs()

    tis = api.task_instances(DAG_ID, run_id)
    shards = [t for t in tis if t["task_id"] == SHARD_TASK]
    assert len(shards) == 4
    # shards ran only on the gpu worker, through the gpu queue and pool; the rest on the default worker
    assert {(t["queue"], t["pool"], t["hostname"]) for t in shards} == {("gpu", "gpu", "gpu-worker")}
    assert {(t["queue"], t["hostname"]) for t in tis if t["task_id"] != SHARD_TASK} == {("default", "default-worker")}

    manifests = shard_manifests(tmp_path / "celery")
    attempts = [a for m in manifests.values() for a in m["params"]["attempts"]]
    assert {a["host"] for a in attempts} == {"gpu-worker"}
    # each celery child holds one GPU: every task saw exactly one of the worker's two
    assert {a["cuda_visible_devices"] for a in attempts} <= {"0", "1"}

    # two shards ran at the same time (overlapping start/end of their final tries) on different GPUs
    spans = sorted((when(t["start_date"]), when(t["end_date"]), t["map_index"]) for t in shards)
    overlapping = [(a[2], b[2]) for i, a in enumerate(spans) for b in spans[i + 1:] if b[0] < a[1]]
    assert overlapping, spans
    gpu_of = {i: m["params"]["attempts"][-1]["cuda_visible_devices"] for i, m in manifests.items()}
    assert all(gpu_of[a] != gpu_of[b] for a, b in overlapping), (overlapping, gpu_of)

    # the shards cut by the kill were failed by the heartbeat timeout, retried on the restarted worker,
    # and resumed after the chunks they had committed
    try_of = {t["map_index"]: t["try_number"] for t in shards}
    for i, committed in at_kill.items():
        attempts_i = manifests[i]["params"]["attempts"]
        assert try_of[i] >= 2 and len(attempts_i) >= 2, (i, try_of, attempts_i)
        assert attempts_i[-1]["resumed_chunks"] >= committed, (i, committed, attempts_i)
    # nothing lost or duplicated: each shard holds exactly its planned rows once (verify also checked values)
    for i, m in manifests.items():
        assert m["complete"] and len(m["chunks"]) == 4
        rows = [r for c in m["chunks"] for r in range(c["first_row"], c["last_row"] + 1)]
        assert rows == list(range(8 * i, 8 * i + 8))
    summary = api.xcom(DAG_ID, run_id, "verify")
    summary = json.loads(summary) if isinstance(summary, str) else summary
    assert summary["samples"] == 32
