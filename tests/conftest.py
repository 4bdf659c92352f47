"""Shared fixtures. Airflow's environment is set here, before anything imports airflow."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_AF_HOME = Path(tempfile.mkdtemp(prefix="eagle3-test-airflow-"))
os.environ.setdefault("AIRFLOW_HOME", str(_AF_HOME))
os.environ["AIRFLOW__CORE__UNIT_TEST_MODE"] = "True"
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(ROOT / "dags")
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(ROOT / "plugins")
os.environ.setdefault("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", f"sqlite:///{_AF_HOME}/airflow.db")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct as an HF folder (converted once into the shared cache)."""
    from eagle3.models import ensure_smollm2

    return ensure_smollm2()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from eagle3.models import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_model(smollm2_path):
    from eagle3.models import load_model

    return load_model(smollm2_path)
