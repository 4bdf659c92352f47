"""The one shape every eagle3 operator has, as Airflow providers write them.

An operator templates one thing, its phase config: its part of the run configuration that preflight resolved
(eagle3.config.RunConfig, pulled from preflight's XCom as a native dict: `phase_config(name)`), or a dict of the
phase's fields when the operator is used on its own. It builds the core's config dataclass from it (an unknown
key is a ConfigError naming it), calls the core and returns a small JSON-able summary. The retry policy is the
failure class's (eagle3.errors.retried): a failure no retry changes (a config error, bad input over its
threshold, a pre-check refusal, a wrong API key) becomes AirflowFailException, so the task fails at once;
faults (a killed worker, a flaky endpoint) stay ordinary exceptions and keep their retries. Hugging Face
libraries' output goes through the task log at its own level (hf_output_to_task_log).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, ClassVar, Generic, Iterator, Mapping, Sequence, TypeVar

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from eagle3.errors import ConfigError, failure_kind, retried
from eagle3.knobs import build
from eagle3_airflow.operators._render import rendered

C = TypeVar("C")


class Eagle3Operator(BaseOperator, Generic[C]):
    """Subclasses set `config_class` and implement `run(cfg, context)`."""

    config_class: ClassVar[type]
    template_fields: Sequence[str] = ("config",)

    def __init__(self, *, config: Mapping[str, Any] | str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = config

    def build_config(self, **extra: Any) -> C:
        """The phase config from the rendered template (plus mapped values in `extra`)."""
        values = rendered(self.config)
        if not isinstance(values, dict):
            raise ConfigError(f"task {self.task_id}: its config rendered to {type(values).__name__}, not an object "
                              f"(a DAG renders it natively with render_template_as_native_obj=True)")
        return build(self.config_class, {**values, **extra}, where=self.task_id)

    def execute(self, context: Context) -> Any:
        hf_output_to_task_log()
        with retry_policy(self.task_id):
            return self.run(self.build_config(**self.mapped_values()), context)

    def mapped_values(self) -> dict[str, Any]:
        """Config fields that come from the task's own arguments (a mapped shard, a dataset); none by default."""
        return {}

    def run(self, cfg: C, context: Context) -> Any:
        raise NotImplementedError


@contextmanager
def retry_policy(task_id: str) -> Iterator[None]:
    """A failure whose class says no retry can help fails the task at once (AirflowFailException), saying
    what kind it is; anything else propagates and keeps the task's retries."""
    try:
        yield
    except Exception as e:
        if retried(e):
            raise
        raise AirflowFailException(f"{task_id}: {e} ({failure_kind(e)}: not retried)") from e


def hf_output_to_task_log() -> None:
    """No progress bars, and transformers' log records through the task's logger at their own level.

    Airflow logs whatever a task writes to stderr as ERROR: transformers' "Loading weights" bar (tqdm) and its
    own stderr handler (deprecation notices) made red ERROR lines in successful tasks.
    """
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read at import by huggingface_hub and transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' bars and huggingface_hub's
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()  # to the root logger, which Airflow's task log reads
