"""Phase configs from flat keyword arguments, as tests write them: the target's fields (model_path,
capture_layers, tp_size, dtype) go into the config's target section, max_seq_len into its data section."""

from __future__ import annotations

import dataclasses

from eagle3.sections import DataConfig, TargetConfig

TARGET_FIELDS = {f.name for f in dataclasses.fields(TargetConfig)}


def phase(cls, **kw):
    fields = {f.name for f in dataclasses.fields(cls)}
    target = {k: kw.pop(k) for k in list(kw) if k in TARGET_FIELDS}
    if "model_path" in target:
        target["model_path"] = str(target["model_path"])
    if "target" in fields and target:
        kw["target"] = TargetConfig(**target)
    if "max_seq_len" in kw and "data" in fields:
        kw["data"] = DataConfig(max_seq_len=kw.pop("max_seq_len"))
    return cls(**kw)
