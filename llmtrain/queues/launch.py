"""The launcher's queue path: how a run of an environment with queues is started and followed.

The launcher's functions (llmtrain.handlers.launcher, .queue) call these where the team's platform
context has queues (`PlatformContext.queues`); the lifecycle around them (resolve, retries,
summaries) stays the same. In order:

- `check_queue_choice` (Resolve, before anything): the run's queue is one of the team's and its
  priority within the team's `max_priority`; a queue or priority where there are no queues, or a run
  of more instances than the environment's capacity, is refused as bad input.
- `queued_attempts` (Resolve): a run's earlier attempts are its service jobs (Batch names the
  training jobs it creates itself, so SageMaker's list has them under other names), and
  `queued_pin` the template version they ran, from their tags.
- `with_submission` (Resolve and NextAttempt): the attempt's SubmitServiceJob request beside its
  rendered request, checked against botocore's models; the state machine submits it as it is.
- `watch` (the Watch function, between waits): the service job's state for the run (QUEUED with its
  place and the team's share usage, STARTING, TRAINING), and at its end the training job's
  description (summarized as today) or the failure NextAttempt classifies (`queue_failure`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from llmtrain.errors import LlmtrainError
from llmtrain.platform import PlatformContext
from llmtrain.queues import jobs, policy
from llmtrain.render import TAG_PREFIX
from llmtrain.runs import ExecutionInput, InvalidRunInput, RunState

# How often the Watch step looks again: a queued run every 5 minutes, a training one every 15
# (an execution's history holds 25,000 events: 9 per look, so about 4 weeks of training).
QUEUED_POLL_SECONDS = 300
TRAINING_POLL_SECONDS = 900
# The error a Watch step hands NextAttempt when Batch ended the service job without a training job.
SERVICE_JOB_FAILED = "Batch.ServiceJobFailed"

# Failure kinds of the queue path, their error names and what to do.
QUEUE_CAPACITY = "queue_capacity"
QUEUE_MISCONFIGURED = "queue_misconfigured"
QUEUE_FAILURE_ERRORS = {
    QUEUE_CAPACITY: "QueueCapacityTimeLimit",
    QUEUE_MISCONFIGURED: "QueueMisconfigured",
}


def check_queue_choice(run_input: ExecutionInput, platform: PlatformContext) -> None:
    """InvalidRunInput unless the run's queue and priority are the team's to use."""
    queues = platform.queues
    if queues is None:
        asked = [name for name in ("queue", "priority") if getattr(run_input, name) is not None]
        if asked:
            raise InvalidRunInput(
                f"{' and '.join(asked)} given, but environment {platform.environment!r} has no queues: its "
                "runs start their training jobs directly; leave them out"
            )
        return
    if run_input.queue is not None and run_input.queue not in queues.queue_arns:
        raise InvalidRunInput(
            f"queue {run_input.queue!r} is not one of team {platform.team!r}'s queues "
            f"({', '.join(queues.queue_arns)}); leave it out for {queues.default_queue!r}"
        )
    if (run_input.priority or 0) > queues.max_priority:
        raise InvalidRunInput(
            f"priority {run_input.priority} is above team {platform.team!r}'s max_priority "
            f"({queues.max_priority}); ask for 0..{queues.max_priority}"
        )


def check_capacity(request: Mapping[str, Any], platform: PlatformContext) -> None:
    """InvalidRunInput for a run larger than the environment's queues can ever run."""
    queues = platform.queues
    count = (request.get("ResourceConfig") or {}).get("InstanceCount", 1)
    if queues is not None and count > queues.max_instances:
        raise InvalidRunInput(
            f"the run asks for {count} instances; the environment's queues run at most "
            f"{queues.max_instances} at once, so it could never start: ask for fewer (instance_count)"
        )


def with_submission(result: dict[str, Any], platform: PlatformContext) -> dict[str, Any]:
    """Resolve's or NextAttempt's result, with the SubmitServiceJob request of its attempt where the
    environment has queues (unchanged otherwise, and for a result that starts nothing)."""
    if platform.queues is None or "request" not in result or "run" not in result:
        return result
    run = RunState.from_dict(result["run"])
    check_capacity(result["request"], platform)
    submission = jobs.submit_request(result["request"], platform.queues, queue=run.queue,
                                     priority=run.priority)
    return {**result, "submission": submission}


def queued_attempts(batch, platform: PlatformContext, run_name: str,
                    previous: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The run's attempts: its jobs in SageMaker (`previous`, by their names) and its service jobs in
    the team's queues, one entry per attempt (the service job's where both know it)."""
    stem = f"{platform.job_name_prefix}-{run_name}-a"
    queued = jobs.run_service_jobs(batch, list(platform.queues.queue_arns.values()), stem)
    by_attempt = {job["attempt"]: dict(job) for job in previous}
    by_attempt.update({job["attempt"]: job for job in queued})
    return [by_attempt[attempt] for attempt in sorted(by_attempt)]


def queued_pin(batch, attempts: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
    """The template and version the run's latest service job ran (its `llmtrain:` tags)."""
    for attempt in reversed(attempts):
        if "job_id" in attempt:
            tags = batch.describe_service_job(jobId=attempt["job_id"]).get("tags") or {}
            name, version = tags.get(TAG_PREFIX + "template"), tags.get(TAG_PREFIX + "template-version")
            return (name, version) if name and version else None
    return None


def watch(batch, sagemaker, queue_state: Mapping[str, Any], platform: PlatformContext) -> dict[str, Any]:
    """The run's service job now: `{"job_id", "phase", ..., "wait_seconds"}` while it waits or
    trains; at its end `"job"` (the training job's description) or `"failure"` (`{"Error", "Cause"}`)."""
    if platform.queues is None:
        raise LlmtrainError("the Watch step ran for a team without queues: deploy the launcher and its "
                            "functions together")
    run, described = jobs.queued_run(batch, queue_state["job_id"], share=platform.queues.share_identifier)
    state = {**run.to_dict(), "message": run.describe()}
    if run.phase == "SUCCEEDED":
        return {**state, "job": _training_job(sagemaker, run.training_job_arn)}
    if run.phase == "FAILED":
        return {**state, "failure": _failure(sagemaker, run, described)}
    wait = QUEUED_POLL_SECONDS if run.phase == "QUEUED" else TRAINING_POLL_SECONDS
    return {**state, "wait_seconds": wait}


def _training_job(sagemaker, arn: str | None) -> dict[str, Any]:
    if not arn:
        return {}
    job = sagemaker.describe_training_job(TrainingJobName=arn.rsplit("/", 1)[-1])
    job.pop("ResponseMetadata", None)
    return json.loads(json.dumps(job, default=str))


def _failure(sagemaker, run: jobs.QueuedRun, described: Mapping[str, Any]) -> dict[str, str]:
    """What NextAttempt classifies: the training job's description where one ran (as the .sync
    integration reports a failed job), else Batch's reason for ending the service job."""
    job = _training_job(sagemaker, run.training_job_arn)
    if job and job.get("TrainingJobStatus") in ("Failed", "Stopped"):
        return {"Error": "States.TaskFailed", "Cause": json.dumps(job)}
    reason = described.get("statusReason") or "the service job failed without a reason"
    return {"Error": SERVICE_JOB_FAILED, "Cause": reason}


def queue_failure(error: str, cause: str) -> tuple[str, str] | None:
    """(kind, reason) of a service job Batch ended at the head of its queue; None for another failure."""
    if error != SERVICE_JOB_FAILED:
        return None
    if policy.CAPACITY_REASON in cause:
        return QUEUE_CAPACITY, cause
    if "MISCONFIGURATION:" in cause:
        return QUEUE_MISCONFIGURED, cause
    return None


def queue_advice(kind: str, run: RunState) -> str:
    if kind == QUEUE_CAPACITY:
        return (
            f"the run waited at the head of its queue for {', '.join(run.instance_types)} longer than the "
            "queue's capacity time limit (queues.capacity_wait_seconds): SageMaker had no such instances. "
            "Start the run again later (it resumes from its checkpoints), or with another instance_type"
        )
    return (
        "Batch could not schedule the job as configured (larger than the service environment's capacity?): "
        "ask the platform team to check the environment's queues: settings"
    )


__all__ = [
    "QUEUE_CAPACITY",
    "QUEUE_FAILURE_ERRORS",
    "QUEUE_MISCONFIGURED",
    "SERVICE_JOB_FAILED",
    "check_capacity",
    "check_queue_choice",
    "queue_advice",
    "queue_failure",
    "queued_attempts",
    "queued_pin",
    "watch",
    "with_submission",
]
