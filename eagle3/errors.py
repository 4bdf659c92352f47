"""Errors the pipeline raises on purpose: each message names the file, line or param at fault.

Whether a retry can help is a property of the failure's class (`retried`, `failure_kind`); the operators' base
class applies it (docs/operations.md, "Which failures are retried"): config errors, bad input over its
threshold, pre-check refusals and authentication failures fail the task at once; faults of the machine or a
service (5xx, timeouts, connection resets, a lost worker or rank) keep the task's retries.
"""


class PipelineError(RuntimeError):
    """A failure the user can act on (bad input, bad param, not enough disk...). Retried unless the class (or
    the instance: `retried=`) says a retry cannot help."""

    retried: bool = True
    kind: str = "a fault"

    def __init__(self, *args, retried: bool | None = None):
        super().__init__(*args)
        if retried is not None:
            self.retried = retried


class ConfigError(PipelineError, ValueError):
    """A parameter is invalid; the message names the parameter."""

    retried = False
    kind = "a config error"


class DeviceOOMError(PipelineError):
    """The GPU ran out of memory; the message names the params that make the work fit. Retried where another
    process may have held the memory (a retry resumes from what is committed), not where a pre-check refuses."""

    kind = "out of memory"


def retried(e: BaseException) -> bool:
    """Whether a retry of the task can help: False for the classes that say so; any other exception (an OSError,
    a torch error, a timeout) is taken for a fault and retried."""
    return bool(getattr(e, "retried", True))


def failure_kind(e: BaseException) -> str:
    return getattr(e, "kind", "a fault")
