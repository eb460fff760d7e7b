"""A tune through the launcher: its attempt is a SageMaker tuning job, whose trials are runs of the
template as the launcher renders a run.

An execution whose input has `tune` (`llmtrain.core.runs.ExecutionInput`; `llmtrain tune`) is a tune.
Resolve (`llmtrain.lifecycle.resolve.start_tune`) plans it with `plan_tune`: the ranges within the
template's overridable bounds and the training program's (the contract of the code the version runs,
`llmtrain.core.tuning.check_tune_program`), the run's CreateTrainingJob request rendered as for any run
(the team's platform context: its templates, instance types, caps, channels; the version's program),
one trial planned, and a tune refused whose trials could cost more than the team's budget together
(one trial's planned cost x the maximum number of trials). `TuningSubmission`, the lifecycle's
`Submission` of a tune, turns that request into the CreateHyperParameterTuningJob request
(`llmtrain.core.tuning_request.tuning_request`, with the earlier tunes it warm-starts from), which the state
machine starts and waits for (`.sync`: stopping the execution stops it; one state per
`TUNING_LAYOUTS` entry), and classifies how it failed for NextAttempt. A tune is not retried but for a
throttled call or a quota the template waits for: SageMaker retries the trials itself. Its summary
names the best trial and the `llmtrain start` of a full run with its values
(`llmtrain.lifecycle.summaries.tune_summary`).

A tune keeps one tuning job per attempt, named `<team prefix>-<run>-t<n>`
(`llmtrain.lifecycle.jobs.tuning_jobs`). Tunes need an environment without queues: a tuning job
cannot be submitted to AWS Batch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmtrain.core.errors import LauncherStateError
from llmtrain.core.failures import TUNE_FAILED, Failure, classify_failure
from llmtrain.core.platform import PlatformContext
from llmtrain.core.program_contract import ProgramContract
from llmtrain.core.render import render
from llmtrain.core.request_layouts import TUNING_LAYOUTS
from llmtrain.core.run_settings import RunInput
from llmtrain.core.runs import InvalidRunInput, RunState
from llmtrain.core.spec import TemplateSpec
from llmtrain.core.tuning import (
    MAX_TUNE_ATTEMPTS,
    Trial,
    TuneError,
    TuneSpec,
    check_tune,
    check_tune_budget,
    check_tune_program,
)
from llmtrain.core.tuning_request import check_tune_request, check_tune_run_name, tuning_request
from llmtrain.lifecycle.jobs import tuning_jobs
from llmtrain.planner.checks import check_run

FINISHED_TUNING_STATUSES = ("Completed", "Stopped")


def check_tune_environment(platform: PlatformContext) -> None:
    """TuneError where the team's environment queues its jobs: a tuning job cannot be queued."""
    if platform.queues is not None:
        raise TuneError(
            f"environment {platform.environment!r} queues its training jobs (AWS Batch), and SageMaker's "
            "tuning jobs cannot be queued: tune in an environment without queues, or locally (--local)"
        )


@dataclass(frozen=True)
class TuningSubmission:
    """CreateHyperParameterTuningJob `.sync` of the run's rendered request, waiting for the tuning
    job's end; one state per `TUNING_LAYOUTS` entry. ``sagemaker``: a boto3 SageMaker client (the
    tune's tuning jobs, and those of the tunes it warm-starts from)."""

    tune: TuneSpec
    platform: PlatformContext
    sagemaker: Any

    @classmethod
    def for_tune(cls, tune: Mapping[str, Any], platform: PlatformContext, sagemaker: Any) -> TuningSubmission:
        """The tune's submission (`ExecutionInput.tune`, `RunState.tune`); TuneError where it cannot run."""
        check_tune_environment(platform)
        return cls(tune=TuneSpec.from_dict(tune), platform=platform, sagemaker=sagemaker)

    def check(self, request: Mapping[str, Any]) -> None:
        check_tune_request(self.tune, request)

    def attempt_state(self, request: Mapping[str, Any], run: RunState) -> dict[str, Any]:
        """`{"request": the CreateHyperParameterTuningJob request, "layout"}` of the run's attempt."""
        if run.attempt > MAX_TUNE_ATTEMPTS:
            raise TuneError(f"tune {run.run_name!r} has used all {MAX_TUNE_ATTEMPTS} attempts; choose a new "
                            "run_name (--warm-start it to build on its trials)")
        parents = parent_tuning_jobs(self.sagemaker, self.platform, self.tune.warm_start_from)
        tuning = tuning_request(self.tune, request, self.platform, run_name=run.run_name, attempt=run.attempt,
                                parent_tuning_jobs=parents)
        return {"request": tuning, "layout": tuning_layout(tuning)}

    def classify(self, caught: Mapping[str, Any], request: Mapping[str, Any]) -> Failure:
        """A tuning job that ended Failed or Stopped (the `.sync` state's cause is its
        DescribeHyperParameterTuningJob output), else what CreateHyperParameterTuningJob's error says
        (quota, throttling, ...), read as a training job's."""
        description = _tuning_job_from_cause(str(caught.get("Cause", "")))
        if description is None:
            return classify_failure(caught)
        status = description.get("HyperParameterTuningJobStatus")
        reason = str(description.get("FailureReason") or f"the tuning job ended {status}")
        return Failure(kind="stopped" if status == "Stopped" else TUNE_FAILED, reason=reason, job=description)

    def attempts(self, run_name: str, jobs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The tune's tuning jobs; InvalidRunInput where its name already names a run of training jobs
        (`jobs`): a run name identifies one run."""
        if jobs:
            raise InvalidRunInput(
                f"run name {run_name!r} already names a training run ({jobs[-1]['kind']} "
                f"{jobs[-1]['job_name']}): a run name identifies one run; choose a new one for the tune"
            )
        return tuning_jobs(self.sagemaker, self.platform.job_name_prefix, run_name)

    def template_of(self, attempts: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
        return None  # trials keep no checkpoints: a tune started again may run another version

    def started_job(self, request: Mapping[str, Any]) -> tuple[str, str | None]:
        definition = request.get("TrainingJobDefinition") or {}
        return request.get("HyperParameterTuningJobName", ""), (definition.get("ResourceConfig") or {}).get(
            "InstanceType")


def tuning_layout(request: Mapping[str, Any]) -> str:
    """The `TUNING_LAYOUTS` entry whose fields are exactly the tuning request's."""
    for name, fields in TUNING_LAYOUTS.items():
        if set(fields) == set(request):
            return name
    raise LauncherStateError(f"no tuning state takes a request with fields {sorted(request)}: "
                             "llmtrain.core.tuning_request.tuning_request and TUNING_LAYOUTS disagree")


def _tuning_job_from_cause(cause: str) -> dict[str, Any] | None:
    try:
        data = json.loads(cause)
    except ValueError:
        return None
    return data if isinstance(data, dict) and "HyperParameterTuningJobStatus" in data else None


def parent_tuning_jobs(sagemaker, platform: PlatformContext, tunes: Sequence[str]) -> list[str]:
    """The latest finished tuning job of each earlier tune a tune warm-starts from."""
    parents = []
    for name in tunes:
        finished = [
            job for job in tuning_jobs(sagemaker, platform.job_name_prefix, name)
            if job["status"] in FINISHED_TUNING_STATUSES
        ]
        if not finished:
            raise TuneError(
                f"--warm-start {name}: team {platform.team!r} has no finished tune {name!r} "
                "(a tune warm-starts from completed or stopped tunes)"
            )
        parents.append(finished[-1]["job_name"])
    return parents


def plan_tune(
    template: TemplateSpec,
    run: RunInput,
    tune: TuneSpec,
    platform: PlatformContext,
    program: ProgramContract | None = None,
    *,
    skip_plan_check: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The rendered CreateTrainingJob request of a tune's trials (`run`: its name, overrides, attempt,
    owner and base model) and the tune's plan; TuneError (or the renderer's and planner's errors)
    where the tune cannot start: what Resolve and `llmtrain tune` check before anything exists."""
    check_tune_run_name(run.run_name, platform)
    check_tune(template, tune, run.overrides)
    check_tune_program(template, tune, run, platform, program)
    training = render(template, run, platform, program)
    check_tune_request(tune, training)
    plan = check_run(
        template,
        training,
        run.overrides,
        budget_usd=platform.run_budget_usd,
        team=platform.team,
        skip_fit_check=skip_plan_check,
    )
    return training, check_tune_budget(plan, tune, budget_usd=platform.run_budget_usd, team=platform.team)


def render_tune(
    template: TemplateSpec,
    run: RunInput,
    tune: TuneSpec,
    platform: PlatformContext,
    program: ProgramContract | None = None,
    *,
    parents: Sequence[str] = (),
    skip_plan_check: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The CreateHyperParameterTuningJob request and the plan of a tune: what `llmtrain tune
    --dry-run` prints and the launcher sends for its attempt `run.attempt`."""
    training, plan = plan_tune(template, run, tune, platform, program, skip_plan_check=skip_plan_check)
    request = tuning_request(tune, training, platform, run_name=run.run_name, attempt=run.attempt,
                             parent_tuning_jobs=parents)
    return request, plan


# --- trials ---------------------------------------------------------------------------------------


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


__all__ = [
    "TuningSubmission",
    "check_tune_environment",
    "parent_tuning_jobs",
    "plan_tune",
    "render_tune",
    "tune_trials",
]
