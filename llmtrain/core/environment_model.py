"""The typed model of ``config/<name>.yaml``: one frozen dataclass per section of the file.

`EnvironmentConfig` is one deployment of the platform (an AWS account and region); its sections
(network, guard rails, teams, queues, optional SageMaker features) are the other records here. They
hold validated values only: llmtrain.core.environments loads and validates a file into them, raising
`EnvironmentConfigError`. The file format, field by field, is in ``docs/infrastructure.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmtrain.core.platform import MAX_KEEP_ALIVE_SECONDS, mlflow_tracking_server_arn, package_repository_arn

# SageMaker's own upper bound for ResourceConfig.KeepAlivePeriodInSeconds (botocore: 0..21600).
MAX_WARM_POOL_KEEP_ALIVE_SECONDS = MAX_KEEP_ALIVE_SECONDS  # SageMaker's limit (llmtrain.core.platform)


class EnvironmentConfigError(ValueError):
    """An environment file is invalid; the message names the file, the field and the fix."""


@dataclass(frozen=True, kw_only=True)
class ExistingVpcConfig:
    """A VPC that already exists, imported by its attributes (no lookups, no AWS calls at synth).

    ``subnet_ids`` are private subnets, one per entry of ``NetworkConfig.availability_zones`` in
    the same order; ``route_table_ids`` are their route tables (the S3 gateway endpoint is attached
    to them). ``create_endpoints`` is false when the VPC already has the interface endpoints.
    """

    vpc_id: str
    vpc_cidr: str
    subnet_ids: tuple[str, ...]
    route_table_ids: tuple[str, ...]
    create_endpoints: bool = True


@dataclass(frozen=True, kw_only=True)
class NetworkConfig:
    """Where training jobs run.

    ``nat_gateways`` is 0 for isolated subnets (the default: jobs reach AWS only through VPC
    endpoints); 1 or more adds public subnets with NAT gateways so jobs can reach the internet
    (e.g. ``pip install`` of packages the container lacks). ``s3_prefix_list_id`` narrows the
    security group's HTTPS egress to S3 (``com.amazonaws.<region>.s3``); without it, HTTPS egress
    is open, which in isolated subnets only reaches the VPC endpoints and S3 anyway.
    """

    vpc_cidr: str
    availability_zones: tuple[str, ...]
    nat_gateways: int = 0
    inter_container_traffic_encryption: bool = False
    s3_prefix_list_id: str | None = None
    existing_vpc: ExistingVpcConfig | None = None


@dataclass(frozen=True, kw_only=True)
class QuotaConfig:
    """Alarm when training-instance usage exceeds this share of the Service Quotas value."""

    alarm_threshold_percent: float = 80.0


@dataclass(frozen=True, kw_only=True)
class WarmPoolConfig:
    """Limits on SageMaker warm pools.

    ``max_keep_alive_seconds`` is the hard cap: an IAM Deny on ``sagemaker:KeepAlivePeriod``
    rejects any CreateTrainingJob asking for more, and the platform's rendering enforces it too.
    ``idle_budget_seconds`` is the softer operational limit: the warm-pool reaper releases a pool
    that has sat idle longer than this (it cannot exceed the cap, which SageMaker already enforces).
    """

    max_keep_alive_seconds: int = 3600
    idle_budget_seconds: int = 1800


@dataclass(frozen=True, kw_only=True)
class BudgetConfig:
    """What one run may cost: the launcher refuses a run whose planned cost (llmtrain.planner)
    exceeds ``max_run_cost_usd``, before any job exists. None: no limit. A team may set its own
    (``teams.<name>.max_run_cost_usd``); this is the default of every team that does not."""

    max_run_cost_usd: float | None = None


@dataclass(frozen=True, kw_only=True)
class LogsConfig:
    """How long logs are kept. ``training_jobs_retention_days``: SageMaker's log group of every
    training job of the account and region (``/aws/sagemaker/TrainingJobs``), which SageMaker creates
    without a retention: the operations stack sets it (one of ``LOG_RETENTION_DAYS``)."""

    training_jobs_retention_days: int = 365


@dataclass(frozen=True, kw_only=True)
class NotificationConfig:
    """Who hears about finished runs and alarms (an SNS e-mail subscription; none when unset)."""

    email: str | None = None


PACKAGE_SOURCES = ("codeartifact", "pypi")


@dataclass(frozen=True, kw_only=True)
class PackagesConfig:
    """Where the training container's pip finds the sourcedir's requirements.txt.

    ``codeartifact`` (the default): a CodeArtifact repository with a PyPI upstream that the platform
    provisions, reached through VPC endpoints, which the SageMaker training toolkit uses when the job
    has ``CA_REPOSITORY_ARN`` (works in isolated subnets). ``pypi``: straight from PyPI, which needs a
    route to the internet (``network.nat_gateways`` >= 1).
    """

    source: str = "codeartifact"

    @property
    def codeartifact(self) -> bool:
        return self.source == "codeartifact"


@dataclass(frozen=True, kw_only=True)
class MlflowConfig:
    """An optional SageMaker managed MLflow tracking server that every job of the environment logs to."""

    tracking_server: bool = False
    size: str = "Small"


@dataclass(frozen=True, kw_only=True)
class JobQueueConfig:
    """One job queue of the environment (`queues.job_queues.<name>`): a queue of higher ``priority``
    (0..1000) is served first by the service environment."""

    name: str
    priority: int


@dataclass(frozen=True, kw_only=True)
class QueuesConfig:
    """Every run of the environment goes through an AWS Batch queue (`queues:`; off without it).

    ``max_instances``: the service environment's capacity limit, instances running at once across
    every queue. ``job_queues``: the queues, in order; ``default_queue`` takes a run that names none.
    ``share_decay_seconds`` (0..604800) and ``compute_reservation`` (0..99 percent of the capacity
    kept for teams with nothing running) shape the fair-share policy whose shares are the teams
    (``TeamConfig.share_weight``). ``capacity_wait_seconds``: how long a run may wait at the head of
    its queue for instances SageMaker does not have before Batch ends it;
    ``misconfiguration_wait_seconds``: likewise for a run larger than ``max_instances`` (600..86400).
    """

    max_instances: int
    job_queues: tuple[JobQueueConfig, ...]
    default_queue: str
    share_decay_seconds: int = 86400
    compute_reservation: int = 0
    capacity_wait_seconds: int = 14400
    misconfiguration_wait_seconds: int = 600

    @property
    def queue_names(self) -> tuple[str, ...]:
        return tuple(queue.name for queue in self.job_queues)


@dataclass(frozen=True, kw_only=True)
class TeamConfig:
    """One team sharing the environment (`teams.<name>` in the file).

    Every field but the name is optional: ``templates`` defaults to every template the environment
    enables; ``instance_types`` (None) to every type its templates may run on (resolved with the
    catalog by the stacks); ``max_instance_count`` (None) to no cap beyond the templates' bounds;
    ``max_keep_alive_seconds`` to the environment's cap; ``notification_email`` to the
    environment's address; ``max_run_cost_usd`` (the most one run may cost as planned) to the
    environment's ``budgets.max_run_cost_usd``. ``job_name_prefix`` is `<environment prefix>-<name>`.
    With the environment's queues: ``share_weight`` (1..999, default 1) is the team's fair share
    relative to the other teams', ``max_priority`` (0..9999, default 0) the highest priority its runs
    may ask for, and ``queues`` (None: every queue) the queues it may submit to.
    """

    name: str
    job_name_prefix: str
    templates: tuple[str, ...]
    instance_types: tuple[str, ...] | None = None
    max_instance_count: int | None = None
    max_keep_alive_seconds: int = 3600
    notification_email: str | None = None
    max_run_cost_usd: float | None = None
    tags: Mapping[str, str] = field(default_factory=dict)
    share_weight: int = 1
    max_priority: int = 0
    queues: tuple[str, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class EnvironmentConfig:
    """One deployment of the platform, loaded from ``config/<name>.yaml``."""

    name: str
    account: str
    region: str
    network: NetworkConfig
    enabled_templates: tuple[str, ...]
    job_name_prefix: str
    quotas: QuotaConfig = field(default_factory=QuotaConfig)
    warm_pools: WarmPoolConfig = field(default_factory=WarmPoolConfig)
    notifications: NotificationConfig = field(default_factory=NotificationConfig)
    budgets: BudgetConfig = field(default_factory=BudgetConfig)
    logs: LogsConfig = field(default_factory=LogsConfig)
    tags: Mapping[str, str] = field(default_factory=dict)
    # The teams sharing the environment; one team named `default` when the file has no `teams:`.
    teams: tuple[TeamConfig, ...] = ()
    source: Path | None = None
    packages: PackagesConfig = field(default_factory=PackagesConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    # Training plans (reserved capacity) runs may target: name -> ARN.
    training_plans: Mapping[str, str] = field(default_factory=dict)
    # SageMaker remote debugging (SSM into a job's container): endpoints and permissions deployed.
    remote_debug: bool = False
    # AWS Batch queues every run goes through (None: runs create their training jobs directly).
    queues: QueuesConfig | None = None

    def team_queues(self, team: TeamConfig) -> tuple[str, ...]:
        """The queues a team may submit to (none without the environment's queues)."""
        if self.queues is None:
            return ()
        return team.queues if team.queues is not None else self.queues.queue_names

    def platform_features(self) -> dict[str, Any]:
        """The PlatformContext fields of the optional features (names fixed by the constructs, so a
        context built from config agrees with the deployed stacks)."""
        return {
            "package_repository_arn": (package_repository_arn(self.region, self.account, self.name)
                                       if self.packages.codeartifact else None),
            "mlflow_tracking_server_arn": (mlflow_tracking_server_arn(self.region, self.account, self.name)
                                           if self.mlflow.tracking_server else None),
            "training_plans": dict(self.training_plans),
            "remote_debug": self.remote_debug,
        }

    def stack_name(self, part: str) -> str:
        """The CloudFormation stack name of one part of this environment, e.g. ``llmtrain-dev-storage``."""
        return f"llmtrain-{self.name}-{part}"

    def team(self, name: str) -> TeamConfig:
        """The team of that name; EnvironmentConfigError lists the environment's teams otherwise."""
        for team in self.teams:
            if team.name == name:
                return team
        raise EnvironmentConfigError(
            f"{self.source or self.name}: teams: environment {self.name!r} has no team {name!r}; its teams: "
            f"{', '.join(t.name for t in self.teams)}"
        )
