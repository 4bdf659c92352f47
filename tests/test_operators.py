"""The operators' shared behaviour: what reaches the task log, and how templated values arrive."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from operators._render import rendered
from operators.base import hf_output_to_task_log


def test_hf_output_goes_to_the_task_log_not_stderr(capfd, caplog):
    """Airflow logs a task's stderr as ERROR: after the operators' set-up, transformers' progress bar prints
    nothing and its warnings reach the root logger (the task log) as WARNING records."""
    from transformers.utils import logging as hf_logging

    hf_output_to_task_log()
    with caplog.at_level(logging.INFO):
        assert sum(hf_logging.tqdm(range(50), desc="Loading weights")) == 1225
        hf_logging.get_logger("transformers.modeling_utils").warning("a deprecation notice")
    out, err = capfd.readouterr()
    assert "Loading weights" not in out + err and "deprecation" not in err
    rec = [r for r in caplog.records if r.getMessage() == "a deprecation notice"]
    assert len(rec) == 1 and rec[0].levelno == logging.WARNING and rec[0].name == "transformers.modeling_utils"


class CountingSequence(Sequence):
    """A sequence that answers item and slice requests like Airflow's LazyXComSequence (IndexError past the end)
    and counts them, so the test sees how the operator read it."""

    def __init__(self, items):
        self.items, self.requests = list(items), []

    def __len__(self):
        return len(self.items)

    def __getitem__(self, key):
        self.requests.append(key)
        return self.items[key]


def test_mapped_results_are_read_in_one_request_without_a_probe_past_the_end():
    seq = CountingSequence([{"shard_dir": "a"}, {"shard_dir": "b"}])
    assert rendered(seq) == [{"shard_dir": "a"}, {"shard_dir": "b"}]
    assert seq.requests == [slice(None, None, None)]  # iterating would ask for index 2 (404, an ERROR line)
    assert rendered("[2, 15, 27]") == [2, 15, 27] and rendered([1]) == [1] and rendered("x") == "x"
