"""What the merge saw and did: bad input per reason (with file:line examples), drops, the cap, the length
histogram and the extraction estimate. Written to stats.json; the bad-input threshold is checked here."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from eagle3.errors import PipelineError
from eagle3.merge.parse import BadLine
from eagle3.extract.config import stored_dtype
from eagle3.fit import bytes_per_token
from eagle3.sections import TargetConfig

# Length histogram bin edges: 0, 64, 128, ..., 2^20 tokens, then everything longer.
HIST_EDGES = [0] + [2**k for k in range(6, 21)]


class BadInputError(PipelineError):
    """More bad input than its threshold allows: the same input fails the same way."""

    retried = False
    kind = "bad input over its threshold"


@dataclass
class ReasonCount:
    count: int = 0
    tokens: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, count: int, examples: list[str], max_examples: int, tokens: int = 0) -> None:
        self.count += count
        self.tokens += tokens
        self.examples += examples[:max(0, max_examples - len(self.examples))]


@dataclass
class DatasetStats:
    lines: int = 0
    bad: int = 0
    samples_in: int = 0  # valid samples, before the cap
    tokens_in: int = 0
    truncated: int = 0
    dropped: int = 0
    duplicates: int = 0
    samples_out: int = 0
    tokens_out: int = 0


def _hist(lengths: np.ndarray) -> np.ndarray:
    return np.bincount(np.searchsorted(HIST_EDGES, lengths, side="right") - 1, minlength=len(HIST_EDGES))


class MergeStats:
    def __init__(self, max_examples: int = 5):
        self.max_examples = max_examples
        self.bad: dict[str, ReasonCount] = {}
        self.dropped: dict[str, ReasonCount] = {}
        self.datasets: dict[str, DatasetStats] = {}
        self.truncated = self.truncated_tokens = 0
        self.hist_in = np.zeros(len(HIST_EDGES), np.int64)
        self.hist_out = np.zeros(len(HIST_EDGES), np.int64)
        self.assistant_tokens_out = 0
        self.empty_datasets = 0

    def dataset(self, name: str) -> DatasetStats:
        return self.datasets.setdefault(name, DatasetStats())

    def add_bad(self, dataset: str, path, reason: str, count: int, examples: list[BadLine]) -> None:
        self.bad.setdefault(reason, ReasonCount()).add(
            count, [f"{path}:{b.line}: {b.message}" for b in examples], self.max_examples)
        if reason == "empty_dataset":
            self.empty_datasets += count
        else:
            self.dataset(dataset).bad += count

    def add_drop(self, dataset: str, path, reason: str, count: int, tokens: int, examples: list[BadLine]) -> None:
        self.dropped.setdefault(reason, ReasonCount()).add(
            count, [f"{path}:{b.line}: {b.message}" for b in examples], self.max_examples, tokens)
        self.dataset(dataset).dropped += count

    def add_valid(self, dataset: str, lengths: np.ndarray, truncated: int, truncated_tokens: int) -> None:
        d = self.dataset(dataset)
        d.samples_in += len(lengths)
        d.tokens_in += int(lengths.sum())
        d.truncated += truncated
        self.truncated += truncated
        self.truncated_tokens += truncated_tokens
        self.hist_in += _hist(lengths)

    def add_output(self, datasets: np.ndarray, lengths: np.ndarray, assistant_tokens: int) -> None:
        names, inv = np.unique(datasets, return_inverse=True)
        tokens = np.bincount(inv, weights=lengths, minlength=len(names))
        rows = np.bincount(inv, minlength=len(names))
        for name, r, t in zip(names, rows, tokens):
            d = self.dataset(str(name))
            d.samples_out += int(r)
            d.tokens_out += int(t)
        self.hist_out += _hist(lengths)
        self.assistant_tokens_out += assistant_tokens

    @property
    def lines(self) -> int:
        return sum(d.lines for d in self.datasets.values())

    @property
    def bad_total(self) -> int:
        return sum(r.count for r in self.bad.values())

    def bad_fraction(self) -> float:
        # An empty dataset counts as one bad unit, so a run of nothing but empty datasets fails.
        return self.bad_total / max(1, self.lines + self.empty_datasets)

    def check_threshold(self, max_bad_fraction: float) -> None:
        frac = self.bad_fraction()
        if frac <= max_bad_fraction and self.bad_total < self.lines + self.empty_datasets:
            return
        parts = [f"{reason} {r.count} (e.g. {r.examples[0]})" for reason, r in sorted(self.bad.items())]
        if frac <= max_bad_fraction:  # every input item is bad: no threshold makes a dataset of that
            raise BadInputError(
                f"merge: every input item is bad ({self.bad_total} of {self.lines} line(s) + {self.empty_datasets} "
                f"empty dataset(s)): nothing to merge, whatever max_bad_fraction allows: " + "; ".join(parts))
        raise BadInputError(
            f"merge: {self.bad_total} bad input item(s) of {self.lines} line(s) + {self.empty_datasets} empty dataset(s)"
            f" = {frac:.2%}, above max_bad_fraction {max_bad_fraction:.2%}: " + "; ".join(parts))

    def to_dict(self, rows: int, tokens: int, estimate: dict | None) -> dict:
        samples_in = sum(d.samples_in for d in self.datasets.values())
        tokens_in = sum(d.tokens_in for d in self.datasets.values())
        return {
            "lines": self.lines,
            "samples_in": samples_in, "tokens_in": tokens_in,
            "samples_out": rows, "tokens_out": tokens, "assistant_tokens_out": self.assistant_tokens_out,
            "truncated": {"samples": self.truncated, "tokens_removed": self.truncated_tokens},
            "dropped": {k: vars(v) for k, v in sorted(self.dropped.items())},
            "bad_input": {"total": self.bad_total, "fraction": self.bad_fraction(),
                          "by_reason": {k: {"count": v.count, "examples": v.examples}
                                        for k, v in sorted(self.bad.items())}},
            "per_dataset": {k: vars(v) for k, v in sorted(self.datasets.items())},
            "length_histogram": {"edges": HIST_EDGES, "samples_in": self.hist_in.tolist(),
                                 "samples_out": self.hist_out.tolist(),
                                 "note": "bin i counts lengths in [edges[i], edges[i+1]); the last bin is open"},
            "extraction_estimate": estimate,
        }


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def human_hours(h: float) -> str:
    if h >= 10:
        return f"{h:.0f} h"
    if h >= 1:
        return f"{h:.1f} h"
    if h * 60 >= 1:
        return f"{h * 60:.0f} min"
    return f"{h * 3600:.0f} s" if h * 3600 >= 10 else f"{h * 3600:.1f} s"


def extraction_estimate(tokens: int, target: TargetConfig | None, storage_dtype: str,
                        tokens_per_s: float | None) -> dict | None:
    """Disk and time the extraction phase will need for these tokens, e.g. "5.5 TB / 91 h"."""
    if target is None or target.hidden_size is None or not isinstance(target.capture_layers, list):
        return None
    n = len(target.capture_layers)
    storage_dtype = stored_dtype(storage_dtype, target.dtype)
    per_token = bytes_per_token(n, target.hidden_size, storage_dtype)
    nbytes = tokens * per_token
    out = {"tokens": tokens, "bytes": nbytes, "num_capture_layers": n, "hidden_size": target.hidden_size,
           "storage_dtype": storage_dtype, "bytes_per_token": per_token, "tokens_per_s": tokens_per_s, "hours": None}
    text = human_bytes(nbytes)
    if tokens_per_s:
        out["hours"] = tokens / tokens_per_s / 3600
        text += f" / {human_hours(out['hours'])}"
    out["text"] = text
    return out
