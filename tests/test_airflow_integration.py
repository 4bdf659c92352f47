"""The DAG as users run it, against a real Airflow (Postgres metadata DB; LocalExecutor, then Celery + Redis).

The LocalExecutor tests run the real eagle3_drafter DAG end to end on the real SmolLM2 (datagen through
llama.cpp's server, merge, extraction shards, training, evaluation) at toy sizes. The Celery drill kills a
GPU worker mid-shard, which needs shards that take seconds: it drives tests/dags/eagle3_shard_demo.py, the
extraction part in miniature (same queue/pool, chunk format, committed-chunk resume and reader).
"""

from __future__ import annotations

import json
import os
import time
from urllib.parse import urlencode
from datetime import datetime
from pathlib import Path

import pytest

from airflow_client import ApiError
from airflow_harness import AirflowCluster, MetadataDB
from browser import chromium, log_in, wait_for
from eagle3.config import form_params

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
DAGS = ROOT / "dags"
DAG_ID = "eagle3_drafter"
DEMO_DAGS = ROOT / "tests" / "dags"  # the Celery drill's miniature
DEMO_DAG_ID = "eagle3_shard_demo"
SHARD_TASK = "extract"
ARTIFACTS = Path(os.environ.get("EAGLE3_TEST_ARTIFACTS", ROOT / "artifacts" / "tests"))


def when(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def real_conf(root: Path, run_name: str) -> dict:
    """The real DAG at toy sizes: 2 datasets x 6 prompts, 2 shards of > 256 tokens (>= 2 chunks), a few training steps."""
    from eagle3.models import ensure_smollm2, find_smollm2_gguf

    eval_prompts = root / "eval.jsonl"
    root.mkdir(parents=True, exist_ok=True)
    eval_prompts.write_text(json.dumps({"prompt": "Name a color."}) + "\n")
    datasets = [{"name": n, "prompt_file": str(ROOT / f"data/demo/{n}.jsonl"), "max_tokens": 40, "limit": 6,
                 "drop_truncated": False} for n in ("A1", "B1")]
    return {
        "model_path": str(ensure_smollm2()), "output_root": str(root), "run_name": run_name, "allow_cpu": True,
        "datasets": datasets, "datagen_mode": "local", "gguf": str(find_smollm2_gguf()),
        "server_command": "llama.cpp",  # a named server: free-form commands are off by default
        "served_model_name": "smollm2", "datagen_client": {"concurrency": 2},
        # 0.3 MiB = 34 fp32 tokens, so each forward batch (<= 256 tokens) is its own chunk: >= 2 chunks a shard
        "num_shards": 2, "chunk_mb": 0.3, "token_budget": 256,
        "max_steps": 2, "batch_size": 2, "ttt_steps": 2, "train_overrides": {"checkpoint_every": 1},
        "eval_prompts": str(eval_prompts), "eval_ks": [2], "eval_max_new_tokens": 8,
    }


def error_lines(api, run_id: str, ti: dict) -> list[str]:
    """The ERROR-level lines of a task instance's log (its last try), from the REST API as the UI reads them."""
    log = api.get(f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{ti['task_id']}/logs/{ti['try_number']}",
                  map_index=ti["map_index"])
    return [str(e.get("event"))[:300] for e in log["content"] if isinstance(e, dict) and
            str(e.get("level", "")).lower() in ("error", "critical")]


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
                             extra_env={"EAGLE3_INJECT_FAULT": f"shard=1,after_chunks=1,once_file={fault_once}",
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
        api.trigger(DAG_ID, conf={"num_shards": 0})
    assert e.value.status_code == 400
    assert "0 is less than the minimum of 1" in e.value.body
    with pytest.raises(ApiError, match="does not match"):
        api.trigger(DAG_ID, conf={"run_name": "../escape"})
    with pytest.raises(ApiError, match="prompt_file"):
        api.trigger(DAG_ID, conf={"datasets": [{"name": "A1"}]})


def test_failed_shard_is_cleared_alone_and_resumes(local_airflow, tmp_path):
    """A shard fails (injected fault, as a GPU fault would), the user clears only that map index through the
    REST API, it resumes from its committed chunk, training and evaluation follow, no other shard re-runs."""
    api = local_airflow.client()
    api.wait_dag(DAG_ID)
    api.unpause(DAG_ID)
    run_dir = tmp_path / "local"
    run_id = api.trigger(DAG_ID, conf=real_conf(tmp_path, "local"))["dag_run_id"]

    # shard 1 fails after 1 committed chunk (this cluster runs shards without retries, so it stays failed)
    failed = api.wait_task(DAG_ID, run_id, SHARD_TASK, 1, states=("failed",), timeout=420)
    assert failed["try_number"] == 1 and local_airflow.fault_once.exists()
    api.wait_run(DAG_ID, run_id, states=("failed",), timeout=180)
    states = api.task_states(DAG_ID, run_id)
    assert states[(SHARD_TASK, 0)] == "success"
    assert states[("train", -1)] == states[("evaluate", -1)] == "upstream_failed"
    m = shard_manifests(run_dir)[1]
    assert len(m["chunks"]) == 1 and not m["complete"]
    # the shard view shows it failed, on try 1, with the error's first line and no (stale) rate
    s1 = api.get("/eagle3/api/shards", dag_id=DAG_ID, run_id=run_id)["shards"][1]
    assert (s1["state"], s1["failed_try"], s1["tokens_per_s"], s1["chunks"]) == ("failed", 1, None, 1), s1
    assert s1["error"] == "InjectedFault: injected fault (EAGLE3_INJECT_FAULT): shard 1 after 1 committed chunks"
    page = api.session.get(f"{api.base_url}/eagle3/shards", params={"dag_id": DAG_ID, "run_id": run_id}, timeout=30)
    assert "<tr class='failed' data-shard='1'>" in page.text and "try 1: InjectedFault" in page.text
    assert "2 shards: 1 complete, 0 in progress, 0 not started, 1 failed" in " ".join(page.text.split())

    api.clear_map_index(DAG_ID, run_id, SHARD_TASK, 1)
    run = api.wait_run(DAG_ID, run_id, timeout=420)
    assert run["state"] == "success", local_airflow.all_logs()

    tis = {(t["task_id"], t["map_index"]): t for t in api.task_instances(DAG_ID, run_id)}
    assert all(t["state"] == "success" for t in tis.values()), {k: t["state"] for k, t in tis.items()}
    # only shard 1 ran twice; training and evaluation (upstream_failed until the clear) ran once, after it
    assert {k for k, t in tis.items() if t["try_number"] > 1} == {(SHARD_TASK, 1)}
    assert when(tis[("train", -1)]["start_date"]) > when(tis[(SHARD_TASK, 1)]["end_date"])
    shard1 = api.xcom(DAG_ID, run_id, SHARD_TASK, map_index=1)
    assert shard1["resumed_from_chunk"] == 1 and shard1["chunks"] >= 2  # chunk 0 kept, the rest written now
    manifests = shard_manifests(run_dir)
    assert sorted(manifests) == [0, 1] and all(m["complete"] for m in manifests.values())
    from eagle3.extract.reader import HiddenStateReader
    from eagle3.merge import read_merged

    reader = HiddenStateReader([run_dir / "extract" / f"shard-{i:05d}" for i in range(2)], verify=True)
    merged = json.loads((run_dir / "merge" / "manifest.json").read_text())
    assert reader.num_samples == merged["rows"] and reader.num_tokens == merged["tokens"]
    assert sorted(s.row for s in reader) == list(range(merged["rows"]))  # every row once, none lost or doubled
    evaluation = api.xcom(DAG_ID, run_id, "evaluate")
    assert evaluation["identical_to_greedy"] is True and evaluation["tau"]["2"] >= 1.0
    assert (run_dir / "train" / "export" / "config.json").is_file()
    local_airflow.finished_run = run_id

    # the exported drafter as an Airflow Asset: the train task's success recorded one event, the export in its extra
    events = api.get("/api/v2/assets/events", source_dag_id=DAG_ID, source_run_id=run_id)["asset_events"]
    assert [(e["name"], e["uri"], e["source_task_id"]) for e in events] == [("eagle3_drafter", "x-eagle3://drafter",
                                                                             "train")]
    assert events[0]["extra"]["export_dir"] == str(run_dir / "train" / "export")
    assert events[0]["extra"]["run_id"] == run_id and events[0]["extra"]["steps"] == 2
    assert when(events[0]["timestamp"]) >= when(tis[("train", -1)]["start_date"])
    # clean logs: no ERROR line in the final try of any successful task (progress bars, transformers' notices and
    # XCom probes used to make some)
    errors = {key: lines for key, t in tis.items() if (lines := error_lines(api, run_id, t))}
    assert not errors, errors

    # the plugin page, served by the running api-server, shows both shards from their manifests
    page = api.session.get(f"{api.base_url}/eagle3/shards", params={"dag_id": DAG_ID, "run_id": run_id}, timeout=30)
    assert page.status_code == 200, page.text
    assert "2 shards: 2 complete, 0 in progress, 0 not started, 0 failed" in " ".join(page.text.split())
    assert page.text.count("<tr class='complete'") == 2 and str(run_dir / "extract") in page.text
    data = api.get("/eagle3/api/shards", dag_id=DAG_ID, run_id=run_id)
    assert [(s["shard"], s["chunks"]) for s in data["shards"]] == [(i, len(manifests[i]["chunks"])) for i in range(2)]
    assert [s["airflow"]["try_number"] for s in data["shards"]] == [1, 2]
    assert data["totals"]["tokens"] == sum(m["tokens"] for m in manifests.values())
    index = api.session.get(f"{api.base_url}/eagle3/", timeout=30)
    assert index.status_code == 200 and run_id in index.text  # Browse > EAGLE-3 runs lists the run
    import requests

    assert requests.get(page.url, timeout=30).status_code in (401, 403)  # no login, no page


@pytest.fixture
def browser():
    driver = chromium()
    yield driver
    driver.quit()


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
        local_airflow.fault_once.touch()  # no injected failure in this run
        run_id = api.trigger(DAG_ID, conf=real_conf(tmp_path, "ui"))["dag_run_id"]
        assert api.wait_run(DAG_ID, run_id, timeout=600)["state"] == "success"
    base = local_airflow.base_url

    # log in through the Simple auth manager's form
    browser.get(base + "/")
    wait_for(browser, "input[type=password]")
    browser.save_screenshot(str(out / "01-login.png"))
    log_in(browser, base, "admin", "admin")

    # the DAG page and its trigger form (built from the DAG's params)
    browser.get(f"{base}/dags/{DAG_ID}")
    wait_for(browser, "button", visible_text="Trigger").click()
    dialog = wait_for(browser, "[role=dialog]", visible_text="Extraction")
    time.sleep(1)
    # the params are grouped in sections (accordions, one open at a time): check two of them
    for section, names in (("Run", ("model_path", "output_root", "run_name", "capture_layers", "allow_cpu")),
                           ("Extraction", ("num_shards", "token_budget", "chunk_mb",
                                           form_params()["num_shards"]["description"]))):
        [b for b in dialog.find_elements(By.CSS_SELECTOR, "button") if b.text.strip() == section][0].click()
        time.sleep(1)
        browser.save_screenshot(str(out / f"02-trigger-form-{section.lower()}.png"))
        for name in names:
            assert name in dialog.text, (section, name)
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
    assert new and new[0]["conf"].get("num_shards", 2) == 2, new
    browser.save_screenshot(str(out / "02b-after-trigger.png"))

    # the plugin's shard view inside the UI (run page entry), then the page itself
    q = urlencode({"dag_id": DAG_ID, "run_id": run_id})
    browser.get(f"{base}/dags/{DAG_ID}/runs/{run_id}/plugin/eagle3-shards")
    time.sleep(4)
    browser.save_screenshot(str(out / "03-run-plugin-tab.png"))
    browser.get(f"{base}/eagle3/shards?{q}")
    table = wait_for(browser, "#shards")
    browser.save_screenshot(str(out / "04-plugin-shards.png"))
    assert "2 shards: 2 complete" in browser.find_element(By.ID, "totals").text
    assert len(table.find_elements(By.CSS_SELECTOR, "tr.complete")) == 2
    assert all((out / f).stat().st_size > 5000 for f in
               ("01-login.png", "02-trigger-form-run.png", "02-trigger-form-extraction.png", "03-run-plugin-tab.png",
                "04-plugin-shards.png"))


@pytest.fixture(scope="module")
def celery_airflow(metadata_db, tmp_path_factory):
    work = tmp_path_factory.mktemp("af-celery")
    db = metadata_db.clone()
    cluster = AirflowCluster(db, work, executor="CeleryExecutor", dags_folder=DEMO_DAGS, pools={"gpu": 2},
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


def start_demo_run(af, tmp_path: Path, run_name: str, shards: int, rows: int):
    """The shard demo DAG triggered on the cluster, 2 samples a chunk, a chunk a second: (api, run id, run dir)."""
    api = af.client()
    api.wait_dag(DEMO_DAG_ID)
    api.unpause(DEMO_DAG_ID)
    conf = {"output_root": str(tmp_path), "run_name": run_name, "shards": shards, "rows": rows,
            "samples_per_chunk": 2, "chunk_seconds": 1.0}
    return api, api.trigger(DEMO_DAG_ID, conf=conf)["dag_run_id"], tmp_path / run_name


def busy_shards(af, run_dir: Path, timeout_s: float) -> dict[int, dict]:
    """The manifests of the shards that have committed a chunk and are not finished, once there is one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ms = shard_manifests(run_dir) if (run_dir / "extract").is_dir() else {}
        busy = {i: m for i, m in ms.items() if m["chunks"] and not m["complete"]}
        if busy:
            return busy
        time.sleep(0.3)
    pytest.fail("no shard started on the gpu worker\n" + af.all_logs())


def test_celery_task_process_sigkilled_mid_shard_is_retried_from_its_last_chunk(celery_airflow, tmp_path):
    """The task's own process (not the worker) SIGKILLed while a shard runs under CeleryExecutor: the worker
    stays up, the task is failed and retried, and the retry resumes after the chunks committed before the kill;
    every row lands once. Bounded: the run must finish within 300 s of the kill."""
    import signal

    af = celery_airflow
    api, run_id, run_dir = start_demo_run(af, tmp_path, "sigkill", shards=2, rows=16)
    victim, m = next(iter(sorted(busy_shards(af, run_dir, 180).items())))
    pid = m["params"]["attempts"][-1]["pid"]
    os.kill(pid, signal.SIGKILL)
    committed = len(shard_manifests(run_dir)[victim]["chunks"])

    run = api.wait_run(DEMO_DAG_ID, run_id, timeout=300)
    assert run["state"] == "success", af.all_logs()
    shard = next(t for t in api.task_instances(DEMO_DAG_ID, run_id)
                 if t["task_id"] == SHARD_TASK and t["map_index"] == victim)
    attempts = shard_manifests(run_dir)[victim]["params"]["attempts"]
    assert shard["try_number"] >= 2 and len(attempts) >= 2, (shard, attempts)
    assert attempts[-1]["pid"] != pid and attempts[-1]["resumed_chunks"] >= committed >= 1, attempts
    for i, m in shard_manifests(run_dir).items():
        rows = [r for c in m["chunks"] for r in range(c["first_row"], c["last_row"] + 1)]
        assert m["complete"] and rows == list(range(8 * i, 8 * i + 8)), (i, rows)


def test_celery_gpu_queue_concurrency_and_worker_kill(celery_airflow, tmp_path):
    af = celery_airflow
    api, run_id, _ = start_demo_run(af, tmp_path, "celery", shards=4, rows=32)

    # wait until a shard has committed a chunk but is not finished, then take the gpu worker down hard
    busy_shards(af, tmp_path / "celery", 120)
    af.kill_worker("gpu-worker")
    # shards cut mid-way: started (manifest stamped) but not complete when the worker died
    at_kill = {i: len(m["chunks"]) for i, m in shard_manifests(tmp_path / "celery").items() if not m["complete"]}
    assert any(at_kill.values()), at_kill
    time.sleep(3)
    # nothing of the dead worker writes on: the cut shards did not move while no gpu worker was up
    after = {i: len(m["chunks"]) for i, m in shard_manifests(tmp_path / "celery").items() if i in at_kill}
    assert after == at_kill, (at_kill, after)
    af.start_worker("gpu-worker", queues="gpu", concurrency=2, extra_env=GPU_WORKER_ENV)

    run = api.wait_run(DEMO_DAG_ID, run_id, timeout=240)
    assert run["state"] == "success", af.all_logs()

    tis = api.task_instances(DEMO_DAG_ID, run_id)
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
    summary = api.xcom(DEMO_DAG_ID, run_id, "verify")
    summary = json.loads(summary) if isinstance(summary, str) else summary
    assert summary["samples"] == 32
