"""NextAttempt: after an attempt failed, classify the failure and either plan the retry (the wait, a
new job name, the same checkpoint prefix, maybe the next fallback instance type) or give up with
the run's summary."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from llmtrain.core.errors import LlmtrainError
from llmtrain.core.failures import QUEUE_CAPACITY, Failure
from llmtrain.core.platform import PlatformContext
from llmtrain.core.program_contract import ProgramContract
from llmtrain.core.program_failures import HUNG_COLLECTIVE, RETRIES
from llmtrain.core.run_settings import MAX_ATTEMPTS
from llmtrain.core.runs import RunState
from llmtrain.core.spec import RetrySpec, TemplateSpec
from llmtrain.lifecycle.resolve import render_attempt
from llmtrain.lifecycle.submission import Submission, training_job_of
from llmtrain.lifecycle.summaries import failure_summary

MAX_THROTTLE_RETRIES = 5
THROTTLE_BACKOFF_SECONDS = 10


@dataclass(frozen=True)
class RetryPlan:
    """What the next call does: wait, then create the job again (a new attempt, or the same attempt
    when the call was throttled and no job was created)."""

    wait_seconds: int
    type_index: int
    capacity_retries: int
    quota_waits: int
    throttle_retries: int = 0
    new_attempt: bool = True


def backoff_seconds(retry: RetrySpec, retry_number: int) -> int:
    """The wait before the `retry_number`-th retry (1-based): exponential, capped."""
    wait = retry.backoff_seconds * retry.backoff_rate ** (retry_number - 1)
    return int(min(wait, retry.max_backoff_seconds))


def throttle_backoff_seconds(retry_number: int) -> int:
    """The wait before calling CreateTrainingJob again after SageMaker throttled it."""
    return THROTTLE_BACKOFF_SECONDS * 2 ** (retry_number - 1)


def plan_retry(retry: RetrySpec, run: RunState, failure: Failure) -> RetryPlan | None:
    """What to do after a failed attempt, by the template's retry policy; None gives up.

    Capacity: up to `capacity_retry_attempts` retries on the same instance type with exponential
    backoff, then the next usable fallback type at once (its capacity is a different pool), which
    gets the same number of retries. A queued attempt that waited out its queue's capacity time
    limit (Batch retried the capacity all that time) moves to the next fallback type at once. Quota
    with policy `wait`: up to `capacity_retry_attempts` waits on the same backoff schedule for
    running jobs to free the quota. A throttled CreateTrainingJob
    (no job was created) is called again, same job name, up to `MAX_THROTTLE_RETRIES` times with a
    short backoff. A job the training program's hang watchdog ended (`hung`) gets
    `RETRIES[HUNG_COLLECTIVE]` new attempt(s) at once; it resumes from its last checkpoint. Anything
    else is not retried.
    """
    index, retries, waits = run.type_index, run.capacity_retries, run.quota_waits
    if failure.kind == "throttled" and run.throttle_retries < MAX_THROTTLE_RETRIES:
        throttles = run.throttle_retries + 1
        wait = throttle_backoff_seconds(throttles)
        return RetryPlan(wait, index, retries, waits, throttles, new_attempt=False)
    if run.attempt >= MAX_ATTEMPTS:
        return None
    if failure.kind == QUEUE_CAPACITY:  # it waited its queue's capacity time: the next type at once
        return RetryPlan(0, index + 1, 0, waits) if index + 1 < len(run.instance_types) else None
    if failure.kind == "capacity":
        if retries < retry.capacity_retry_attempts:
            return RetryPlan(backoff_seconds(retry, retries + 1), index, retries + 1, waits)
        if index + 1 < len(run.instance_types):
            return RetryPlan(0, index + 1, 0, waits)
    if failure.kind == "quota" and retry.quota_policy == "wait" and waits < retry.capacity_retry_attempts:
        return RetryPlan(backoff_seconds(retry, waits + 1), index, retries, waits + 1)
    if failure.kind == "hung" and run.hung_jobs() < RETRIES[HUNG_COLLECTIVE]:
        return RetryPlan(0, index, retries, waits)
    return None


def pooled_job(failure: Failure, request: Mapping[str, Any]) -> str | None:
    """The failed job's name where it keeps its instances after it ended (SageMaker keeps a warm pool
    after a failure by the algorithm too), else None. The name is the one SageMaker gave it: a queued
    run's job is named by AWS Batch, and its description (the failure's cause) says so."""
    job = failure.job or {}
    resources = job.get("ResourceConfig") or request.get("ResourceConfig") or {}
    if int(resources.get("KeepAlivePeriodInSeconds") or 0) <= 0:
        return None
    return str(job.get("TrainingJobName") or training_job_of(request)[0])


def plan_next_attempt(
    template: TemplateSpec,
    run: RunState,
    request: Mapping[str, Any],
    caught: Mapping[str, Any],
    platform: PlatformContext,
    submission: Submission,
    program: ProgramContract | None = None,
    end_warm_pool: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """`{"decision": "retry", "wait_seconds", "run", **attempt state}`, or `{"decision": "fail",
    "summary"}` when the run gives up.

    A hung job's retry starts at once with the same resources, so it would reuse the hung job's warm
    pool: the very instances whose GPU or link may have hung it. `end_warm_pool(job_name)` ends that
    pool first (the retry then gets fresh instances)."""
    failure = submission.classify(caught, request)
    plan = plan_retry(template.retry, run, failure)
    if plan is None or plan.new_attempt:
        job_name, instance_type = submission.started_job(request)
        run = run.with_attempt_ended(job_name, failure.kind, failure.reason, instance_type=instance_type)
        pooled = pooled_job(failure, request) if plan is not None and failure.kind == "hung" else None
        if pooled and end_warm_pool:
            end_warm_pool(pooled)
    if plan is None:
        return {"decision": "fail", "summary": failure_summary(template, run, failure)}
    run = run.replace(
        attempt=run.attempt + 1 if plan.new_attempt else run.attempt,
        type_index=plan.type_index,
        capacity_retries=plan.capacity_retries,
        quota_waits=plan.quota_waits,
        throttle_retries=plan.throttle_retries,  # counts the current attempt's throttled calls
    )
    try:
        state = submission.attempt_state(render_attempt(template, run, platform, program), run)
    except LlmtrainError as error:
        kind = "capacity" if failure.kind == "capacity" else "invalid_retry"
        bad = Failure(kind=kind, reason=f"the retry could not be rendered: {error}")
        return {"decision": "fail", "summary": failure_summary(template, run, bad)}
    return {"decision": "retry", "wait_seconds": plan.wait_seconds, "run": run.to_dict(), **state}
