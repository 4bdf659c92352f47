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
    assert dag.task_dict["train"].pool_slots == 1  # EAGLE3_TRAIN_GPU_SLOTS unset: training on one GPU
    from airflow.sdk.definitions.mappedoperator import MappedOperator

    assert isinstance(dag.task_dict["extract"], MappedOperator)
    assert isinstance(dag.task_dict["datagen"], MappedOperator)
    assert dag.task_dict["preflight"].retries == 0


def test_gpu_pool_slots_follow_the_deployment(monkeypatch):
    """A shard of tp_size N holds N gpu pool slots; a local datagen server its GPUs. Fixed at parse time from
    EAGLE3_EXTRACT_TP_SIZE / EAGLE3_DATAGEN_GPUS (the scheduler reserves slots before a task runs)."""
    from airflow.dag_processing.dagbag import DagBag

    from eagle3.config import check_run
    from eagle3.errors import ConfigError

    def parse():
        bag = DagBag(dag_folder=str(ROOT / "dags"))
        assert bag.import_errors == {}
        return bag.dags["eagle3_drafter"]

    d = parse()
    assert d.task_dict["extract"].pool_slots == 1 and d.params["extract_tp_size"] == 1
    assert d.task_dict["datagen"].pool == "default_pool"  # its server is remote by default
    monkeypatch.setenv("EAGLE3_EXTRACT_TP_SIZE", "4")
    monkeypatch.setenv("EAGLE3_DATAGEN_GPUS", "8")
    monkeypatch.setenv("EAGLE3_TRAIN_GPU_SLOTS", "2")
    d = parse()
    ex, dg = d.task_dict["extract"], d.task_dict["datagen"]
    assert (ex.pool, ex.pool_slots, d.params["extract_tp_size"]) == ("gpu", 4, 4)
    assert (dg.queue, dg.pool, dg.pool_slots) == ("gpu", "gpu", 8)
    assert d.task_dict["preflight"].gpu_slots == {"extract": 4, "datagen": 8, "train": 2}
    assert (d.task_dict["train"].pool, d.task_dict["train"].pool_slots) == ("gpu", 2)
    with pytest.raises(ConfigError, match=r"train_num_gpus=4 needs 4 GPUs, but the train task holds 2 slot\(s\)"
                                          r".*EAGLE3_TRAIN_GPU_SLOTS=4"):
        check_run({"train_num_gpus": 4}, "r1", {"extract": 4, "datagen": 8, "train": 2})
    # a run asking more ranks per shard than the task's slots fails in preflight, naming both
    with pytest.raises(ConfigError, match=r"extract_tp_size=8 needs 8 GPUs per shard, but the extract task holds "
                                          r"4 slot\(s\).*EAGLE3_EXTRACT_TP_SIZE=8"):
        check_run({"extract_tp_size": 8}, "r1", {"extract": 4, "datagen": 8})
    monkeypatch.setenv("EAGLE3_EXTRACT_TP_SIZE", "zero")
    bag = DagBag(dag_folder=str(ROOT / "dags"))
    assert "EAGLE3_EXTRACT_TP_SIZE='zero': expected an integer" in "".join(map(str, bag.import_errors.values()))


def test_param_defaults_are_valid_and_bad_values_are_rejected(dag):
    from airflow.sdk.exceptions import ParamValidationError

    dag.params.validate()  # the defaults pass their own schema (the UI form starts valid)
    for name, bad, why in (("num_shards", 0, "less than the minimum"), ("run_name", "../escape", "does not match"),
                           ("cap_policy", "sometimes", "is not one of"), ("capture_layers", [0], "less than"),
                           ("capture_layers", [], "should be non-empty|is too short"),
                           ("ttt_steps", 33, "greater than the maximum"),
                           ("datasets", [{"name": "A1"}], "'prompt_file' is a required property"),
                           ("extract_attention", "flash3", "is not one of"),
                           ("extract_pad_multiple", "sixty", "does not match"),
                           ("extract_pad_multiple", "0", "does not match"),
                           ("extract_pad_multiple", 0, "less than the minimum")):
        with pytest.raises(ParamValidationError, match=why):
            dag.params.get_param(name).resolve(value=bad)


def test_every_task_builds_its_phase_from_preflights_resolved_configuration(dag, smollm2_path, tmp_path):
    """Render each task's config as Airflow does (native objects, preflight's XCom) and build the phase config
    from it: the very sections preflight resolved, with no string round trip."""
    from eagle3.config import PHASES, check_run
    from eagle3.knobs import build

    cfg, _ = check_run({"model_path": str(smollm2_path), "output_root": str(tmp_path), "run_name": "r",
                        "max_seq_len": 3000, "token_budget": 1024, "extract_attention": "math",
                        "extract_pad_multiple": "16"}, "manual__x")
    xcom = {"run_config": cfg.to_dict()}

    class TI:
        def xcom_pull(self, task_ids):
            assert task_ids == "preflight"
            return xcom

    env = dag.get_template_env()
    context = {"params": dag.params, "run_id": "manual__x", "ti": TI()}
    tasks = {"datagen": "datagen", "merge": "merge", "plan": "plan_shards", "extract": "extract", "train": "train",
             "evaluate": "evaluate"}
    for phase, task_id in tasks.items():
        task = dag.task_dict[task_id]
        template = task.partial_kwargs["config"] if hasattr(task, "partial_kwargs") else task.config
        values = task.render_template(template, context, env)
        assert isinstance(values, dict), phase  # native: no literal_eval of a string
        assert build(PHASES[phase], values, phase) == getattr(cfg, phase), phase
    assert cfg.train.max_seq_len == cfg.merge.max_seq_len == 3000
    assert cfg.extract.target.capture_layers == [2, 15, 27] and cfg.extract.token_budget == 1024
    assert (cfg.extract.attention, cfg.extract.pad_multiple) == ("math", 16)
    # the form's "auto" server, as preflight resolved it (no GPU here: llama.cpp on the packaged GGUF)
    assert "llama_cpp_server" in cfg.datagen.server_command and cfg.datagen.gguf.endswith(".gguf")
    assert cfg.datagen.served_model_name == "target"
    # the SDPA kernel and backend choices come from the torch-free config; they stay those the torch side accepts
    from eagle3.extract.backend import SDPA_KERNELS
    from eagle3.extract.extractor import BACKENDS

    assert dag.params.get_param("extract_attention").schema["enum"] == list(SDPA_KERNELS)
    assert dag.params.get_param("extract_backend").schema["enum"] == list(BACKENDS)


def test_a_config_error_fails_the_task_without_retries(tmp_path):
    """A ConfigError is the user's input: AirflowFailException, which Airflow does not retry."""
    from airflow.sdk.exceptions import AirflowFailException

    from eagle3_airflow.operators.merge import MergeOperator
    from eagle3_airflow.operators.train import TrainDrafterOperator

    op = MergeOperator(task_id="merge", config={"inputs": [str(tmp_path)], "output_dir": str(tmp_path / "m"),
                                                "data": {"max_seq_len": 0}})
    with pytest.raises(AirflowFailException, match="max_seq_len"):
        op.execute({})
    train = {"target": {"model_path": "m"}, "output_dir": str(tmp_path / "t")}
    op = TrainDrafterOperator(task_id="train", config={**train, "lerning_rate": 1e-3}, shard_dirs=[str(tmp_path)])
    with pytest.raises(AirflowFailException, match="lerning_rate"):
        op.execute({})
    # more training ranks than the gpu-pool slots the task holds: refused before any work, naming both
    op = TrainDrafterOperator(task_id="train", config={**train, "num_gpus": 2}, shard_dirs=[str(tmp_path)],
                              pool="gpu", pool_slots=1)
    with pytest.raises(AirflowFailException, match=r"train_num_gpus=2.*holds 1 slot.*EAGLE3_TRAIN_GPU_SLOTS"):
        op.execute({})


def test_core_package_never_imports_airflow():
    for path in (ROOT / "eagle3").rglob("*.py"):
        text = path.read_text()
        assert "import airflow" not in text and "from airflow" not in text, path
