"""The quality run's plan: the main configuration, its ablations (one knob each, at equal data) in the order that
tells most first, the time estimates that keep a device call under its deadline, and the results table.

Order: the knobs expected to move tau most, or to change the recipe's cost most, come first (TTT depth 1 vs 7,
epochs 1, sampled answers, max_seq_len 2048, draft vocab 8K, fp8 storage), then the finer steps (epochs 6, depth 3,
vocab 16K, all distinct tokens). A row's `cost` is its expected time relative to the main run's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.io import atomic_write_json


@dataclass(frozen=True)
class DataVariant:
    answers: str = "greedy"  # greedy | sampled (at the run's --temperature)
    storage: str = "bfloat16"  # extraction storage dtype
    max_seq_len: int = 512

    @property
    def key(self) -> str:
        return f"{self.answers}-{self.storage}-{self.max_seq_len}"


@dataclass
class Variant:
    name: str
    change: str  # what differs from the main run
    data: DataVariant
    train: dict  # TrainConfig overrides
    ks: list[int]
    cost: float = 1.0

    def row(self, status: str, train: dict | None = None, ev: dict | None = None, merged: dict | None = None,
            **extra) -> dict:
        row = {"name": self.name, "change": self.change, "status": status, "ks": self.ks}
        if train:
            row.update(draft_vocab=train["draft_vocab_size"], steps=train["steps"], train_tokens=train["train_tokens"],
                       final_loss=train["last"]["loss"], final_acc_k=train["last"]["acc_k"])
        if merged:
            row.update(merged_tokens=merged.get("tokens"), truncated=merged.get("truncated"))
        if ev:
            row.update(tau=ev["tau"], tau_ended_with_eos=ev["tau_ended_with_eos"], share_hit_cap=ev["share_hit_cap"],
                       tau_per_turn=ev["tau_per_turn"], identical_to_greedy=ev["identical_to_greedy"],
                       answers=ev["answers"], eval_seconds=ev["results"]["trained"]["seconds"])
        row.update({k: v for k, v in extra.items() if v is not None})
        return row


ORDER = ["ttt1", "epochs1", "sampled", "seq2048", "vocab8k", "fp8", "epochs6", "ttt3", "vocab16k", "vocab_all"]


def plan(args) -> list[Variant]:
    base_data = DataVariant(max_seq_len=args.max_seq_len)
    base = {"epochs": args.epochs, "ttt_steps": args.ttt_steps, "draft_vocab_size": args.draft_vocab}
    k1 = args.ks[:1]

    def v(name, change, data=base_data, cost=1.0, **train):
        return Variant(name, change, data, {**base, **train}, k1, cost)

    e = args.epochs
    ablations = {
        "ttt1": v("ttt1", "TTT depth 1", ttt_steps=1, cost=0.4),
        "ttt3": v("ttt3", "TTT depth 3", ttt_steps=3, cost=0.6),
        "epochs1": v("epochs1", "1 epoch", epochs=1, cost=1 / e),
        "epochs6": v("epochs6", "6 epochs", epochs=6, cost=6 / e),
        "vocab8k": v("vocab8k", "draft vocab 8K", draft_vocab_size=8192),
        "vocab16k": v("vocab16k", "draft vocab 16K", draft_vocab_size=16384),
        "vocab_all": v("vocab_all", "draft vocab = all distinct tokens", draft_vocab_size=10 ** 6),
        "fp8": v("fp8", "states stored float8_e4m3fn", DataVariant("greedy", "float8_e4m3fn", args.max_seq_len),
                 cost=1.2),
        "sampled": v("sampled", f"sampled answers (T={args.temperature})",
                     DataVariant("sampled", "bfloat16", args.max_seq_len), cost=1.5),
        "seq2048": v("seq2048", "max_seq_len 2048", DataVariant("greedy", "bfloat16", 2048), cost=1.4),
    }
    wanted = ORDER if args.ablations == "all" else [] if args.ablations == "none" else args.ablations.split(",")
    unknown = [w for w in wanted if w not in ablations]
    if unknown:
        raise SystemExit(f"--ablations: unknown {unknown}; known: {ORDER}")
    main = Variant("main", f"main: TTT {args.ttt_steps}, vocab {args.draft_vocab}, bf16, {e} epochs, greedy, "
                           f"max_seq_len {args.max_seq_len}", base_data, dict(base), list(args.ks))
    return [main] + [ablations[w] for w in wanted]


@dataclass
class Clock:
    """Seconds per unit of each kind of stage, measured as the run goes (and kept in `path` for a resumed run):
    a stage is allowed when its estimate ends before the deadline. A kind never measured is allowed."""

    deadline: float
    path: Path
    rates: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.path.is_file():
            self.rates = json.loads(self.path.read_text())

    def record(self, kind: str, units: float, seconds: float) -> None:
        if units > 0:
            self.rates[kind] = seconds / units
            atomic_write_json(self.path, self.rates)

    def allows(self, kind: str, units: float) -> bool:
        return time.time() + self.rates.get(kind, 0.0) * units <= self.deadline


def _fmt(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def write_table(out: Path, meta: dict, rows: list[dict], variants: list[Variant]) -> None:
    """ablations.json (every figure) and ablations.md (the table): tau at the first k over whole answers, over
    answers ending with eos, the share hitting the cap, and tau's change against the main run."""
    main = next((r for r in rows if r["name"] == "main" and "tau" in r), None)
    k = str(variants[0].ks[0])
    lines = [f"| run | change | tau k={k} | vs main | tau eos-ended | share at cap | draft vocab | steps | "
             f"train s | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tau = r.get("tau", {}).get(k)
        delta = tau - main["tau"][k] if main and tau is not None and r is not main else None
        extra = "".join(f"; k={kk}: {_fmt(t)}" for kk, t in r.get("tau", {}).items() if kk != k)
        lines.append(f"| {r['name']} | {r['change']}{extra} | {_fmt(tau)} | "
                     f"{'-' if delta is None else f'{delta:+.2f}'} | {_fmt(r.get('tau_ended_with_eos', {}).get(k))} | "
                     f"{_fmt(r.get('share_hit_cap', {}).get(k))} | {_fmt(r.get('draft_vocab'))} | "
                     f"{_fmt(r.get('steps'))} | {_fmt(r.get('train_s'), 0)} | {r['status']} |")
    atomic_write_json(out / "ablations.json", {**meta, "rows": rows})
    (out / "ablations.md").write_text("\n".join(lines) + "\n")
