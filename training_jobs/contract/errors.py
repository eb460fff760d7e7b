"""The errors the contract raises: a bad hyperparameter, named, with what to set instead.

The training program's other errors (training_jobs/trainer/errors.py) derive from the same
TrainingError: the entry point prints its message (no traceback) and exits non-zero.
"""


class TrainingError(RuntimeError):
    """A problem in the job's input or environment; the message names it and says what to fix."""


class ConfigError(TrainingError, ValueError):
    """A hyperparameter is unknown or invalid."""
