"""The launcher's queue path: `QueueSubmission`, how a run of an environment with queues starts and
is followed (the `llmtrain.lifecycle.submission.Submission` of such a deployment).

The launcher's functions use it where the team's platform context has queues
(`PlatformContext.queues`; `llmtrain.handlers.launcher.submission` picks it); the lifecycle around it
(resolve, retries, summaries: `llmtrain.lifecycle`) stays the same. Resolve checks the run's queue and
priority before anything (`llmtrain.lifecycle.resolve.check_queue_choice`); then:

- `check` (Resolve, for the run and each fallback type): a run of more instances than the
  environment's queues can ever run is refused as bad input, and so is a request botocore's models
  refuse as a SubmitServiceJob payload.
- `attempts`, `template_of` (Resolve): a run's earlier attempts are its service jobs (Batch names the
  training jobs it creates itself, so SageMaker's list has them under other names), and the
  template version they ran is in their tags.
- `attempt_state` (Resolve and NextAttempt): the attempt's SubmitServiceJob request beside its
  rendered request, in the run's queue with its priority, checked against botocore's models; the
  state machine submits it as it is.
- `watch` (the Watch function, between waits): the service job's state for the run (QUEUED with its
  place and the team's share usage, STARTING, TRAINING), and at its end the training job's
  description (summarized as any run's) or the failure NextAttempt classifies (`classify`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmtrain.core import queue_policy as policy
from llmtrain.core.errors import LlmtrainError
from llmtrain.core.failures import QUEUE_CAPACITY, QUEUE_MISCONFIGURED, Failure, classify_failure
from llmtrain.core.platform import PlatformContext
from llmtrain.core.queue_context import TeamQueues
from llmtrain.core.render import TAG_PREFIX
from llmtrain.core.runs import InvalidRunInput, RunState
from llmtrain.lifecycle import queue_jobs as jobs
from llmtrain.lifecycle.jobs import attempt_name_stem
from llmtrain.lifecycle.submission import training_job_of

# How often the Watch step looks again: a queued run every 5 minutes, a training one every 15
# (an execution's history holds 25,000 events: 9 per look, so about 4 weeks of training).
QUEUED_POLL_SECONDS = 300
TRAINING_POLL_SECONDS = 900
# The error a Watch step hands NextAttempt when Batch ended the service job without a training job.
SERVICE_JOB_FAILED = "Batch.ServiceJobFailed"


@dataclass(frozen=True)
class QueueSubmission:
    """SubmitServiceJob in the team's queue under its share identifier, then Watch until the job
    ends. ``queues``: the team's (its platform context's); ``job_name_prefix``: the team's, which
    names every attempt's job; ``batch``: a boto3 Batch client (or anything with its methods)."""

    queues: TeamQueues
    job_name_prefix: str
    batch: Any

    @classmethod
    def for_platform(cls, platform: PlatformContext, batch: Any) -> QueueSubmission:
        if platform.queues is None:
            raise LlmtrainError(f"team {platform.team!r} has no queues: its launcher creates training jobs")
        return cls(queues=platform.queues, job_name_prefix=platform.job_name_prefix, batch=batch)

    def check(self, request: Mapping[str, Any]) -> None:
        self._check_capacity(request)
        jobs.submit_request(request, self.queues)

    def attempt_state(self, request: Mapping[str, Any], run: RunState) -> dict[str, Any]:
        self._check_capacity(request)
        submission = jobs.submit_request(request, self.queues, queue=run.queue, priority=run.priority)
        return {"request": dict(request), "submission": submission}

    def _check_capacity(self, request: Mapping[str, Any]) -> None:
        """InvalidRunInput for a run larger than the environment's queues can ever run."""
        count = (request.get("ResourceConfig") or {}).get("InstanceCount", 1)
        if count > self.queues.max_instances:
            raise InvalidRunInput(
                f"the run asks for {count} instances; the environment's queues run at most "
                f"{self.queues.max_instances} at once, so it could never start: ask for fewer "
                "(instance_count)"
            )

    def classify(self, caught: Mapping[str, Any], request: Mapping[str, Any]) -> Failure:
        """A service job Batch ended at the head of its queue (`SERVICE_JOB_FAILED` from Watch), else
        as a training job's failure: Watch hands over the training job's description as `.sync` does."""
        error, cause = str(caught.get("Error", "")), str(caught.get("Cause", ""))
        if error == SERVICE_JOB_FAILED and policy.CAPACITY_REASON in cause:
            return Failure(kind=QUEUE_CAPACITY, reason=cause)
        if error == SERVICE_JOB_FAILED and "MISCONFIGURATION:" in cause:
            return Failure(kind=QUEUE_MISCONFIGURED, reason=cause)
        in_plan = "TrainingPlanArn" in (request.get("ResourceConfig") or {})
        return classify_failure(caught, in_training_plan=in_plan)

    def attempts(self, run_name: str, training_jobs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The run's training jobs SageMaker lists under its job names (started before the environment
        had queues) and its service jobs, one entry per attempt (the service job's where both know it)."""
        stem = attempt_name_stem(self.job_name_prefix, run_name)
        queued = jobs.run_service_jobs(self.batch, list(self.queues.queue_arns.values()), stem)
        by_attempt = {job["attempt"]: dict(job) for job in training_jobs}
        by_attempt.update({job["attempt"]: job for job in queued})
        return [by_attempt[attempt] for attempt in sorted(by_attempt)]

    def template_of(self, attempts: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
        """The template and version of the run's latest service job (its `llmtrain:` tags)."""
        for attempt in reversed(attempts):
            if "job_id" in attempt:
                tags = self.batch.describe_service_job(jobId=attempt["job_id"]).get("tags") or {}
                name, version = tags.get(TAG_PREFIX + "template"), tags.get(TAG_PREFIX + "template-version")
                return (name, version) if name and version else None
        return None

    def started_job(self, request: Mapping[str, Any]) -> tuple[str, str | None]:
        return training_job_of(request)


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


__all__ = ["QUEUED_POLL_SECONDS", "SERVICE_JOB_FAILED", "TRAINING_POLL_SECONDS", "QueueSubmission", "watch"]
