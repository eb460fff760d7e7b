"""`TeamSpec`: one team of a training environment, as the access and launcher constructs see it.

A team shares the environment's network, key and buckets with the other teams, and nothing else:
its data lives under `teams/<name>/` in the datasets, checkpoints and artifacts buckets, its jobs
are named `<job_name_prefix>-<run>-a<n>`, and IAM holds its roles to both (`TrainingAccess`,
`TrainingLauncher`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import llmtrain.core.queue_policy as queue_policy
from llmtrain.core.platform import (
    EMAIL_PATTERN,
    MAX_KEEP_ALIVE_SECONDS,
    MAX_TEAM_JOB_NAME_PREFIX,
    TEAM_NAME_PATTERN,
    is_job_name_prefix,
    team_data_prefix,
)
from llmtrain.core.render import TAG_PREFIX
from training_constructs._props import check_instance_types, freeze_sequences, is_whole_number, require

_NAME = "TeamSpec"


@dataclass(frozen=True, kw_only=True)
class TeamSpec:
    """What a team may do; validated when built (``PropsError`` names the field).

    ``name``: 1-12 lowercase letters and digits (no hyphen: IAM matches a team's jobs by
      ``<job_name_prefix>-*``, and a hyphen would let one team's prefix cover another's jobs).
    ``job_name_prefix``: the team's job names start with it and a hyphen.
    ``instance_types``: the instance types its jobs may run on (the job-creating role's
      ``sagemaker:InstanceTypes`` condition).
    ``max_keep_alive_seconds``: its warm-pool cap (``sagemaker:KeepAlivePeriod``), 0..21600.
    ``max_instance_count``: instances per job; the launcher refuses more (SageMaker has no IAM
      condition key for it). None: no cap beyond the templates' bounds.
    ``templates``: the template names its runs may use; empty means every registered one.
    ``notification_email``: subscribed to its launcher's topic.
    ``max_run_cost_usd``: the most one run may cost as planned (llmtrain.planner), in US dollars;
      the launcher refuses a run planned above it. None: no limit.
    ``tags``: added to the team's resources.
    ``share_weight``, ``max_priority``, ``queues``: where the environment has queues
      (``TrainingQueues``), the team's fair share relative to the other teams' weights (1..999), the
      highest scheduling priority its runs may ask for (0..9999), and the queues it may submit to
      (empty: every queue).
    """

    name: str
    job_name_prefix: str
    instance_types: tuple[str, ...]
    max_keep_alive_seconds: int
    max_instance_count: int | None = None
    templates: tuple[str, ...] = ()
    notification_email: str | None = None
    max_run_cost_usd: float | None = None
    tags: Mapping[str, str] = field(default_factory=dict)
    share_weight: int = 1
    max_priority: int = 0
    queues: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        freeze_sequences(_NAME, self)
        object.__setattr__(self, "tags", dict(self.tags))
        _validate(self)

    @property
    def data_prefix(self) -> str:
        """`teams/<name>/`: the team's key prefix in the datasets, checkpoints and artifacts buckets."""
        return team_data_prefix(self.name)

    @property
    def construct_suffix(self) -> str:
        """The team's name as construct ids and CloudFormation output keys spell it (`Nlp`)."""
        return self.name.capitalize()


# The Sid of the statement that lets a team's launcher create its jobs (tests read it by this name).
CREATE_JOBS_SID = "CreateTeamTrainingJobs"
# The Sid of the statement that lets a team's launcher create its tuning jobs (`llmtrain tune`).
CREATE_TUNING_JOBS_SID = "CreateTeamTuningJobs"
TEAM_TAG = f"{TAG_PREFIX}team"
ENVIRONMENT_TAG = f"{TAG_PREFIX}environment"


def job_creation_conditions(
    *,
    team: TeamSpec,
    subnet_ids: Sequence[str],
    security_group_ids: Sequence[str],
    key_arn: str,
    environment_name: str,
    inter_container_traffic_encryption: bool,
    warm_pools: bool = True,
    instance_types: Sequence[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """The IAM conditions under which a team's role may call CreateTrainingJob (and, without
    `warm_pools`, CreateHyperParameterTuningJob, whose trials have no warm pool and which SageMaker
    evaluates the same keys on, and CreateProcessingJob, with `instance_types` the CPU types of the
    team's preparations instead of the team's own).

    SageMaker evaluates these keys on CreateTrainingJob: the instance types, the VPC's subnets and
    security groups (all required: no job outside the VPC), the KMS keys of the volume (absent for
    instance types with local NVMe storage, which SageMaker encrypts itself) and of the output, the
    warm pool's keep-alive period, inter-container traffic encryption when the environment asks for
    it, and the team's and environment's tags on the job. Values are strings, numbers included, as
    IAM's grammar writes them (every CloudFormation implementation parses those).
    """
    conditions: dict[str, dict[str, Any]] = {
        "ForAllValues:StringEquals": {
            "sagemaker:InstanceTypes": list(team.instance_types if instance_types is None
                                            else instance_types),
            "sagemaker:VpcSubnets": list(subnet_ids),
            "sagemaker:VpcSecurityGroupIds": list(security_group_ids),
        },
        # ForAllValues also matches a request without the key: require each one to be present.
        "Null": {
            "sagemaker:InstanceTypes": "false",
            "sagemaker:VpcSubnets": "false",
            "sagemaker:VpcSecurityGroupIds": "false",
        },
        "StringEquals": {
            "sagemaker:OutputKmsKey": key_arn,
            f"aws:RequestTag/{TEAM_TAG}": team.name,
            f"aws:RequestTag/{ENVIRONMENT_TAG}": environment_name,
        },
        "StringEqualsIfExists": {"sagemaker:VolumeKmsKey": key_arn},
    }
    if warm_pools:
        keep_alive = str(team.max_keep_alive_seconds)
        conditions["NumericLessThanEqualsIfExists"] = {"sagemaker:KeepAlivePeriod": keep_alive}
    if inter_container_traffic_encryption:
        conditions["Bool"] = {"sagemaker:InterContainerTrafficEncryption": "true"}
    return conditions


def _validate(team: TeamSpec) -> None:
    require(
        isinstance(team.name, str) and bool(TEAM_NAME_PATTERN.fullmatch(team.name)),
        _NAME,
        "name",
        f"{team.name!r} must be 1-12 lowercase letters and digits, starting with a letter (no hyphens: "
        "IAM matches a team's jobs by its prefix, which must not cover another team's)",
    )
    require(
        is_job_name_prefix(team.job_name_prefix, MAX_TEAM_JOB_NAME_PREFIX),
        _NAME,
        "job_name_prefix",
        f"{team.job_name_prefix!r} must be 1-{MAX_TEAM_JOB_NAME_PREFIX} lowercase letters, digits and "
        "hyphens",
    )
    check_instance_types(_NAME, "instance_types", team.instance_types)
    require(
        is_whole_number(team.max_keep_alive_seconds)
        and 0 <= team.max_keep_alive_seconds <= MAX_KEEP_ALIVE_SECONDS,
        _NAME,
        "max_keep_alive_seconds",
        f"must be a whole number of seconds from 0 to {MAX_KEEP_ALIVE_SECONDS}, "
        f"got {team.max_keep_alive_seconds!r}",
    )
    require(
        team.max_instance_count is None
        or (is_whole_number(team.max_instance_count) and team.max_instance_count >= 1),
        _NAME,
        "max_instance_count",
        f"must be a whole number of at least 1, or None, got {team.max_instance_count!r}",
    )
    budget = team.max_run_cost_usd
    require(
        budget is None or (isinstance(budget, int | float) and not isinstance(budget, bool) and budget > 0),
        _NAME,
        "max_run_cost_usd",
        f"must be a positive number of US dollars, or None for no limit, got {budget!r}",
    )
    require(
        team.notification_email is None or bool(EMAIL_PATTERN.fullmatch(team.notification_email)),
        _NAME,
        "notification_email",
        f"{team.notification_email!r} is not an e-mail address",
    )
    _validate_queue_settings(team)


def _validate_queue_settings(team: TeamSpec) -> None:
    weight = queue_policy.share_weight_problem(team.share_weight)
    require(weight is None, _NAME, "share_weight", weight or "")
    priority = queue_policy.priority_problem(team.max_priority)
    require(priority is None, _NAME, "max_priority", priority or "")
    bad = [name for name in team.queues if not queue_policy.QUEUE_NAME_PATTERN.fullmatch(str(name))]
    require(not bad, _NAME, "queues", f"{bad} are not queue names (1-16 lowercase letters and digits)")


__all__ = [
    "CREATE_JOBS_SID", "CREATE_TUNING_JOBS_SID", "ENVIRONMENT_TAG", "TEAM_TAG", "TeamSpec",
    "job_creation_conditions",
]
