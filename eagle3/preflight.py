"""Preflight: check the machine and the run's parameters before any expensive work starts.

Every check runs (a failing one does not hide the next) and the report lists them all; the
phase fails with every problem's message at once, so a user fixes them in one go.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from eagle3.errors import ConfigError, PipelineError
from eagle3.extract.config import stored_dtype
from eagle3.fit import (bytes_per_token, check_fits, check_fp8_device, check_tp_divides, load_config,
                        smallest_fitting_tp, weight_estimate)
from eagle3.io import atomic_write_json
from eagle3.knobs import check_knobs, knob
from eagle3.extract.rates import time_estimate
from eagle3.merge.stats import human_hours
from eagle3.models import model_info
from eagle3.sections import TargetConfig
from eagle3.train.serving import ENGINES, sglang_layer_ids, vllm_layer_ids

log = logging.getLogger(__name__)

OPTIONAL_PACKAGES = ("sglang", "flashinfer-python", "flash-attn", "vllm")
NVIDIA_SMI_QUERY = "index,name,memory.total,memory.used,driver_version,compute_cap"


@dataclass
class PreflightConfig:
    output_dir: str = knob(help="where preflight.json goes")
    estimated_tokens: int = knob(0, min=0, param="estimated_tokens", section="Run",
                                 help="Tokens expected for extraction; preflight checks free disk against it "
                                      "(0 = no disk estimate).")
    allow_cpu: bool = knob(True, param="allow_cpu", section="Run",
                           help="Run on the CPU when no GPU is found (the demo); off = a run without a GPU fails "
                                "in preflight (a GPU worker that lost its GPUs).")
    min_gpus: int = knob(1, min=0, help="GPUs the run needs unless allow_cpu")
    disk_headroom: float = knob(1.1, min=1.0, help="ask for this multiple of the disk estimate")
    estimate_mean_length: int = knob(2048, min=1, help="Mean sample length in tokens the extraction time estimate "
                                                       "assumes (attention's cost grows with it).")
    fit_headroom: float = knob(0.8, gt=0, max=1, help="The target's weights per GPU must fit this fraction of the "
                                                      "free GPU memory (activations and the CUDA context need the rest).")
    serving_engines: list[str] = knob(default_factory=lambda: ["sglang"], param="serving_engines", section="Run",
                                      items={"enum": list(ENGINES)}, schema={"uniqueItems": True},
                                      help="Engines the drafter must be servable by (sglang, vllm): a capture-layer "
                                           "or target problem for one of them fails preflight; for the others it "
                                           "is a note in preflight's log.")

    def __post_init__(self):
        check_knobs(self, "preflight")
        bad = sorted(set(self.serving_engines) - set(ENGINES))
        if bad:
            raise ConfigError(f"preflight param serving_engines: unknown engine(s) {bad}; use {list(ENGINES)}")


class PreflightError(PipelineError):
    retried = False
    kind = "a pre-check refusal"

    def __init__(self, failures: list[str], report: dict):
        self.failures = failures
        self.report = report
        super().__init__("preflight failed:\n  - " + "\n  - ".join(failures))


def parse_nvidia_smi(text: str) -> list[dict]:
    """Parse `nvidia-smi --query-gpu=<NVIDIA_SMI_QUERY> --format=csv,noheader,nounits` output."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 6:
            continue
        idx, name, mem_total, mem_used, driver, cc = parts
        gpus.append(
            {
                "index": int(idx),
                "name": name,
                "memory_total_mib": int(float(mem_total)),
                "memory_used_mib": int(float(mem_used)),
                "driver_version": driver,
                "compute_capability": cc,
            }
        )
    return gpus


def gpu_report(nvidia_smi: str | None = "nvidia-smi") -> dict:
    report: dict = {"nvidia_smi": None, "gpus": [], "torch": {}}
    exe = shutil.which(nvidia_smi) if nvidia_smi else None
    if exe:
        try:
            out = subprocess.run(
                [exe, f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=30, check=True,
            ).stdout
            report["nvidia_smi"] = exe
            report["gpus"] = parse_nvidia_smi(out)
        except (subprocess.SubprocessError, OSError) as e:
            report["nvidia_smi_error"] = str(e)
    import torch

    t = {"version": torch.__version__, "cuda_available": torch.cuda.is_available(), "cuda_runtime": torch.version.cuda}
    if t["cuda_available"]:
        t["device_count"] = torch.cuda.device_count()
        t["devices"] = [
            {
                "name": torch.cuda.get_device_name(i),
                "compute_capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                "memory_total_mib": torch.cuda.get_device_properties(i).total_memory // 2**20,
            }
            for i in range(t["device_count"])
        ]
    else:
        t["device_count"] = 0
    report["torch"] = t
    return report


def package_versions(names=OPTIONAL_PACKAGES) -> dict:
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_model(target: TargetConfig, failures: list[str]) -> dict:
    try:
        info = model_info(target.model_path)
    except ConfigError as e:
        failures.append(str(e))
        return {}
    out = {"info": info.to_dict()}
    path = Path(target.model_path)
    weights = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    if not weights:
        failures.append(f"model_path {path}: no *.safetensors or *.bin weight files")
    for w in weights:
        if not os.access(w, os.R_OK):
            failures.append(f"model weights {w} are not readable")
    out["weight_files"] = [w.name for w in weights]
    out["weight_bytes"] = sum(w.stat().st_size for w in weights if w.exists())
    has_template = (path / "chat_template.jinja").is_file()
    tok_cfg = path / "tokenizer_config.json"
    if not has_template and tok_cfg.is_file():
        try:
            has_template = bool(json.loads(tok_cfg.read_text()).get("chat_template"))
        except (OSError, json.JSONDecodeError) as e:
            failures.append(f"{tok_cfg}: unreadable: {e}")
    if not has_template:
        failures.append(f"model_path {path}: the tokenizer has no chat template (chat_template.jinja or tokenizer_config.json)")
    out["chat_template"] = has_template
    if isinstance(target.capture_layers, list):  # resolved (TargetConfig.resolved): what serving engines get
        out["capture_layers"] = target.capture_layers
        out["sglang_aux_layer_ids"] = sglang_layer_ids(target.capture_layers, info.architecture)
        out["vllm_aux_layer_ids"] = vllm_layer_ids(target.capture_layers)
    return out


def check_disk(cfg: PreflightConfig, n_layers: int, hidden: int, storage_dtype: str, failures: list[str]) -> dict:
    where = _existing_parent(Path(cfg.output_dir))
    usage = shutil.disk_usage(where)
    per_token = bytes_per_token(n_layers, hidden, storage_dtype)
    need = cfg.estimated_tokens * per_token
    out = {"path": str(where), "free_bytes": usage.free, "estimated_extraction_bytes": need,
           "storage_dtype": storage_dtype, "bytes_per_token": per_token,
           "required_bytes": int(need * cfg.disk_headroom)}
    if need and usage.free < out["required_bytes"]:
        failures.append(
            f"not enough disk at {where}: extraction needs ~{need / 1e9:.2f} GB "
            f"({cfg.estimated_tokens} tokens x {per_token} B: {n_layers + 1} states x {hidden} hidden in "
            f"{storage_dtype} storage, +{(cfg.disk_headroom - 1) * 100:.0f}% headroom) but only "
            f"{usage.free / 1e9:.2f} GB is free"
        )
    return out


TP_PARAM = "extract_tp_size"


def extraction_time(cfg: PreflightConfig, target: TargetConfig, n_gpus: int) -> dict:
    """How long extraction takes at the measured rate of the target's class (eagle3.extract.rates)."""
    try:
        return time_estimate(load_config(target.model_path), cfg.estimated_tokens, cfg.estimate_mean_length, n_gpus,
                             target.tp_size)
    except (ConfigError, KeyError) as e:  # an unreadable config.json is check_model's to report
        return {"error": str(e)}


def check_fit(cfg: PreflightConfig, target: TargetConfig, gpus: list[dict], n_gpus: int,
              failures: list[str]) -> dict:
    """What fits, from config.json alone: tp_size against heads/kv heads/experts and the GPUs; the weights per GPU
    at tp_size against the least free memory of the GPUs, and the smallest tp_size that fits."""
    tp_size = target.tp_size
    try:
        mcfg = load_config(target.model_path)
        check_tp_divides(mcfg, tp_size, TP_PARAM, where=str(target.model_path))
    except (ConfigError, KeyError) as e:
        if isinstance(e, ConfigError) and TP_PARAM in str(e):
            failures.append(str(e))
        return {}
    est = weight_estimate(mcfg, tp_size, "bfloat16")
    out = {"tp_size": tp_size, **est.to_dict()}
    if n_gpus and tp_size > n_gpus:
        failures.append(f"{TP_PARAM}={tp_size} needs {tp_size} GPUs, but this worker sees {n_gpus}")
    free = [(g["memory_total_mib"] - g["memory_used_mib"]) * 2**20 for g in gpus]
    if free:
        out["free_bytes_per_gpu"] = min(free)
        out["smallest_tp_size"] = smallest_fitting_tp(mcfg, min(free), cfg.fit_headroom, dtype="bfloat16")
        try:
            check_fits(mcfg, tp_size, min(free), TP_PARAM, cfg.fit_headroom, dtype="bfloat16", gpus=len(gpus))
        except ConfigError as e:
            failures.append(str(e))
    return out


def run_preflight(cfg: PreflightConfig, target: TargetConfig, storage_dtype: str = "auto",
                  nvidia_smi: str | None = "nvidia-smi", notes: list[str] | None = None) -> dict:
    """Run every check of the machine against the run's (resolved) target, write `<output_dir>/preflight.json`,
    raise PreflightError listing all failures. `storage_dtype`: extraction's, for the disk estimate. `notes`:
    what the run chose before (the datagen server "auto" picked), shown in the summary."""
    failures: list[str] = []
    report: dict = {"host": platform.node(), "python": platform.python_version(), "notes": list(notes or [])}
    report["gpu"] = gpu_report(nvidia_smi)
    report["packages"] = package_versions()
    n_gpus = report["gpu"]["torch"]["device_count"]
    report["device"] = "cuda" if n_gpus else "cpu"
    if not n_gpus and cfg.allow_cpu:
        report["notes"].append("no GPU found: the run uses the CPU (allow_cpu; set it false to require a GPU)")
    if n_gpus < cfg.min_gpus and not cfg.allow_cpu:
        failures.append(
            f"found {n_gpus} usable GPU(s) (torch.cuda), need {cfg.min_gpus}; set allow_cpu=true to run on the CPU"
        )
    report["model"] = check_model(target, failures)
    report["fit"] = check_fit(cfg, target, report["gpu"]["gpus"], n_gpus, failures)
    if not n_gpus:
        try:
            check_fp8_device(load_config(target.model_path), "cpu", target.model_path)
        except ConfigError as e:
            if "FP8" in str(e):  # an unreadable config.json is check_model's to report
                failures.append(str(e))
    info = report["model"].get("info")
    if info and isinstance(target.capture_layers, list):
        # "auto" storage as the shard's worker resolves it; "auto" compute counts as a GPU's (fp8 states)
        report["disk"] = check_disk(cfg, len(target.capture_layers), info["hidden_size"],
                                    stored_dtype(storage_dtype, target.dtype), failures)
        if not n_gpus and storage_dtype == target.dtype == "auto":
            report["notes"].append("the disk estimate counts fp8 states, as a GPU worker stores them; an extraction "
                                   "on this machine's CPU stores float32 ones, about 4x the bytes")
    if info and cfg.estimated_tokens:
        report["time"] = extraction_time(cfg, target, n_gpus)
    report["failures"] = failures
    report["ok"] = not failures
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "preflight.json", report)
    log.info("preflight report:\n%s", format_report(report))
    if failures:
        raise PreflightError(failures, report)
    return report


def format_report(report: dict) -> str:
    g = report["gpu"]
    lines = [f"host {report['host']}, python {report['python']}, torch {g['torch'].get('version')}"
             f" (cuda runtime {g['torch'].get('cuda_runtime')}), device: {report['device']}"]
    for gpu in g["gpus"]:
        lines.append(f"  GPU{gpu['index']}: {gpu['name']} {gpu['memory_total_mib']} MiB, driver {gpu['driver_version']},"
                     f" cc {gpu['compute_capability']}")
    lines.append("  packages: " + ", ".join(f"{k} {v}" for k, v in report["packages"].items()))
    m = report.get("model") or {}
    if m.get("info"):
        i = m["info"]
        lines.append(f"  model {i['path']}: {i['model_type']}, {i['num_layers']} layers, hidden {i['hidden_size']},"
                     f" vocab {i['vocab_size']}; capture layers {m.get('capture_layers')}")
    if "disk" in report:
        d = report["disk"]
        lines.append(f"  disk {d['path']}: {d['free_bytes'] / 1e9:.1f} GB free, extraction needs"
                     f" {d['estimated_extraction_bytes'] / 1e9:.2f} GB ({d['storage_dtype']} states)")
    if report.get("time"):
        t = report["time"]
        lines.append(f"  extraction time: {human_hours(t['hours_one_gpu'])} on one H200"
                     + (f", {human_hours(t['hours'])} on this worker's {t['gpus']} GPUs" if t["hours"] else "")
                     + f" ({t['tok_per_s']:.0f} tokens/s a GPU at mean length {t['mean_length']}; {t['note']})")
    fit = report.get("fit") or {}
    if fit:
        line = (f"  fit: weights {fit['total_bytes'] / 2**30:.1f} GiB, {fit['per_gpu_bytes'] / 2**30:.1f} GiB per GPU "
                f"at {TP_PARAM}={fit['tp_size']}")
        if "free_bytes_per_gpu" in fit:
            line += (f"; {fit['free_bytes_per_gpu'] / 2**30:.1f} GiB free per GPU, smallest tp_size that fits: "
                     f"{fit['smallest_tp_size']}")
        lines.append(line)
    for note in report.get("notes", []):
        lines.append(f"  {note}")
    for f in report["failures"]:
        lines.append(f"  FAIL: {f}")
    lines.append("  OK" if report["ok"] else "  preflight FAILED")
    return "\n".join(lines)
