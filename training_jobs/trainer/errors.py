"""Errors that stop the job with a message for the person who launched it, and the job's failure file.

The entry point prints a TrainingError's message (no traceback), records it as the job's failure
reason ("<ErrorClass>: <message>") and exits non-zero; anything else is a bug and keeps its
traceback. TrainingError and ConfigError belong to the torch-free contract
(training_jobs/contract/errors.py), which the platform checks runs with before any job exists. The
platform reads two of these reasons (training_jobs/contract/failures.py): `RuleTriggered: ...` (a
rule stopped the run; not retried) and `HungCollective: ...` (the hang watchdog's, written by
trainer/watchdog.py; retried once).
"""

import os
from pathlib import Path

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


class RuleTriggered(TrainingError):
    """A rule (trainer/rules.py) whose action is stop fired, or one whose action is rollback could not
    roll back. The message starts with the rule's name and the step. Its name is the contract's
    `failures.RULE_TRIGGERED` (the failure reason is "<class name>: <message>"; a test keeps them
    equal)."""



def record_failure(reason: str) -> None:
    """SageMaker reports the first 1024 characters of output/failure as the job's FailureReason (the
    toolkit only writes it when absent). Every rank tries, because torchrun may kill rank 0 before it
    gets here; the first to fail wins."""
    output_dir = os.environ.get("SM_OUTPUT_DIR")
    if not output_dir:
        return
    try:
        with open(Path(output_dir) / "failure", "x", encoding="utf-8") as failure:
            failure.write(reason)
    except OSError:  # another rank wrote it first, or there is no output folder (a plain torchrun run)
        pass
