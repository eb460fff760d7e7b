"""`llmtrain plans --env ENV [--team TEAM]`: the environment's SageMaker training plans and their free
capacity.

A training plan is reserved capacity (instances of one type for a time window). The environment names
the plans its runs may use in `config/<env>.yaml` (`training_plans:` name -> ARN); the deployed
record (llmtrain.core.deployed) carries them in every team's platform context, and a run targets one with
`--set training_plan=NAME`. This command reads the record like the other cloud commands, then lists,
with the caller's credentials, every training plan of the account and region
(`sagemaker:ListTrainingPlans`), marks which the environment offers, and shows the offered ones'
instances in use and available (`sagemaker:DescribeTrainingPlan`, which a team's engineers' policy
allows on exactly those plans).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from llmtrain.client.aws import ENGINEER_POLICY_HINT, AwsAccessError
from llmtrain.commands._common import add_cloud_arguments, connect, print_table

_HEADERS = ("PLAN", "STATUS", "INSTANCES", "AVAILABLE", "IN USE", "START", "END", "")


@dataclass(frozen=True)
class PlanScope:
    """Where the plans are looked for, and which the environment offers (name -> ARN)."""

    environment: str
    account: str
    region: str
    offered: Mapping[str, str]


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
        "ones the deployed environment offers to runs (config training_plans:), and show their instances "
        "in use and available. A run targets one with --set training_plan=NAME. Needs your team's "
        "engineers' policy (sagemaker:ListTrainingPlans, sagemaker:DescribeTrainingPlan).",
    )
    add_cloud_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.set_defaults(handler=plans_command)


def plans_command(args: argparse.Namespace) -> int:
    cloud = connect(args)
    deployed = cloud.deployed
    scope = PlanScope(environment=deployed.environment, account=deployed.account, region=deployed.region,
                      offered=cloud.team.platform.training_plans)
    views = list_plans(cloud.session.client("sagemaker", region_name=deployed.region), scope)
    if args.json:
        print(json.dumps([view.to_dict() for view in views], indent=2))
    else:
        print_plans(views, scope)
    return 0


def list_plans(sagemaker, scope: PlanScope) -> list[PlanView]:
    """Every plan of the account (offered ones first), with the offered plans described."""
    try:
        summaries = _summaries(sagemaker)
    except (ClientError, BotoCoreError) as error:
        raise AwsAccessError(
            f"could not list the training plans of account {scope.account} in {scope.region}: "
            f"{error}; your credentials need sagemaker:ListTrainingPlans ({ENGINEER_POLICY_HINT})"
        ) from error
    by_arn = {summary["TrainingPlanArn"]: summary for summary in summaries}
    configured = {arn: name for name, arn in scope.offered.items()}
    views = [_configured_view(sagemaker, name, arn, by_arn.get(arn)) for name, arn in scope.offered.items()]
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
                        True, "the account has no plan with this ARN in this region: fix config "
                        "training_plans")
    try:
        described = sagemaker.describe_training_plan(TrainingPlanName=summary["TrainingPlanName"])
    except (ClientError, BotoCoreError) as error:
        return _view(name, summary, configured=True,
                     note=f"could not describe it ({error}); needs sagemaker:DescribeTrainingPlan "
                     "(your team's engineers' policy allows it on the offered plans)")
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


def print_plans(views: list[PlanView], scope: PlanScope) -> None:
    print(f"Environment {scope.environment} (account {scope.account}, {scope.region}): "
          f"{len(scope.offered)} training plan(s) offered to runs")
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
    print_table(_HEADERS, rows)
    if any(not view.configured for view in views):
        print("* not in config/<env>.yaml training_plans: runs cannot target it yet")
