"""The training program's failure reasons that the platform acts on.

The training program writes why it failed into output/failure as `<Kind>: <message>`; SageMaker
reports it as the job's FailureReason, after "AlgorithmError: ". Two kinds say more than "the job
failed" (docs/training.md, "Rules"):

- `RuleTriggered`: one of the program's rules stopped the run (a loss spike, an exploding gradient,
  a throughput drop, or a roll-back that could not help). A retry would resume from the same
  checkpoint into the same fault: the launcher does not retry it.
- `HungCollective`: the program's hang watchdog ended a job whose collectives stopped completing
  (a dead or stalled rank, a broken link), after every rank wrote its Python stacks. Often
  transient: the launcher retries the run once, from its last checkpoint, as a new job.

The names are the training contract's (training_jobs/contract/failures.py), which the program
writes them by; tests/llmtrain/test_program_failures.py reads what the program writes. Standard
library only, imported by the launcher's and the job events' functions and by the CLI.
"""

from __future__ import annotations

from training_jobs.contract.failures import HUNG_COLLECTIVE, RULE_TRIGGERED

__all__ = ["HUNG_COLLECTIVE", "MEANING", "RETRIES", "RULE_TRIGGERED", "meaning", "program_failure"]
# Retries the launcher allows a run after a job failed with this kind (not counting other retries).
RETRIES = {RULE_TRIGGERED: 0, HUNG_COLLECTIVE: 1}
# What each kind means for the person who reads a run's status or notification.
MEANING = {
    RULE_TRIGGERED: "a rule of the training program stopped the run (its [rule] lines in the job's log "
    "say what it saw); it is not retried: starting it again resumes from its last checkpoint",
    HUNG_COLLECTIVE: "the training program's hang watchdog ended a job whose collectives stopped "
    "completing; every rank's Python stacks are in the job's log and in hang/ of its output; the "
    "launcher retries such a run once from its last checkpoint",
}


def program_failure(failure_reason: str | None) -> str | None:
    """RULE_TRIGGERED or HUNG_COLLECTIVE when a job's FailureReason carries one, else None."""
    reason = failure_reason or ""
    return next((kind for kind in (HUNG_COLLECTIVE, RULE_TRIGGERED) if f"{kind}: " in reason), None)


def meaning(failure_reason: str | None) -> str | None:
    """What the program failure in a FailureReason means, or None for any other reason."""
    kind = program_failure(failure_reason)
    return MEANING[kind] if kind else None
