import json
import os
import shutil
import stat

import pytest

from eagle3.errors import ConfigError
from eagle3.fit import bytes_per_token
from eagle3.preflight import PreflightConfig, PreflightError, parse_nvidia_smi, run_preflight
from eagle3.sections import TargetConfig


def preflight(model, out, storage_dtype="auto", nvidia_smi="nvidia-smi", **kw):
    """run_preflight as the run runs it: on the target resolved where it can be (a missing model is
    preflight's to report)."""
    kw.setdefault("allow_cpu", True)
    target = TargetConfig(model_path=str(model))
    try:
        target = target.resolved()
    except ConfigError:
        pass
    return run_preflight(PreflightConfig(output_dir=str(out), **kw), target, storage_dtype, nvidia_smi=nvidia_smi)


def test_preflight_passes_on_cpu_with_real_model(smollm2_path, tmp_path):
    report = preflight(smollm2_path, tmp_path / "pf", estimated_tokens=10_000)
    assert report["ok"] and report["failures"] == []
    assert report["device"] in ("cpu", "cuda")
    assert report["model"]["capture_layers"] == [2, 15, 27]
    assert report["model"]["sglang_aux_layer_ids"] == [1, 14, 26]
    # "auto" storage on a GPU run (the estimate's assumption): 4 fp8 states of 576 values with an fp32 scale each,
    # an int32 id and a uint8 mask a token
    assert report["disk"]["storage_dtype"] == "float8_e4m3fn"
    assert report["disk"]["estimated_extraction_bytes"] == 10_000 * (4 * (576 + 4) + 5)
    cpu_note = [n for n in report["notes"] if "the disk estimate counts fp8 states" in n]
    assert len(cpu_note) == (report["device"] == "cpu")  # where the extraction would store float32 instead
    assert report["model"]["vllm_aux_layer_ids"] == [2, 15, 27]
    assert report["packages"]["sglang"]  # a version or "absent"
    saved = json.loads((tmp_path / "pf" / "preflight.json").read_text())
    assert saved["ok"] is True


def test_bad_capture_layer_fails_naming_layer_and_depth(smollm2_path, tmp_path):
    with pytest.raises(ConfigError, match=r"capture layer 58 is out of range.*30 decoder layers"):
        TargetConfig(model_path=str(smollm2_path), capture_layers=[2, 15, 58]).resolved()


def test_not_enough_disk_fails_with_both_numbers(smollm2_path, tmp_path):
    free = shutil.disk_usage(tmp_path).free
    tokens = free // bytes_per_token(3, 576, "auto") * 2  # twice what fits
    with pytest.raises(PreflightError) as e:
        preflight(smollm2_path, tmp_path, estimated_tokens=tokens)
    msg = str(e.value)
    assert "not enough disk" in msg
    need_gb = tokens * bytes_per_token(3, 576, "auto") / 1e9
    assert f"{need_gb:.2f} GB" in msg and "GB is free" in msg
    # the report is still written, with the failure in it
    assert json.loads((tmp_path / "preflight.json").read_text())["ok"] is False


def test_no_gpu_without_allow_cpu_fails(smollm2_path, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(PreflightError, match=r"found 0 usable GPU\(s\).*allow_cpu=true"):
        preflight(smollm2_path, tmp_path, allow_cpu=False)


def test_missing_model_and_missing_template(smollm2_path, tmp_path):
    with pytest.raises(PreflightError, match="no such directory"):
        preflight(tmp_path / "missing", tmp_path / "out")
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(smollm2_path / "config.json", broken)
    with pytest.raises(PreflightError) as e:
        preflight(broken, tmp_path / "out2")
    assert "no *.safetensors" in str(e.value) and "no chat template" in str(e.value)


def test_nvidia_smi_output_is_parsed(smollm2_path, tmp_path):
    text = "0, NVIDIA H200, 143771, 0, 580.95.05, 9.0\n1, NVIDIA H200, 143771, 512, 580.95.05, 9.0\n"
    gpus = parse_nvidia_smi(text)
    assert gpus[1] == {"index": 1, "name": "NVIDIA H200", "memory_total_mib": 143771, "memory_used_mib": 512,
                       "driver_version": "580.95.05", "compute_capability": "9.0"}
    # and through a real subprocess: a stand-in nvidia-smi on PATH that prints that text
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nprintf '{text}'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    from eagle3.preflight import gpu_report

    rep = gpu_report(str(fake))
    assert [g["index"] for g in rep["gpus"]] == [0, 1]
