"""Knobs: each config field declared once, with its default, bounds and help.

A phase config is a dataclass whose fields are `knob(...)`s. From that one declaration come
- the checks: `check_knobs(cfg)` (type, bounds, choices; the message names the phase and the param),
- the build from user input: `build(cls, mapping, where)` (an unknown key is a ConfigError naming it),
- the trigger form: `form_params(cls)` gives, for every knob with a `param` name, its default and
  JSON schema (the DAG wraps them in Airflow Params; this module imports neither Airflow nor torch).

    @dataclass
    class ExtractConfig:
        token_budget: int = knob(16384, min=256, param="token_budget", section="Extraction",
                                 help="Padded tokens per forward pass; lower it after an out-of-memory error.")
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from eagle3.errors import ConfigError

_META = "eagle3_knob"


def knob(default: Any = dataclasses.MISSING, *, help: str, min: float | None = None, max: float | None = None,
         gt: float | None = None, choices: tuple | list | None = None, param: str | None = None,
         section: str | None = None, default_factory: Any = dataclasses.MISSING, pattern: str | None = None,
         items: dict | None = None, schema: dict | None = None) -> Any:
    """A dataclass field with its bounds and help. `param`: the trigger-form name (None = not in the form);
    `min`/`max` inclusive, `gt` exclusive; `choices` for strings; `pattern`/`items`/`schema` extend the form's
    JSON schema (e.g. schema={"maxItems": 8})."""
    meta = {_META: {"help": help, "min": min, "max": max, "gt": gt, "choices": tuple(choices) if choices else None,
                    "param": param, "section": section, "pattern": pattern, "items": items, "schema": schema}}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def knob_meta(f: dataclasses.Field) -> dict | None:
    return f.metadata.get(_META)


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _union_args(tp) -> tuple:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def _matches(value: Any, tp) -> bool:
    """Does `value` have type `tp` (int is not bool; an int is a float; list[X] checks its items)?"""
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return isinstance(value, (list, tuple)) and (not args or all(_matches(v, args[0]) for v in value))
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    return isinstance(value, tp) if isinstance(tp, type) else True


def _type_name(tp) -> str:
    names = {int: "an int", float: "a number", bool: "true or false", str: "a string", dict: "an object",
             type(None): "null"}
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (list, tuple):
        args = typing.get_args(tp)
        return f"a list of {_type_name(args[0]).removeprefix('an ').removeprefix('a ')}s" if args else "a list"
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def param_label(where: str, f: dataclasses.Field) -> str:
    """How an error names a knob: `extract param token_budget`, plus the trigger-form name when it differs."""
    meta = knob_meta(f) or {}
    form = meta.get("param")
    return f"{where} param {f.name}" + (f" (trigger-form param {form})" if form and form != f.name else "")


def check_value(where: str, f: dataclasses.Field, tp, value: Any) -> None:
    meta = knob_meta(f)
    label = param_label(where, f)
    if not _matches(value, tp):
        raise ConfigError(f"{label} must be {_type_name(tp)}, got {value!r}")
    if meta is None:
        return
    numbers = [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []
    if isinstance(value, (list, tuple)):
        numbers = [v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
    for v in numbers:
        lo, hi, gt = meta["min"], meta["max"], meta["gt"]
        if (lo is not None and v < lo) or (hi is not None and v > hi) or (gt is not None and not v > gt):
            bounds = " and ".join(b for b in (f">= {lo}" if lo is not None else "", f"> {gt}" if gt is not None else "",
                                             f"<= {hi}" if hi is not None else "") if b)
            raise ConfigError(f"{label} must be {bounds}, got {value!r}")
    if meta["choices"] and isinstance(value, str) and value not in meta["choices"]:
        raise ConfigError(f"{label}={value!r}: use one of {list(meta['choices'])}")


def check_knobs(cfg: Any, where: str) -> None:
    """Check every knob of `cfg` against its declared type and bounds; the first bad one raises ConfigError."""
    hints = _hints(type(cfg))
    for f in dataclasses.fields(cfg):
        if knob_meta(f) is not None:
            check_value(where, f, hints[f.name], getattr(cfg, f.name))


def build(cls, values: Any, where: str):
    """`cls(**values)`, where an unknown or missing key is a ConfigError naming it (not a TypeError)."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where} config must be an object of params, got {type(values).__name__}: {values!r}")
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown param(s) {unknown}; known: {sorted(known)}")
    missing = [n for n, f in known.items() if n not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: missing required param(s) {missing}")
    hints = _hints(cls)
    values = {k: _section(hints[k], v, f"{where}.{k}") for k, v in values.items()}
    return cls(**values)


def _section(tp, value: Any, where: str) -> Any:
    """A shared section given as an object (a JSON round trip of the run configuration) built as its dataclass."""
    if isinstance(value, dict):
        for a in _union_args(tp):
            if dataclasses.is_dataclass(a):
                return build(a, value, where)
    return value


def _json_type(tp) -> list[str]:
    out: list[str] = []
    for a in _union_args(tp):
        origin = typing.get_origin(a)
        name = ("null" if a is type(None) else "array" if origin in (list, tuple) else
                "object" if a is dict or origin is dict else
                {bool: "boolean", int: "integer", float: "number", str: "string"}.get(a, "string"))
        if name not in out:
            out.append(name)
    return out


def _item_schema(tp) -> dict:
    """The JSON schema of a list's items from its annotation (list[int] -> integer)."""
    for a in _union_args(tp):
        if typing.get_origin(a) in (list, tuple) and typing.get_args(a):
            return {"type": _json_type(typing.get_args(a)[0])[0]}
    return {}


def form_params(*classes) -> dict[str, dict]:
    """{form name: {"default", "schema", "section", "description"}} for every knob with a `param` name.

    The schema is JSON Schema (what Airflow's Param takes); the description is the knob's help."""
    out: dict[str, dict] = {}
    for cls in classes:
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            meta = knob_meta(f)
            if meta is None or not meta["param"]:
                continue
            types_ = _json_type(hints[f.name])
            schema: dict[str, Any] = {"type": types_[0] if len(types_) == 1 else types_}
            bounds = {"minimum": meta["min"], "maximum": meta["max"], "exclusiveMinimum": meta["gt"]}
            target = schema
            if "array" in types_:
                target = schema.setdefault("items", dict(meta["items"] or _item_schema(hints[f.name])))
            elif meta["items"]:
                schema["items"] = meta["items"]
            target.update({k: v for k, v in bounds.items() if v is not None})
            if meta["choices"]:
                schema["enum"] = list(meta["choices"])
                schema.pop("type")
            if meta["pattern"]:
                schema["pattern"] = meta["pattern"]
            schema.update(meta["schema"] or {})
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            name = meta["param"]
            if name in out:
                raise ValueError(f"trigger-form param {name!r} is declared twice ({cls.__name__}.{f.name})")
            out[name] = {"default": default, "schema": schema, "section": meta["section"],
                         "description": meta["help"], "field": f"{cls.__name__}.{f.name}"}
    return out
