"""`llmtrain plans --env ENV`: the environment's SageMaker training plans and their free capacity.

A training plan is reserved capacity (instances of one type for a time window). The environment names
the plans its runs may use in `config/<env>.yaml` (`training_plans:` name -> ARN); a run targets one
with `--set training_plan=NAME`. This command lists, with the caller's credentials, every training
plan of the account and region (`sagemaker:ListTrainingPlans`), marks which the environment offers,
and shows the configured ones' instances in use and available (`sagemaker:DescribeTrainingPlan`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from llmtrain.commands._common import add_environment_arguments, environment_of
from llmtrain.environments import EnvironmentConfig
from llmtrain.errors import LlmtrainError
from llmtrain.launcher_client import account_session

_HEADERS = ("PLAN", "STATUS", "INSTANCES", "AVAILABLE", "IN USE", "START", "END", "")


@dataclass(frozen=True)
class PlanView:
    """One training plan as the command shows it."""

    name: str  # the environment's name for it (config), else the plan's own name
    plan_name: str
    arn: str
    status: str
    instance_type: str
    total_instances: int | None
    available_instances: int | None
    in_use_instances: int | None
    start: str | None
    end: str | None
    configured: bool
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plans",
        help="the environment's training plans (reserved capacity) and their free instances",
        description="List the account's SageMaker training plans in the environment's region, mark the "
        "ones config/<env>.yaml offers to runs (training_plans:), and show their instances in use and "
        "available. A run targets one with --set training_plan=NAME. Needs sagemaker:ListTrainingPlans "
        "and sagemaker:DescribeTrainingPlan.",
    )
    add_environment_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.set_defaults(handler=plans_command)


def plans_command(args: argparse.Namespace) -> int:
    environment = environment_of(args)
    session = account_session(environment)
    views = list_plans(session.client("sagemaker", region_name=environment.region), environment)
    if args.json:
        print(json.dumps([view.to_dict() for view in views], indent=2))
    else:
        print_plans(views, environment)
    return 0


def list_plans(sagemaker, environment: EnvironmentConfig) -> list[PlanView]:
    """Every plan of the account (configured ones first), with the configured plans described."""
    try:
        summaries = _summaries(sagemaker)
    except (ClientError, BotoCoreError) as error:
        raise LlmtrainError(
            f"could not list the training plans of account {environment.account} in {environment.region}: "
            f"{error}; your credentials need sagemaker:ListTrainingPlans"
        ) from error
    by_arn = {summary["TrainingPlanArn"]: summary for summary in summaries}
    configured = {arn: name for name, arn in environment.training_plans.items()}
    views = [_configured_view(sagemaker, name, arn, by_arn.get(arn))
             for name, arn in environment.training_plans.items()]
    views += [_view(summary["TrainingPlanName"], summary, configured=False,
                    note="not offered to runs: add it to training_plans in config")
              for arn, summary in by_arn.items() if arn not in configured]
    return views


def _summaries(sagemaker) -> list[dict[str, Any]]:
    summaries, token = [], None
    while True:
        page = sagemaker.list_training_plans(**({"NextToken": token} if token else {}))
        summaries.extend(page.get("TrainingPlanSummaries", []))
        token = page.get("NextToken")
        if not token:
            return summaries


def _configured_view(sagemaker, name: str, arn: str, summary: Mapping[str, Any] | None) -> PlanView:
    if summary is None:
        return PlanView(name, arn.rpartition("/")[2], arn, "NotFound", "?", None, None, None, None, None,
                        True, "the account has no plan with this ARN in this region: fix config")
    try:
        described = sagemaker.describe_training_plan(TrainingPlanName=summary["TrainingPlanName"])
    except (ClientError, BotoCoreError) as error:
        return _view(name, summary, configured=True,
                     note=f"could not describe it ({error}); needs sagemaker:DescribeTrainingPlan")
    return _view(name, {**summary, **described}, configured=True)


def _view(name: str, plan: Mapping[str, Any], *, configured: bool, note: str = "") -> PlanView:
    capacity = plan.get("ReservedCapacitySummaries") or [{}]
    instance_type = ", ".join(sorted({c.get("InstanceType", "?") for c in capacity}))
    if not note and plan.get("Status") != "Active":
        note = (plan.get("StatusMessage")
                or f"runs wait in Pending until the plan is Active ({plan.get('Status')})")
    return PlanView(
        name=name,
        plan_name=plan.get("TrainingPlanName", name),
        arn=plan["TrainingPlanArn"],
        status=plan.get("Status", "?"),
        instance_type=instance_type,
        total_instances=plan.get("TotalInstanceCount"),
        available_instances=plan.get("AvailableInstanceCount"),
        in_use_instances=plan.get("InUseInstanceCount"),
        start=_time(plan.get("StartTime")),
        end=_time(plan.get("EndTime")),
        configured=configured,
        note=note,
    )


def _time(value: Any) -> str | None:
    return value.isoformat(timespec="minutes") if hasattr(value, "isoformat") else value


def _count(value: int | None) -> str:
    return "?" if value is None else str(value)


def print_plans(views: list[PlanView], environment: EnvironmentConfig) -> None:
    print(f"Environment {environment.name} (account {environment.account}, {environment.region}): "
          f"{len(environment.training_plans)} training plan(s) offered to runs")
    if not views:
        print("  no training plans in this account and region")
        return
    rows = [
        (
            view.name + ("" if view.configured else " *"),
            view.status,
            f"{_count(view.total_instances)} x {view.instance_type}",
            _count(view.available_instances),
            _count(view.in_use_instances),
            view.start or "",
            view.end or "",
            view.note,
        )
        for view in views
    ]
    widths = [max(len(row[i]) for row in (_HEADERS, *rows)) for i in range(len(_HEADERS))]
    for row in (_HEADERS, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    if any(not view.configured for view in views):
        print("* not in config/<env>.yaml training_plans: runs cannot target it yet")
