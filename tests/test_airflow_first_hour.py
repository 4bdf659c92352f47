"""A new user's first hour, as the README tells it: `bash scripts/airflow.sh start` (airflow standalone: SQLite +
LocalExecutor), log in with the printed credentials, trigger eagle3_drafter from the UI with the form's defaults
on the CPU, watch both shards, one fails (an injected fault), clear that map index in the UI, it resumes from
its committed chunk and the run succeeds with no ERROR line in its tasks' logs. And a pool that does not exist
fails preflight with the reason instead of leaving the shards "scheduled" forever.

Overrides of the defaults, and why: EAGLE3_SHARD_RETRIES=0 (else the failed shard retries by itself and there is
nothing to clear), eval_max_new_tokens 16 (the default evaluation takes
minutes on a loaded 2-core machine: the test would not finish in ~8 min). The form's chunk_mb and token_budget
stay "auto": on the CPU they give each shard a few chunks, so the failed shard has committed ones to resume from.
Screenshots: artifacts/tests/first-hour/.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest

from airflow_client import AirflowClient
from airflow_harness import free_port
from browser import chromium, log_in, wait_for

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
DAG_ID = "eagle3_drafter"
RUN_NAME = "first-hour"
ARTIFACTS = Path(os.environ.get("EAGLE3_TEST_ARTIFACTS", ROOT / "artifacts" / "tests")) / "first-hour"


def airflow_sh(cmd: str, env: dict[str, str], timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "airflow.sh"), cmd], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout)


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    """The one command, as a user runs it, in a fresh AIRFLOW_HOME (the test session's own Airflow settings off)."""
    work = tmp_path_factory.mktemp("first-hour")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update({
        "AIRFLOW_HOME": str(work / "airflow"), "EAGLE3_AIRFLOW_PORT": str(free_port()),
        "EAGLE3_VENV": str(Path(sys.executable).parent.parent), "EAGLE3_OUTPUT_ROOT": str(work / "runs"),
        "EAGLE3_INJECT_FAULT": f"shard=1,after_chunks=1,once_file={work / 'fault-fired'}",
        "EAGLE3_SHARD_RETRIES": "0",
    })
    started = airflow_sh("start", env)
    try:
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        m = re.search(r"Airflow UI: (\S+)\s+login: (\S+) / (\S+)", started.stdout)
        assert m, started.stdout
        # the UI and REST API listen on this machine only (Airflow's own default is every interface)
        port = int(env["EAGLE3_AIRFLOW_PORT"])
        listening = [f.split()[1] for f in Path("/proc/net/tcp").read_text().splitlines()[1:] + Path(
            "/proc/net/tcp6").read_text().splitlines()[1:] if f.split()[3] == "0A" and
            int(f.split()[1].rsplit(":", 1)[1], 16) == port]
        assert listening == [f"0100007F:{port:04X}"], listening
        status = airflow_sh("status", env, timeout=60)
        assert status.returncode == 0 and '"scheduler":{"status":"healthy"' in status.stdout, status.stdout
        yield {"url": m.group(1), "user": m.group(2), "password": m.group(3), "work": work, "env": env}
    finally:
        stopped = airflow_sh("stop", env, timeout=120)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        for log in ("standalone.log", "migrate.log"):
            if (work / "airflow" / log).is_file():
                shutil.copy(work / "airflow" / log, ARTIFACTS / log)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    assert airflow_sh("status", env, timeout=60).returncode == 3  # "not running"


def task_log(api: AirflowClient, run_id: str, task_id: str, map_index: int, try_number: int) -> list[dict]:
    """The task's log as Airflow serves it (structured lines: event, level, ...)."""
    r = api.session.get(f"{api.base_url}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}/logs/"
                        f"{try_number}", params={"map_index": map_index}, headers={"Accept": "application/json"},
                        timeout=30)
    r.raise_for_status()
    return [e if isinstance(e, dict) else {"event": str(e)} for e in r.json()["content"]]


def settled(read, done, timeout: float = 40):
    """`read()` again until `done(value)`: the UI re-renders (stale elements) and fills in lists as data arrives."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline, value = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            value = read()
            if done(value):
                return value
        except (StaleElementReferenceException, IndexError):
            pass
        time.sleep(0.5)
    return value


def test_missing_pool_fails_preflight_with_the_reason(standalone):
    """Without pool `gpu` the shards would wait "scheduled" forever; preflight fails at once and says why."""
    api = AirflowClient(standalone["url"], standalone["user"], standalone["password"])
    api.request("DELETE", "/api/v2/pools/gpu")
    try:
        t0 = time.monotonic()
        run_id = api.trigger(DAG_ID, conf={"run_name": "no-pool"})["dag_run_id"]
        ti = api.wait_task(DAG_ID, run_id, "preflight", -1, states=("failed",), timeout=240)
        assert ti["try_number"] == 1  # a config error: not retried
        assert api.wait_run(DAG_ID, run_id, timeout=60)["state"] == "failed"
        assert time.monotonic() - t0 < 200
        text = "\n".join(json.dumps(e) for e in task_log(api, run_id, "preflight", -1, 1))  # with the exception
        assert "pool 'gpu' does not exist" in text and "['evaluate', 'extract', 'train']" in text, text[-3000:]
        assert "airflow pools set gpu" in text
        states = api.task_states(DAG_ID, run_id)
        assert all(states[(t, -1)] in ("upstream_failed", None) for t in ("datasets", "merge", "train")), states
        assert not (standalone["work"] / "runs" / "no-pool" / "datagen").exists()  # nothing ran after preflight
    finally:
        api.set_pool("gpu", 1)


def test_first_hour_in_the_browser(standalone):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    base, api = standalone["url"], AirflowClient(standalone["url"], standalone["user"], standalone["password"])
    d = chromium()
    try:
        log_in(d, base, standalone["user"], standalone["password"])
        d.get(f"{base}/dags/{DAG_ID}")
        wait_for(d, "button", visible_text="Trigger").click()
        dialog = wait_for(d, "[role=dialog]", visible_text="Extraction")
        time.sleep(1)

        def section(name: str) -> None:
            [b for b in dialog.find_elements(By.CSS_SELECTOR, "button") if b.text.strip() == name][0].click()
            time.sleep(1)

        section("Run")
        assert d.find_element(By.ID, "element_capture_layers").get_attribute("value") == "auto"  # not "[]"
        el = d.find_element(By.CSS_SELECTOR, "input[name=element_run_name]")
        el.send_keys(RUN_NAME, Keys.TAB)
        section("Data generation")
        for name in ("server_command", "gguf", "served_model_name"):
            assert d.find_element(By.ID, f"element_{name}").get_attribute("value") == "auto", name
        section("Extraction")
        for name in ("chunk_mb", "token_budget"):  # "auto": a few chunks a shard on the CPU (module doc)
            assert d.find_element(By.ID, f"element_{name}").get_attribute("value") == "auto", name
        section("Evaluation")
        el = d.find_element(By.CSS_SELECTOR, "input[name=element_eval_max_new_tokens]")  # time (module doc)
        el.send_keys(Keys.CONTROL, "a")
        el.send_keys("16", Keys.TAB)
        d.save_screenshot(str(ARTIFACTS / "01-trigger-form.png"))
        submit = [b for b in dialog.find_elements(By.CSS_SELECTOR, "button") if b.text.strip() == "Trigger"][-1]
        d.execute_script("arguments[0].scrollIntoView();", submit)
        submit.click()
        deadline, runs = time.monotonic() + 30, []
        while not runs and time.monotonic() < deadline:
            runs = [r for r in api.get(f"/api/v2/dags/{DAG_ID}/dagRuns")["dag_runs"]
                    if r["conf"].get("run_name") != "no-pool"]  # the other test's run
            time.sleep(0.5)
        assert len(runs) == 1, runs
        run_id, conf = runs[0]["dag_run_id"], runs[0]["conf"]
        assert conf["chunk_mb"] == "auto" and conf["token_budget"] == "auto" and conf["num_shards"] == 2, conf
        assert conf["run_name"] == RUN_NAME, conf
        run_dir = standalone["work"] / "runs" / RUN_NAME

        # preflight says what "auto" chose on this machine: llama.cpp on the GGUF, the CPU
        api.wait_task(DAG_ID, run_id, "preflight", -1, states=("success",), timeout=180)
        pre = "\n".join(str(e.get("event")) for e in task_log(api, run_id, "preflight", -1, 1))
        assert "datagen: llama.cpp server (no GPU)" in pre and "the run uses the CPU" in pre, pre[-3000:]

        # both shards run; shard 1 fails after its first committed chunk (the injected fault) and stays failed
        api.wait_task(DAG_ID, run_id, "extract", 1, states=("failed",), timeout=480)
        assert api.wait_run(DAG_ID, run_id, timeout=120)["state"] == "failed"
        mapped = f"{base}/dags/{DAG_ID}/runs/{run_id}/tasks/extract/mapped"
        d.get(mapped)
        rows = settled(lambda: {r.text.split("\n")[0].strip(): r.text
                                for r in d.find_elements(By.CSS_SELECTOR, "tbody tr")},
                       lambda rows: set(rows) == {"0", "1"} and "Failed" in rows["1"])
        assert "Success" in rows["0"] and "Failed" in rows["1"], rows
        d.save_screenshot(str(ARTIFACTS / "02-shard-1-failed.png"))
        manifest = json.loads((run_dir / "extract" / "shard-00001" / "manifest.json").read_text())
        assert len(manifest["chunks"]) == 1 and not manifest["complete"]

        # clear map index 1 in the UI: the dialog offers it with its downstream tasks (Downstream is on)
        settled(lambda: [r for r in d.find_elements(By.CSS_SELECTOR, "tbody tr") if r.text.split("\n")[0].strip()
                         == "1"][0].find_element(By.CSS_SELECTOR, "button[aria-label='Clear Task Instance']").click()
                or True, bool)
        clear = wait_for(d, "[role=dialog]", visible_text="Affected Tasks")
        # the list fills in after a dry-run request
        affected = settled(lambda: sorted((r.text.split()[0], r.text.split()[-2]) for r in clear.find_elements(
            By.CSS_SELECTOR, "tbody tr") if len(r.text.split()) >= 3), lambda a: len(a) >= 3)
        assert affected == [("evaluate", "-1"), ("extract", "1"), ("train", "-1")], affected
        d.save_screenshot(str(ARTIFACTS / "03-clear-dialog.png"))
        settled(lambda: [b for b in d.find_elements(By.CSS_SELECTOR, "[role=dialog] button")
                         if b.text.strip() == "Confirm"][0].click() or True, bool)
        # the clear takes effect when the UI's request lands: until then the run still reads "failed"
        api.wait_task(DAG_ID, run_id, "extract", 1, states=(None, "scheduled", "queued", "running", "success"),
                      timeout=60)

        run = api.wait_run(DAG_ID, run_id, states=("success", "failed"), timeout=900)
        d.get(f"{base}/dags/{DAG_ID}/runs/{run_id}")
        time.sleep(3)
        d.save_screenshot(str(ARTIFACTS / "04-run-succeeded.png"))
        assert run["state"] == "success", api.task_states(DAG_ID, run_id)
        # the run's name where the run page shows its identity: the note preflight set
        assert api.get(f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}")["note"].startswith(f"eagle3 run {RUN_NAME}")
        assert wait_for(d, "body", visible_text=f"eagle3 run {RUN_NAME}")
        # the Drafter tab: the evaluation's tau, read from the page the tab frames
        wait_for(d, "a, button", visible_text="Drafter").click()
        frame = wait_for(d, "iframe", timeout=60)
        d.switch_to.frame(frame)
        rows = settled(lambda: [r.text for r in d.find_elements(By.CSS_SELECTOR, "#tau tr")], lambda r: len(r) >= 2)
        assert rows[0].startswith("k tau") and rows[1].split()[0] == "5", rows
        assert float(rows[1].split()[1]) >= 1.0, rows  # tau: at least the target's own token per forward
        assert d.find_element(By.ID, "run-name").text == RUN_NAME
        assert "lossless" in d.find_element(By.ID, "lossless").text
        assert "--speculative-draft-model-path" in d.find_element(By.ID, "serve-sglang").text
        d.switch_to.default_content()
        time.sleep(2)
        d.save_screenshot(str(ARTIFACTS / "05-drafter-tab.png"))
        d.set_window_size(1400, 2600)  # the whole Drafter page, as its own page, for a reader of the screenshots
        d.get(f"{base}/eagle3/drafter?dag_id={DAG_ID}&run_id={quote(run_id)}")
        wait_for(d, "#tau")
        d.save_screenshot(str(ARTIFACTS / "05b-drafter-page.png"))
        d.set_window_size(1400, 1000)
        # Browse lists the run by its name
        d.get(f"{base}/eagle3/")
        assert wait_for(d, "#runs", visible_text=RUN_NAME)
        # a committed chunk file deleted: the shard view flags the shard damaged
        chunk = sorted((run_dir / "extract" / "shard-00000").glob("chunk-*.safetensors"))[-1]
        chunk.unlink()
        d.get(f"{base}/eagle3/shards?dag_id={DAG_ID}&run_id={quote(run_id)}")
        row = wait_for(d, "tr[data-shard='0']")
        assert "damaged" in row.get_attribute("class") and chunk.name in row.text, row.text
        d.save_screenshot(str(ARTIFACTS / "06-damaged-shard.png"))
    finally:
        d.quit()

    tis = {(t["task_id"], t["map_index"]): t for t in api.task_instances(DAG_ID, run_id)}
    assert {k for k, t in tis.items() if t["try_number"] > 1} == {("extract", 1)}  # shard 0 did not re-run
    shard1 = api.xcom(DAG_ID, run_id, "extract", map_index=1)
    assert shard1["resumed_from_chunk"] == 1 and shard1["chunks"] >= 2
    # no ERROR line in the successful tasks' logs (the failed try of shard 1 has its error, as it should)
    errors = {k: [e["event"] for e in task_log(api, run_id, k[0], k[1], t["try_number"])
                  if str(e.get("level", "")).lower() in ("error", "critical")]
              for k, t in tis.items() if t["state"] == "success"}
    assert not {k: v for k, v in errors.items() if v}, errors
    # the evaluate task prints its progress and result table, and no library deprecation warning
    ev = [str(e.get("event")) for e in task_log(api, run_id, "evaluate", -1, tis[("evaluate", -1)]["try_number"])]
    assert any(line.startswith("k=5: tau") for line in ev) and any("tau turn 1" in line for line in ev), ev[-20:]
    assert not [line for line in ev if "deprecat" in line.lower()], ev
    # the datagen task log names its server's output file instead of holding it
    dg = [str(e.get("event")) for e in task_log(api, run_id, "datagen", 0, 1)]
    assert any("the server's output goes to" in line for line in dg) and len(dg) < 300, len(dg)
