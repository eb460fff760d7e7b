"""Resolve: from an execution's input to the run's first attempt, or a refusal before any job exists.

It checks the execution input (`llmtrain.core.runs.ExecutionInput`), resolves `template@version` in the
launcher's registry (a run with earlier jobs keeps the version they ran), refuses a run that is in
progress or already completed or beyond its team's limits, renders attempt 1 (or the attempt after
the run's last one, so a failed run started again resumes from its checkpoints) and checks the
template's capacity fallbacks against the run. Where the environment has queues, the run's queue
and priority must be the team's (`check_queue_choice`), and its earlier attempts include its service
jobs (the deployment's `Submission` finds them). It plans the run (llmtrain.planner.checks) and refuses
one planned not to fit its GPUs (unless the input sets `skip_plan_check`) or to cost more than the
team's budget (`run_budget_usd`). A run's JumpStart base model (`base_model=<model id>`) is resolved
here, in the environment's region, once for every attempt. A tune (the input's `tune`) is started by
`start_tune`: its attempts are tuning jobs (`llmtrain.lifecycle.tuning_jobs.TuningSubmission`). Refusals
are the `REJECTIONS`, whose messages say what to fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llmtrain.core.catalog import LATEST, Catalog
from llmtrain.core.errors import LlmtrainError, OverrideError
from llmtrain.core.jumpstart import BaseModel, resolve_base_model
from llmtrain.core.platform import PlatformContext
from llmtrain.core.program_contract import ProgramContract
from llmtrain.core.render import check_team_template, max_run_name_length, render
from llmtrain.core.run_settings import MAX_ATTEMPTS, RunInput
from llmtrain.core.runs import DEFAULT_OWNER, ExecutionInput, InvalidRunInput, RunState, UnusableInstanceType
from llmtrain.core.spec import TemplateSpec
from llmtrain.core.validate import reshape_problems
from llmtrain.lifecycle.jobs import ACTIVE_JOB_STATUSES, TRAINING_JOB, TUNING_JOB, pinned_template, run_jobs
from llmtrain.lifecycle.submission import Submission
from llmtrain.lifecycle.tuning_jobs import TuningSubmission, plan_tune
from llmtrain.planner.checks import check_run


class RunAlreadyInProgress(LlmtrainError):
    """A training job of this run is still running; a second one is never started."""


class RunAlreadyCompleted(LlmtrainError):
    """This run name already has a completed training job; run names identify one run."""


# Resolve's refusals: the execution ends with their class name as its error, before any job exists.
REJECTIONS = (InvalidRunInput, RunAlreadyInProgress, RunAlreadyCompleted)


def resolve_run(
    data: Any,
    *,
    platform: PlatformContext,
    submission: Submission,
    catalog: Catalog,
    sagemaker: Any,
    s3: Any = None,
    execution_arn: str | None = None,
) -> dict[str, Any]:
    """The execution input `data` -> `{"run", **submission.attempt_state(request)}`; raises one of
    the `REJECTIONS` for a run that must not start. `submission`: the deployment's; a tune's is its
    `TuningSubmission`. `s3`: a client that reads JumpStart's catalogue (a run's `base_model`)."""
    run_input = ExecutionInput.parse(data)
    try:
        check_team_template(run_input.template, platform)
        check_run_name(run_input.run_name, platform)
        check_queue_choice(run_input, platform)
        tuning = (None if run_input.tune is None
                  else TuningSubmission.for_tune(run_input.tune, platform, sagemaker))
    except LlmtrainError as error:
        raise rejected(error) from error
    submission = tuning or submission
    jobs = run_jobs(sagemaker, platform.job_name_prefix, run_input.run_name)
    previous = submission.attempts(run_input.run_name, jobs)
    refuse_duplicate_run(run_input.run_name, previous)
    try:
        pinned = submission.template_of(previous) or pinned_template(sagemaker, jobs)
        template = run_template(run_input, pinned, catalog)
        base_model = resolve_base_model(run_input.overrides, s3, platform.region)
    except LlmtrainError as error:
        raise rejected(error) from error
    program = catalog.program_contract(template)
    if tuning is not None:
        return start_tune(template, run_input, platform, previous, tuning, program=program,
                          base_model=base_model, execution_arn=execution_arn)
    return start_run(template, run_input, platform, previous, submission, program=program,
                     base_model=base_model, execution_arn=execution_arn)


def rejected(error: LlmtrainError) -> InvalidRunInput:
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


def check_queue_choice(run_input: ExecutionInput, platform: PlatformContext) -> None:
    """InvalidRunInput unless the run's queue and priority are the team's to use: its queues, at most
    its `max_priority`; none at all where the environment has no queues. The CLI checks the same."""
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
    submission: Submission,
    *,
    program: ProgramContract | None = None,
    base_model: BaseModel | None = None,
    execution_arn: str | None = None,
) -> dict[str, Any]:
    """Render the run's first attempt here, after checking what earlier attempts left behind, and
    check its capacity fallbacks up front: a type that cannot hold the run is never tried."""
    attempt = next_attempt_number(run_input.run_name, previous)
    owner = run_input.owner or DEFAULT_OWNER
    try:
        request = _render(template, run_input.run_name, run_input.overrides, attempt, owner, None, platform,
                          program, base_model)
        submission.check(request)
        # The planner: refuse a run that will not fit its GPUs or costs more than the team's budget.
        plan = check_run(
            template,
            request,
            run_input.overrides,
            budget_usd=platform.run_budget_usd,
            team=platform.team,
            skip_fit_check=run_input.skip_plan_check,
            program=program,
        )
    except LlmtrainError as error:
        raise rejected(error) from error
    first = request["ResourceConfig"]["InstanceType"]
    usable, unusable = check_fallbacks(template, run_input, request, platform, submission, program,
                                       base_model)
    run = _run_state(
        template, run_input, platform, owner, attempt, execution_arn, base_model,
        instance_types=(first, *usable),
        unusable_instance_types=unusable,
        checkpoint_s3_uri=request.get("CheckpointConfig", {}).get("S3Uri"),
        plan=plan,
        queue=run_input.queue,
        priority=run_input.priority,
    )
    try:
        state = submission.attempt_state(request, run)
    except LlmtrainError as error:
        raise rejected(error) from error
    return {"run": run.to_dict(), **state}


def start_tune(
    template: TemplateSpec,
    run_input: ExecutionInput,
    platform: PlatformContext,
    previous: Sequence[Mapping[str, Any]],
    submission: TuningSubmission,
    *,
    program: ProgramContract | None = None,
    base_model: BaseModel | None = None,
    execution_arn: str | None = None,
) -> dict[str, Any]:
    """A tune's attempt: its tuning job runs trials of the run as rendered here (the ranges checked,
    its trials together planned within the team's budget: `llmtrain.lifecycle.tuning_jobs.plan_tune`).
    No capacity fallbacks: a tuning job's trials run on one instance type, and SageMaker retries them."""
    attempt = next_attempt_number(run_input.run_name, previous)
    owner = run_input.owner or DEFAULT_OWNER
    try:
        trials = RunInput(run_name=run_input.run_name, overrides=run_input.overrides, attempt=attempt,
                          owner=owner, base_model=base_model)
        request, plan = plan_tune(template, trials, submission.tune, platform, program,
                                  skip_plan_check=run_input.skip_plan_check)
        run = _run_state(template, run_input, platform, owner, attempt, execution_arn, base_model,
                         instance_types=(request["ResourceConfig"]["InstanceType"],), plan=plan,
                         tune=submission.tune.to_dict())
        state = submission.attempt_state(request, run)
    except LlmtrainError as error:
        raise rejected(error) from error
    return {"run": run.to_dict(), **state}


def _run_state(
    template: TemplateSpec,
    run_input: ExecutionInput,
    platform: PlatformContext,
    owner: str,
    attempt: int,
    execution_arn: str | None,
    base_model: BaseModel | None,
    **fields: Any,
) -> RunState:
    """The run's state at its attempt, as the state machine carries it between steps."""
    return RunState(
        run_name=run_input.run_name,
        team=platform.team,
        template=template.name,
        version=template.version,
        overrides=run_input.overrides,
        owner=owner,
        execution_arn=execution_arn,
        attempt=attempt,
        base_model=base_model.to_dict() if base_model else None,
        **fields,
    )


def next_attempt_number(run_name: str, previous: Sequence[Mapping[str, Any]]) -> int:
    """The attempt after the run's last one (1 for a new run), once nothing of it runs or completed."""
    refuse_duplicate_run(run_name, previous)
    attempt = previous[-1]["attempt"] + 1 if previous else 1
    if attempt > MAX_ATTEMPTS:
        raise InvalidRunInput(f"run {run_name!r} has used all {MAX_ATTEMPTS} attempts; choose a new run_name")
    return attempt


def check_fallbacks(
    template: TemplateSpec,
    run_input: ExecutionInput,
    first: Mapping[str, Any],
    platform: PlatformContext,
    submission: Submission,
    program: ProgramContract | None = None,
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
                              platform, program, base_model)
            submission.check(request)
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


def refuse_duplicate_run(run_name: str, previous: Sequence[Mapping[str, Any]]) -> None:
    """RunAlreadyInProgress or RunAlreadyCompleted where the run's earlier attempts (training jobs, or a
    tune's tuning jobs: `llmtrain.lifecycle.jobs`) say it must not start again."""
    active = [job for job in previous if job["status"] in ACTIVE_JOB_STATUSES]
    if active:
        job = active[-1]
        raise RunAlreadyInProgress(
            f"run {run_name!r} already has {job.get('kind', TRAINING_JOB)} {job['job_name']} in progress, so "
            f"no second job was started: follow it with `llmtrain status {run_name}` or stop it with "
            f"`llmtrain stop {run_name}`"
        )
    completed = [job for job in previous if job["status"] == "Completed"]
    if completed:
        job = completed[-1]
        kind = job.get("kind", TRAINING_JOB)
        build_on = " (`llmtrain tune --warm-start` builds on its trials)" if kind == TUNING_JOB else ""
        raise RunAlreadyCompleted(
            f"run {run_name!r} already completed ({kind} {job['job_name']}); a run name identifies one "
            f"run: choose a new run_name{build_on}"
        )


def _render(
    template: TemplateSpec,
    run_name: str,
    overrides: Mapping[str, Any],
    attempt: int,
    owner: str,
    instance_type: str | None,
    platform: PlatformContext,
    program: ProgramContract | None,
    base_model: BaseModel | None = None,
) -> dict:
    run_input = RunInput(
        run_name=run_name, overrides=overrides, attempt=attempt, instance_type=instance_type, owner=owner,
        base_model=base_model,
    )
    # The training program's rules of the code this version runs (its frozen code's, bundled).
    return render(template, run_input, platform, program)


def render_attempt(template: TemplateSpec, run: RunState, platform: PlatformContext,
                   program: ProgramContract | None = None) -> dict:
    """The request of the run's current attempt (on its current instance type, from the base model
    resolved when the run started)."""
    fallback = run.instance_type if run.type_index else None
    base_model = BaseModel.from_dict(run.base_model) if run.base_model else None
    return _render(template, run.run_name, run.overrides, run.attempt, run.owner, fallback, platform, program,
                   base_model)
