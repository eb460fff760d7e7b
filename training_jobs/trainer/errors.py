"""Errors that stop the job with a message for the person who launched it.

The entry point prints a TrainingError's message (no traceback) and exits non-zero; anything else
is a bug and keeps its traceback. TrainingError and ConfigError belong to the torch-free contract
(training_jobs/contract/errors.py), which the platform checks runs with before any job exists.
"""

from ..contract.errors import ConfigError, TrainingError

__all__ = ["CheckpointError", "ConfigError", "ContainerError", "DataError", "DivergenceError",
           "ExportError", "TrainingError"]


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
