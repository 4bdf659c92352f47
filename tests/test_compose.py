"""Schema-level checks of docker-compose.yml and docker/ (there is no Docker engine here):
what every service builds and runs exists in this repository and parses as a real Airflow command,
the Airflow services share one consistent environment, and the queue/pool names match the DAGs."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
IMAGE_ROOT = "/opt/eagle3"  # where the Dockerfiles copy the repository
AIRFLOW_SERVICES = {"airflow-init", "api-server", "scheduler", "dag-processor", "triggerer", "worker-cpu", "worker-gpu"}


def env_example() -> dict[str, str]:
    lines = (ROOT / "docker" / "env.example").read_text().splitlines()
    return dict(l.split("=", 1) for l in lines if l.strip() and not l.startswith("#"))


def interpolate(value, env):
    """Compose's variable substitution: ${X}, ${X:-default}, ${X:?error}, $$ -> $."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m):
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op == ":?":
            raise AssertionError(f"${{{name}}} is required ({arg}) and not in docker/env.example")
        return arg or ""

    value = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:-|:\?)([^}]*))?\}", sub, value.replace("$$", "\0"))
    return value.replace("\0", "$")


@pytest.fixture(scope="module")
def compose():
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return interpolate(raw, env_example())


def dockerfile_of(svc) -> Path:
    build = svc["build"]
    return ROOT / build.get("context", ".") / build.get("dockerfile", "Dockerfile")


def test_services_and_health_checks(compose):
    services = compose["services"]
    assert set(services) == AIRFLOW_SERVICES | {"postgres", "redis"}
    for name, svc in services.items():
        if name != "airflow-init":
            assert "healthcheck" in svc and svc["healthcheck"]["test"], f"{name} has no health check"
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            assert cond["condition"] in ("service_healthy", "service_completed_successfully", "service_started")
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy, it has no check"
    assert services["api-server"]["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully"
    gpu = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    for vol in {v.split(":")[0] for s in services.values() for v in s.get("volumes", [])}:
        assert vol in compose["volumes"], f"volume {vol} not declared"


def test_builds_exist_and_copy_only_existing_paths(compose):
    for name in AIRFLOW_SERVICES:
        dockerfile = dockerfile_of(compose["services"][name])
        assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY"):
                srcs = [a for a in line.split()[1:-1] if not a.startswith("--")]
                for src in srcs:
                    assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src} does not exist"
            if line.startswith("ENTRYPOINT"):
                for arg in json.loads(line.split(None, 1)[1]):
                    if arg.startswith(IMAGE_ROOT):
                        assert (ROOT / arg[len(IMAGE_ROOT) + 1:]).is_file(), arg
    gpu_df = (ROOT / "docker" / "Dockerfile.gpu").read_text()
    assert "nvidia/cuda" in gpu_df and "EAGLE3_PIN_GPUS=1" in gpu_df
    assert "airflow celery worker --queues" in (ROOT / "docker" / "gpu-worker.sh").read_text()


def test_images_copy_every_installed_folder_before_the_install(compose):
    """`pip install /opt/eagle3` builds from what is copied so far: every folder pyproject installs (its packages'
    roots and package-dir sources, e.g. dags/ as eagle3_dags) must be copied before that RUN."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setup.get("package-dir", {})
    needed = {mapped.get(p, p.split(".")[0]) for p in setup["packages"]} | {"pyproject.toml"}
    for name in AIRFLOW_SERVICES:
        copied = set()
        for line in dockerfile_of(compose["services"][name]).read_text().splitlines():
            if line.startswith("COPY"):
                copied |= {a for a in line.split()[1:-1] if not a.startswith("--")}
            if line.startswith("RUN") and IMAGE_ROOT in line and "pip install" in line:
                assert needed <= copied, f"{name}: not copied before the install: {sorted(needed - copied)}"
                break
        else:
            pytest.fail(f"{name}: its Dockerfile never installs {IMAGE_ROOT}")


def airflow_argv(name, svc) -> list[str]:
    cmd = svc["command"]
    cmd = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
    if name == "worker-gpu":  # docker/gpu-worker.sh execs this with the service's args appended
        script = (ROOT / "docker" / "gpu-worker.sh").read_text()
        assert 'exec airflow celery worker --queues "${EAGLE3_GPU_QUEUE:-gpu}" --concurrency "$n" "$@"' in script
        return ["celery", "worker", "--queues", "gpu", "--concurrency", "8", *cmd]
    return cmd


def test_commands_parse_with_airflows_own_cli(compose, tmp_path):
    """Every Airflow service's command (and each health check's `airflow ...`) is accepted by the real
    `airflow` argument parser with the CeleryExecutor configured (which adds the celery commands)."""
    argvs = {}
    for name in AIRFLOW_SERVICES - {"airflow-init"}:
        svc = compose["services"][name]
        argvs[name] = airflow_argv(name, svc)
        test = svc["healthcheck"]["test"]
        if test[0] == "CMD" and test[1] == "airflow":
            argvs[name + ":health"] = test[2:]
    init = compose["services"]["airflow-init"]["command"]
    assert init[0] == "bash" and (ROOT / init[1][len(IMAGE_ROOT) + 1:]).is_file()
    init_script = (ROOT / init[1][len(IMAGE_ROOT) + 1:]).read_text()
    for line in init_script.splitlines():
        line = line.strip()
        if line.startswith("airflow "):
            argvs[f"init:{line}"] = shlex.split(interpolate(line.split(">")[0].split("||")[0], {}))[1:]
    code = (
        "import json, sys\n"
        "from airflow.cli.cli_parser import get_parser\n"
        "p = get_parser()\n"
        "bad = {}\n"
        "for k, argv in json.loads(sys.argv[1]).items():\n"
        "    try:\n"
        "        p.parse_args([a.replace('\"$conn_id\"', 'x').replace('\"${!var}\"', 'u') for a in argv])\n"
        "    except SystemExit as e:\n"
        "        bad[k] = argv\n"
        "print(json.dumps(bad))\n"
    )
    env = dict(os.environ, AIRFLOW_HOME=str(tmp_path), AIRFLOW__CORE__EXECUTOR="CeleryExecutor",
               AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{tmp_path}/a.db")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}, out.stderr[-3000:]
    # negative control: the same parser rejects a wrong option, so the check can fail
    out = subprocess.run([sys.executable, "-c", code, json.dumps({"x": ["celery", "worker", "--queue-typo", "gpu"]})],
                         env=env, capture_output=True, text=True, timeout=120)
    assert "x" in json.loads(out.stdout.strip().splitlines()[-1])


def test_environment_is_consistent(compose):
    services = compose["services"]
    pg = services["postgres"]["environment"]
    envs = {n: services[n]["environment"] for n in AIRFLOW_SERVICES}
    for key in ("AIRFLOW__CORE__EXECUTOR", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__CELERY__BROKER_URL",
                "AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__CORE__EXECUTION_API_SERVER_URL", "EAGLE3_OUTPUT_ROOT",
                "AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS", "EAGLE3_EXTRACT_TP_SIZE", "EAGLE3_DATAGEN_GPUS"):
        # (the GPUs per task: the DAG's pool slots and the GPU worker's pinning must agree)
        values = {n: e.get(key) for n, e in envs.items()}
        assert len(set(values.values())) == 1 and None not in values.values(), f"{key} differs: {values}"
    e = envs["scheduler"]
    assert e["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert f"{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}@postgres:5432/{pg['POSTGRES_DB']}" in \
        e["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    assert e["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://redis:6379/")
    assert e["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"].startswith("http://api-server:8080/")
    assert "8080" in services["api-server"]["command"]
    module, attr = e["AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS"].rsplit(".", 1)
    assert (ROOT / (module.replace(".", "/") + ".py")).is_file()
    # the output root lives on the volume every worker mounts (manifests must be shared)
    data_mounts = {n: [v for v in services[n]["volumes"] if v.endswith(":/data")] for n in AIRFLOW_SERVICES}
    assert all(data_mounts.values()) and e["EAGLE3_OUTPUT_ROOT"].startswith("/data/")
    assert envs["worker-gpu"]["EAGLE3_PIN_GPUS"] == "1" and "EAGLE3_PIN_GPUS" not in envs["worker-cpu"]
    # no secret literal in the compose file: secrets come from .env
    text = (ROOT / "docker-compose.yml").read_text()
    assert "sk-" not in text and "JWT_SECRET: ${AIRFLOW_JWT_SECRET:?" in text


def served_queues(compose) -> set[str]:
    qs = set()
    for name in ("worker-cpu", "worker-gpu"):
        argv = airflow_argv(name, compose["services"][name])
        qs |= set(argv[argv.index("--queues") + 1].split(","))
    return qs


@pytest.mark.parametrize("dags_folder", ["dags", "tests/dags"])
def test_queues_and_pools_match_the_dags(compose, dags_folder):
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(ROOT / dags_folder))
    assert bag.import_errors == {}
    init_script = (ROOT / "docker" / "init.sh").read_text()
    created_pools = set(re.findall(r"airflow pools set (\w+)", init_script)) | {"default_pool"}
    queues = served_queues(compose)
    assert queues == {"default", "gpu"}
    for dag in bag.dags.values():
        for t in dag.tasks:
            assert t.queue in queues, f"{dag.dag_id}.{t.task_id} uses queue {t.queue!r}: no worker serves it"
            assert t.pool in created_pools, f"{dag.dag_id}.{t.task_id} uses pool {t.pool!r}: init creates {created_pools}"
            if t.pool == "gpu":
                assert t.queue == "gpu", f"{dag.dag_id}.{t.task_id}: gpu pool but queue {t.queue}"
    if dags_folder == "tests/dags":
        ext = bag.dags["eagle3_shard_demo"].task_dict["extract"]
        assert (ext.queue, ext.pool) == ("gpu", "gpu")
