"""The training phase as the DAG runs it: idempotent, with artifacts and report.json.

train_phase: shards -> <train_dir>/{draft_vocab.safetensors, checkpoints/, metrics.jsonl, validation.jsonl (with a
             held-out slice), export/, training.png, report.json}. A finished run (report.json complete with the same fingerprint and the export present)
             is skipped; a killed one resumes from its last checkpoint.
report.json is the phase's record (eagle3.io.PhaseOutput): written last, it says the phase is complete.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import asdict
from pathlib import Path

from eagle3.io import PhaseOutput, atomic_path, fingerprint
from eagle3.train.config import TrainConfig, data_fingerprint, shard_chunk_hashes
from eagle3.train.export import WEIGHTS_FILE, export_drafter
from eagle3.train.serving import serving_problems
from eagle3.train.trainer import read_metrics, train

REPORT = "report.json"

log = logging.getLogger(__name__)


def plot_training(metrics: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    K = len(metrics[0]["loss_k"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(steps, [m["loss"] for m in metrics], "k-", label="weighted total")
    for k in range(K):
        a.plot(steps, [m["loss_k"][k] for m in metrics], lw=0.8, label=f"step {k}")
        b.plot(steps, [m["acc_k"][k] for m in metrics], lw=0.8, label=f"step {k}")
    a.set(xlabel="optimizer step", ylabel="soft cross-entropy", title="TTT loss", yscale="log")
    b.set(xlabel="optimizer step", ylabel="top-1 accuracy vs target", title="TTT top-1 accuracy", ylim=(0, 1))
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=90)
    plt.close(fig)


def train_phase(cfg: TrainConfig) -> dict:
    out = Path(cfg.output_dir)
    export_dir = out / "export"
    # the record vouches for the params and the data: re-extracted chunks that hash the same need no training
    data = data_fingerprint(cfg.shard_dirs)
    chunks = sum(len(h or []) for h in shard_chunk_hashes(cfg.shard_dirs).values())
    record = PhaseOutput(out, fingerprint([cfg.fingerprint(), data]), REPORT)
    if (done := record.completed(lambda r: (export_dir / WEIGHTS_FILE).is_file())) is not None:
        log.info("training already complete in %s with these params, and the %d chunks of the %d shards hash the "
                 "same as those it trained on (data %s): skipping; the export is %s", out, chunks,
                 len(cfg.shard_dirs), data, export_dir)
        return done
    before = record.read() or {}
    if before.get("complete") and before.get("data_fingerprint") not in (None, data):
        # a finished training on other chunks: its checkpoints would resume the old run, not train on these
        log.info("the shards' chunks differ from those the drafter in %s was trained on (data %s, now %s): "
                 "training again from scratch", out, before["data_fingerprint"], data)
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    record.invalidate()
    res = train(cfg)
    problems = list(serving_problems(res["capture_layers"], res["info"].architecture).values())
    for p in problems:
        log.warning("%s", p)
    export_drafter(res["drafter"], res["vocab"], res["info"], res["capture_layers"], export_dir)
    metrics = read_metrics(out / "metrics.jsonl")
    plot_training(metrics, out / "training.png")
    first, last = metrics[0], metrics[-1]
    return record.commit({
        "params": asdict(cfg), "export_dir": str(export_dir), "steps": res["steps"], "data_fingerprint": data,
        "chunks": chunks,
        "train_tokens": res["tokens"], "train_samples": res["samples"], "truncation": res["truncation"],
        "draft_vocab_size": res["vocab"].size, "capture_layers": res["capture_layers"],
        "serving_problems": problems, "first": {"loss": first["loss"], "acc_k": first["acc_k"]},
        "last": {"loss": last["loss"], "acc_k": last["acc_k"]}, "metrics": str(out / "metrics.jsonl"),
        "plot": str(out / "training.png"), "seconds_this_run": round(res["seconds"], 1),
        # with a held-out slice: which step's weights were exported and by how much they beat the last step's
        "checkpoint_selection": res["selection"] or None,
    })
