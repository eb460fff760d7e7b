"""The launcher state machine's functions: resolve a run, plan the next attempt, summarize the run.

The state machine (constructs/training_constructs/launcher.py) calls three Lambda functions:

- `resolve`: checks the execution input, resolves `template@version` in the bundled registry (a
  run with earlier jobs keeps the version they ran), refuses a run that is in progress or already
  completed or beyond its team's limits, renders attempt 1 (or the attempt after the run's last
  one, so a failed run started again resumes from its checkpoints) and checks the template's
  capacity fallbacks against the run. It plans the run (llmtrain.planner.checks) and refuses one
  planned not to fit its GPUs (unless the input sets `skip_plan_check`) or to cost more than the
  team's budget (`run_budget_usd`). Bad input is refused BEFORE any training job exists, with a
  message that says what to fix.
- `next_attempt`: after CreateTrainingJob (`.sync`) failed, classifies the failure (capacity,
  quota, throttling, the job's own failure, a stop, an API error) and either plans a retry (the wait, a new
  job name, the same checkpoint prefix, maybe the next fallback instance type) or gives up with a
  summary of the run.
- `summarize`: the summary of a run whose job completed. Every summary holds the cost the last job
  billed (billable seconds x instances x on-demand price) beside the plan's prediction.

Between states the execution carries `{"run": RunState, "request": CreateTrainingJob request,
"layout": name}`; the execution input and the run state are the typed records of `llmtrain.runs`,
shared with the CLI. The summary (`build_summary`) is the execution's output, the SNS
notification's body, and what `llmtrain status` shows. A run refused at Resolve gets a summary too
(`rejection_summary`, status `Rejected`): the execution fails with its error, after the notification.

The functions read their settings from their environment, set by the construct:
`LLMTRAIN_PLATFORM_CONTEXT` (the PlatformContext as JSON), `LLMTRAIN_REQUEST_LAYOUTS` (the request
layouts the deployed state machine can pass, see `request_layouts`) and optionally
`LLMTRAIN_TEMPLATES_DIR` (default: the `templates/` folder bundled next to the `llmtrain` package).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import boto3

from llmtrain.catalog import LATEST, Catalog
from llmtrain.errors import LlmtrainError, OverrideError
from llmtrain.handlers import tuning
from llmtrain.jumpstart import BaseModel, resolve_base_model
from llmtrain.planner.checks import actual_cost, check_run
from llmtrain.platform import PlatformContext
from llmtrain.queues import launch as queued
from llmtrain.render import (
    MAX_ATTEMPTS,
    TAG_PREFIX,
    RunInput,
    check_team_template,
    max_run_name_length,
    render,
)
from llmtrain.runs import (
    DEFAULT_OWNER,
    ExecutionInput,
    InvalidRunInput,
    LauncherStateError,
    RunState,
    UnusableInstanceType,
)
from llmtrain.spec import RetrySpec, TemplateSpec
from llmtrain.validate import reshape_problems

ENV_PLATFORM_CONTEXT = "LLMTRAIN_PLATFORM_CONTEXT"
ENV_TEMPLATES_DIR = "LLMTRAIN_TEMPLATES_DIR"
# In the Lambda bundle, templates/ sits next to llmtrain/ (see training_constructs.lambda_code).
BUNDLED_TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "templates"

ENV_REQUEST_LAYOUTS = "LLMTRAIN_REQUEST_LAYOUTS"

CAPACITY_MARKERS = ("CapacityError", "InsufficientInstanceCapacity", "InsufficientCapacity")
# SageMaker's API throttling, as Step Functions reports it in the cause of a failed call.
THROTTLING_MARKERS = ("ThrottlingException", "Rate exceeded", "TooManyRequestsException")
MAX_THROTTLE_RETRIES = 5
THROTTLE_BACKOFF_SECONDS = 10
QUOTA_MARKER = "ResourceLimitExceeded"
ACTIVE_JOB_STATUSES = ("InProgress", "Stopping")
_QUOTA_MESSAGE = re.compile(
    r"service limit '(?P<name>[^']+)' is (?P<limit>\d+) \w+, with current utilization of "
    r"(?P<used>\d+) \w+ and a request delta of (?P<delta>\d+) \w+"
)
_SUBJECT_MAX = 100


class RunAlreadyInProgress(LlmtrainError):
    """A training job of this run is still running; a second one is never started."""


class RunAlreadyCompleted(LlmtrainError):
    """This run name already has a completed training job; run names identify one run."""


# Resolve's refusals: the execution ends with their class name as its error, before any job exists.
REJECTIONS = (InvalidRunInput, RunAlreadyInProgress, RunAlreadyCompleted)


# --- Lambda entry points ----------------------------------------------------------------------------


def resolve(event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
    """`{"input": execution input, "execution_arn", "execution_name"}` -> `{"run", "request", "layout"}`,
    or `{"summary": ...}` of a rejected run (status `Rejected`; nothing was created)."""
    try:
        return resolve_run(event)
    except REJECTIONS as refusal:
        return {"summary": rejection_summary(refusal, event)}


def resolve_run(event: Mapping[str, Any]) -> dict[str, Any]:
    """Resolve, raising the refusals that `resolve` turns into a rejection summary."""
    platform = platform_from_environment()
    layouts = layouts_from_environment()
    run_input = ExecutionInput.parse(event.get("input"))
    try:
        check_team_template(run_input.template, platform)
        check_run_name(run_input.run_name, platform)
        queued.check_queue_choice(run_input, platform)
    except LlmtrainError as error:
        raise _rejected(error) from error
    sagemaker = _sagemaker(platform)
    previous = run_jobs(sagemaker, platform.job_name_prefix, run_input.run_name)
    pinned = None
    if platform.queues is not None:  # the run's attempts are service jobs (llmtrain.queues.launch)
        batch = service_client("batch", platform)
        previous = queued.queued_attempts(batch, platform, run_input.run_name, previous)
        pinned = queued.queued_pin(batch, previous)
    _refuse_duplicate_run(run_input.run_name, previous)
    try:
        pinned = pinned or _pinned_template(sagemaker, [job for job in previous if "job_id" not in job])
        template = run_template(run_input, pinned, _catalog())
    except LlmtrainError as error:
        raise _rejected(error) from error
    execution_arn = event.get("execution_arn")
    if run_input.tune is not None:
        return tuning.start_tune(template, run_input, platform, sagemaker, _s3(platform),
                                 execution_arn=execution_arn)
    started = start_run(template, run_input, platform, previous, layouts, execution_arn=execution_arn)
    try:
        return queued.with_submission(started, platform)
    except LlmtrainError as error:
        raise _rejected(error) from error


def next_attempt(event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
    """`{"run", "request", "failure": {"Error", "Cause"}}` -> a retry plan or a failure summary."""
    run, request = _state(event)
    if run.tune is not None:
        return tuning.tune_failure(run, event.get("failure") or {})
    template = _catalog().get(run.template, run.version)
    platform = platform_from_environment()
    planned = plan_next_attempt(
        template,
        run,
        request,
        event.get("failure") or {},
        platform,
        layouts_from_environment(),
    )
    return queued.with_submission(planned, platform)


def summarize(event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
    """`{"run", "job": DescribeTrainingJob output}` -> `{"summary": ...}` for a completed job."""
    run, _ = _state(event, need_request=False)
    job = event.get("job") or {}
    if run.tune is not None:
        return {"summary": tuning.tune_summary(run, job)}
    status = job.get("TrainingJobStatus", "Completed")
    run = run.with_attempt_ended(job.get("TrainingJobName", ""), status)
    return {"summary": build_summary(run, status=status, job=job)}


# --- settings --------------------------------------------------------------------------------------


def platform_from_environment() -> PlatformContext:
    raw = os.environ.get(ENV_PLATFORM_CONTEXT)
    if not raw:
        raise LauncherStateError(f"{ENV_PLATFORM_CONTEXT} is not set: the launcher construct sets it")
    return PlatformContext.from_dict(json.loads(raw))


def layouts_from_environment() -> dict[str, list[str]]:
    raw = os.environ.get(ENV_REQUEST_LAYOUTS)
    if not raw:
        raise LauncherStateError(f"{ENV_REQUEST_LAYOUTS} is not set: the launcher construct sets it")
    return json.loads(raw)


def _catalog() -> Catalog:
    return _load_catalog(os.environ.get(ENV_TEMPLATES_DIR) or str(BUNDLED_TEMPLATES_DIR))


@cache
def _load_catalog(root: str) -> Catalog:
    folder = Path(root)
    return Catalog.load(root=folder, repo_root=folder.parent)


def service_client(service: str, platform: PlatformContext):
    """A boto3 client of the platform's region (SageMaker, or Batch for queued runs)."""
    return boto3.client(service, region_name=platform.region)


def _sagemaker(platform: PlatformContext):
    return service_client("sagemaker", platform)


def _s3(platform: PlatformContext):
    return boto3.client("s3", region_name=platform.region)


def _state(event: Mapping[str, Any], *, need_request: bool = True) -> tuple[RunState, dict]:
    run, request = event.get("run"), event.get("request")
    if not isinstance(run, Mapping) or (need_request and not isinstance(request, Mapping)):
        raise LauncherStateError(
            "the state lacks 'run' or 'request': the state machine and the functions "
            "disagree (deploy them together)"
        )
    return RunState.from_dict(run), dict(request or {})


# --- resolve ---------------------------------------------------------------------------------------


def parse_execution_input(data: Any) -> ExecutionInput:
    """The checked execution input (`llmtrain.runs.ExecutionInput`); InvalidRunInput says what to fix."""
    return ExecutionInput.parse(data)


def _rejected(error: LlmtrainError) -> InvalidRunInput:
    return error if isinstance(error, InvalidRunInput) else InvalidRunInput(str(error))


def check_run_name(run_name: str, platform: PlatformContext) -> None:
    """Raise OverrideError unless the run name fits SageMaker's job names with the team's prefix."""
    RunInput(run_name=run_name)
    longest = max_run_name_length(platform)
    if len(run_name) > longest:
        raise OverrideError(
            "run_name",
            f"{run_name!r} is {len(run_name)} characters; with the job-name "
            f"prefix '{platform.job_name_prefix}' it may be at most {longest}",
        )


def attempt_name_stem(job_name_prefix: str, run_name: str) -> str:
    """The job name of every attempt of a run without the attempt number; agrees with
    `llmtrain.render.job_name` (tests check it)."""
    return f"{job_name_prefix}-{run_name}-a"


def run_jobs(sagemaker, job_name_prefix: str, run_name: str) -> list[dict[str, Any]]:
    """The run's training jobs (any status), oldest attempt first:
    `{"attempt", "job_name", "job_arn", "status"}`."""
    stem = attempt_name_stem(job_name_prefix, run_name)
    own = re.compile(re.escape(stem) + r"(\d+)", re.IGNORECASE)
    found = []
    for page in sagemaker.get_paginator("list_training_jobs").paginate(NameContains=stem):
        for job in page["TrainingJobSummaries"]:
            match = own.fullmatch(job["TrainingJobName"])
            if match:
                found.append(
                    {
                        "attempt": int(match.group(1)),
                        "job_name": job["TrainingJobName"],
                        "job_arn": job.get("TrainingJobArn"),
                        "status": job["TrainingJobStatus"],
                    }
                )
    return sorted(found, key=lambda job: job["attempt"])


def _pinned_template(sagemaker, previous: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
    """The template and version a run's earlier jobs ran (their `llmtrain:` tags), if any."""
    if not previous or not previous[-1].get("job_arn"):
        return None
    tags = {
        tag["Key"]: tag["Value"]
        for page in sagemaker.get_paginator("list_tags").paginate(ResourceArn=previous[-1]["job_arn"])
        for tag in page["Tags"]
    }
    name, version = tags.get(TAG_PREFIX + "template"), tags.get(TAG_PREFIX + "template-version")
    return (name, version) if name and version else None


def run_template(
    run_input: ExecutionInput, pinned: tuple[str, str] | None, catalog: Catalog
) -> TemplateSpec:
    """The template version a run renders: the input's, or for a run that already has jobs, the one
    those jobs ran. A run keeps its template and version for life (its program and checkpoints)."""
    if pinned is None:
        return catalog.get(run_input.template, run_input.version)
    name, version = pinned
    if run_input.template != name or run_input.version not in (LATEST, version):
        asked = f"{run_input.template}@{run_input.version}"
        raise InvalidRunInput(
            f"run {run_input.run_name!r} runs {name}@{version} (its earlier jobs), not {asked}: a run keeps "
            f"its template and version for life, because its checkpoints belong to that program; continue "
            f"it with template {name!r} and version {version!r}, or choose a new run_name for {asked}"
        )
    return catalog.get(name, version)


def start_run(
    template: TemplateSpec,
    run_input: ExecutionInput,
    platform: PlatformContext,
    previous: Sequence[Mapping[str, Any]],
    layouts: Mapping[str, Sequence[str]],
    *,
    execution_arn: str | None = None,
) -> dict[str, Any]:
    """Render the run's first attempt here, after checking what earlier attempts left behind, and
    check its capacity fallbacks up front: a type that cannot hold the run is never tried."""
    _refuse_duplicate_run(run_input.run_name, previous)
    attempt = previous[-1]["attempt"] + 1 if previous else 1
    if attempt > MAX_ATTEMPTS:
        raise InvalidRunInput(
            f"run {run_input.run_name!r} has used all {MAX_ATTEMPTS} attempts; choose a new run_name"
        )
    owner = run_input.owner or DEFAULT_OWNER
    try:
        base_model = resolve_base_model(run_input.overrides, _s3(platform), platform.region)
        request = _render(template, run_input.run_name, run_input.overrides, attempt, owner, None, platform,
                          base_model=base_model)
        layout = request_layout(request, layouts)
        # The planner: refuse a run that will not fit its GPUs or costs more than the team's budget.
        plan = check_run(
            template,
            request,
            run_input.overrides,
            budget_usd=platform.run_budget_usd,
            team=platform.team,
            skip_fit_check=run_input.skip_plan_check,
        )
    except LlmtrainError as error:
        raise _rejected(error) from error
    first = request["ResourceConfig"]["InstanceType"]
    usable, unusable = _check_fallbacks(template, run_input, request, platform, layouts, base_model)
    run = RunState(
        run_name=run_input.run_name,
        team=platform.team,
        template=template.name,
        version=template.version,
        overrides=run_input.overrides,
        owner=owner,
        execution_arn=execution_arn,
        attempt=attempt,
        instance_types=(first, *usable),
        unusable_instance_types=unusable,
        checkpoint_s3_uri=request.get("CheckpointConfig", {}).get("S3Uri"),
        plan=plan,
        base_model=base_model.to_dict() if base_model else None,
        queue=run_input.queue,
        priority=run_input.priority,
    )
    return {"run": run.to_dict(), "request": request, "layout": layout}


def _check_fallbacks(
    template: TemplateSpec,
    run_input: ExecutionInput,
    first: Mapping[str, Any],
    platform: PlatformContext,
    layouts: Mapping[str, Sequence[str]],
    base_model: BaseModel | None = None,
) -> tuple[list[str], list[UnusableInstanceType]]:
    """The template's fallback types that can hold this run, and those that cannot (with why). A
    fallback with another number of GPUs holds it where the checkpoints reshard: the attempt
    resumes with another number of data-parallel ranks."""
    usable: list[str] = []
    unusable: list[UnusableInstanceType] = []
    for fallback in dict.fromkeys(template.retry.fallback_instance_types):
        if fallback == first["ResourceConfig"]["InstanceType"]:
            continue
        try:
            request = _render(template, run_input.run_name, run_input.overrides, 1, DEFAULT_OWNER, fallback,
                              platform, base_model=base_model)
            request_layout(request, layouts)
            problems = reshape_problems(template.distribution.strategy, first, request)
        except LlmtrainError as error:
            problems = [str(error)]
        if problems:
            unusable.append(UnusableInstanceType(instance_type=fallback, reason=_one_line(problems[0])))
        else:
            usable.append(fallback)
    return usable, unusable


def _one_line(text: str) -> str:
    return " ".join(text.split())[:500]


def _refuse_duplicate_run(run_name: str, previous: Sequence[Mapping[str, Any]]) -> None:
    active = [job["job_name"] for job in previous if job["status"] in ACTIVE_JOB_STATUSES]
    if active:
        raise RunAlreadyInProgress(
            f"run {run_name!r} already has training job {active[-1]} in progress, so no second job was "
            f"started: follow it with `llmtrain status {run_name}` or stop it with "
            f"`llmtrain stop {run_name}`"
        )
    completed = [job["job_name"] for job in previous if job["status"] == "Completed"]
    if completed:
        raise RunAlreadyCompleted(
            f"run {run_name!r} already completed (training job {completed[-1]}); a run name identifies one "
            "run: choose a new run_name"
        )


def _render(
    template: TemplateSpec,
    run_name: str,
    overrides: Mapping[str, Any],
    attempt: int,
    owner: str,
    instance_type: str | None,
    platform: PlatformContext,
    *,
    base_model: BaseModel | None = None,
) -> dict:
    run_input = RunInput(
        run_name=run_name, overrides=overrides, attempt=attempt, instance_type=instance_type, owner=owner,
        base_model=base_model,
    )
    return render(template, run_input, platform)


def _render_attempt(template: TemplateSpec, run: RunState, platform: PlatformContext) -> dict:
    fallback = run.instance_type if run.type_index else None
    base_model = BaseModel.from_dict(run.base_model) if run.base_model else None
    return _render(template, run.run_name, run.overrides, run.attempt, run.owner, fallback, platform,
                   base_model=base_model)


def request_layouts(requests: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """The layouts (sets of top-level fields) of some rendered requests, named for the state machine.

    Step Functions (JSONPath) cannot splat an object into a task's parameters, and a path to a
    missing field fails the state, so the state machine has one CreateTrainingJob state per
    layout, passing every field of it. The construct computes the layouts at synth from the
    registered templates' requests; `request_layout` picks a run's at run time. A layout is named
    after the fields it lacks from their union: "all", or e.g. "without-CheckpointConfig".
    """
    union = list(dict.fromkeys(field for request in requests for field in request))
    layouts: dict[str, list[str]] = {}
    for request in requests:
        missing = [field for field in union if field not in request]
        name = "without-" + "-".join(missing) if missing else "all"
        layouts[name] = [field for field in union if field in request]
    return dict(sorted(layouts.items()))


def request_layout(request: Mapping[str, Any], layouts: Mapping[str, Sequence[str]]) -> str:
    """The name of the layout whose fields are exactly the request's; LlmtrainError when none is."""
    fields = set(request)
    for name, layout in layouts.items():
        if fields == set(layout):
            return name
    known = set().union(*map(set, layouts.values())) if layouts else set()
    raise LlmtrainError(
        f"these settings produce a CreateTrainingJob request with fields "
        f"{sorted(fields - known) or sorted(fields)} "
        "in a combination the deployed launcher cannot pass (it was built for the layouts "
        f"{sorted(layouts)}); redeploy the platform with this template enabled, or change the overrides"
    )


# --- failures and retries --------------------------------------------------------------------------


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


@dataclass(frozen=True)
class Failure:
    """One failed attempt, classified. `kind`: capacity, plan_capacity (a job in a training plan found
    no free capacity in its pending time), quota, throttled (SageMaker refused the call for its rate;
    no job exists), job_failed, stopped or api_error."""

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
    queue_ended = queued.queue_failure(error, cause)  # Batch ended a queued run (llmtrain.queues.launch)
    if queue_ended is not None:
        return Failure(kind=queue_ended[0], reason=queue_ended[1])
    job = _job_from_cause(cause)
    if job is not None:
        classified = _classify_job(job)
        return _in_plan(classified) if in_training_plan else classified
    text = f"{error}: {cause}"
    if QUOTA_MARKER in text:
        return Failure(kind="quota", reason=cause or error, quota=parse_quota(cause))
    if any(marker in text for marker in CAPACITY_MARKERS):
        return Failure(kind="plan_capacity" if in_training_plan else "capacity", reason=cause or error)
    if any(marker in text for marker in THROTTLING_MARKERS):
        return Failure(kind="throttled", reason=cause or error)
    return Failure(kind="api_error", reason=f"{error}: {cause}" if cause else error)


def _in_plan(failure: Failure) -> Failure:
    pending = failure.job is not None and failure.job.get("TrainingStartTime") is None and (
        "pending" in failure.reason.lower())
    if failure.kind == "capacity" or (failure.kind == "job_failed" and pending):
        return Failure(kind="plan_capacity", reason=failure.reason, job=failure.job)
    return failure


def _job_from_cause(cause: str) -> dict[str, Any] | None:
    try:
        data = json.loads(cause)
    except ValueError:
        return None
    return data if isinstance(data, dict) and "TrainingJobStatus" in data else None


def _classify_job(job: Mapping[str, Any]) -> Failure:
    reason = str(job.get("FailureReason") or job.get("TrainingJobStatus"))
    if job.get("TrainingJobStatus") == "Stopped":
        return Failure(kind="stopped", reason=reason, job=job)
    if any(marker in reason for marker in CAPACITY_MARKERS):
        return Failure(kind="capacity", reason=reason, job=job)
    if QUOTA_MARKER in reason:
        return Failure(kind="quota", reason=reason, job=job, quota=parse_quota(reason))
    return Failure(kind="job_failed", reason=reason, job=job)


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
    gets the same number of retries. Quota with policy `wait`: up to `capacity_retry_attempts` waits
    on the same backoff schedule for running jobs to free the quota. A throttled CreateTrainingJob
    (no job was created) is called again, same job name, up to `MAX_THROTTLE_RETRIES` times with a
    short backoff. Anything else is not retried.
    """
    index, retries, waits = run.type_index, run.capacity_retries, run.quota_waits
    if failure.kind == "throttled" and run.throttle_retries < MAX_THROTTLE_RETRIES:
        throttles = run.throttle_retries + 1
        wait = throttle_backoff_seconds(throttles)
        return RetryPlan(wait, index, retries, waits, throttles, new_attempt=False)
    if run.attempt >= MAX_ATTEMPTS:
        return None
    if failure.kind == queued.QUEUE_CAPACITY:  # it waited its queue's capacity time: the next type
        return RetryPlan(0, index + 1, 0, waits) if index + 1 < len(run.instance_types) else None
    if failure.kind == "capacity":
        if retries < retry.capacity_retry_attempts:
            return RetryPlan(backoff_seconds(retry, retries + 1), index, retries + 1, waits)
        if index + 1 < len(run.instance_types):
            return RetryPlan(0, index + 1, 0, waits)
    if failure.kind == "quota" and retry.quota_policy == "wait" and waits < retry.capacity_retry_attempts:
        return RetryPlan(backoff_seconds(retry, waits + 1), index, retries, waits + 1)
    return None


def plan_next_attempt(
    template: TemplateSpec,
    run: RunState,
    request: Mapping[str, Any],
    caught: Mapping[str, Any],
    platform: PlatformContext,
    layouts: Mapping[str, Sequence[str]],
) -> dict[str, Any]:
    in_plan = "TrainingPlanArn" in request.get("ResourceConfig", {})
    failure = classify_failure(caught, in_training_plan=in_plan)
    plan = plan_retry(template.retry, run, failure)
    if plan is None or plan.new_attempt:
        run = run.with_attempt_ended(
            request.get("TrainingJobName", ""),
            failure.kind,
            failure.reason,
            instance_type=request.get("ResourceConfig", {}).get("InstanceType"),
        )
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
        next_request = _render_attempt(template, run, platform)
        layout = request_layout(next_request, layouts)
    except LlmtrainError as error:
        kind = "capacity" if failure.kind == "capacity" else "invalid_retry"
        bad = Failure(kind=kind, reason=f"the retry could not be rendered: {error}")
        return {"decision": "fail", "summary": failure_summary(template, run, bad)}
    return {
        "decision": "retry",
        "wait_seconds": plan.wait_seconds,
        "run": run.to_dict(),
        "request": next_request,
        "layout": layout,
    }


# --- summaries ---------------------------------------------------------------------------------------

# The error name a failed execution ends with, by the kind of the last attempt's failure.
FAILURE_ERRORS = {
    "capacity": "CapacityUnavailable",
    "plan_capacity": "TrainingPlanCapacityUnavailable",
    "quota": "QuotaExceeded",
    "job_failed": "TrainingJobFailed",
    "stopped": "TrainingJobStopped",
    "api_error": "CreateTrainingJobFailed",
    "throttled": "CreateTrainingJobFailed",
    "invalid_retry": "RetryNotPossible",
    **queued.QUEUE_FAILURE_ERRORS,
}


def failure_summary(template: TemplateSpec, run: RunState, failure: Failure) -> dict[str, Any]:
    status = "Stopped" if failure.kind == "stopped" else "Failed"
    summary = build_summary(
        run,
        status=status,
        job=failure.job or {},
        error=FAILURE_ERRORS[failure.kind],
        reason=failure.reason,
        advice=_advice(template, run, failure),
    )
    if failure.quota is not None:
        summary["quota"] = {
            "name": failure.quota.name,
            "limit": failure.quota.limit,
            "in_use": failure.quota.in_use,
            "requested": failure.quota.requested,
        }
    return summary


def _advice(template: TemplateSpec, run: RunState, failure: Failure) -> str:
    if failure.kind in queued.QUEUE_FAILURE_ERRORS:
        return queued.queue_advice(failure.kind, run)
    if failure.kind == "capacity":
        return _capacity_advice(template, run)
    if failure.kind == "quota":
        numbers = failure.quota.describe() if failure.quota else failure.reason
        policy = (
            ""
            if template.retry.quota_policy == "fail"
            else f" (waited {run.quota_waits} time(s) for it to free up)"
        )
        return (
            f"the account's {numbers}{policy}: request an increase in Service Quotas (service "
            "Amazon SageMaker), wait for running jobs to end, or use fewer or other instances"
        )
    if failure.kind == "plan_capacity":
        return (
            "the training plan had no free capacity for the job within its pending time "
            "(max_pending_seconds); see the plan's instances with `llmtrain plans --env ENV`, then start "
            "the run again (it resumes from its checkpoints) or raise max_pending_seconds"
        )
    if failure.kind == "job_failed":
        return f"the training job failed: read its logs with `llmtrain logs {run.run_name}`"
    if failure.kind == "stopped":
        return "the training job was stopped before it completed"
    if failure.kind == "throttled":
        return (f"SageMaker throttled CreateTrainingJob {run.throttle_retries + 1} time(s) in a row; start "
                "the run again in a few minutes (it continues where it stopped)")
    return "SageMaker refused the request; fix what the message names and start a new run"


def _capacity_advice(template: TemplateSpec, run: RunState) -> str:
    types = ", ".join(run.instance_types)
    advice = (
        f"SageMaker had no capacity for {types} after {len(run.history)} attempt(s) "
        f"({template.retry.capacity_retry_attempts} retries per type); start the run again later "
        "(it resumes from its checkpoints) or override instance_type"
    )
    if run.unusable_instance_types:
        skipped = "; ".join(f"{item.instance_type}: {item.reason}" for item in run.unusable_instance_types)
        advice += f". Fallback types that cannot hold this run were not tried ({skipped})"
    return advice


def build_summary(
    run: RunState,
    *,
    status: str,
    job: Mapping[str, Any],
    error: str | None = None,
    reason: str | None = None,
    advice: str | None = None,
) -> dict[str, Any]:
    """The run's outcome: the execution output, the notification and what `llmtrain status` shows."""
    history = [entry.to_dict() for entry in run.history]
    last = history[-1] if history else {}
    summary = {
        "run_name": run.run_name,
        "team": run.team,
        "template": f"{run.template}@{run.version}",
        "status": status,
        "job_name": job.get("TrainingJobName") or last.get("job_name"),
        "job_arn": job.get("TrainingJobArn"),
        "instance_type": last.get("instance_type"),
        "final_metrics": final_metrics(job),
        "model_artifacts": (job.get("ModelArtifacts") or {}).get("S3ModelArtifacts"),
        "billable_seconds": job.get("BillableTimeInSeconds"),
        "training_seconds": job.get("TrainingTimeInSeconds"),
        "attempts": len(history),
        "attempt_history": history,
        "checkpoint_s3_uri": run.checkpoint_s3_uri,
        "execution_arn": run.execution_arn,
        "actual_cost_usd": actual_cost(job),
        "predicted_cost_usd": (run.plan or {}).get("usd"),
        "plan": (run.plan or {}).get("summary"),
    }
    if error is not None:
        summary.update(error=error, failure_reason=reason, advice=advice)
    summary["subject"] = notification_subject(run.run_name, status, error)
    summary["message"] = summary_message(summary)
    return summary


def rejection_summary(refusal: Exception, event: Mapping[str, Any]) -> dict[str, Any]:
    """The summary of a run refused before any job: the execution fails with `error`, notified."""
    raw = event.get("input")
    name = raw.get("run_name") if isinstance(raw, Mapping) else None
    run_name = name if isinstance(name, str) and name else str(event.get("execution_name") or "?")
    error = type(refusal).__name__
    message = f"Run {run_name}: Rejected\nError: {error}: {refusal}"
    return {
        "status": "Rejected",
        "run_name": run_name,
        "error": error,
        "message": message,
        "subject": notification_subject(run_name, "rejected", None),
        "execution_arn": event.get("execution_arn"),
    }


def _usd(value: float | None) -> str:
    return "-" if value is None else f"${value:,.2f}"


def final_metrics(job: Mapping[str, Any]) -> dict[str, float]:
    return {
        metric["MetricName"]: metric["Value"]
        for metric in job.get("FinalMetricDataList") or ()
        if "MetricName" in metric and "Value" in metric
    }


def notification_subject(run_name: str, status: str, error: str | None) -> str:
    """An SNS subject: printable ASCII, at most 100 characters (SNS refuses longer ones); a long run
    name is shortened, never the outcome."""
    outcome = f" {status}" + (f" ({error})" if error else "")
    room = _SUBJECT_MAX - len("llmtrain: run ") - len(outcome)
    name = "".join(c if " " <= c <= "~" else "?" for c in run_name)
    if len(name) > room:
        name = name[: room - 3] + "..."
    return f"llmtrain: run {name}{outcome}"


def summary_message(summary: Mapping[str, Any]) -> str:
    """The human-readable text of a summary (the notification body and the failure's cause)."""
    lines = [f"Run {summary['run_name']} ({summary['template']}): {summary['status']}"]
    if summary.get("error"):
        lines.append(f"Error: {summary['error']}: {summary.get('failure_reason')}")
        lines.append(f"What to do: {summary.get('advice')}")
    lines.append(f"Training job: {summary.get('job_name') or '-'} on {summary.get('instance_type') or '-'}")
    metrics = summary.get("final_metrics") or {}
    lines.append("Final metrics: " + (", ".join(f"{k}={v:g}" for k, v in sorted(metrics.items())) or "-"))
    lines.append(f"Model artifacts: {summary.get('model_artifacts') or '-'}")
    billable = summary.get("billable_seconds")
    lines.append(f"Billable seconds: {billable if billable is not None else '-'}")
    lines.append(f"Cost: {_usd(summary.get('actual_cost_usd'))} actual (billable seconds x instances x "
                 f"on-demand price), {_usd(summary.get('predicted_cost_usd'))} predicted")
    lines.append(f"Checkpoints: {summary.get('checkpoint_s3_uri') or '-'}")
    lines.append(f"Attempts: {summary['attempts']}")
    for entry in summary.get("attempt_history", ()):
        detail = f": {entry['reason']}" if entry.get("reason") and entry["outcome"] != "Completed" else ""
        lines.append(
            f"  {entry['attempt']}. {entry['job_name']} on {entry['instance_type']}: "
            f"{entry['outcome']}{detail}"
        )
    return "\n".join(lines)
