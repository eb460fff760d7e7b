"""Errors that stop the job with a message for the person who launched it.

The entry point prints a TrainingError's message (no traceback) and exits non-zero; anything else
is a bug and keeps its traceback.
"""


class TrainingError(RuntimeError):
    """A problem in the job's input or environment; the message names it and says what to fix."""


class ConfigError(TrainingError, ValueError):
    """A hyperparameter is unknown or invalid."""


class DataError(TrainingError):
    """A data channel is missing, empty or malformed."""


class ContainerError(TrainingError):
    """The container environment lacks something the job needs."""


class DivergenceError(TrainingError):
    """Training produced a non-finite loss or gradient norm."""


class CheckpointError(TrainingError):
    """A checkpoint could not be written."""


class ExportError(TrainingError):
    """The final model could not be exported as trained."""
