"""Errors the pipeline raises on purpose: each message names the file, line or param at fault."""


class PipelineError(RuntimeError):
    """A failure the user can act on (bad input, bad param, not enough disk...)."""


class ConfigError(PipelineError, ValueError):
    """A parameter is invalid; the message names the parameter."""
