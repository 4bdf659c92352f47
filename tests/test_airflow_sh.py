"""scripts/airflow.sh's guard on the address it serves: another host than this machine with the default login is
refused before anything starts (the bind itself, 127.0.0.1 by default, is checked by test_airflow_first_hour)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start(tmp_path, **env):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "EAGLE3_A"))},
           "AIRFLOW_HOME": str(tmp_path / "airflow"), "PATH": "/usr/bin:/bin",
           "EAGLE3_VENV": str(tmp_path / "no-venv"), **env}  # no airflow to start, whatever happens
    return subprocess.run(["bash", str(ROOT / "scripts" / "airflow.sh"), "start"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_another_host_with_the_default_password_is_refused(tmp_path):
    for host in ("0.0.0.0", "10.1.2.3"):
        p = start(tmp_path, EAGLE3_AIRFLOW_HOST=host)
        assert p.returncode == 1, p.stdout + p.stderr
        assert f"refusing to serve the Airflow UI and REST API on {host}" in p.stderr
        assert "EAGLE3_ADMIN_PASSWORD" in p.stderr and not (tmp_path / "airflow" / "passwords.json").exists()
    # with a password of one's own the guard lets it through (here it then stops: no airflow in that venv)
    p = start(tmp_path, EAGLE3_AIRFLOW_HOST="0.0.0.0", EAGLE3_ADMIN_PASSWORD="s3cret-pw")
    assert p.returncode == 1 and "refusing" not in p.stderr and "no airflow in" in p.stderr, p.stderr
