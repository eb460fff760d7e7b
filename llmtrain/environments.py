"""Per-environment configuration of the platform: the typed model of ``config/<name>.yaml``.

One YAML file describes one deployment of the platform (an AWS account and region): its network,
which job templates it offers, its guard rails (quota alarms, warm-pool limits) and who is notified.
``app.py`` builds one CDK Stage per file; the launcher, the guard rails and the CLI read the same
objects, so every consumer sees the same validated values.

Everything here is pure Python (no aws_cdk): load with :func:`load_environments` or
:func:`load_environment`; invalid input raises :class:`EnvironmentConfigError` naming the file and
the field (``config/dev.yaml: network.vpc_cidr: ...``).

The file format, field by field, is documented in ``docs/infrastructure.md``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import yaml

from llmtrain.platform import (
    ACCOUNT_PATTERN,
    DEFAULT_TEAM,
    EMAIL_PATTERN,
    ENVIRONMENT_NAME_PATTERN,
    JOB_NAME_PREFIX_PATTERN,
    LOG_RETENTION_DAYS,
    MAX_JOB_NAME_PREFIX,
    MAX_KEEP_ALIVE_SECONDS,
    MLFLOW_SIZES,
    PREFIX_LIST_ID_PATTERN,
    REGION_PATTERN,
    ROUTE_TABLE_ID_PATTERN,
    SUBNET_ID_PATTERN,
    TEAM_NAME_PATTERN,
    TRAINING_PLAN_ARN,
    TRAINING_PLAN_NAME,
    VPC_ID_PATTERN,
    mlflow_tracking_server_arn,
    package_repository_arn,
    team_job_name_prefix,
)
from llmtrain.queues import policy as queue_policy

__all__ = [
    "MAX_WARM_POOL_KEEP_ALIVE_SECONDS",
    "BudgetConfig",
    "EnvironmentConfig",
    "EnvironmentConfigError",
    "LogsConfig",
    "ExistingVpcConfig",
    "JobQueueConfig",
    "NetworkConfig",
    "MlflowConfig",
    "NotificationConfig",
    "PackagesConfig",
    "QueuesConfig",
    "QuotaConfig",
    "StackOutput",
    "TeamConfig",
    "WarmPoolConfig",
    "load_environment",
    "load_environments",
]

# SageMaker's own upper bound for ResourceConfig.KeepAlivePeriodInSeconds (botocore: 0..21600).
MAX_WARM_POOL_KEEP_ALIVE_SECONDS = MAX_KEEP_ALIVE_SECONDS  # SageMaker's limit (llmtrain.platform)

# Template names follow the catalog's rule: lowercase words joined by hyphens.
_TEMPLATE_NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
_TAG_KEY = re.compile(r"^[\w.:/=+\-@ ]{1,128}$")
_TAG_VALUE = re.compile(r"^[\w.:/=+\-@ ]{0,256}$")
_INSTANCE_TYPE = re.compile(r"^ml\.[a-z0-9]+\.[a-z0-9]+$")


class EnvironmentConfigError(ValueError):
    """An environment file is invalid; the message names the file, the field and the fix."""


class StackOutput:
    """Names of the CloudFormation outputs the platform stacks publish.

    This is the contract between the stacks (which create the outputs) and the ``llmtrain`` CLI
    (which reads them with ``DescribeStacks`` to build a platform context). The stack that holds
    each output is :meth:`EnvironmentConfig.stack_name` of the part named in the comment.
    """

    # stack "network"
    VPC_ID = "VpcId"
    SUBNET_IDS = "SubnetIds"  # comma-separated
    SECURITY_GROUP_ID = "TrainingSecurityGroupId"
    # stack "storage"
    KEY_ARN = "KeyArn"
    DATASETS_BUCKET = "DatasetsBucketName"
    CHECKPOINTS_BUCKET = "CheckpointsBucketName"
    ARTIFACTS_BUCKET = "ArtifactsBucketName"
    CODE_BUCKET = "CodeBucketName"
    ACCESS_LOGS_BUCKET = "AccessLogsBucketName"
    # stack "access": per team (team_output), and the environment's guard rail
    EXECUTION_ROLE_ARN = "ExecutionRoleArn"
    ENGINEER_POLICY_ARN = "EngineerPolicyArn"
    GUARDRAIL_POLICY_ARN = "GuardrailPolicyArn"

    @staticmethod
    def team_output(team: str, key: str) -> str:
        """A team's output key, e.g. `TeamNlpExecutionRoleArn`. An environment with a single team
        also publishes its outputs under the bare keys (`ExecutionRoleArn`), as before teams."""
        return f"Team{team.capitalize()}{key}"


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


def load_environments(config_dir: str | Path) -> dict[str, EnvironmentConfig]:
    """Load every ``*.yaml`` file in ``config_dir``, keyed by environment name (sorted by name)."""
    directory = Path(config_dir)
    if not directory.is_dir():
        raise EnvironmentConfigError(f"{directory}: not a directory; expected a folder of <env>.yaml files")
    files = sorted(directory.glob("*.yaml"))
    if not files:
        raise EnvironmentConfigError(f"{directory}: no *.yaml environment files found")
    environments = [load_environment(path) for path in files]
    _check_unique(
        environments,
        "account",
        lambda env: (env.account, env.region),
        "two environments deploy to the same account and region; give each its own",
    )
    return {env.name: env for env in environments}


def load_environment(path: str | Path) -> EnvironmentConfig:
    """Load and validate one environment file; the file's stem must equal its ``name``."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise EnvironmentConfigError(f"{path}: cannot read: {error}") from error
    except yaml.YAMLError as error:
        raise EnvironmentConfigError(f"{path}: not valid YAML: {error}") from error
    return parse_environment(data, source=path)


def parse_environment(data: Any, *, source: Path | None = None) -> EnvironmentConfig:
    """Validate a parsed environment document (what ``load_environment`` reads from a file)."""
    reader = _Reader(data, prefix="", origin=str(source) if source else "<environment>")
    config = _read_environment(reader, source)
    if source is not None and source.stem != config.name:
        reader.fail("name", f"must equal the file name {source.stem!r}, got {config.name!r}")
    return config


def _read_environment(reader: _Reader, source: Path | None) -> EnvironmentConfig:
    reader.only_keys(
        {
            "name",
            "account",
            "region",
            "network",
            "job_templates",
            "job_name_prefix",
            "quotas",
            "warm_pools",
            "notifications",
            "budgets",
            "logs",
            "tags",
            "teams",
            "packages",
            "mlflow",
            "training_plans",
            "remote_debug",
            "queues",
        }
    )
    region = reader.string("region", pattern=REGION_PATTERN, hint="an AWS region such as us-east-1")
    templates = reader.section("job_templates")
    templates.only_keys({"enabled"})
    enabled = _read_template_names(templates)
    job_name_prefix = _read_job_name_prefix(reader)
    warm_pools = _read_warm_pools(reader.section("warm_pools", required=False))
    notifications = _read_notifications(reader.section("notifications", required=False))
    budgets = _read_budgets(reader.section("budgets", required=False))
    account = _read_account(reader)
    network = _read_network(reader.section("network"), region)
    defaults = TeamConfig(
        name=DEFAULT_TEAM,
        job_name_prefix=team_job_name_prefix(job_name_prefix, DEFAULT_TEAM),
        templates=enabled,
        max_keep_alive_seconds=warm_pools.max_keep_alive_seconds,
        notification_email=notifications.email,
        max_run_cost_usd=budgets.max_run_cost_usd,
    )
    queues_section = reader.section("queues", required=False)
    queues = _read_queues(queues_section) if queues_section.present else None
    return EnvironmentConfig(
        name=reader.string(
            "name",
            pattern=ENVIRONMENT_NAME_PATTERN,
            hint="lowercase letters, digits and hyphens, starting with a letter, at most 20",
        ),
        account=account,
        region=region,
        network=network,
        enabled_templates=enabled,
        job_name_prefix=job_name_prefix,
        quotas=_read_quotas(reader.section("quotas", required=False)),
        warm_pools=warm_pools,
        notifications=notifications,
        budgets=budgets,
        logs=_read_logs(reader.section("logs", required=False)),
        tags=_read_tags(reader, "tags"),
        teams=_read_teams(reader, defaults, job_name_prefix, queues),
        source=source,
        queues=queues,
        **_read_features(reader, region=region, account=account, network=network),
    )


def _read_teams(
    reader: _Reader, defaults: TeamConfig, environment_prefix: str, queues: QueuesConfig | None
) -> tuple[TeamConfig, ...]:
    """`teams:` maps team names to their settings; without it the environment has the default team."""
    if reader.raw("teams", default=None) is None:
        return (defaults,)
    teams = reader.raw("teams")
    if not isinstance(teams, dict) or not teams:
        reader.fail("teams", "must map team names to their settings, e.g. teams: {nlp: {templates: [...]}}")
    read = []
    for name in teams:
        if not isinstance(name, str) or not TEAM_NAME_PATTERN.fullmatch(name):
            reader.fail(
                f"teams.{name}",
                "is not a valid team name: 1-12 lowercase letters and digits, starting with a letter (no "
                "hyphens: a team's jobs are named <job_name_prefix>-<team>-..., and IAM matches them by "
                "that prefix)",
            )
        section = reader.section("teams").section(name, required=False)
        team = _read_team(section, name, defaults, environment_prefix)
        read.append(_read_team_queues(section, team, queues))
    return tuple(read)


def _read_team(reader: _Reader, name: str, defaults: TeamConfig, environment_prefix: str) -> TeamConfig:
    reader.only_keys(
        {
            "templates",
            "instance_types",
            "max_instance_count",
            "max_keep_alive_seconds",
            "max_run_cost_usd",
            "notifications",
            "tags",
            "share_weight",
            "max_priority",
            "queues",
        }
    )
    templates = defaults.templates
    if reader.raw("templates", default=None) is not None:
        templates = reader.string_list("templates", min_items=1, pattern=_TEMPLATE_NAME)
        outside = [t for t in templates if t not in defaults.templates]
        if outside:
            reader.fail(
                "templates",
                f"{', '.join(outside)} not enabled in this environment (job_templates.enabled: "
                f"{', '.join(defaults.templates)}); a team runs a subset of them",
            )
    instance_types = None
    if reader.raw("instance_types", default=None) is not None:
        instance_types = reader.string_list("instance_types", min_items=1, pattern=_INSTANCE_TYPE)
    cap = defaults.max_keep_alive_seconds
    keep_alive = reader.integer("max_keep_alive_seconds", default=cap, minimum=0)
    if keep_alive > cap:
        reader.fail(
            "max_keep_alive_seconds",
            f"{keep_alive} exceeds the environment's warm_pools.max_keep_alive_seconds ({cap}); a team's cap "
            "is at most the environment's",
        )
    max_instances = None
    if reader.raw("max_instance_count", default=None) is not None:
        max_instances = reader.integer("max_instance_count", default=1, minimum=1)
    notifications = _read_notifications(reader.section("notifications", required=False))
    return TeamConfig(
        name=name,
        job_name_prefix=team_job_name_prefix(environment_prefix, name),
        templates=templates,
        instance_types=instance_types,
        max_instance_count=max_instances,
        max_keep_alive_seconds=keep_alive,
        notification_email=notifications.email or defaults.notification_email,
        max_run_cost_usd=_read_run_cost(reader, defaults.max_run_cost_usd),
        tags=_read_tags(reader, "tags"),
    )


def _read_queues(reader: _Reader) -> QueuesConfig:
    reader.only_keys({"max_instances", "job_queues", "default_queue", "share_decay_seconds",
                      "compute_reservation", "capacity_wait_seconds", "misconfiguration_wait_seconds"})
    queues = reader.raw("job_queues")
    if not isinstance(queues, dict) or not queues:
        reader.fail("job_queues", "must map queue names to their settings, e.g. job_queues: {standard: "
                                  "{priority: 10}, urgent: {priority: 100}}")
    job_queues = []
    for name in queues:
        if not isinstance(name, str) or not queue_policy.QUEUE_NAME_PATTERN.fullmatch(name):
            reader.fail(f"job_queues.{name}", "is not a queue name: 1-16 lowercase letters and digits, "
                                              "starting with a letter")
        section = reader.section("job_queues").section(name, required=False)
        section.only_keys({"priority"})
        priority = section.integer("priority", default=0, minimum=0, maximum=queue_policy.MAX_QUEUE_PRIORITY)
        job_queues.append(JobQueueConfig(name=name, priority=priority))
    names = tuple(queue.name for queue in job_queues)
    default_queue = reader.raw("default_queue", default=names[0])
    if default_queue not in names:
        reader.fail("default_queue", f"{default_queue!r} is not one of job_queues ({', '.join(names)})")
    if reader.raw("max_instances", default=None) is None:
        reader.fail("max_instances", "is required: the most instances the environment's runs use at once")
    limits = (queue_policy.MIN_TIME_LIMIT_SECONDS, queue_policy.MAX_TIME_LIMIT_SECONDS)
    return QueuesConfig(
        max_instances=reader.integer("max_instances", default=1, minimum=1),
        job_queues=tuple(job_queues),
        default_queue=default_queue,
        share_decay_seconds=reader.integer("share_decay_seconds", default=QueuesConfig.share_decay_seconds,
                                           minimum=0, maximum=queue_policy.MAX_SHARE_DECAY_SECONDS),
        compute_reservation=reader.integer("compute_reservation", default=0, minimum=0,
                                           maximum=queue_policy.MAX_COMPUTE_RESERVATION),
        capacity_wait_seconds=reader.integer("capacity_wait_seconds",
                                             default=QueuesConfig.capacity_wait_seconds,
                                             minimum=limits[0], maximum=limits[1]),
        misconfiguration_wait_seconds=reader.integer("misconfiguration_wait_seconds",
                                                     default=QueuesConfig.misconfiguration_wait_seconds,
                                                     minimum=limits[0], maximum=limits[1]),
    )


def _read_team_queues(reader: _Reader, team: TeamConfig, queues: QueuesConfig | None) -> TeamConfig:
    """A team's place in the environment's queues: its share weight, highest priority and queues."""
    asked = [key for key in ("share_weight", "max_priority", "queues") if key in reader.data]
    if queues is None:
        if asked:
            reader.fail(asked[0], "the environment has no queues: add a queues: section to the environment, "
                                  "or remove this field")
        return team
    weight = reader.raw("share_weight", default=1)
    problem = queue_policy.share_weight_problem(weight)
    if problem:
        reader.fail("share_weight", problem)
    max_priority = reader.integer("max_priority", default=0, minimum=0,
                                  maximum=queue_policy.MAX_SCHEDULING_PRIORITY)
    own = None
    if "queues" in reader.data:
        own = reader.string_list("queues", min_items=1)
        unknown = [name for name in own if name not in queues.queue_names]
        if unknown:
            reader.fail("queues", f"{', '.join(unknown)} not among the environment's queues.job_queues "
                                  f"({', '.join(queues.queue_names)})")
    if team.max_instance_count is not None and team.max_instance_count > queues.max_instances:
        reader.fail("max_instance_count", f"{team.max_instance_count} exceeds queues.max_instances "
                                          f"({queues.max_instances}): such a run could never leave the queue")
    return dataclasses.replace(team, share_weight=weight, max_priority=max_priority, queues=own)


def _read_features(reader: _Reader, *, region: str, account: str, network: NetworkConfig) -> dict[str, Any]:
    """The optional SageMaker features: package source, MLflow, training plans, remote debugging."""
    packages = reader.section("packages", required=False)
    packages.only_keys({"source"})
    source = packages.raw("source", default="codeartifact")
    if source not in PACKAGE_SOURCES:
        packages.fail("source", f"must be one of {', '.join(PACKAGE_SOURCES)}, got {source!r}")
    # An existing VPC's routing is its own: it may well reach PyPI.
    if source == "pypi" and not network.nat_gateways and network.existing_vpc is None:
        packages.fail("source", "pypi needs a route to the internet: set network.nat_gateways >= 1, or use "
                                "codeartifact (a PyPI mirror reached through VPC endpoints)")
    mlflow = reader.section("mlflow", required=False)
    mlflow.only_keys({"tracking_server", "size"})
    size = mlflow.raw("size", default="Small")
    if size not in MLFLOW_SIZES:
        mlflow.fail("size", f"must be one of {', '.join(MLFLOW_SIZES)}, got {size!r}")
    debug = reader.section("remote_debug", required=False)
    debug.only_keys({"enabled"})
    return {
        "packages": PackagesConfig(source=source),
        "mlflow": MlflowConfig(tracking_server=mlflow.boolean("tracking_server", default=False), size=size),
        "training_plans": _read_training_plans(reader, region, account),
        "remote_debug": debug.boolean("enabled", default=False),
    }


def _read_training_plans(reader: _Reader, region: str, account: str) -> dict[str, str]:
    plans = reader.raw("training_plans", default={})
    if not isinstance(plans, dict):
        reader.fail("training_plans", "must map plan names to training plan ARNs")
    for name, arn in plans.items():
        if not isinstance(name, str) or not TRAINING_PLAN_NAME.fullmatch(name):
            reader.fail(f"training_plans.{name}", "is not a training plan name (letters, digits, dashes)")
        if not isinstance(arn, str) or not TRAINING_PLAN_ARN.fullmatch(arn):
            reader.fail(f"training_plans.{name}", f"expected a training plan ARN "
                        f"(arn:aws:sagemaker:REGION:ACCOUNT:training-plan/NAME), got {arn!r}")
        if arn.split(":")[3:5] != [region, account]:
            reader.fail(f"training_plans.{name}", f"{arn} is not in this environment's account and region "
                        f"({account}, {region}): a job can only use a plan of its own account and region")
    return dict(plans)


def _read_account(reader: _Reader) -> str:
    value = reader.raw("account")
    if isinstance(value, int):
        reader.fail(
            "account",
            "must be a quoted string (YAML reads an unquoted number and drops "
            f'leading zeros): write account: "{value:012d}"',
        )
    return reader.string("account", pattern=ACCOUNT_PATTERN, hint="a 12-digit AWS account id in quotes")


def _read_network(reader: _Reader, region: str) -> NetworkConfig:
    reader.only_keys(
        {
            "vpc_cidr",
            "availability_zones",
            "nat_gateways",
            "inter_container_traffic_encryption",
            "s3_prefix_list_id",
            "existing_vpc",
        }
    )
    zones = reader.string_list("availability_zones", min_items=2)
    for zone in zones:
        if not re.fullmatch(re.escape(region) + r"[a-z]", zone):
            reader.fail(
                "availability_zones",
                f"{zone!r} is not an availability zone of {region} (expected e.g. {region}a)",
            )
    nat_gateways = reader.integer("nat_gateways", default=0, minimum=0, maximum=len(zones))
    existing = reader.section("existing_vpc", required=False)
    existing_vpc = _read_existing_vpc(existing, len(zones)) if existing.present else None
    if existing_vpc is not None and nat_gateways:
        reader.fail("nat_gateways", "must be 0 with existing_vpc: the existing VPC's routing is its own")
    if existing_vpc is not None and "vpc_cidr" in reader.data:
        reader.fail("vpc_cidr", "remove it: with existing_vpc, existing_vpc.vpc_cidr is used")
    return NetworkConfig(
        vpc_cidr=(existing_vpc.vpc_cidr if existing_vpc else _read_cidr(reader, "vpc_cidr")),
        availability_zones=zones,
        nat_gateways=nat_gateways,
        inter_container_traffic_encryption=reader.boolean(
            "inter_container_traffic_encryption", default=False
        ),
        s3_prefix_list_id=reader.optional_string(
            "s3_prefix_list_id", pattern=PREFIX_LIST_ID_PATTERN, hint="a prefix list id such as pl-63a5400a"
        ),
        existing_vpc=existing_vpc,
    )


def _read_existing_vpc(reader: _Reader, zone_count: int) -> ExistingVpcConfig:
    reader.only_keys({"vpc_id", "vpc_cidr", "subnet_ids", "route_table_ids", "create_endpoints"})
    subnet_ids = reader.string_list("subnet_ids", min_items=zone_count, pattern=SUBNET_ID_PATTERN)
    route_table_ids = reader.string_list("route_table_ids", min_items=zone_count,
                                         pattern=ROUTE_TABLE_ID_PATTERN)
    for key, ids in (("subnet_ids", subnet_ids), ("route_table_ids", route_table_ids)):
        if len(ids) != zone_count:
            reader.fail(key, f"needs one entry per availability zone ({zone_count}), got {len(ids)}")
    return ExistingVpcConfig(
        vpc_id=reader.string("vpc_id", pattern=VPC_ID_PATTERN, hint="a VPC id such as vpc-0123456789abcdef0"),
        vpc_cidr=_read_cidr(reader, "vpc_cidr"),
        subnet_ids=subnet_ids,
        route_table_ids=route_table_ids,
        create_endpoints=reader.boolean("create_endpoints", default=True),
    )


def _read_cidr(reader: _Reader, key: str) -> str:
    text = reader.string(key, hint="an IPv4 CIDR block such as 10.20.0.0/16")
    try:
        network = ipaddress.IPv4Network(text, strict=True)
    except ValueError as error:
        reader.fail(key, f"{text!r} is not an IPv4 network CIDR block ({error}); e.g. 10.20.0.0/16")
    if not 16 <= network.prefixlen <= 24:
        reader.fail(
            key,
            f"prefix /{network.prefixlen} is out of range: use /16 to /24 "
            "(a VPC allows /16 at most, and training nodes need addresses in every zone)",
        )
    return text


def _read_template_names(reader: _Reader) -> tuple[str, ...]:
    names = reader.string_list("enabled", min_items=1, pattern=_TEMPLATE_NAME)
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        reader.fail("enabled", f"lists {', '.join(duplicates)} more than once")
    return names


def _read_job_name_prefix(reader: _Reader) -> str:
    prefix = reader.string(
        "job_name_prefix",
        pattern=JOB_NAME_PREFIX_PATTERN,
        hint="lowercase letters, digits and hyphens, e.g. llmtrain-dev",
    )
    if len(prefix) > MAX_JOB_NAME_PREFIX:
        reader.fail(
            "job_name_prefix",
            f"is {len(prefix)} characters; at most {MAX_JOB_NAME_PREFIX} "
            "leave room for the run name in SageMaker's 63-character job names",
        )
    return prefix


def _read_budgets(reader: _Reader) -> BudgetConfig:
    reader.only_keys({"max_run_cost_usd"})
    return BudgetConfig(max_run_cost_usd=_read_run_cost(reader, None))


def _read_run_cost(reader: _Reader, default: float | None) -> float | None:
    """`max_run_cost_usd` of a section: a positive number of US dollars, or `default` when unset."""
    if reader.raw("max_run_cost_usd", default=None) is None:
        return default
    limit = reader.number("max_run_cost_usd", default=0)
    if limit <= 0:
        reader.fail("max_run_cost_usd", f"must be a positive number of US dollars, got {limit}")
    return float(limit)


def _read_logs(reader: _Reader) -> LogsConfig:
    reader.only_keys({"training_jobs_retention_days"})
    days = reader.integer(
        "training_jobs_retention_days", default=LogsConfig.training_jobs_retention_days, minimum=1
    )
    if days not in LOG_RETENTION_DAYS:
        reader.fail(
            "training_jobs_retention_days",
            f"CloudWatch Logs keeps logs {', '.join(map(str, LOG_RETENTION_DAYS))} days; got {days}",
        )
    return LogsConfig(training_jobs_retention_days=days)


def _read_quotas(reader: _Reader) -> QuotaConfig:
    reader.only_keys({"alarm_threshold_percent"})
    percent = reader.number("alarm_threshold_percent", default=QuotaConfig.alarm_threshold_percent)
    if not 0 < percent <= 100:
        reader.fail("alarm_threshold_percent", f"must be above 0 and at most 100, got {percent}")
    return QuotaConfig(alarm_threshold_percent=float(percent))


def _read_warm_pools(reader: _Reader) -> WarmPoolConfig:
    reader.only_keys({"max_keep_alive_seconds", "idle_budget_seconds"})
    cap = reader.integer(
        "max_keep_alive_seconds",
        default=WarmPoolConfig.max_keep_alive_seconds,
        minimum=0,
        maximum=MAX_WARM_POOL_KEEP_ALIVE_SECONDS,
    )
    idle = reader.integer(
        "idle_budget_seconds", default=min(WarmPoolConfig.idle_budget_seconds, cap), minimum=0
    )
    if idle > cap:
        reader.fail(
            "idle_budget_seconds",
            f"{idle} exceeds max_keep_alive_seconds ({cap}); a pool "
            "never idles longer than the cap, so lower it to at most the cap",
        )
    return WarmPoolConfig(max_keep_alive_seconds=cap, idle_budget_seconds=idle)


def _read_notifications(reader: _Reader) -> NotificationConfig:
    reader.only_keys({"email"})
    email = reader.optional_string("email", pattern=EMAIL_PATTERN, hint="an e-mail address")
    return NotificationConfig(email=email)


def _read_tags(reader: _Reader, field_name: str) -> dict[str, str]:
    tags = reader.raw(field_name, default={})
    if not isinstance(tags, dict):
        reader.fail(field_name, "must be a mapping of tag key to string value")
    for key, value in tags.items():
        if not isinstance(key, str) or not _TAG_KEY.fullmatch(key) or key.lower().startswith("aws:"):
            reader.fail(
                f"{field_name}.{key}", "is not a valid tag key (1-128 characters, not starting with aws:)"
            )
        if not isinstance(value, str) or not _TAG_VALUE.fullmatch(value):
            reader.fail(f"{field_name}.{key}", "must be a string of at most 256 characters (quote numbers)")
    return dict(tags)


def _check_unique(environments, what, key, message) -> None:
    seen: dict[Any, EnvironmentConfig] = {}
    for env in environments:
        other = seen.setdefault(key(env), env)
        if other is not env:
            raise EnvironmentConfigError(f"{env.source}: {what}: {message} (also used by {other.source})")


class _Reader:
    """Typed access to one mapping of the document; every error names the file and the dotted field."""

    _MISSING = object()

    def __init__(self, data: Any, *, prefix: str, origin: str, present: bool = True) -> None:
        self.origin = origin
        self.prefix = prefix
        self.present = present
        if data is None and not present:
            data = {}
        if not isinstance(data, dict):
            where = prefix.rstrip(".") or "the document"
            raise EnvironmentConfigError(f"{origin}: {where}: must be a mapping of field names to values")
        self.data = data

    def fail(self, key: str, message: str) -> NoReturn:
        raise EnvironmentConfigError(f"{self.origin}: {self.prefix}{key}: {message}")

    def only_keys(self, allowed: set[str]) -> None:
        for key in self.data:
            if key not in allowed:
                self.fail(str(key), f"unknown field; allowed here: {', '.join(sorted(allowed))}")

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        if key in self.data and self.data[key] is not None:
            return self.data[key]
        if default is self._MISSING:
            self.fail(key, "is required")
        return default

    def section(self, key: str, *, required: bool = True) -> _Reader:
        present = self.data.get(key) is not None
        if required and not present:
            self.fail(key, "is required")
        return _Reader(self.data.get(key), prefix=f"{self.prefix}{key}.", origin=self.origin, present=present)

    def string(self, key: str, *, pattern: re.Pattern | None = None, hint: str = "") -> str:
        value = self.raw(key)
        if not isinstance(value, str) or (pattern is not None and not pattern.fullmatch(value)):
            self.fail(key, f"expected {hint or 'a string'}, got {value!r}")
        return value

    def optional_string(self, key: str, *, pattern: re.Pattern, hint: str) -> str | None:
        if self.raw(key, default=None) is None:
            return None
        return self.string(key, pattern=pattern, hint=hint)

    def string_list(self, key: str, *, min_items: int, pattern: re.Pattern | None = None) -> tuple[str, ...]:
        values = self.raw(key)
        if not isinstance(values, list) or not all(isinstance(item, str) for item in values):
            self.fail(key, f"expected a list of strings, got {values!r}")
        if len(values) < min_items:
            self.fail(key, f"needs at least {min_items} entries, got {len(values)}")
        for item in values:
            if pattern is not None and not pattern.fullmatch(item):
                self.fail(key, f"{item!r} is not valid (must match {pattern.pattern})")
        return tuple(values)

    def boolean(self, key: str, *, default: bool) -> bool:
        value = self.raw(key, default=default)
        if not isinstance(value, bool):
            self.fail(key, f"expected true or false, got {value!r}")
        return value

    def integer(self, key: str, *, default: int, minimum: int, maximum: int | None = None) -> int:
        value = self.raw(key, default=default)
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, f"expected a whole number, got {value!r}")
        if value < minimum or (maximum is not None and value > maximum):
            upper = f" and at most {maximum}" if maximum is not None else ""
            self.fail(key, f"must be at least {minimum}{upper}, got {value}")
        return value

    def number(self, key: str, *, default: float) -> float:
        value = self.raw(key, default=default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(key, f"expected a number, got {value!r}")
        return value
