"""Where a team's `PlatformContext` is assembled: the one place its fields are put together.

Every context of a team is this one function's result, whoever holds the values: the launcher
construct (CDK tokens at synth: it passes the fields as a dict to the functions, which read them back
with `PlatformContext.from_dict`), `llmtrain render` (the stacks' outputs, or stand-ins from
`config/<env>.yaml` for a dry run), the local runner (obviously local names), the planner and the
tests. A context is the environment, where the team's jobs run (`PlatformResources`) and the team
itself (`TeamSettings`), with the environment's optional features.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmtrain.core.platform import DEFAULT_TEAM, MAX_KEEP_ALIVE_SECONDS, PlatformContext, team_job_name_prefix

if TYPE_CHECKING:  # the environment model imports the platform context, not this module
    from llmtrain.core.environments import EnvironmentConfig, TeamConfig

LOCAL_ACCOUNT = "000000000000"
LOCAL_REGION = "us-east-1"


@dataclass(frozen=True, kw_only=True)
class PlatformResources:
    """Where a team's jobs run: its execution role, the environment's buckets and data key, and its
    network (subnets and security groups)."""

    execution_role_arn: str
    datasets_bucket: str
    checkpoints_bucket: str
    artifacts_bucket: str
    code_bucket: str
    kms_key_arn: str
    subnet_ids: Sequence[str]
    security_group_ids: Sequence[str]

    @classmethod
    def placeholder(cls, *, account: str, region: str, resource_prefix: str, team: str) -> PlatformResources:
        """Stand-ins from configuration alone: names follow the platform's conventions, ids are
        obviously fake. Rendering with them shows the request's shape, not a launchable job."""
        prefix = resource_prefix.lower()
        return cls(
            execution_role_arn=f"arn:aws:iam::{account}:role/{prefix}-{team}-sagemaker-execution-DRYRUN",
            datasets_bucket=f"{prefix}-datasets-{account}-{region}",
            checkpoints_bucket=f"{prefix}-checkpoints-{account}-{region}",
            artifacts_bucket=f"{prefix}-artifacts-{account}-{region}",
            code_bucket=f"{prefix}-code-{account}-{region}",
            kms_key_arn=f"arn:aws:kms:{region}:{account}:key/00000000-0000-0000-0000-000000000000",
            subnet_ids=("subnet-0dryrun0000000001", "subnet-0dryrun0000000002"),
            security_group_ids=("sg-0dryrun0000000001",),
        )

    @classmethod
    def local(cls) -> PlatformResources:
        """Where a local run's request points: obviously local names; nothing of it is contacted."""
        return cls(
            execution_role_arn=f"arn:aws:iam::{LOCAL_ACCOUNT}:role/local-run",
            datasets_bucket="local-datasets",
            checkpoints_bucket="local-checkpoints",
            artifacts_bucket="local-artifacts",
            code_bucket="local-code",
            kms_key_arn=f"arn:aws:kms:{LOCAL_REGION}:{LOCAL_ACCOUNT}:key/local",
            subnet_ids=("subnet-local",),
            security_group_ids=("sg-local",),
        )


@dataclass(frozen=True, kw_only=True)
class TeamSettings:
    """What a team's context takes from the team: its name, job-name prefix and warm-pool cap, its
    limits (templates, instance types, instances, the planned cost of one run; empty or None: none
    beyond the templates' own) and its queues where the environment has them."""

    job_name_prefix: str
    warm_pool_cap_seconds: int
    name: str = DEFAULT_TEAM
    allowed_templates: Sequence[str] = ()
    allowed_instance_types: Sequence[str] = ()
    max_instance_count: int | None = None
    run_budget_usd: float | None = None
    queues: Any = None


def team_context_fields(
    *,
    environment: str,
    region: str,
    account: str,
    resources: PlatformResources,
    team: TeamSettings,
    inter_container_traffic_encryption: bool = False,
    features: Mapping[str, Any] | None = None,
    dry_run: bool = False,
) -> dict[str, Any]:
    """A team's context as `PlatformContext.to_dict` writes it (values may be CDK tokens)."""
    fields: dict[str, Any] = {
        "environment": environment,
        "region": region,
        "account": account,
        "execution_role_arn": resources.execution_role_arn,
        "datasets_bucket": resources.datasets_bucket,
        "checkpoints_bucket": resources.checkpoints_bucket,
        "artifacts_bucket": resources.artifacts_bucket,
        "code_bucket": resources.code_bucket,
        "kms_key_arn": resources.kms_key_arn,
        "subnet_ids": list(resources.subnet_ids),
        "security_group_ids": list(resources.security_group_ids),
        "warm_pool_cap_seconds": team.warm_pool_cap_seconds,
        "job_name_prefix": team.job_name_prefix,
        "team": team.name,
        "allowed_templates": list(team.allowed_templates),
        "allowed_instance_types": list(team.allowed_instance_types),
        "max_instance_count": team.max_instance_count,
        "inter_container_traffic_encryption": inter_container_traffic_encryption,
        "run_budget_usd": team.run_budget_usd,
        **(features or {}),
    }
    if team.queues is not None:
        fields["queues"] = team.queues
    if dry_run:
        fields["dry_run"] = True
    return fields


def team_context(**arguments: Any) -> PlatformContext:
    """A team's `PlatformContext` (the arguments of `team_context_fields`), validated."""
    return PlatformContext.from_dict(team_context_fields(**arguments))


def placeholder_context(
    *,
    environment: str,
    account: str,
    region: str,
    resource_prefix: str,
    warm_pool_cap_seconds: int,
    team: str = DEFAULT_TEAM,
    job_name_prefix: str | None = None,
    inter_container_traffic_encryption: bool = False,
    features: Mapping[str, Any] | None = None,
    **limits: Any,
) -> PlatformContext:
    """A dry-run context from configuration alone (`PlatformResources.placeholder`). The job-name
    prefix defaults to the team's (`<resource_prefix>-<team>`); ``limits`` are `TeamSettings`'."""
    settings = TeamSettings(
        name=team,
        job_name_prefix=job_name_prefix or team_job_name_prefix(resource_prefix.lower(), team),
        warm_pool_cap_seconds=warm_pool_cap_seconds,
        **limits,
    )
    return team_context(
        environment=environment, region=region, account=account,
        resources=PlatformResources.placeholder(account=account, region=region,
                                                resource_prefix=resource_prefix, team=team),
        team=settings, inter_container_traffic_encryption=inter_container_traffic_encryption,
        features=features, dry_run=True,
    )


def local_context() -> PlatformContext:
    """The context of `llmtrain run --local` and `tune --local`: local names, the longest warm pool."""
    return team_context(
        environment="local", region=LOCAL_REGION, account=LOCAL_ACCOUNT, resources=PlatformResources.local(),
        team=TeamSettings(job_name_prefix="local", warm_pool_cap_seconds=MAX_KEEP_ALIVE_SECONDS),
    )


def configured_team_context(
    env: EnvironmentConfig, team: TeamConfig, resources: PlatformResources | None = None
) -> PlatformContext:
    """A team's context from its environment's file (`config/<env>.yaml`), as the stacks set it: with
    the deployed resources (the stacks' outputs), else stand-ins (a dry run). A team without
    `instance_types` may use every type its templates run on: no limit beyond theirs."""
    settings = TeamSettings(
        name=team.name,
        job_name_prefix=team.job_name_prefix,
        warm_pool_cap_seconds=team.max_keep_alive_seconds,
        allowed_templates=team.templates,
        allowed_instance_types=team.instance_types or (),
        max_instance_count=team.max_instance_count,
        run_budget_usd=team.max_run_cost_usd,
    )
    placeholder = resources is None
    if placeholder:
        resources = PlatformResources.placeholder(account=env.account, region=env.region,
                                                  resource_prefix=env.job_name_prefix, team=team.name)
    return team_context(
        environment=env.name, region=env.region, account=env.account, resources=resources, team=settings,
        inter_container_traffic_encryption=env.network.inter_container_traffic_encryption,
        features=env.platform_features(), dry_run=placeholder,
    )
