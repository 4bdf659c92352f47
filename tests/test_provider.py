"""`pip install .` into an existing Airflow: the wheel carries every package of the checkout, the provider and
plugin entry points, and the DAG file, all under the project's own import names (no top-level `operators` that
would collide in a shared Airflow); installed alone (no checkout on the path), Airflow finds all of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # no build isolation: setuptools comes from the venv (no index needed); a copy keeps build/ out of the checkout
    src = out / "src"
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           check=True, capture_output=True).stdout.decode().split("\0")
    for f in filter(None, files):
        if (ROOT / f).is_file() and not f.startswith(("tests/", "bench/", "docs/")):
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            (src / f).write_bytes((ROOT / f).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=300)
    return next(out.glob("eagle3_pipeline-*.whl"))


# The design's top-level folders and the packages they install as (pyproject's package-dir).
MAPPED = {"operators": "eagle3_airflow/operators", "plugins": "eagle3_airflow/plugins", "dags": "eagle3_dags"}
TOP_LEVEL = {"eagle3", "eagle3_airflow", "eagle3_dags", "eagle3_demo"}  # every import name the wheel claims


def checkout_modules() -> set[str]:
    """Every module of the checkout's packages, at the path the wheel must hold it."""
    mods = {str(p.relative_to(ROOT)) for top in ("eagle3", "eagle3_airflow") for p in (ROOT / top).rglob("*.py")
            if "__pycache__" not in p.parts}
    return mods | {f"{pkg}/{p.name}" for folder, pkg in MAPPED.items() for p in (ROOT / folder).glob("*.py")}


def test_wheel_holds_every_package_and_the_entry_points(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = checkout_modules() - names
    assert not missing, f"not installed by `pip install .` (add the package to pyproject's list): {sorted(missing)}"
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == TOP_LEVEL
    assert "eagle3_dags/eagle3_drafter.py" in names
    assert {f"eagle3_demo/{p.name}" for p in (ROOT / "data" / "demo").glob("*.jsonl")} <= names  # form defaults
    ep = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(ep).decode()
    assert "[apache_airflow_provider]\nprovider_info = eagle3_airflow.get_provider_info:get_provider_info" in text
    assert '[airflow.plugins]\neagle3 = eagle3_airflow.plugins.shard_view:Eagle3Plugin' in text
    assert "eagle3 = eagle3.cli:main" in text


INSTALLED_CHECK = r"""
import json, os, sys
from importlib.metadata import entry_points
assert not any(p.rstrip("/") == os.environ["CHECKOUT"] for p in sys.path), sys.path
out = {}
import eagle3, eagle3_airflow.operators.base, eagle3_airflow.plugins.shard_view
out["from"] = [eagle3.__file__, eagle3_airflow.operators.base.__file__, eagle3_airflow.plugins.shard_view.__file__]
try:
    import operators
    out["operators"] = operators.__file__
except ModuleNotFoundError:
    out["operators"] = None
from airflow.providers_manager import ProvidersManager
pm = ProvidersManager()
pm.initialize_providers_hooks()
info = pm.providers["eagle3-pipeline"]
out["provider"] = {"version": info.version, "name": info.data["name"]}
out["hooks"] = {c: pm.hooks[c].hook_class_name for c in ("openai", "mlflow", "airflow_api") if pm.hooks.get(c)}
from airflow import plugins_manager
plugins, errors = plugins_manager._get_plugins()
out["plugins"] = [(p.name, p.__module__) for p in plugins]
out["plugin_errors"] = errors
from eagle3.cli import dags_folder
out["dags_folder"] = dags_folder()
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=out["dags_folder"])
from eagle3.config import form_params
defaults = {n: p["default"] for n, p in form_params().items()}
evals = [] if defaults["eval_prompts"] == "mtbench" else [defaults["eval_prompts"]]  # MT-bench: a package
out["default_files"] = [d["prompt_file"] for d in defaults["datasets"]] + evals
out["dags"], out["import_errors"] = sorted(bag.dags), {k: v[-300:] for k, v in bag.import_errors.items()}
print(json.dumps(out))
"""


def test_installed_alone_airflow_finds_provider_plugin_and_dag(wheel, tmp_path):
    """The plugins folder is the checkout's (as scripts/env.sh sets it): its file defers to the installed entry
    point, so the plugin loads once, from the install (twice would be an "already registered" error)."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(PYTHONPATH=str(site), CHECKOUT=str(ROOT), AIRFLOW_HOME=str(tmp_path / "home"),
               AIRFLOW__CORE__PLUGINS_FOLDER=str(ROOT / "plugins"), AIRFLOW__CORE__DAGS_FOLDER=str(tmp_path / "dags"),
               AIRFLOW__CORE__LOAD_EXAMPLES="False", AIRFLOW__CORE__UNIT_TEST_MODE="True",
               AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{tmp_path / 'airflow.db'}")
    r = subprocess.run([sys.executable, "-c", INSTALLED_CHECK], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(f.startswith(str(site)) for f in out["from"]), out["from"]  # the install, not the checkout
    assert out["from"][1:] == [str(site / "eagle3_airflow" / "operators" / "base.py"),
                               str(site / "eagle3_airflow" / "plugins" / "shard_view.py")]
    # `pip install` laid out the mapped folders inside the package: no top-level operators/plugins to collide
    assert out["operators"] is None
    assert {p.name for p in site.iterdir() if not p.name.endswith(".dist-info")} - {"bin"} == TOP_LEVEL
    assert out["provider"] == {"version": "0.1.0", "name": "EAGLE-3 pipeline"}
    assert out["hooks"] == {"openai": "eagle3_airflow.hooks.OpenAICompatibleHook",
                            "mlflow": "eagle3_airflow.hooks.MLflowTrackingHook",
                            "airflow_api": "eagle3_airflow.hooks.AirflowApiHook"}
    plugins = [tuple(p) for p in out["plugins"]]
    assert ("eagle3", "eagle3_airflow.plugins.shard_view") in plugins and not out["plugin_errors"]
    assert out["dags_folder"] == str(site / "eagle3_dags")
    assert out["dags"] == ["eagle3_drafter"] and not out["import_errors"], out["import_errors"]
    # the form's default prompt files come with the install
    assert all(f.startswith(str(site / "eagle3_demo")) and Path(f).is_file() for f in out["default_files"])

