from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(ROOT / "dags"))


def test_dag_imports_without_errors_and_has_no_cycles():
    bag = load_dagbag()
    assert bag.import_errors == {}
    dag = bag.dags["eagle3_drafter"]
    assert dag.task_dict["preflight"].retries == 0
    # topological sort raises on a cycle
    order = [t.task_id for t in dag.topological_sort()] if hasattr(dag, "topological_sort") else list(dag.task_dict)
    assert order[0] == "preflight"
    dag.check_cycle() if hasattr(dag, "check_cycle") else None


def test_core_package_never_imports_airflow():
    for path in (ROOT / "eagle3").rglob("*.py"):
        text = path.read_text()
        assert "import airflow" not in text and "from airflow" not in text, path
