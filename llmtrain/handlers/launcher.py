"""The launcher state machine's functions: resolve a run, plan the next attempt, summarize the run.

The state machine (constructs/training_constructs/launcher.py) calls three Lambda functions:

- `resolve`: checks the execution input, resolves `template@version` in the bundled registry,
  refuses a run that is in progress or already completed, and renders attempt 1 (or the attempt
  after the run's last one, so a failed run started again resumes from its checkpoints). Bad
  input raises `InvalidRunInput` BEFORE any training job exists; its message says what to fix.
- `next_attempt`: after CreateTrainingJob (`.sync`) failed, classifies the failure (capacity,
  quota, the job's own failure, a stop, an API error) and either plans a retry (the wait, a new
  job name, the same checkpoint prefix, maybe the next fallback instance type) or gives up with a
  summary of the run.
- `summarize`: the summary of a run whose job completed.

Between states the execution carries `{"run": RunState, "request": CreateTrainingJob request,
"layout": name}`; RunState is plain JSON (see `_new_run_state`). The summary (`build_summary`) is
the execution's output, the SNS notification's body, and what `llmtrain status` shows.

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
from llmtrain.platform import PlatformContext
from llmtrain.render import MAX_ATTEMPTS, RunInput, max_run_name_length, render
from llmtrain.spec import RetrySpec, TemplateSpec

ENV_PLATFORM_CONTEXT = "LLMTRAIN_PLATFORM_CONTEXT"
ENV_TEMPLATES_DIR = "LLMTRAIN_TEMPLATES_DIR"
# In the Lambda bundle, templates/ sits next to llmtrain/ (see training_constructs.lambda_code).
BUNDLED_TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "templates"

ENV_REQUEST_LAYOUTS = "LLMTRAIN_REQUEST_LAYOUTS"

INPUT_FIELDS = {"template": "str", "version": "str", "run_name": "str", "overrides": "object", "owner": "str"}
CAPACITY_MARKERS = ("CapacityError", "InsufficientInstanceCapacity", "InsufficientCapacity")
QUOTA_MARKER = "ResourceLimitExceeded"
ACTIVE_JOB_STATUSES = ("InProgress", "Stopping")
_QUOTA_MESSAGE = re.compile(
    r"service limit '(?P<name>[^']+)' is (?P<limit>\d+) \w+, with current utilization of "
    r"(?P<used>\d+) \w+ and a request delta of (?P<delta>\d+) \w+"
)
_SUBJECT_MAX = 100


class InvalidRunInput(Exception):
    """The execution input cannot start a run; nothing was created. The message says what to fix."""


class RunAlreadyInProgress(Exception):
    """A training job of this run is still running; a second one is never started."""


class RunAlreadyCompleted(Exception):
    """This run name already has a completed training job; run names identify one run."""


class LauncherStateError(Exception):
    """The state the state machine passed is not what this function expects (a deployment bug)."""


# --- Lambda entry points ----------------------------------------------------------------------------


def resolve(event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
    """`{"input": execution input, "execution_arn": ...}` -> `{"run", "request", "layout"}`."""
    platform = platform_from_environment()
    run_input = parse_execution_input(event.get("input"))
    try:
        template = _catalog().get(run_input["template"], run_input["version"])
        check_run_name(run_input["run_name"], platform)
    except LlmtrainError as error:
        raise _rejected(error) from error
    previous = run_jobs(_sagemaker(platform), platform.job_name_prefix, run_input["run_name"])
    return start_run(
        template,
        run_input,
        platform,
        previous,
        layouts_from_environment(),
        execution_arn=event.get("execution_arn"),
    )


def next_attempt(event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
    """`{"run", "request", "failure": {"Error", "Cause"}}` -> a retry plan or a failure summary."""
    run, request = _state(event)
    template = _catalog().get(run["template"], run["version"])
    return plan_next_attempt(
        template,
        run,
        request,
        event.get("failure") or {},
        platform_from_environment(),
        layouts_from_environment(),
    )


def summarize(event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
    """`{"run", "job": DescribeTrainingJob output}` -> `{"summary": ...}` for a completed job."""
    run, _ = _state(event, need_request=False)
    job = event.get("job") or {}
    run = _record_attempt(run, job.get("TrainingJobName", ""), job.get("TrainingJobStatus", "Completed"), "")
    return {"summary": build_summary(run, status=job.get("TrainingJobStatus", "Completed"), job=job)}


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


def _sagemaker(platform: PlatformContext):
    return boto3.client("sagemaker", region_name=platform.region)


def _state(event: Mapping[str, Any], *, need_request: bool = True) -> tuple[dict, dict]:
    run, request = event.get("run"), event.get("request")
    if not isinstance(run, Mapping) or (need_request and not isinstance(request, Mapping)):
        raise LauncherStateError(
            "the state lacks 'run' or 'request': the state machine and the functions "
            "disagree (deploy them together)"
        )
    return dict(run), dict(request or {})


# --- resolve ---------------------------------------------------------------------------------------


def parse_execution_input(data: Any) -> dict[str, Any]:
    """The checked execution input: template, version, run_name, overrides, owner."""
    expected = (
        '{"template": NAME, "version": SEMVER or "latest", "run_name": NAME, "overrides": {SETTING: VALUE}}'
    )
    if not isinstance(data, Mapping):
        raise _invalid(f"the execution input must be a JSON object like {expected}")
    unknown = sorted(set(data) - set(INPUT_FIELDS))
    if unknown:
        raise _invalid(f"unknown input field(s) {', '.join(unknown)}; the input is {expected}")
    for name in ("template", "run_name"):
        if not isinstance(data.get(name), str) or not data[name]:
            raise _invalid(f"'{name}' is required and must be a non-empty string; the input is {expected}")
    for name in ("version", "owner"):
        if name in data and not isinstance(data[name], str):
            raise _invalid(f"'{name}' must be a string, got {data[name]!r}")
    overrides = data.get("overrides", {})
    if overrides is None or not isinstance(overrides, Mapping):
        raise _invalid(f"'overrides' must be an object of setting name to value, got {overrides!r}")
    return {
        "template": data["template"],
        "version": data.get("version") or LATEST,
        "run_name": data["run_name"],
        "overrides": dict(overrides),
        "owner": data.get("owner") or "launcher",
    }


def _invalid(problem: str) -> InvalidRunInput:
    return InvalidRunInput(f"run input rejected before any training job was created: {problem}")


def _rejected(error: Exception) -> InvalidRunInput:
    return _invalid(str(error))


def check_run_name(run_name: str, platform: PlatformContext) -> None:
    """Raise OverrideError unless the run name fits SageMaker's job names with the platform's prefix."""
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
    """The run's training jobs (any status), oldest attempt first: `{"attempt", "job_name", "status"}`."""
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
                        "status": job["TrainingJobStatus"],
                    }
                )
    return sorted(found, key=lambda job: job["attempt"])


def start_run(
    template: TemplateSpec,
    run_input: Mapping[str, Any],
    platform: PlatformContext,
    previous: Sequence[Mapping[str, Any]],
    layouts: Mapping[str, Sequence[str]],
    *,
    execution_arn: str | None = None,
) -> dict[str, Any]:
    """Render the run's first attempt here, after checking what earlier attempts left behind."""
    _refuse_duplicate_run(run_input["run_name"], previous)
    attempt = previous[-1]["attempt"] + 1 if previous else 1
    run = _new_run_state(template, run_input, attempt, execution_arn)
    try:
        request = _render_attempt(template, run, platform)
        layout = request_layout(request, layouts)
    except LlmtrainError as error:
        raise _rejected(error) from error
    run["instance_types"] = _instance_types(template, request)
    run["checkpoint_s3_uri"] = request.get("CheckpointConfig", {}).get("S3Uri")
    return {"run": run, "request": request, "layout": layout}


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
    if previous and previous[-1]["attempt"] >= MAX_ATTEMPTS:
        raise _invalid(f"run {run_name!r} has used all {MAX_ATTEMPTS} attempts; choose a new run_name")


def _new_run_state(
    template: TemplateSpec, run_input: Mapping[str, Any], attempt: int, execution_arn: str | None
) -> dict[str, Any]:
    return {
        "run_name": run_input["run_name"],
        "template": template.name,
        "version": template.version,  # pinned: every attempt renders this exact version
        "overrides": dict(run_input["overrides"]),
        "owner": run_input["owner"],
        "execution_arn": execution_arn,
        "attempt": attempt,
        "type_index": 0,  # index into instance_types: 0 is the run's own instance type
        "capacity_retries": 0,  # capacity retries on the current instance type
        "quota_waits": 0,
        "history": [],  # one entry per ended attempt
    }


def _instance_types(template: TemplateSpec, request: Mapping[str, Any]) -> list[str]:
    """The run's instance type, then the template's fallbacks (in order, without repeats)."""
    first = request["ResourceConfig"]["InstanceType"]
    return list(dict.fromkeys([first, *template.retry.fallback_instance_types]))


def _render_attempt(template: TemplateSpec, run: Mapping[str, Any], platform: PlatformContext) -> dict:
    fallback = run["instance_types"][run["type_index"]] if run["type_index"] else None
    run_input = RunInput(
        run_name=run["run_name"],
        overrides=run["overrides"],
        attempt=run["attempt"],
        instance_type=fallback,
        owner=run["owner"],
    )
    return render(template, run_input, platform)


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
    """One failed attempt, classified. `kind`: capacity, plan_capacity, quota, job_failed, stopped or
    api_error."""

    kind: str
    reason: str
    job: Mapping[str, Any] | None = None
    quota: Quota | None = None


def classify_failure(failure: Mapping[str, Any], *, in_training_plan: bool = False) -> Failure:
    """Classify the `{"Error", "Cause"}` that Step Functions caught from CreateTrainingJob `.sync`.

    A job that ran and ended badly arrives as `States.TaskFailed` with the DescribeTrainingJob
    output as the cause (JSON); an API error (e.g. ResourceLimitExceeded) arrives as
    `SageMaker.<...>` with SageMaker's message as the cause.

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
    if QUOTA_MARKER in text:
        return Failure(kind="quota", reason=cause or error, quota=parse_quota(cause))
    if any(marker in text for marker in CAPACITY_MARKERS):
        return Failure(kind="plan_capacity" if in_training_plan else "capacity", reason=cause or error)
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
    wait_seconds: int
    type_index: int
    capacity_retries: int
    quota_waits: int


def backoff_seconds(retry: RetrySpec, retry_number: int) -> int:
    """The wait before the `retry_number`-th retry (1-based): exponential, capped."""
    wait = retry.backoff_seconds * retry.backoff_rate ** (retry_number - 1)
    return int(min(wait, retry.max_backoff_seconds))


def plan_retry(retry: RetrySpec, run: Mapping[str, Any], failure: Failure) -> RetryPlan | None:
    """What to do after a failed attempt, by the template's retry policy; None gives up.

    Capacity: up to `capacity_retry_attempts` retries on the same instance type with exponential
    backoff, then the next fallback type at once (its capacity is a different pool), which gets the
    same number of retries. Quota with policy `wait`: up to `capacity_retry_attempts` waits on the
    same backoff schedule for running jobs to free the quota. Anything else is not retried.
    """
    if run["attempt"] >= MAX_ATTEMPTS:
        return None
    index, retries, waits = run["type_index"], run["capacity_retries"], run["quota_waits"]
    if failure.kind == "capacity":
        if retries < retry.capacity_retry_attempts:
            return RetryPlan(backoff_seconds(retry, retries + 1), index, retries + 1, waits)
        if index + 1 < len(run["instance_types"]):
            return RetryPlan(0, index + 1, 0, waits)
    if failure.kind == "quota" and retry.quota_policy == "wait" and waits < retry.capacity_retry_attempts:
        return RetryPlan(backoff_seconds(retry, waits + 1), index, retries, waits + 1)
    return None


def plan_next_attempt(
    template: TemplateSpec,
    run: Mapping[str, Any],
    request: Mapping[str, Any],
    caught: Mapping[str, Any],
    platform: PlatformContext,
    layouts: Mapping[str, Sequence[str]],
) -> dict[str, Any]:
    in_plan = "TrainingPlanArn" in request.get("ResourceConfig", {})
    failure = classify_failure(caught, in_training_plan=in_plan)
    run = _record_attempt(
        run,
        request.get("TrainingJobName", ""),
        failure.kind,
        failure.reason,
        instance_type=request.get("ResourceConfig", {}).get("InstanceType"),
    )
    plan = plan_retry(template.retry, run, failure)
    if plan is None:
        return {"decision": "fail", "summary": failure_summary(template, run, failure)}
    run.update(
        attempt=run["attempt"] + 1,
        type_index=plan.type_index,
        capacity_retries=plan.capacity_retries,
        quota_waits=plan.quota_waits,
    )
    try:
        next_request = _render_attempt(template, run, platform)
        layout = request_layout(next_request, layouts)
    except LlmtrainError as error:
        bad = Failure(kind="invalid_retry", reason=f"the retry could not be rendered: {error}")
        return {"decision": "fail", "summary": failure_summary(template, run, bad)}
    return {
        "decision": "retry",
        "wait_seconds": plan.wait_seconds,
        "run": run,
        "request": next_request,
        "layout": layout,
    }


def _record_attempt(
    run: Mapping[str, Any], job: str, outcome: str, reason: str, *, instance_type: str | None = None
) -> dict[str, Any]:
    entry = {
        "attempt": run["attempt"],
        "job_name": job,
        "instance_type": instance_type or run["instance_types"][run["type_index"]],
        "outcome": outcome,
        "reason": reason[:1000],
    }
    return {**run, "history": [*run.get("history", []), entry]}


# --- summaries ---------------------------------------------------------------------------------------

# The error name a failed execution ends with, by the kind of the last attempt's failure.
FAILURE_ERRORS = {
    "capacity": "CapacityUnavailable",
    "plan_capacity": "TrainingPlanCapacityUnavailable",
    "quota": "QuotaExceeded",
    "job_failed": "TrainingJobFailed",
    "stopped": "TrainingJobStopped",
    "api_error": "CreateTrainingJobFailed",
    "invalid_retry": "RetryNotPossible",
}


def failure_summary(template: TemplateSpec, run: Mapping[str, Any], failure: Failure) -> dict[str, Any]:
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


def _advice(template: TemplateSpec, run: Mapping[str, Any], failure: Failure) -> str:
    types = ", ".join(run["instance_types"])
    if failure.kind == "capacity":
        return (
            f"SageMaker had no capacity for {types} after {len(run['history'])} attempt(s) "
            f"({template.retry.capacity_retry_attempts} retries per type); start the run again later "
            "(it resumes from its checkpoints) or override instance_type"
        )
    if failure.kind == "quota":
        numbers = failure.quota.describe() if failure.quota else failure.reason
        policy = (
            ""
            if template.retry.quota_policy == "fail"
            else f" (waited {run['quota_waits']} time(s) for it to free up)"
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
        return f"the training job failed: read its logs with `llmtrain logs {run['run_name']}`"
    if failure.kind == "stopped":
        return "the training job was stopped before it completed"
    return "SageMaker refused the request; fix what the message names and start a new run"


def build_summary(
    run: Mapping[str, Any],
    *,
    status: str,
    job: Mapping[str, Any],
    error: str | None = None,
    reason: str | None = None,
    advice: str | None = None,
) -> dict[str, Any]:
    """The run's outcome: the execution output, the notification and what `llmtrain status` shows."""
    history = list(run.get("history", []))
    last = history[-1] if history else {}
    summary = {
        "run_name": run["run_name"],
        "template": f"{run['template']}@{run['version']}",
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
        "checkpoint_s3_uri": run.get("checkpoint_s3_uri"),
        "execution_arn": run.get("execution_arn"),
    }
    if error is not None:
        summary.update(error=error, failure_reason=reason, advice=advice)
    summary["subject"] = _subject(summary)
    summary["message"] = summary_message(summary)
    return summary


def final_metrics(job: Mapping[str, Any]) -> dict[str, float]:
    return {
        metric["MetricName"]: metric["Value"]
        for metric in job.get("FinalMetricDataList") or ()
        if "MetricName" in metric and "Value" in metric
    }


def _subject(summary: Mapping[str, Any]) -> str:
    subject = f"llmtrain: run {summary['run_name']} {summary['status']}"
    if summary.get("error"):
        subject += f" ({summary['error']})"
    return subject.encode("ascii", "replace").decode()[:_SUBJECT_MAX]


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
    lines.append(f"Checkpoints: {summary.get('checkpoint_s3_uri') or '-'}")
    lines.append(f"Attempts: {summary['attempts']}")
    for entry in summary.get("attempt_history", ()):
        detail = f": {entry['reason']}" if entry.get("reason") and entry["outcome"] != "Completed" else ""
        lines.append(
            f"  {entry['attempt']}. {entry['job_name']} on {entry['instance_type']}: "
            f"{entry['outcome']}{detail}"
        )
    return "\n".join(lines)
