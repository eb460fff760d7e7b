"""What rendering needs to know about one team of one deployed environment of the platform.

The stacks pass a `PlatformContext` to each team's launcher functions as JSON (`to_dict`) and write
it into the deployed environment's record (llmtrain.core.deployed), where the cloud commands read it;
`llmtrain render` builds it from stack outputs, or a clearly marked dry-run placeholder from
`config/<env>.yaml`. Whoever builds one, its fields are put together in one place
(llmtrain.core.team_context).

A context is one team's view: its execution role, its job-name prefix, its limits (templates,
instance types, instance count, warm-pool cap, the planned cost of one run) and its data prefix
`teams/<team>/` in the datasets, checkpoints and artifacts buckets. An environment without
`teams:` has one team, `default`. The environment's optional features (the package mirror, the MLflow
tracking server, training plans, remote debugging) are the same in every team's context.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from llmtrain.core.errors import PlatformContextError
from llmtrain.core.queue_context import TeamQueues

# Shared with llmtrain.core.environments (config/<env>.yaml); both match with fullmatch.
REGION_PATTERN = re.compile(r"[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-\d")
ACCOUNT_PATTERN = re.compile(r"\d{12}")
_ROLE_ARN = re.compile(r"arn:aws[a-z\-]*:iam::\d{12}:role/?[a-zA-Z_0-9+=,.@\-_/]+")
_KMS_KEY_ARN = re.compile(r"arn:aws[a-z\-]*:kms:[a-z0-9\-]+:\d{12}:key/[a-zA-Z0-9\-]+")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
_SUBNET = re.compile(r"subnet-[0-9a-zA-Z]+")
_SECURITY_GROUP = re.compile(r"sg-[0-9a-zA-Z]+")
# botocore's patterns for the request fields these ARNs go into (CA_REPOSITORY_ARN is the training
# toolkit's: sagemaker_training.modules reads the domain and repository out of it).
CODEARTIFACT_REPOSITORY_ARN = re.compile(
    r"arn:aws[a-z\-]*:codeartifact:[a-z0-9\-]+:\d{12}:repository/"
    r"[a-z][a-z0-9\-]{0,48}[a-z0-9]/[A-Za-z0-9][A-Za-z0-9._\-]{1,99}"
)
MLFLOW_ARN = re.compile(r"arn:aws[a-z\-]*:sagemaker:[a-z0-9\-]*:[0-9]{12}:mlflow-[a-zA-Z-]*/.+")
TRAINING_PLAN_ARN = re.compile(r"arn:aws[a-z\-]*:sagemaker:[a-z0-9\-]*:[0-9]{12}:training-plan/.+")
TRAINING_PLAN_NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,63}")
MAX_KEEP_ALIVE_SECONDS = 21600  # botocore: ResourceConfig.KeepAlivePeriodInSeconds max

# The names and ids below are checked where a platform team writes them (config/<env>.yaml, through
# llmtrain.core.environments) and again by the constructs, for teams that use those without config/:
# one pattern each, all matched with fullmatch.
#
# SageMaker job names match [a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}. The prefix is lowercase because
# SageMaker lowercases job names inside ARNs and the IAM policies match ARNs by this prefix, and it
# is short to leave room for "-<run name>-<timestamp>" within the 63 characters.
JOB_NAME_PREFIX_PATTERN = re.compile(r"[a-z0-9](-*[a-z0-9])*")
MAX_JOB_NAME_PREFIX = 24
ENVIRONMENT_NAME_PATTERN = re.compile(r"[a-z][a-z0-9-]{0,19}")
EMAIL_PATTERN = re.compile(r"[^@\s]+@[^@\s]+\.[^@\s]+")
VPC_ID_PATTERN = re.compile(r"vpc-[0-9a-f]{8,17}")
SUBNET_ID_PATTERN = re.compile(r"subnet-[0-9a-f]{8,17}")
ROUTE_TABLE_ID_PATTERN = re.compile(r"rtb-[0-9a-f]{8,17}")
PREFIX_LIST_ID_PATTERN = re.compile(r"pl-[0-9a-f]{8,17}")
# Team names: lowercase letters and digits, no hyphens. A team's jobs are named
# `<environment prefix>-<team>-<run>-a<n>` and IAM matches them by `<environment prefix>-<team>-*`;
# with a hyphen in team names, team `a` would match the jobs of a team `a-b`.
TEAM_NAME_PATTERN = re.compile(r"[a-z][a-z0-9]{0,11}")
MAX_TEAM_NAME = 12
# A team's job-name prefix: the environment's prefix, a hyphen and the team name.
MAX_TEAM_JOB_NAME_PREFIX = MAX_JOB_NAME_PREFIX + 1 + MAX_TEAM_NAME
DEFAULT_TEAM = "default"
# Where a team's data lives in the datasets, checkpoints and artifacts buckets.
TEAM_DATA_ROOT = "teams"


# The retention periods CloudWatch Logs accepts (PutRetentionPolicy), in days.
LOG_RETENTION_DAYS = (
    1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653,
)


def team_data_prefix(team: str) -> str:
    """The key prefix of a team's data in the datasets, checkpoints and artifacts buckets."""
    return f"{TEAM_DATA_ROOT}/{team}/"


def team_job_name_prefix(environment_prefix: str, team: str) -> str:
    """The job-name prefix of a team's training jobs (IAM scopes the team's roles by it)."""
    return f"{environment_prefix}-{team}"


# AWS Batch names a queued run's training job itself: "AWSBatch", the payload's TrainingJobName, an
# attempt id (AWS's examples of service jobs; cut to SageMaker's 63 characters, the name keeps its
# first 23 characters). The job's log streams are named after it.
QUEUED_JOB_NAME_PREFIX = "AWSBatch"
QUEUED_NAME_KEPT = 23
# The longest team prefix whose hyphen survives that cut (its queued jobs' names keep the prefix).
MAX_QUEUED_TEAM_JOB_NAME_PREFIX = QUEUED_NAME_KEPT - 1


def team_job_log_streams(job_name_prefix: str) -> tuple[str, ...]:
    """The CloudWatch log-stream name patterns of a team's jobs: its own jobs', and its queued jobs'
    (named by AWS Batch) where the team's prefix and its hyphen survive Batch's cut."""
    streams = [f"{job_name_prefix}-*"]
    if len(job_name_prefix) <= MAX_QUEUED_TEAM_JOB_NAME_PREFIX:
        streams.append(f"{QUEUED_JOB_NAME_PREFIX}{job_name_prefix}-*")
    return tuple(streams)


def is_job_name_prefix(value: object, longest: int = MAX_JOB_NAME_PREFIX) -> bool:
    return (isinstance(value, str) and len(value) <= longest
            and bool(JOB_NAME_PREFIX_PATTERN.fullmatch(value)))


@dataclass(frozen=True)
class PlatformContext:
    environment: str
    region: str
    account: str
    execution_role_arn: str
    datasets_bucket: str
    checkpoints_bucket: str
    artifacts_bucket: str
    code_bucket: str
    kms_key_arn: str
    subnet_ids: tuple[str, ...]
    security_group_ids: tuple[str, ...]
    warm_pool_cap_seconds: int
    job_name_prefix: str
    # True for a placeholder built from config only (`llmtrain render` without deployed outputs).
    dry_run: bool = False
    # The team this context renders for; its data lives under teams/<team>/ (team_data_prefix).
    team: str = DEFAULT_TEAM
    # The team's limits; empty or None means no limit beyond the templates' own bounds.
    allowed_templates: tuple[str, ...] = ()
    allowed_instance_types: tuple[str, ...] = ()
    max_instance_count: int | None = None
    # The environment encrypts traffic between the instances of every job, whatever the template says.
    inter_container_traffic_encryption: bool = False
    # The most one run of the team may cost, in US dollars, as planned (llmtrain.planner): the team's
    # `max_run_cost_usd`, else the environment's `budgets.max_run_cost_usd`; None: no limit.
    run_budget_usd: float | None = None
    # The environment's optional features (EnvironmentConfig.platform_features), the same for every
    # team. The CodeArtifact repository (PyPI upstream) the container's pip installs requirements.txt
    # from (the toolkit's CA_REPOSITORY_ARN); None where jobs reach PyPI through NAT gateways.
    package_repository_arn: str | None = None
    # The SageMaker managed MLflow tracking server jobs log to (MlflowConfig); None: no MLflow.
    mlflow_tracking_server_arn: str | None = None
    # Training plans (reserved capacity) runs may target: plan name -> ARN.
    training_plans: Mapping[str, str] = field(default_factory=dict)
    # Whether jobs may enable SageMaker remote debugging (SSM endpoints and permissions deployed).
    remote_debug: bool = False
    # The team's AWS Batch queues (llmtrain.core.queue_context) where the environment has queues: its
    # runs are submitted to them instead of creating their training jobs. None: no queues.
    queues: TeamQueues | None = None

    @property
    def data_prefix(self) -> str:
        """`teams/<team>/`: the team's key prefix in the datasets, checkpoints and artifacts buckets."""
        return team_data_prefix(self.team)

    @property
    def datasets_uri(self) -> str:
        """The only place the team's run channels may read from."""
        return f"s3://{self.datasets_bucket}/{self.data_prefix}"

    def __post_init__(self) -> None:
        for name in ("subnet_ids", "security_group_ids", "allowed_templates", "allowed_instance_types"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.training_plans, Mapping):
            object.__setattr__(self, "training_plans", dict(self.training_plans))
        object.__setattr__(self, "queues", TeamQueues.from_value(self.queues))
        problems = list(self._problems())
        if problems:
            raise PlatformContextError("invalid platform context: " + "; ".join(problems))

    def _problems(self):
        checks = [
            ("region", self.region, REGION_PATTERN, "an AWS region such as us-east-1"),
            ("account", self.account, ACCOUNT_PATTERN, "a 12-digit AWS account id"),
            ("execution_role_arn", self.execution_role_arn, _ROLE_ARN, "an IAM role ARN"),
            (
                "kms_key_arn",
                self.kms_key_arn,
                _KMS_KEY_ARN,
                "a KMS key ARN (arn:aws:kms:REGION:ACCOUNT:key/ID)",
            ),
        ]
        for bucket_field in ("datasets_bucket", "checkpoints_bucket", "artifacts_bucket", "code_bucket"):
            checks.append((bucket_field, getattr(self, bucket_field), _BUCKET, "an S3 bucket name"))
        for name, value, pattern, expected in checks:
            if not isinstance(value, str) or not pattern.fullmatch(value):
                yield f"{name} {value!r} must be {expected}"
        if not self.environment:
            yield "environment must not be empty"
        if not is_job_name_prefix(self.job_name_prefix, MAX_TEAM_JOB_NAME_PREFIX):
            yield (f"job_name_prefix {self.job_name_prefix!r} must be 1-{MAX_TEAM_JOB_NAME_PREFIX} lowercase "
                   "letters, digits and hyphens")
        yield from _id_problems("subnet_ids", self.subnet_ids, _SUBNET, 16)
        yield from _id_problems("security_group_ids", self.security_group_ids, _SECURITY_GROUP, 5)
        cap = self.warm_pool_cap_seconds
        if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= MAX_KEEP_ALIVE_SECONDS:
            yield f"warm_pool_cap_seconds {cap!r} must be an integer in 0..{MAX_KEEP_ALIVE_SECONDS}"
        yield from self._team_problems()
        yield from self._feature_problems()

    def _team_problems(self):
        if not isinstance(self.team, str) or not TEAM_NAME_PATTERN.fullmatch(self.team):
            yield f"team {self.team!r} must be 1-12 lowercase letters and digits, starting with a letter"
        count = self.max_instance_count
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            yield f"max_instance_count {count!r} must be a whole number of at least 1, or null"
        for name in ("allowed_templates", "allowed_instance_types"):
            if not all(isinstance(item, str) and item for item in getattr(self, name)):
                yield f"{name} must list non-empty strings"
        budget = self.run_budget_usd
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int | float) or budget <= 0
        ):
            yield f"run_budget_usd {budget!r} must be a positive number of US dollars, or null"

    def _feature_problems(self):
        optional = (
            ("package_repository_arn", self.package_repository_arn, CODEARTIFACT_REPOSITORY_ARN,
             "a CodeArtifact repository ARN (arn:aws:codeartifact:REGION:ACCOUNT:repository/DOMAIN/REPO)"),
            ("mlflow_tracking_server_arn", self.mlflow_tracking_server_arn, MLFLOW_ARN,
             "a SageMaker MLflow tracking server ARN"),
        )
        for name, value, pattern, expected in optional:
            if value is not None and (not isinstance(value, str) or not pattern.fullmatch(value)):
                yield f"{name} {value!r} must be {expected}"
        if not isinstance(self.training_plans, Mapping):
            yield "training_plans must map plan names to training plan ARNs"
            return
        for name, arn in self.training_plans.items():
            if not isinstance(name, str) or not TRAINING_PLAN_NAME.fullmatch(name):
                yield f"training_plans: {name!r} is not a training plan name (letters, digits, dashes)"
            if not isinstance(arn, str) or not TRAINING_PLAN_ARN.fullmatch(arn):
                yield f"training_plans.{name}: {arn!r} must be a training plan ARN"
        if not isinstance(self.remote_debug, bool):
            yield f"remote_debug {self.remote_debug!r} must be true or false"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("subnet_ids", "security_group_ids", "allowed_templates", "allowed_instance_types"):
            data[name] = list(data[name])
        data["training_plans"] = dict(self.training_plans)
        # Left out without queues: a context written before queues reads the same.
        if self.queues is None:
            del data["queues"]
        else:
            data["queues"] = self.queues.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlatformContext:
        if not isinstance(data, Mapping):
            raise PlatformContextError(f"platform context must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise PlatformContextError(f"unknown platform context field(s): {', '.join(unknown)}")
        missing = sorted(f.name for f in fields(cls) if f.name not in data and f.name in _REQUIRED_FIELDS)
        if missing:
            raise PlatformContextError(f"platform context lacks field(s): {', '.join(missing)}")
        return cls(**data)


# SageMaker's SSM target for one host of a training job under remote debugging is
# `sagemaker-training-job:<job>_<host>`: `llmtrain debug` opens sessions to it, and the engineers'
# policies match it (condition key ssm:resourceTag/aws:ssmmessages:target-id) by the team's prefix.
REMOTE_DEBUG_TARGET_PREFIX = "sagemaker-training-job:"
# The fields of the environment's optional features (EnvironmentConfig.platform_features).
FEATURE_FIELDS = ("package_repository_arn", "mlflow_tracking_server_arn", "training_plans", "remote_debug")
_REQUIRED_FIELDS = {
    f.name for f in fields(PlatformContext) if f.default is MISSING and f.default_factory is MISSING
}
# The CodeArtifact repository the platform provisions in each environment (training_constructs
# .packages names its domain and repository by these, so the ARN is known without a deployment).
PACKAGE_REPOSITORY_NAME = "pypi-mirror"


def package_domain_name(environment: str) -> str:
    """CodeArtifact domain names are 2-50 lowercase letters, digits and inner dashes."""
    return f"llmtrain-{environment}".rstrip("-")[:50]


def package_repository_arn(region: str, account: str, environment: str, partition: str = "aws") -> str:
    domain = package_domain_name(environment)
    return f"arn:{partition}:codeartifact:{region}:{account}:repository/{domain}/{PACKAGE_REPOSITORY_NAME}"


# The sizes of a SageMaker managed MLflow tracking server (its TrackingServerSize).
MLFLOW_SIZES = ("Small", "Medium", "Large")


def mlflow_tracking_server_name(environment: str) -> str:
    """The environment's SageMaker MLflow tracking server (training_constructs.mlflow creates it)."""
    return f"llmtrain-{environment}".rstrip("-")


def mlflow_tracking_server_arn(region: str, account: str, environment: str, partition: str = "aws") -> str:
    name = mlflow_tracking_server_name(environment)
    return f"arn:{partition}:sagemaker:{region}:{account}:mlflow-tracking-server/{name}"


def _id_problems(name: str, values: tuple[str, ...], pattern: re.Pattern, most: int):
    if not 1 <= len(values) <= most:
        yield f"{name} must hold 1..{most} ids, got {len(values)}"
    for value in values:
        if not isinstance(value, str) or not pattern.fullmatch(value):
            yield f"{name} entry {value!r} is not a valid id"
