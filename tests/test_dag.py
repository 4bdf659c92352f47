from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(ROOT / "dags"))
    assert bag.import_errors == {}
    return bag.dags["eagle3_drafter"]


def test_dag_wires_the_five_phases_in_order(dag):
    assert set(dag.task_dict) == {"preflight", "datasets", "datagen", "merge", "plan_shards", "extract", "train",
                                  "evaluate"}
    down = {t: sorted(dag.task_dict[t].downstream_task_ids) for t in dag.task_dict}
    assert down == {"preflight": ["datasets"], "datasets": ["datagen"], "datagen": ["merge"], "merge": ["plan_shards"],
                    "plan_shards": ["extract"], "extract": ["train"], "train": ["evaluate"], "evaluate": []}
    # no cycle: a topological order exists and starts at preflight
    order = [t.task_id for t in dag.topological_sort()] if hasattr(dag, "topological_sort") else None
    if order:
        assert order[0] == "preflight" and order[-1] == "evaluate"


def test_gpu_tasks_use_the_gpu_queue_and_pool_and_shards_are_mapped(dag):
    for tid in ("extract", "train", "evaluate"):
        t = dag.task_dict[tid]
        assert (t.queue, t.pool) == ("gpu", "gpu"), tid
    from airflow.sdk.definitions.mappedoperator import MappedOperator

    assert isinstance(dag.task_dict["extract"], MappedOperator)
    assert isinstance(dag.task_dict["datagen"], MappedOperator)
    assert dag.task_dict["preflight"].retries == 0


def test_param_defaults_are_valid_and_bad_values_are_rejected(dag):
    from airflow.sdk.exceptions import ParamValidationError

    dag.params.validate()  # the defaults pass their own schema (the UI form starts valid)
    for name, bad, why in (("num_shards", 0, "less than the minimum"), ("run_name", "../escape", "does not match"),
                           ("cap_policy", "sometimes", "is not one of"), ("capture_layers", [-1], "less than"),
                           ("datasets", [{"name": "A1"}], "'prompt_file' is a required property"),
                           ("extract_attention", "flash3", "is not one of"),
                           ("extract_pad_multiple", "sixty", "does not match"),
                           ("extract_pad_multiple", "0", "does not match"),
                           ("extract_pad_multiple", 0, "less than the minimum")):
        with pytest.raises(ParamValidationError, match=why):
            dag.params.get_param(name).resolve(value=bad)


def test_extraction_params_reach_the_mapped_operator(dag):
    """The SDPA kernel and backend params are templated into every mapped extraction task."""
    extract = dag.task_dict["extract"]
    kwargs = extract.partial_kwargs
    assert kwargs["attention"] == "{{ params.extract_attention }}"
    assert kwargs["backend"] == "{{ params.extract_backend }}"
    assert dag.params["extract_attention"] == "auto"
    assert kwargs["pad_multiple"] == "{{ params.extract_pad_multiple }}"
    assert dag.params["extract_pad_multiple"] == "auto"
    for good in ("auto", "64", 64):
        assert dag.params.get_param("extract_pad_multiple").resolve(value=good) == good
    # the DAG spells the choices out (it must not import torch to be parsed); they stay those the core accepts
    from eagle3.extract.backend import SDPA_KERNELS
    from eagle3.extract.extractor import BACKENDS

    assert dag.params.get_param("extract_attention").schema["enum"] == list(SDPA_KERNELS)
    assert dag.params.get_param("extract_backend").schema["enum"] == list(BACKENDS)


def test_core_package_never_imports_airflow():
    for path in (ROOT / "eagle3").rglob("*.py"):
        text = path.read_text()
        assert "import airflow" not in text and "from airflow" not in text, path
