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


@pytest.fixture(scope="session")
def shards(tmp_path_factory, smollm2_model, smollm2_tokenizer, smollm2_path):
    """Real self-distillation data: SmolLM2 answers 24 prompts greedily, the reference oracle extracts."""
    from tests.support import selfdistill as sd
    from tests.train_helpers import CAPTURE

    samples = sd.generate_answers(smollm2_model, smollm2_tokenizer, sd.make_prompts(24), max_new_tokens=40)
    assert all(sum(s["loss_mask"]) > 0 for s in samples)
    out = tmp_path_factory.mktemp("shards")
    return sd.write_shards(smollm2_model, samples, out, CAPTURE, num_shards=2, chunk_samples=6,
                           model_path=str(smollm2_path))


@pytest.fixture(scope="session")
def trained(shards, smollm2_path, tmp_path_factory):
    """A drafter trained for 24 steps on `shards` and exported: (TrainConfig, the training report)."""
    from eagle3.train.run import train_phase
    from tests.train_helpers import small_config

    out = tmp_path_factory.mktemp("train")
    cfg = small_config(shards, out, model_path=smollm2_path)
    return cfg, train_phase(cfg)
