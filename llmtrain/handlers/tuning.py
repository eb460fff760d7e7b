"""The launcher's side of a tune: Resolve renders a SageMaker tuning job instead of a training job.

An execution whose input has `tune` (llmtrain.runs.ExecutionInput; the CLI's `llmtrain tune`) is a
tune: Resolve renders the run's CreateTrainingJob request as for any run (the team's platform
context: its templates, instance types, caps, channels), plans one trial and refuses a tune whose
trials could cost more than the team's budget together (one trial's planned cost x the maximum
number of trials), then builds the CreateHyperParameterTuningJob request (llmtrain.tuning) with the
earlier tunes it warm-starts from. The state machine creates the tuning job (`.sync`: it waits for
the tuning job to end; stopping the execution stops it) and the run's summary names the best
trial and the `llmtrain start` of a full run with its values.

A tune keeps one tuning job per execution, named `<team prefix>-<run>-t<n>`; SageMaker retries its
trials itself, so the launcher does not retry a tune. Pure Python plus boto3.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from llmtrain.errors import LlmtrainError
from llmtrain.jumpstart import BaseModel, resolve_base_model
from llmtrain.planner.checks import check_run
from llmtrain.platform import PlatformContext
from llmtrain.render import RunInput, render
from llmtrain.runs import DEFAULT_OWNER, ExecutionInput, InvalidRunInput, RunState
from llmtrain.spec import TemplateSpec
from llmtrain.tuning import (
    MAX_TUNE_ATTEMPTS,
    Trial,
    TuneError,
    TuneSpec,
    best_trial,
    check_tune,
    check_tune_budget,
    start_command,
    tuning_problems_for_request,
    tuning_request,
)

# The state machine's layouts of a CreateHyperParameterTuningJob request (which fields it passes).
TUNE_LAYOUT = "tune"
TUNE_WARM_START_LAYOUT = "tune-warm-start"
TUNE_LAYOUTS = {
    TUNE_LAYOUT: [
        "HyperParameterTuningJobName",
        "HyperParameterTuningJobConfig",
        "TrainingJobDefinition",
        "Tags",
    ],
    TUNE_WARM_START_LAYOUT: [
        "HyperParameterTuningJobName",
        "HyperParameterTuningJobConfig",
        "TrainingJobDefinition",
        "WarmStartConfig",
        "Tags",
    ],
}
ACTIVE_TUNING_STATUSES = ("InProgress", "Stopping")
FINISHED_TUNING_STATUSES = ("Completed", "Stopped")


def tuning_jobs(sagemaker, job_name_prefix: str, run_name: str) -> list[dict[str, Any]]:
    """The tune's tuning jobs (any status), oldest first: `{"attempt", "name", "status"}`."""
    stem = f"{job_name_prefix}-{run_name}-t"
    own = re.compile(re.escape(stem) + r"(\d+)", re.IGNORECASE)
    found = []
    for page in sagemaker.get_paginator("list_hyper_parameter_tuning_jobs").paginate(NameContains=stem):
        for job in page["HyperParameterTuningJobSummaries"]:
            match = own.fullmatch(job["HyperParameterTuningJobName"])
            if match:
                found.append(
                    {
                        "attempt": int(match.group(1)),
                        "name": job["HyperParameterTuningJobName"],
                        "status": job["HyperParameterTuningJobStatus"],
                    }
                )
    return sorted(found, key=lambda job: job["attempt"])


def parent_tuning_jobs(sagemaker, platform: PlatformContext, tunes: Sequence[str]) -> list[str]:
    """The latest finished tuning job of each earlier tune a tune warm-starts from."""
    parents = []
    for name in tunes:
        finished = [
            job
            for job in tuning_jobs(sagemaker, platform.job_name_prefix, name)
            if job["status"] in FINISHED_TUNING_STATUSES
        ]
        if not finished:
            raise TuneError(
                f"--warm-start {name}: team {platform.team!r} has no finished tune {name!r} "
                "(a tune warm-starts from completed or stopped tunes)"
            )
        parents.append(finished[-1]["name"])
    return parents


def render_tune(
    template: TemplateSpec,
    run_name: str,
    overrides: Mapping[str, Any],
    tune: TuneSpec,
    platform: PlatformContext,
    *,
    attempt: int = 1,
    owner: str = DEFAULT_OWNER,
    parents: Sequence[str] = (),
    skip_plan_check: bool = False,
    base_model: BaseModel | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tuning request and the plan of a tune: what the CLI's dry run prints and Resolve sends."""
    check_tune(template, tune, overrides)
    run_input = RunInput(run_name=run_name, overrides=overrides, owner=owner, base_model=base_model)
    training = render(template, run_input, platform)
    problems = tuning_problems_for_request(tune, training)
    if problems:
        raise TuneError(problems[0])
    plan = check_run(
        template,
        training,
        overrides,
        budget_usd=platform.run_budget_usd,
        team=platform.team,
        skip_fit_check=skip_plan_check,
    )
    plan = check_tune_budget(plan, tune, budget_usd=platform.run_budget_usd, team=platform.team)
    request = tuning_request(
        tune, training, platform, run_name=run_name, attempt=attempt, parent_tuning_jobs=parents
    )
    return request, plan


def start_tune(
    template: TemplateSpec,
    run_input: ExecutionInput,
    platform: PlatformContext,
    sagemaker,
    s3,
    *,
    execution_arn: str | None = None,
) -> dict[str, Any]:
    """Resolve's result for a tune: `{"run", "request", "layout"}`; InvalidRunInput refuses it before
    anything is created (a tune in progress or completed, beyond the team's limits or budget)."""
    try:
        if platform.queues is not None:
            raise TuneError("this environment queues its training jobs (AWS Batch), and SageMaker's "
                            "tuning jobs cannot be queued: tune in an environment without queues, or "
                            "locally (--local)")
        tune = TuneSpec.from_dict(run_input.tune)
        previous = tuning_jobs(sagemaker, platform.job_name_prefix, run_input.run_name)
        _refuse_duplicate_tune(run_input.run_name, previous)
        attempt = previous[-1]["attempt"] + 1 if previous else 1
        if attempt > MAX_TUNE_ATTEMPTS:
            raise TuneError(
                f"tune {run_input.run_name!r} has used all {MAX_TUNE_ATTEMPTS} attempts; choose a "
                "new run_name"
            )
        parents = parent_tuning_jobs(sagemaker, platform, tune.warm_start_from)
        owner = run_input.owner or DEFAULT_OWNER
        base_model = resolve_base_model(run_input.overrides, s3, platform.region)
        request, plan = render_tune(
            template,
            run_input.run_name,
            run_input.overrides,
            tune,
            platform,
            attempt=attempt,
            owner=owner,
            parents=parents,
            base_model=base_model,
            skip_plan_check=run_input.skip_plan_check,
        )
    except LlmtrainError as error:
        raise error if isinstance(error, InvalidRunInput) else InvalidRunInput(str(error)) from error
    run = RunState(
        run_name=run_input.run_name,
        team=platform.team,
        template=template.name,
        version=template.version,
        overrides=run_input.overrides,
        owner=owner,
        execution_arn=execution_arn,
        attempt=attempt,
        instance_types=(request["TrainingJobDefinition"]["ResourceConfig"]["InstanceType"],),
        plan=plan,
        tune=tune.to_dict(),
    )
    layout = TUNE_WARM_START_LAYOUT if "WarmStartConfig" in request else TUNE_LAYOUT
    return {"run": run.to_dict(), "request": request, "layout": layout}


def _refuse_duplicate_tune(run_name: str, previous: Sequence[Mapping[str, Any]]) -> None:
    active = [job["name"] for job in previous if job["status"] in ACTIVE_TUNING_STATUSES]
    if active:
        raise TuneError(
            f"tune {run_name!r} already has tuning job {active[-1]} in progress: follow it with "
            f"`llmtrain status {run_name}` or stop it with `llmtrain stop {run_name}`"
        )
    completed = [job["name"] for job in previous if job["status"] == "Completed"]
    if completed:
        raise TuneError(
            f"tune {run_name!r} already completed (tuning job {completed[-1]}); a run name "
            "identifies one run: choose a new run_name (--warm-start it to build on its trials)"
        )


# --- trials and summaries ------------------------------------------------------------------------


def tune_trials(sagemaker, tuning_job_name: str) -> list[Trial]:
    """The tuning job's trials (ListTrainingJobsForHyperParameterTuningJob), oldest first."""
    summaries = [
        job
        for page in sagemaker.get_paginator("list_training_jobs_for_hyper_parameter_tuning_job").paginate(
            HyperParameterTuningJobName=tuning_job_name
        )
        for job in page["TrainingJobSummaries"]
    ]
    summaries.sort(key=lambda job: job["CreationTime"])
    return [trial_from_summary(number, job) for number, job in enumerate(summaries)]


def trial_from_summary(number: int, job: Mapping[str, Any]) -> Trial:
    """A SageMaker HyperParameterTrainingJobSummary as a trial (tuned values as SageMaker passes them:
    strings)."""
    metric = job.get("FinalHyperParameterTuningJobObjectiveMetric") or {}
    status = job.get("TrainingJobStatus", "")
    if status == "Stopped" and job.get("ObjectiveStatus") == "Succeeded":
        status = "Completed"  # early-stopped by the tuning job, with an objective: a finished trial
    return Trial(
        number=number,
        name=job.get("TrainingJobName", ""),
        params=dict(job.get("TunedHyperParameters") or {}),
        objective=metric.get("Value"),
        status=status,
        detail=str(job.get("FailureReason") or ""),
    )


def tune_summary(
    run: RunState, description: Mapping[str, Any], *, error: str | None = None, reason: str | None = None
) -> dict[str, Any]:
    """The summary of a tune that ended: its tuning job, counters, the best trial and the command
    that runs the best values in full."""
    from llmtrain.handlers.launcher import notification_subject

    tune = TuneSpec.from_dict(run.tune)
    best_job = description.get("BestTrainingJob") or {}
    metric = best_job.get("FinalHyperParameterTuningJobObjectiveMetric") or {}
    status = "Failed" if error else description.get("HyperParameterTuningJobStatus", "Completed")
    best = None
    if best_job:
        best = {
            "training_job": best_job.get("TrainingJobName"),
            "params": best_job.get("TunedHyperParameters"),
            "objective": metric.get("Value"),
        }
    summary: dict[str, Any] = {
        "run_name": run.run_name,
        "team": run.team,
        "template": f"{run.template}@{run.version}",
        "kind": "tune",
        "status": status,
        "tuning_job": description.get("HyperParameterTuningJobName"),
        "objective": tune.objective,
        "direction": "maximize" if tune.maximize else "minimize",
        "trials": description.get("TrainingJobStatusCounters"),
        "best": best,
        "predicted_cost_usd": (run.plan or {}).get("usd"),
        "plan": (run.plan or {}).get("summary"),
        "execution_arn": run.execution_arn,
    }
    if best and best["params"]:
        summary["best_run_command"] = start_command(
            f"{run.template}@{run.version}", f"{run.run_name}-best", run.overrides, best["params"]
        )
    if error:
        summary.update(
            error=error,
            failure_reason=reason or description.get("FailureReason"),
            advice=f"see the tune's trials with `llmtrain status {run.run_name}`",
        )
    summary["subject"] = notification_subject(run.run_name, status, error)
    summary["message"] = tune_message(summary)
    return summary


def tune_failure(run: RunState, failure: Mapping[str, Any]) -> dict[str, Any]:
    """NextAttempt for a tune: no retry (SageMaker retries trials itself); the failure's summary."""
    import json

    cause = str(failure.get("Cause", ""))
    try:
        description = json.loads(cause)
    except ValueError:
        description = {}
    if not isinstance(description, dict) or "HyperParameterTuningJobStatus" not in description:
        description = {}
    stopped = description.get("HyperParameterTuningJobStatus") == "Stopped"
    summary = tune_summary(
        run,
        description,
        error="TuningJobStopped" if stopped else "TuningJobFailed",
        reason=description.get("FailureReason") or f"{failure.get('Error')}: {cause}"[:1000],
    )
    return {"decision": "fail", "summary": summary}


def tune_message(summary: Mapping[str, Any]) -> str:
    lines = [f"Tune {summary['run_name']} ({summary['template']}): {summary['status']}"]
    if summary.get("error"):
        lines.append(f"Error: {summary['error']}: {summary.get('failure_reason')}")
    lines.append(
        f"Tuning job: {summary.get('tuning_job') or '-'}; objective: {summary['direction']} "
        f"{summary['objective']}"
    )
    counters = summary.get("trials") or {}
    if counters:
        lines.append("Trials: " + ", ".join(f"{k} {v}" for k, v in counters.items()))
    best = summary.get("best")
    if best:
        lines.append(
            f"Best trial: {best['training_job']}: {summary['objective']}={best['objective']} with "
            + ", ".join(f"{k}={v}" for k, v in (best["params"] or {}).items())
        )
    if summary.get("best_run_command"):
        lines.append(f"Run it in full: {summary['best_run_command']}")
    if summary.get("predicted_cost_usd") is not None:
        lines.append(f"Planned: up to ${summary['predicted_cost_usd']:,.2f}")
    return "\n".join(lines)


def best_of(trials: Sequence[Trial], tune: TuneSpec) -> Trial | None:
    return best_trial(trials, maximize=tune.maximize)
