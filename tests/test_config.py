"""The run configuration (eagle3.config): one definition per param, from the trigger form to each phase."""

from __future__ import annotations

import dataclasses

import pytest

from eagle3.config import (PHASE_CLASSES, check_run, form_params, model_facts, phase_template, phase_values, run_dir,
                           with_form_defaults)
from eagle3.errors import ConfigError
from eagle3.extract.config import ExtractConfig
from eagle3.knobs import build
from eagle3.merge.config import MergeConfig
from eagle3.train.config import TrainConfig


def form(smollm2_path, tmp_path, **conf):
    return with_form_defaults({"model_path": str(smollm2_path), "output_root": str(tmp_path), "run_name": "r",
                               **conf})


def test_every_form_param_is_one_knob_and_its_default_is_the_knobs():
    params = form_params()
    # token_budget used to be defaulted in the DAG, the operator and the extractor: now the knob alone
    assert params["token_budget"]["default"] == ExtractConfig.__dataclass_fields__["token_budget"].default
    assert params["token_budget"]["field"] == "ExtractConfig.token_budget"
    # the form's ttt_steps bound is the trainer's (they were 16 and 32)
    ttt = TrainConfig.__dataclass_fields__["ttt_steps"].metadata["eagle3_knob"]
    assert params["ttt_steps"]["schema"]["maximum"] == ttt["max"]
    with pytest.raises(ConfigError, match="ttt_steps"):
        build(TrainConfig, {"shard_dirs": ["x"], "model_path": "m", "output_dir": "o", "ttt_steps": ttt["max"] + 1},
              "train")
    for name, p in params.items():
        assert p["description"] and p["section"], name


def test_a_param_fed_to_several_phases_has_the_same_bounds_in_each():
    """max_seq_len is declared by merge (the form) and fed to training: a value one accepts the other must too."""
    from eagle3.config import FORM_CLASSES, PHASE_SOURCES, FromParam

    declared = {f.metadata["eagle3_knob"]["param"]: f.metadata["eagle3_knob"] for cls in FORM_CLASSES
                for f in dataclasses.fields(cls) if f.metadata.get("eagle3_knob", {}).get("param")}
    checked = 0
    for phase, sources in PHASE_SOURCES.items():
        fields = PHASE_CLASSES[phase].__dataclass_fields__
        for name, src in sources.items():
            if isinstance(src, FromParam) and src.name in declared and "eagle3_knob" in fields[name].metadata:
                got, want = fields[name].metadata["eagle3_knob"], declared[src.name]
                assert (got["min"], got["max"], got["gt"]) == (want["min"], want["max"], want["gt"]), (phase, name)
                checked += 1
    assert checked >= 1


def test_max_seq_len_reaches_training(smollm2_path, tmp_path):
    """The form's max_seq_len was merge's only; training truncated at its own 2048 without a word."""
    params = form(smollm2_path, tmp_path, max_seq_len=4096)
    facts = model_facts(str(smollm2_path), None)
    assert phase_template("train")["max_seq_len"] == phase_template("merge")["max_seq_len"] == "{{ params.max_seq_len }}"
    train = phase_values("train", params, "run1", facts)
    merge = phase_values("merge", params, "run1", facts)
    assert train["max_seq_len"] == merge["max_seq_len"] == 4096
    assert "max_seq_len" not in {p for p, v in form_params().items() if v["field"].startswith("TrainConfig.")}


def test_capture_layers_are_resolved_once_and_reach_extraction(smollm2_path, tmp_path):
    params = form(smollm2_path, tmp_path)
    facts = check_run(params, "run1")
    assert facts["capture_layers"] == [2, 15, 27] and facts["num_capture_layers"] == 3
    assert phase_values("extract", params, "run1", facts)["capture_layers"] == [2, 15, 27]
    assert phase_template("extract")["capture_layers"] == "{{ ti.xcom_pull(task_ids='preflight')['capture_layers'] }}"
    for bad, why in (([15, 2, 27], r"ascending, got \[15, 2, 27\]"), ([0, 15, 27], "capture_layers must be >= 1"),
                     ([2, 15, 30], "out of range")):
        with pytest.raises(ConfigError, match=why):
            check_run(form(smollm2_path, tmp_path, capture_layers=bad), "run1")
    with pytest.raises(ConfigError, match="capture_layers"):
        check_run(form(smollm2_path, tmp_path, capture_layers=[]), "run1")


def test_check_run_lists_every_problem_at_once(smollm2_path, tmp_path):
    params = form(smollm2_path, tmp_path, token_budget=16, train_overrides={"lerning_rate": 1},
                  datasets=[{"name": "A1", "prompt_file": "x.jsonl", "max_token": 5}])
    with pytest.raises(ConfigError) as e:
        check_run(params, "run1")
    msg = str(e.value)
    assert "token_budget" in msg and "lerning_rate" in msg and "max_token" in msg
    with pytest.raises(ConfigError, match="cannot set.*max_seq_len"):
        check_run(form(smollm2_path, tmp_path, train_overrides={"max_seq_len": 99}), "run1")
    with pytest.raises(ConfigError, match=r"unknown trigger param\(s\) \['num_shard'\]"):
        with_form_defaults({"num_shard": 2})


def test_phase_templates_and_values_name_the_same_fields():
    for phase, cls in PHASE_CLASSES.items():
        names = set(phase_template(phase))
        fields = {f.name for f in dataclasses.fields(cls)}
        assert names <= fields, (phase, names - fields)


def test_run_folder_rule():
    assert run_dir({"output_root": "/o", "run_name": None}, "manual__2026-12-03T01:00:00+00:00") == \
        "/o/manual__2026-12-03T01-00-00-00-00"
    assert run_dir({"output_root": "/o", "run_name": "exp1"}, "x") == "/o/exp1"


def test_unknown_key_in_a_phase_config_names_it():
    with pytest.raises(ConfigError, match=r"merge: unknown param\(s\) \['max_seq_length'\]"):
        build(MergeConfig, {"inputs": ["a"], "output_dir": "o", "max_seq_length": 5}, "merge")
