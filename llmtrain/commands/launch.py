"""`llmtrain start | status | stop | logs`: start a run on the deployed launcher and follow it.

    llmtrain start NAME[@VERSION] --run-name R [--set KEY=VALUE ...] [--env ENV] [--wait] [--skip-plan-check]
    llmtrain status R [--env ENV] [--json]
    llmtrain stop R [--env ENV]
    llmtrain logs R [--env ENV] [--attempt N] [--limit N]

The launcher of environment ENV (config/<ENV>.yaml) is found through its stack's output
`StateMachineArn` (llmtrain.launcher_client); `--state-machine-arn` skips that lookup. AWS
credentials come from the usual places (AWS_PROFILE, `aws sso login`, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import boto3

from llmtrain.catalog import Catalog
from llmtrain.commands._common import (
    add_environment_arguments,
    add_overrides_argument,
    environment_of,
    parse_overrides,
)
from llmtrain.environments import EnvironmentConfig
from llmtrain.errors import LlmtrainError
from llmtrain.launcher_client import LauncherClient, RunStatus, owner_from_identity
from llmtrain.planner.plan import plan_run

FINISHED = ("SUCCEEDED", "FAILED", "TIMED_OUT", "ABORTED")


def register(subparsers) -> None:
    start = _parser(
        subparsers,
        "start",
        "start a training run on the deployed launcher",
        "Start an execution of the environment's launcher state machine for one run of a "
        "template version. The run name names the execution and the training jobs.",
    )
    start.add_argument("ref", metavar="NAME[@VERSION]", help="template name, optionally @VERSION or @latest")
    start.add_argument("--run-name", required=True, help="the run's name, unique per environment")
    add_overrides_argument(start)
    start.add_argument("--wait", action="store_true", help="wait for the run to end and print its summary")
    start.add_argument(
        "--skip-plan-check",
        action="store_true",
        help="start the run even if the planner predicts it will not fit its GPUs (`llmtrain plan`)",
    )
    start.add_argument("--poll-seconds", type=float, default=30.0, help=argparse.SUPPRESS)
    start.set_defaults(handler=start_command)

    status = _parser(
        subparsers,
        "status",
        "show a run: execution and job status, latest metrics",
        "Show the run's execution, its training jobs (one per attempt) and the latest job's "
        "status and metrics; for a finished run, its summary.",
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
    add_environment_arguments(parser)
    parser.add_argument(
        "--state-machine-arn", default=None, help="use this launcher instead of the launcher stack's output"
    )
    return parser


# -- commands -------------------------------------------------------------------------------------------


def start_command(args: argparse.Namespace) -> int:
    environment = environment_of(args)
    overrides = parse_overrides(args.overrides)
    print(run_plan_summary(args.ref, overrides))
    client = _client(args, environment)
    execution = client.start(
        template_ref=args.ref,
        run_name=args.run_name,
        overrides=overrides,
        owner=owner_from_identity(client.identity),
        skip_plan_check=args.skip_plan_check,
    )
    print(f"started run {args.run_name}: {execution['executionArn']}")
    if not args.wait:
        print(f"follow it with `llmtrain status {args.run_name} --env {environment.name}`")
        return 0
    while client.find_execution(args.run_name)["status"] not in FINISHED:
        time.sleep(args.poll_seconds)
    status = client.status(args.run_name)
    print(format_status(status))
    return 0 if status.execution_status == "SUCCEEDED" else 1


def status_command(args: argparse.Namespace) -> int:
    status = _client(args, environment_of(args)).status(args.run_name)
    print(json.dumps(status.to_dict(), indent=2, default=str) if args.json else format_status(status))
    return 0


def stop_command(args: argparse.Namespace) -> int:
    client = _client(args, environment_of(args))
    execution = client.stop(args.run_name, by=owner_from_identity(client.identity))
    jobs = client.jobs(args.run_name)
    job = f"; Step Functions stops training job {jobs[-1]['job_name']}" if jobs else ""
    print(f"stopping run {args.run_name} ({execution['executionArn']}){job}")
    return 0


def logs_command(args: argparse.Namespace) -> int:
    client = _client(args, environment_of(args))
    events = client.logs(args.run_name, attempt=args.attempt, limit=args.limit)
    if not events:
        print(f"no log events yet for run {args.run_name}", file=sys.stderr)
    for event in events:
        stream = event.get("logStreamName", "").split("/", 1)[-1]
        print(f"[{stream}] {event['message'].rstrip()}")
    return 0


# -- helpers ------------------------------------------------------------------------------------------


def format_status(status: RunStatus) -> str:
    lines = [
        f"run {status.run_name}: execution {status.execution_status} (started {status.started}"
        + (f", ended {status.stopped})" if status.stopped else ")")
    ]
    if status.job:
        job = status.job
        lines.append(
            f"training job {job['name']}: {job['status']} ({job['secondary_status']}) on "
            f"{job['instance_count']} x {job['instance_type']}"
        )
        if job.get("failure_reason"):
            lines.append(f"  failure reason: {job['failure_reason']}")
        if job.get("tensorboard"):
            lines.append(f"  TensorBoard (live): tensorboard --logdir {job['tensorboard']}")
    else:
        lines.append("training job: none yet")
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
    return "\n".join(lines)


def run_plan_summary(ref: str, overrides: dict[str, str]) -> str:
    """The planner's one line for the run the launcher is about to check (it refuses one that does
    not fit or exceeds the budget), from this checkout's catalog."""
    try:
        return plan_run(Catalog.load().resolve(ref), overrides).summary_line()
    except LlmtrainError as error:
        return f"plan: not available: {error}"


def _client(args: argparse.Namespace, environment: EnvironmentConfig) -> LauncherClient:
    return LauncherClient.discover(
        environment, session=boto3.Session(), state_machine_arn=args.state_machine_arn
    )
