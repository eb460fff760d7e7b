"""`llmtrain start | status | stop | logs`: start a run on the deployed launcher and follow it.

    llmtrain start NAME[@VERSION] --run-name R [--set KEY=VALUE ...] [--env ENV] [--team T]
                   [--wait] [--dry-run] [--skip-plan-check] [--queue Q] [--priority N]
    llmtrain status R [--env ENV] [--team T] [--json]
    llmtrain stop R [--env ENV] [--team T]
    llmtrain logs R [--env ENV] [--team T] [--attempt N] [--limit N]

`--team` picks the team's launcher; without it, the environment's only team (an environment of
several teams asks for it). `start` checks the run in two rounds before it starts anything. First
on this machine, without AWS credentials: the template and version exist, every override is one
the template allows and within its bounds, and the request renders and validates (exit 2 and what
to fix, with "did you mean" for a misspelled name). A template of a team's own catalog, which this
llmtrain does not ship, is found in the deployed environment's record (read first, then checked the
same way). Then against the deployed environment, read
from AWS (llmtrain.core.deployed): the template is enabled, the request renders with the team's platform
context (its templates, instance types and count, channels inside its datasets prefix), every
channel holds data, and the run's plan (llmtrain.planner) fits its GPUs (unless --skip-plan-check)
and its cost stays within the team's budget; the plan's one line is printed. Where the environment
has queues, `--queue` and `--priority` must be the team's to use (its queues, at most its
`max_priority`). Only then does it start an execution of the team's launcher
(llmtrain.client.launcher), with the launcher's own input record (llmtrain.core.runs.ExecutionInput).
`status` shows a queued run's place in its queue; `stop` cancels its queued job too.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from llmtrain.client.datasets import channel_problems
from llmtrain.client.launcher import LauncherClient, owner_from_identity
from llmtrain.client.run_views import FINISHED, RunStatus
from llmtrain.commands._common import (
    Cloud,
    add_cloud_arguments,
    add_overrides_argument,
    connect,
    follow_up_options,
    parse_overrides,
)
from llmtrain.core.catalog import Catalog, parse_ref
from llmtrain.core.errors import LlmtrainError, TemplateNotFoundError, did_you_mean
from llmtrain.core.jumpstart import resolve_base_model
from llmtrain.core.platform import MAX_KEEP_ALIVE_SECONDS
from llmtrain.core.program_contract import ProgramContract, installed_contract
from llmtrain.core.program_failures import meaning
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput, coerce_override
from llmtrain.core.runs import ExecutionInput
from llmtrain.core.spec import CHANNEL_SETTING_PREFIX, PLATFORM_RUN_OPTIONS, TemplateSpec
from llmtrain.core.team_context import placeholder_context
from llmtrain.core.tuning import Trial, TuneSpec, best_trial
from llmtrain.core.tuning import start_command as best_start_command
from llmtrain.lifecycle.resolve import check_queue_choice
from llmtrain.planner.checks import check_run


class RunRejected(LlmtrainError):
    """The run cannot start as asked; nothing was started."""


def register(subparsers) -> None:
    start = _parser(
        subparsers,
        "start",
        "start a training run on the deployed launcher",
        "Check a run of a template version here and against the deployed environment, then start it "
        "on your team's launcher. The run name names the training jobs; a run that failed can be "
        "started again under its name and resumes from its checkpoints.",
    )
    start.add_argument("ref", metavar="NAME[@VERSION]", help="template name, optionally @VERSION or @latest")
    start.add_argument("--run-name", required=True, help="the run's name, unique per environment")
    add_overrides_argument(start)
    start.add_argument("--wait", action="store_true", help="wait for the run to end and print its summary")
    start.add_argument(
        "--dry-run", action="store_true", help="check everything and print the request; start nothing"
    )
    start.add_argument(
        "--skip-plan-check",
        action="store_true",
        help="start the run even if the planner predicts it will not fit its GPUs (`llmtrain plan`)",
    )
    start.add_argument(
        "--queue", default=None,
        help="where the environment has queues: the team's queue the run waits in (default: its first)",
    )
    start.add_argument(
        "--priority", type=int, default=None,
        help="where the environment has queues: the run's priority in its queue, 0 to the team's "
        "max_priority (default 0; higher starts first among the team's runs)",
    )
    start.add_argument("--poll-seconds", type=float, default=30.0, help=argparse.SUPPRESS)
    start.set_defaults(handler=start_command)

    status = _parser(
        subparsers,
        "status",
        "show a run: execution and job status, latest metrics",
        "Show the run's latest execution, its training jobs (one per attempt) and the latest job's "
        "status and metrics; for a finished run, its summary; for a failed run, how to continue it.",
    )
    status.add_argument("run_name", metavar="RUN")
    status.add_argument("--json", action="store_true", help="print JSON instead of text")
    status.set_defaults(handler=status_command)

    stop = _parser(
        subparsers,
        "stop",
        "stop a run (its training job stops with it)",
        "Stop the run's execution; Step Functions stops the training job it is waiting for.",
    )
    stop.add_argument("run_name", metavar="RUN")
    stop.set_defaults(handler=stop_command)

    logs = _parser(
        subparsers,
        "logs",
        "print the training job's logs of a run",
        "Print the CloudWatch logs of the run's latest training job (or of one attempt).",
    )
    logs.add_argument("run_name", metavar="RUN")
    logs.add_argument(
        "--attempt", type=int, default=None, help="the attempt whose job to show (default: the latest)"
    )
    logs.add_argument("--limit", type=int, default=200, help="print the last N events (0: all; default 200)")
    logs.set_defaults(handler=logs_command)


def _parser(subparsers, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(name, help=summary, description=description)
    add_cloud_arguments(parser)
    return parser


# -- start ----------------------------------------------------------------------------------------------


def start_command(args: argparse.Namespace) -> int:
    overrides = parse_overrides(args.overrides)
    catalog, template, cloud = checked_template(args, overrides,
                                                check=lambda template: _queue_choice(template, args))
    check_queue_choice(_queue_choice(template, args), cloud.team.platform)
    request, plan = check_in_environment(
        cloud,
        template,
        args.run_name,
        overrides,
        skip_plan_check=args.skip_plan_check,
        program=catalog.program_contract(template),
    )
    print(plan.get("summary") or f"plan: not available: {plan.get('unavailable')}", file=sys.stderr)
    ref = template.ref  # the version checked here is the version that runs
    if args.dry_run:
        print(json.dumps(request, indent=2))
        print(
            f"llmtrain start: dry run: {ref} for run {args.run_name!r} passed every check; nothing started",
            file=sys.stderr,
        )
        return 0
    client = LauncherClient.for_team(
        cloud.deployed, cloud.team, session=cloud.session, identity=cloud.identity
    )
    execution, previous = client.start(
        template_ref=ref,
        run_name=args.run_name,
        overrides=overrides,
        owner=owner_from_identity(cloud.identity),
        skip_plan_check=args.skip_plan_check,
        queue=args.queue,
        priority=args.priority,
    )
    where = follow_up_options(args, cloud)
    if previous is not None:
        print(
            f"continuing run {args.run_name}: its last execution {previous['name']} ended "
            f"{previous['status']}; "
            "the launcher starts the next attempt, which resumes from the run's latest checkpoint"
        )
    print(f"started run {args.run_name} ({template.ref}): execution {execution['executionArn']}")
    if not args.wait:
        print(f"follow it with `llmtrain status {args.run_name}{where}`")
        return 0
    while client.find_execution(args.run_name)["status"] not in FINISHED:
        time.sleep(args.poll_seconds)
    status = client.status(args.run_name)
    print(format_status(status, where))
    return 0 if status.execution_status == "SUCCEEDED" else 1


def checked_template(
    args: argparse.Namespace, overrides: Mapping[str, str], *, check: Callable[[TemplateSpec], object]
) -> tuple[Catalog, TemplateSpec, Cloud]:
    """The template version `args.ref` that `start` and `tune` start, checked here (`check_locally`,
    then `check`), its catalog and the deployed environment. A template this llmtrain ships is checked
    before any AWS call; a team's own is found in the environment's record (no catalog here has it)."""
    catalog = Catalog.load()
    if parse_ref(args.ref)[0] in catalog.names():
        template = check_locally(catalog, args.ref, args.run_name, overrides)
        check(template)
        return catalog, template, connect(args)
    cloud = _connect_for(args, catalog)
    catalog = environment_catalog(cloud, catalog)
    template = check_locally(catalog, args.ref, args.run_name, overrides)
    check(template)
    return catalog, template, cloud


def _queue_choice(template: TemplateSpec, args: argparse.Namespace) -> ExecutionInput:
    """The run's queue and priority as the launcher reads them (their form; InvalidRunInput)."""
    return ExecutionInput(template=template.name, run_name=args.run_name, queue=args.queue,
                          priority=args.priority)


def _connect_for(args: argparse.Namespace, packaged: Catalog) -> Cloud:
    """The deployed environment, to look up a template this llmtrain does not ship; where it cannot be
    read, the template is unknown here first (a misspelled name gets its "did you mean")."""
    try:
        return connect(args)
    except LlmtrainError as error:
        try:
            packaged.versions(parse_ref(args.ref)[0])
        except TemplateNotFoundError as unknown:
            raise TemplateNotFoundError(
                f"{unknown}; nor could the deployed environment, which lists your team's own templates, "
                f"be read: {error}"
            ) from error
        raise


def environment_catalog(cloud: Cloud, packaged: Catalog) -> Catalog:
    """What `start` resolves in: the platform's templates this llmtrain ships and the versions the
    deployed environment runs from its teams' own catalogs (llmtrain.core.deployed)."""
    own = cloud.deployed.own_catalog()
    return Catalog.of([*packaged.all(), *own.all()], source=f"llmtrain's catalog and {own.source}")


def check_locally(catalog: Catalog, ref: str, run_name: str, overrides: Mapping[str, str]) -> TemplateSpec:
    """Everything about the run that needs no AWS: the template, the overrides, the request's rules.

    Where a channel may read (the team's datasets prefix) is the environment's to say: channels are
    checked here for their form (an S3 URI), then against the team in `check_in_environment`."""
    template = catalog.resolve(ref)
    for setting, value in overrides.items():
        coerce_override(template, setting, value)  # an unknown setting is refused with "did you mean"
    stand_in = placeholder_context(
        environment="check",
        account="000000000000",
        region="us-east-1",
        resource_prefix="llmtrain",
        warm_pool_cap_seconds=MAX_KEEP_ALIVE_SECONDS,
    )
    # The platform run options (training plans, remote debugging, base models) are the environment's
    # to check, with its plans, features and region, as the channels are.
    settings = {k: v for k, v in overrides.items()
                if not k.startswith(CHANNEL_SETTING_PREFIX) and k not in PLATFORM_RUN_OPTIONS}
    run = RunInput(run_name=run_name, overrides=settings)
    render(template, run, stand_in, catalog.program_contract(template))
    return template


def check_in_environment(
    cloud: Cloud,
    template: TemplateSpec,
    run_name: str,
    overrides: Mapping[str, str],
    *,
    skip_plan_check: bool = False,
    program: ProgramContract | None = None,
) -> tuple[dict, dict]:
    """What depends on the deployment: the template enabled, the request rendered with the team's
    platform context (its templates, instance types and count, warm-pool cap, run-name length, channels
    inside its datasets prefix), every channel holding data, and the run's plan: the launcher's own
    check (fits, within the team's budget). `program`: the training program's contract of the code
    the version runs (Catalog.program_contract). Returns the request and the plan's figures."""
    deployed, team = cloud.deployed, cloud.team
    if template.name not in deployed.enabled_templates:
        raise RunRejected(
            f"template {template.name!r} is not enabled in environment {deployed.environment!r}"
            f"{did_you_mean(template.name, deployed.enabled_templates)}; it offers: "
            f"{', '.join(deployed.enabled_templates)}"
        )
    base_model = resolve_base_model(overrides, cloud.session.client("s3", region_name=deployed.region),
                                    deployed.region)
    run = RunInput(run_name=run_name, overrides=dict(overrides), base_model=base_model)
    request = render(template, run, team.platform, program)
    plan = check_run(
        template,
        request,
        overrides,
        budget_usd=team.platform.run_budget_usd,
        team=team.name,
        skip_fit_check=skip_plan_check,
        program=program,
    )
    # A JumpStart base model is in JumpStart's buckets (resolved above), not in the team's datasets.
    own_data = request if base_model is None else {
        **request, "InputDataConfig": [c for c in request["InputDataConfig"] if c["ChannelName"] != "model"]}
    problems = channel_problems(
        cloud.session.client("s3", region_name=deployed.region),
        team,
        own_data,
        token_channels=template.code.is_platform,
        manifest_versions=(program or installed_contract()).manifest_versions,
    )
    if problems:
        raise RunRejected(
            "the run's data is not where it must be:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    return request, plan


# -- status, stop, logs ---------------------------------------------------------------------------------


def status_command(args: argparse.Namespace) -> int:
    cloud = connect(args)
    status = _client(cloud).status(args.run_name)
    print(
        json.dumps(status.to_dict(), indent=2, default=str)
        if args.json
        else format_status(status, follow_up_options(args, cloud))
    )
    return 0


def stop_command(args: argparse.Namespace) -> int:
    cloud = connect(args)
    client = _client(cloud)
    execution = client.stop(args.run_name, by=owner_from_identity(cloud.identity))
    if "cancelled" in execution:  # a queued run: its service jobs were terminated first
        cancelled = ", ".join(execution["cancelled"]) or "none was queued or running"
        print(f"stopping run {args.run_name} ({execution['executionArn']}); cancelled its queued job: "
              f"{cancelled}")
        return 0
    jobs = client.jobs(args.run_name)
    job = f"; Step Functions stops training job {jobs[-1]['job_name']}" if jobs else ""
    print(f"stopping run {args.run_name} ({execution['executionArn']}){job}")
    return 0


def logs_command(args: argparse.Namespace) -> int:
    events = _client(connect(args)).logs(args.run_name, attempt=args.attempt, limit=args.limit)
    if not events:
        print(f"no log events yet for run {args.run_name}", file=sys.stderr)
    for event in events:
        stream = event.get("logStreamName", "").split("/", 1)[-1]
        print(f"[{stream}] {event['message'].rstrip()}")
    return 0


# -- helpers --------------------------------------------------------------------------------------------


def format_status(status: RunStatus, where: str = "") -> str:
    lines = [
        f"run {status.run_name}: execution {status.execution_status} (started {status.started}"
        + (f", ended {status.stopped})" if status.stopped else ")")
    ]
    if len(status.executions) > 1:
        lines.append(f"executions: {', '.join(status.executions)}")
    if status.queue:
        lines.append(f"queue: {status.queue['message']}")
    lines.extend(_tune_lines(status) if status.run_input.get("tune") is not None else _job_lines(status.job))
    if len(status.jobs) > 1:
        lines.append("attempts: " + ", ".join(f"{j['attempt']}:{j['status']}" for j in status.jobs))
    if status.metrics:
        lines.append("latest metrics: " + ", ".join(f"{k}={v:g}" for k, v in sorted(status.metrics.items())))
    lines.extend(status.notes)
    if status.summary:
        lines.append("")
        lines.append(status.summary.get("message") or json.dumps(status.summary, indent=2))
    elif status.error:
        lines.append("")
        lines.append(f"{status.error}: {status.cause}")
    if status.continuable and status.run_input.get("template"):
        lines.append("")
        lines.append(
            f"continue this run under its name (it resumes from its latest checkpoint): "
            f"{continue_command(status, where)}"
        )
    return "\n".join(lines)


def _job_lines(job: Mapping[str, Any] | None) -> list[str]:
    """The run's latest training job: its status, why it failed and what that means, TensorBoard."""
    if not job:
        return ["training job: none yet"]
    lines = [
        f"training job {job['name']}: {job['status']} ({job['secondary_status']}) on "
        f"{job['instance_count']} x {job['instance_type']}"
    ]
    if job.get("failure_reason"):
        lines.append(f"  failure reason: {job['failure_reason']}")
        if meaning(job["failure_reason"]):
            lines.append(f"  what it means: {meaning(job['failure_reason'])}")
    if job.get("tensorboard"):
        lines.append(f"  TensorBoard (live): tensorboard --logdir {job['tensorboard']}")
    return lines


def _tune_lines(status: RunStatus) -> list[str]:
    """A tune's tuning job, its trials and the best one's `llmtrain start` line."""
    tuning = status.tuning
    if not tuning:
        return ["tuning job: none yet"]
    tune = TuneSpec.from_dict(status.run_input["tune"])
    trials = [Trial(number=t["number"], params=t["params"], objective=t["objective"], status=t["status"],
                    name=t["name"], detail=t["detail"]) for t in tuning["trials"]]
    lines = [f"tuning job {tuning['name']}: {tuning['status']}, {len(trials)} of {tune.trials} trials "
             f"({'maximize' if tune.maximize else 'minimize'} {tune.objective})"]
    for trial in trials:
        values = ", ".join(f"{k}={v}" for k, v in trial.params.items())
        objective = "-" if trial.objective is None else f"{trial.objective:g}"
        lines.append(f"  {trial.name}: {trial.status} {tune.objective}={objective} {values}")
    best = best_trial(trials, maximize=tune.maximize)
    if best is not None:
        ref = f"{status.run_input['template']}@{status.run_input.get('version') or 'latest'}"
        lines.append("best trial: " + best.name)
        lines.append("run it in full: " + best_start_command(ref, f"{status.run_name}-best",
                                                        status.run_input.get("overrides") or {}, best.params))
    return lines


def continue_command(status: RunStatus, where: str = "") -> str:
    """The `llmtrain start` that continues a run: its template version and overrides, as started; for
    a tune, the `llmtrain tune` that starts its next tuning job with the same search."""
    run_input = status.run_input
    ref = f"{run_input['template']}@{run_input.get('version') or 'latest'}"
    sets = "".join(
        f" --set {shlex.quote(f'{k}={_plain(v)}')}" for k, v in (run_input.get("overrides") or {}).items()
    )
    if run_input.get("tune") is not None:
        search = " ".join(shlex.quote(option) for option in TuneSpec.from_dict(run_input["tune"]).options())
        return f"llmtrain tune {ref} --run-name {status.run_name} {search}{sets}{where}"
    return f"llmtrain start {ref} --run-name {status.run_name}{sets}{where}"


def _plain(value) -> str:
    return json.dumps(value) if isinstance(value, bool | dict | list) or value is None else str(value)


def _client(cloud: Cloud) -> LauncherClient:
    return LauncherClient.for_team(cloud.deployed, cloud.team, session=cloud.session, identity=cloud.identity)
