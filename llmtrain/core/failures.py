"""How a training job, or the call that starts one, failed: one table of SageMaker's wording, read by
the launcher (which decides a retry from it) and by the job-events function (which counts and
notifies every job's end).

- `classify_job_failure`: the class of an ended job from its FailureReason (`FailureClass`:
  capacity, plan_capacity, quota, rule, hang, algorithm, internal). The job-events function's metric
  dimension.
- `classify_failure`: what the launcher's start step caught (`{"Error", "Cause"}` from
  CreateTrainingJob `.sync`), as a `Failure` whose `kind` drives the retry policy: capacity,
  plan_capacity, quota, throttled, rule_stopped and hung (the training program's own reasons,
  llmtrain.core.program_failures), job_failed, stopped or api_error. A queued attempt's start step
  is another (`llmtrain.lifecycle.queue_submission.QueueSubmission.classify`), which adds the two kinds of a
  service job Batch ended at the head of its queue: `QUEUE_CAPACITY` and `QUEUE_MISCONFIGURED`.

Markers are matched without regard to case, first class first: capacity and quota come before the
rest because SageMaker wraps their reasons in a ClientError prefix, the training program's own
reasons before the AlgorithmError that wraps them. Standard library only (the operations functions
ship no compiled packages).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from llmtrain.core.program_failures import HUNG_COLLECTIVE, RULE_TRIGGERED, program_failure

CAPACITY_MARKERS = (
    "capacityerror",
    "insufficientinstancecapacity",
    "insufficientcapacity",
    "insufficient capacity",
    "unable to provision requested ml compute capacity",
)
QUOTA_MARKERS = ("resourcelimitexceeded", "resource limit exceeded")
# SageMaker's API throttling, as Step Functions reports it in the cause of a failed call.
THROTTLING_MARKERS = ("throttlingexception", "rate exceeded", "toomanyrequestsexception")
INTERNAL_MARKERS = ("internalservererror", "internal server error", "internalfailure")
ALGORITHM_MARKERS = ("algorithmerror", "clienterror")
# A job in a training plan that waited longer than MaxPendingTimeInSeconds fails with a reason about
# its pending time.
PENDING_MARKER = "pending"

# A queued attempt Batch ended at the head of its queue: no capacity for it within the queue's
# capacity time limit, or a job larger than the service environment (llmtrain.lifecycle.queue_submission).
QUEUE_CAPACITY = "queue_capacity"
QUEUE_MISCONFIGURED = "queue_misconfigured"
# A tune's attempt, its tuning job, ended Failed (llmtrain.lifecycle.tuning_jobs.TuningSubmission.classify).
TUNE_FAILED = "tune_failed"

_QUOTA_MESSAGE = re.compile(
    r"service limit '(?P<name>[^']+)' is (?P<limit>\d+) \w+, with current utilization of "
    r"(?P<used>\d+) \w+ and a request delta of (?P<delta>\d+) \w+"
)


class FailureClass(StrEnum):
    """The class of a failed job (the job-events function's `FailureClass` metric dimension)."""

    CAPACITY = "capacity"
    PLAN_CAPACITY = "plan_capacity"
    QUOTA = "quota"
    RULE = "rule"
    HANG = "hang"
    ALGORITHM = "algorithm"
    INTERNAL = "internal"


# Checked in order; the first class with a marker in the reason wins.
_JOB_FAILURE_MARKERS: tuple[tuple[FailureClass, tuple[str, ...]], ...] = (
    (FailureClass.CAPACITY, CAPACITY_MARKERS),
    (FailureClass.QUOTA, QUOTA_MARKERS),
    (FailureClass.RULE, (f"{RULE_TRIGGERED.lower()}: ",)),
    (FailureClass.HANG, (f"{HUNG_COLLECTIVE.lower()}: ",)),
    (FailureClass.INTERNAL, INTERNAL_MARKERS),
    (FailureClass.ALGORITHM, ALGORITHM_MARKERS),
)


def mentions(text: str, markers: tuple[str, ...]) -> bool:
    """Whether `text` holds one of `markers` (lowercase), without regard to case."""
    lowered = text.lower()
    return any(marker in lowered for marker in markers)


def classify_job_failure(failure_reason: str | None, *, in_training_plan: bool = False) -> FailureClass:
    """The class of a failed job from its FailureReason; a job in a training plan that found no free
    instance (capacity, or its pending time ran out) is `plan_capacity`: retrying elsewhere would
    leave the reserved capacity."""
    reason = failure_reason or ""
    found = next(
        (failure_class for failure_class, markers in _JOB_FAILURE_MARKERS if mentions(reason, markers)),
        FailureClass.INTERNAL,
    )
    if in_training_plan and (found is FailureClass.CAPACITY or mentions(reason, (PENDING_MARKER,))):
        return FailureClass.PLAN_CAPACITY
    return found


@dataclass(frozen=True)
class Quota:
    """The numbers of a ResourceLimitExceeded message."""

    name: str
    limit: int
    in_use: int
    requested: int

    def describe(self) -> str:
        return (
            f"quota '{self.name}' is {self.limit}, {self.in_use} in use, and this job asks for "
            f"{self.requested} more"
        )


def parse_quota(message: str) -> Quota | None:
    match = _QUOTA_MESSAGE.search(message)
    if match is None:
        return None
    return Quota(
        name=match["name"],
        limit=int(match["limit"]),
        in_use=int(match["used"]),
        requested=int(match["delta"]),
    )


@dataclass(frozen=True)
class Failure:
    """One failed attempt, classified. `kind`: capacity, plan_capacity (a job in a training plan found
    no free capacity in its pending time), quota, throttled (SageMaker refused the call for its rate;
    no job exists), rule_stopped and hung (the training program's, `PROGRAM_FAILURE_KINDS`),
    job_failed, stopped, api_error, invalid_retry (the retry could not be rendered), for a queued
    attempt queue_capacity and queue_misconfigured, and for a tune tune_failed."""

    kind: str
    reason: str
    job: Mapping[str, Any] | None = None
    quota: Quota | None = None


def classify_failure(failure: Mapping[str, Any], *, in_training_plan: bool = False) -> Failure:
    """Classify the `{"Error", "Cause"}` that Step Functions caught from CreateTrainingJob `.sync`.

    A job that ran and ended badly arrives as `States.TaskFailed` with the DescribeTrainingJob
    output as the cause (JSON); an API error (e.g. ResourceLimitExceeded, ThrottlingException)
    arrives as `SageMaker.<...>` with SageMaker's message and error code as the cause.

    A job in a training plan waits in Pending for the plan's reserved capacity: running out of that
    wait (MaxPendingTimeInSeconds) or of the plan's instances is `plan_capacity`, never `capacity`,
    since retrying elsewhere or on a fallback type would leave the plan that was paid for.
    """
    error, cause = str(failure.get("Error", "")), str(failure.get("Cause", ""))
    job = _job_from_cause(cause)
    if job is not None:
        classified = _classify_job(job)
        return _in_plan(classified) if in_training_plan else classified
    text = f"{error}: {cause}"
    if mentions(text, QUOTA_MARKERS):
        return Failure(kind="quota", reason=cause or error, quota=parse_quota(cause))
    if mentions(text, CAPACITY_MARKERS):
        return Failure(kind="plan_capacity" if in_training_plan else "capacity", reason=cause or error)
    if mentions(text, THROTTLING_MARKERS):
        return Failure(kind="throttled", reason=cause or error)
    return Failure(kind="api_error", reason=f"{error}: {cause}" if cause else error)


def _in_plan(failure: Failure) -> Failure:
    pending = failure.job is not None and failure.job.get("TrainingStartTime") is None and mentions(
        failure.reason, (PENDING_MARKER,)
    )
    if failure.kind == "capacity" or (failure.kind == "job_failed" and pending):
        return Failure(kind="plan_capacity", reason=failure.reason, job=failure.job)
    return failure


def _job_from_cause(cause: str) -> dict[str, Any] | None:
    try:
        data = json.loads(cause)
    except ValueError:
        return None
    return data if isinstance(data, dict) and "TrainingJobStatus" in data else None


# The failure kind of a job that the training program ended with one of its own failure reasons.
PROGRAM_FAILURE_KINDS = {RULE_TRIGGERED: "rule_stopped", HUNG_COLLECTIVE: "hung"}


def _classify_job(job: Mapping[str, Any]) -> Failure:
    reason = str(job.get("FailureReason") or job.get("TrainingJobStatus"))
    if job.get("TrainingJobStatus") == "Stopped":
        return Failure(kind="stopped", reason=reason, job=job)
    failure_class = classify_job_failure(reason)
    if failure_class is FailureClass.CAPACITY:
        return Failure(kind="capacity", reason=reason, job=job)
    if failure_class is FailureClass.QUOTA:
        return Failure(kind="quota", reason=reason, job=job, quota=parse_quota(reason))
    program = program_failure(reason)
    if program is not None:
        return Failure(kind=PROGRAM_FAILURE_KINDS[program], reason=reason, job=job)
    return Failure(kind="job_failed", reason=reason, job=job)
