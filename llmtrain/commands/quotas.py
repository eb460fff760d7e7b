"""`llmtrain quotas`: training instances in use against their Service Quotas, per instance type.

Computes, with the caller's AWS credentials and in the environment's account and region, exactly what
the platform's quota-usage function publishes: for every instance type the environment's enabled
templates may run on, the instances held by in-progress training jobs, by spot training jobs and by
available warm pools, against the matching quotas. Rows at or above the environment's alarm
threshold are marked; a quota that cannot be read is shown with the reason.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from llmtrain.commands._common import account_session, environment_of, print_table
from llmtrain.core.catalog import Catalog
from llmtrain.core.environments import EnvironmentConfig
from llmtrain.core.errors import LlmtrainError
from llmtrain.operations.quotas import QuotaCache, QuotaUsage, collect_usage

_HEADERS = ("INSTANCE TYPE", "USAGE", "IN USE", "QUOTA", "UTILISATION", "")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "quotas",
        help="training instances in use against their Service Quotas",
        description="For every instance type the environment's templates use: instances held by training "
        "jobs, spot training jobs and warm pools, against their Service Quotas. Needs AWS credentials for "
        "the environment's account.",
    )
    parser.add_argument("--env", default="dev", help="environment: config/<ENV>.yaml (default: dev)")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument(
        "--config-dir", type=Path, default=None, help="folder of environment files (default: config/)"
    )
    parser.add_argument("--catalog", type=Path, default=None, help="catalog folder (default: templates/)")
    parser.add_argument("--profile", default=None, help="the AWS profile to use (default: AWS_PROFILE)")
    parser.set_defaults(handler=quotas_command)


def quotas_command(args: argparse.Namespace) -> int:
    environment = environment_of(args)
    instance_types = Catalog.load(args.catalog).instance_types(environment.enabled_templates)
    session = account_session(environment, args.profile)
    try:
        usages = collect_usage(
            sagemaker=session.client("sagemaker", region_name=environment.region),
            service_quotas=session.client("service-quotas", region_name=environment.region),
            instance_types=instance_types,
            cache=QuotaCache(ttl_seconds=0),
        )
    except (ClientError, BotoCoreError) as error:
        raise LlmtrainError(
            f"could not list the training jobs of account {environment.account} in {environment.region}: "
            f"{error}; your credentials need sagemaker:ListTrainingJobs and sagemaker:DescribeTrainingJob"
        ) from error
    threshold = environment.quotas.alarm_threshold_percent
    if args.json:
        print(json.dumps([u.to_dict() | {"over_threshold": _over(u, threshold)} for u in usages], indent=2))
    else:
        _print_table(usages, threshold, environment)
    return 0


def _over(usage: QuotaUsage, threshold: float) -> bool:
    return usage.utilization_percent is not None and usage.utilization_percent >= threshold


def _print_table(usages: list[QuotaUsage], threshold: float, environment: EnvironmentConfig) -> None:
    rows = [
        (
            u.instance_type,
            u.kind.value,
            str(u.in_use),
            "?" if u.quota is None else f"{u.quota:g}",
            "?" if u.utilization_percent is None else f"{u.utilization_percent:.0f}%",
            u.error or (f"at or above the {threshold:g}% alarm threshold" if _over(u, threshold) else ""),
        )
        for u in usages
    ]
    print(f"Environment {environment.name} (account {environment.account}, {environment.region})")
    print_table(_HEADERS, rows)


