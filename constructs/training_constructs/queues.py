"""`TrainingQueues`: an environment's AWS Batch queues of SageMaker training jobs, shared fairly by its teams.

One service environment of type SAGEMAKER_TRAINING caps the instances the environment's runs use at
once (``max_instances``); one job queue per entry of ``job_queues`` (type SAGEMAKER_TRAINING, served
in order of their priorities) leads to it; each queue ends a job that waits at its head too long,
for capacity SageMaker does not have or for more instances than the service environment holds
(job state time limits, action TERMINATE: the only one SAGEMAKER_TRAINING queues allow); and one
fair-share scheduling policy, attached to every queue, gives each team a share identifier (its
name) weighted by its ``share_weight`` (Batch's ``weightFactor`` is the inverse:
``llmtrain.core.queue_policy.weight_factors``), decays usage over ``share_decay_seconds`` and keeps
``compute_reservation`` percent for teams with nothing running.

A team's launcher (``TrainingLauncherProps.queues``) submits its runs here instead of creating
training jobs: ``grant_submit`` lets it submit to its queues only, with its own share identifier
and at most its priority, and ``grant_follow`` lets its functions read its service jobs. The queues
are named after the environment (``llmtrain.core.queue_policy``), so other stacks build their ARNs
(``queue_arns_in``) without a reference, as the engineers' policies do
(``grant_engineer_queue_access``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aws_cdk import ArnFormat, Stack
from aws_cdk import aws_batch as batch
from aws_cdk import aws_iam as iam
from constructs import Construct

import llmtrain.core.queue_policy as policy
from llmtrain.core.platform import ENVIRONMENT_NAME_PATTERN, MAX_QUEUED_TEAM_JOB_NAME_PREFIX, QUEUED_NAME_KEPT
from training_constructs._props import (
    checked_props,
    freeze_sequences,
    is_unresolved,
    is_whole_number,
    require,
)
from training_constructs.teams import TEAM_TAG, TeamSpec

_NAME = "TrainingQueues"

# Sids of the statements the queues grant (tests and acknowledgments read them by these).
SUBMIT_TO_QUEUES_SID = "SubmitToTeamQueues"
SUBMIT_SERVICE_JOBS_SID = "SubmitTeamServiceJobs"
TAG_SERVICE_JOBS_SID = "TagTeamServiceJobs"
READ_SERVICE_JOBS_SID = "ReadServiceJobs"
READ_QUEUES_SID = "ReadTeamQueues"
READ_QUEUED_TRAINING_JOBS_SID = "ReadTeamQueuedTrainingJobs"
CANCEL_SERVICE_JOBS_SID = "CancelTeamServiceJobs"
END_QUEUED_WARM_POOLS_SID = "EndHungQueuedJobsWarmPools"

# Batch actions without resource-level permissions (the Service Authorization Reference lists no
# resource type for them), with the reason.
ACTIONS_WITHOUT_RESOURCES = {
    "batch:DescribeServiceJob": "DescribeServiceJob has no resource type in IAM; it reads one job by its id",
    "batch:ListServiceJobs": "ListServiceJobs has no resource type in IAM; it lists one queue's jobs",
}


@dataclass(frozen=True, kw_only=True)
class JobQueueSpec:
    """One job queue: its short name (``llmtrain-<env>-<name>`` in Batch) and its priority, 0..1000
    (a queue of higher priority is served first by the service environment)."""

    name: str
    priority: int = 0

    def __post_init__(self) -> None:
        require(
            isinstance(self.name, str) and bool(policy.QUEUE_NAME_PATTERN.fullmatch(self.name)),
            "JobQueueSpec", "name", f"{self.name!r} must be 1-16 lowercase letters and digits",
        )
        problem = policy.priority_problem(self.priority, policy.MAX_QUEUE_PRIORITY)
        require(problem is None, "JobQueueSpec", "priority", problem or "")


@dataclass(frozen=True, kw_only=True)
class TrainingQueuesProps:
    """What ``TrainingQueues`` builds; validated when built (``PropsError`` names the field).

    ``environment_name``: names the resources (``llmtrain-<env>...``).
    ``teams``: the teams sharing the queues (``TeamSpec``): one share identifier each, weighted by
      its ``share_weight``; a team's ``queues`` must be among ``job_queues``.
    ``max_instances``: the service environment's capacity, instances running at once; the launchers
      refuse a run larger than it (with ``existing_service_environment_arn``: that environment's).
    ``job_queues``: the queues (``JobQueueSpec``), in order.
    ``default_queue``: a run that names no queue goes here (default: the first of ``job_queues``).
    ``share_decay_seconds``: how far back usage counts for fair share, 0..604800 (0: Batch's 600 s).
    ``compute_reservation``: percent of the capacity kept for teams with nothing running, 0..99.
    ``capacity_wait_seconds``: how long a job may wait at the head of its queue for capacity
      SageMaker does not have before Batch terminates it, 600..86400.
    ``misconfiguration_wait_seconds``: likewise for a job larger than the service environment.
    ``existing_service_environment_arn``: queue into this service environment instead of creating one.
    """

    environment_name: str
    teams: Sequence[TeamSpec]
    max_instances: int
    job_queues: Sequence[JobQueueSpec]
    default_queue: str | None = None
    share_decay_seconds: int = 86400
    compute_reservation: int = 0
    capacity_wait_seconds: int = 14400
    misconfiguration_wait_seconds: int = 600
    existing_service_environment_arn: str | None = None

    def __post_init__(self) -> None:
        freeze_sequences(_NAME, self)
        _validate(self)

    @property
    def queue_names(self) -> tuple[str, ...]:
        return tuple(queue.name for queue in self.job_queues)

    @property
    def default_queue_name(self) -> str:
        return self.default_queue or self.job_queues[0].name


class TrainingQueues(Construct):
    """The environment's service environment, job queues and fair-share scheduling policy.

    Attributes: ``service_environment`` (None with ``existing_service_environment_arn``),
    ``service_environment_arn``, ``scheduling_policy``, ``job_queues`` (by name), ``queue_arns`` (by
    name), ``weight_factors`` (Batch's, by share identifier), ``default_queue``, ``teams`` (by name),
    ``props``.
    """

    def __init__(self, scope: Construct, construct_id: str, props: TrainingQueuesProps) -> None:
        super().__init__(scope, construct_id)
        self.props = checked_props(_NAME, props, TrainingQueuesProps)
        self.stack = Stack.of(self)
        env = props.environment_name
        self.teams = {team.name: team for team in props.teams}
        self.default_queue = props.default_queue_name
        self.weight_factors = policy.weight_factors(
            {policy.share_identifier(team.name): team.share_weight for team in props.teams}
        )
        self.service_environment: batch.CfnServiceEnvironment | None = None
        if props.existing_service_environment_arn is None:
            self.service_environment = batch.CfnServiceEnvironment(
                self,
                "ServiceEnvironment",
                service_environment_name=policy.service_environment_name(env),
                service_environment_type=policy.SERVICE_JOB_TYPE,
                state="ENABLED",
                capacity_limits=[
                    batch.CfnServiceEnvironment.CapacityLimitProperty(
                        max_capacity=props.max_instances, capacity_unit=policy.CAPACITY_UNIT
                    )
                ],
            )
            self.service_environment_arn = self.service_environment.attr_service_environment_arn
        else:
            self.service_environment_arn = props.existing_service_environment_arn
        self.scheduling_policy = batch.CfnSchedulingPolicy(
            self,
            "FairShare",
            name=policy.scheduling_policy_name(env),
            fairshare_policy=batch.CfnSchedulingPolicy.FairsharePolicyProperty(
                share_decay_seconds=props.share_decay_seconds,
                compute_reservation=props.compute_reservation,
                share_distribution=[
                    batch.CfnSchedulingPolicy.ShareAttributesProperty(
                        share_identifier=share, weight_factor=factor
                    )
                    for share, factor in self.weight_factors.items()
                ],
            ),
        )
        self.job_queues = {queue.name: self._job_queue(queue) for queue in props.job_queues}
        self.queue_arns = {name: queue.attr_job_queue_arn for name, queue in self.job_queues.items()}

    def _job_queue(self, queue: JobQueueSpec) -> batch.CfnJobQueue:
        props = self.props
        limits = (
            (policy.CAPACITY_REASON, props.capacity_wait_seconds),
            (policy.MISCONFIGURATION_REASON, props.misconfiguration_wait_seconds),
        )
        return batch.CfnJobQueue(
            self,
            f"Queue{queue.name.capitalize()}",
            job_queue_name=policy.job_queue_name(props.environment_name, queue.name),
            job_queue_type=policy.SERVICE_JOB_TYPE,
            priority=queue.priority,
            state="ENABLED",
            scheduling_policy_arn=self.scheduling_policy.attr_arn,
            service_environment_order=[
                batch.CfnJobQueue.ServiceEnvironmentOrderProperty(
                    order=1, service_environment=self.service_environment_arn
                )
            ],
            job_state_time_limit_actions=[
                batch.CfnJobQueue.JobStateTimeLimitActionProperty(
                    reason=reason,
                    state=policy.TIME_LIMIT_STATE,
                    max_time_seconds=seconds,
                    action=policy.TIME_LIMIT_ACTION,
                )
                for reason, seconds in limits
            ],
        )

    # -- one team's view --------------------------------------------------------------------------

    def team(self, name: str) -> TeamSpec:
        require(name in self.teams, _NAME, "teams", f"team {name!r} does not share these queues "
                f"({', '.join(self.teams)})")
        return self.teams[name]

    def team_queue_names(self, name: str) -> tuple[str, ...]:
        """The queues team ``name`` may submit to, the default first where it may use it."""
        own = self.team(name).queues or self.props.queue_names
        return tuple(sorted(own, key=lambda queue: queue != self.default_queue))

    def team_context(self, name: str) -> dict[str, Any]:
        """The team's queues as its launcher's functions receive them
        (``llmtrain.core.queue_context.TeamQueues``,
        with the queues' ARNs as deploy-time references)."""
        team = self.team(name)
        names = self.team_queue_names(name)
        return {
            "queue_arns": {queue: self.queue_arns[queue] for queue in names},
            "default_queue": names[0],
            "share_identifier": policy.share_identifier(team.name),
            "max_priority": team.max_priority,
            "max_instances": self.props.max_instances,
            "capacity_wait_seconds": self.props.capacity_wait_seconds,
        }

    def grant_submit(self, grantee: iam.IGrantable, team_name: str) -> dict[str, str]:
        """Let ``grantee`` (a team's launcher) submit service jobs to the team's queues only, with
        the team's share identifier, its tag and at most its priority. Returns the wildcard reasons.

        Batch authorizes SubmitServiceJob on the queue (``batch:SchedulingPriority``) and on the new
        service job (``batch:ShareIdentifier`` too), tags it with ``batch:TagResource``, and has the
        caller pass the payload's role to SageMaker (``iam:PassRole``, granted by the launcher for the
        team's execution role only)."""
        team = self.team(team_name)
        priority = {"NumericLessThanEquals": {"batch:SchedulingPriority": str(team.max_priority)}}
        tagged = {"StringEquals": {f"aws:RequestTag/{TEAM_TAG}": team.name}}
        for statement in (
            iam.PolicyStatement(
                sid=SUBMIT_TO_QUEUES_SID,
                actions=["batch:SubmitServiceJob"],
                resources=[self.queue_arns[queue] for queue in self.team_queue_names(team_name)],
                conditions={**priority, **tagged},
            ),
            iam.PolicyStatement(
                sid=SUBMIT_SERVICE_JOBS_SID,
                actions=["batch:SubmitServiceJob"],
                resources=[service_job_arns(self.stack)],
                conditions={
                    **priority,
                    "StringEquals": {
                        "batch:ShareIdentifier": policy.share_identifier(team.name),
                        f"aws:RequestTag/{TEAM_TAG}": team.name,
                    },
                },
            ),
            # Tagging as a job is submitted: the new job has no tags yet (IfExists), and a job that has
            # them (another team's) cannot be re-tagged as this team's, which its engineers may cancel.
            iam.PolicyStatement(
                sid=TAG_SERVICE_JOBS_SID,
                actions=["batch:TagResource"],
                resources=[service_job_arns(self.stack)],
                conditions={**tagged, "StringEqualsIfExists": {f"aws:ResourceTag/{TEAM_TAG}": team.name}},
            ),
        ):
            grantee.grant_principal.add_to_principal_policy(statement)
        return {
            SUBMIT_SERVICE_JOBS_SID: f"Batch names service jobs by an id it chooses; team {team.name}'s "
            "launcher creates them only with its own share identifier, tag and priority (conditions)",
            TAG_SERVICE_JOBS_SID: f"service jobs are tagged as they are submitted, with team {team.name}'s "
            "tag only, and never one already tagged with another team's (conditions); their ids are Batch's",
        }

    def grant_follow(self, grantee: iam.IGrantable, team_name: str) -> dict[str, str]:
        """Let ``grantee`` (a team's launcher functions) read the team's queued runs: their service
        jobs, the queues' order and share usage, and the training jobs Batch created for the team
        (Batch names them itself, so they are matched by the team's tag). Returns the wildcard reasons."""
        team = self.team(team_name)
        queue_arns = [self.queue_arns[queue] for queue in self.team_queue_names(team_name)]
        for statement in queue_read_statements(self.stack, team, queue_arns, describe=True):
            grantee.grant_principal.add_to_principal_policy(statement)
        return read_reasons(team)


    def grant_end_warm_pools(self, grantee: iam.IGrantable, team_name: str) -> dict[str, str]:
        """Let ``grantee`` (the launcher's NextAttempt) end the warm pool of a training job Batch
        created for the team (a hung job's, before its retry). Returns the wildcard reason."""
        statement = queued_training_jobs_statement(self.stack, self.team(team_name),
                                                   END_QUEUED_WARM_POOLS_SID, ["sagemaker:UpdateTrainingJob"])
        grantee.grant_principal.add_to_principal_policy(statement)
        return {END_QUEUED_WARM_POOLS_SID: "Batch names a queued run's training job itself; only those "
                "tagged with the team (condition)"}


def service_job_arns(stack: Stack) -> str:
    return stack.format_arn(service="batch", resource="service-job", resource_name="*",
                            arn_format=ArnFormat.SLASH_RESOURCE_NAME)


def queue_arns_in(stack: Stack, environment_name: str, names: Sequence[str]) -> list[str]:
    """The queues' ARNs as seen from ``stack`` (same account and region), from their fixed names."""
    return [
        stack.format_arn(service="batch", resource="job-queue",
                         resource_name=policy.job_queue_name(environment_name, name),
                         arn_format=ArnFormat.SLASH_RESOURCE_NAME)
        for name in names
    ]


def queue_read_statements(
    stack: Stack, team: TeamSpec, queue_arns: Sequence[str], *, describe: bool
) -> list[iam.PolicyStatement]:
    """Reading queued runs: listing the queues' service jobs (Batch offers no narrower resource),
    the queues' order and share usage, and the training jobs Batch creates, by the team's tag.
    ``describe`` adds DescribeServiceJob, which also shows a job's payload: the launcher's functions
    get it, the engineers (who see other teams' jobs in the listing) do not."""
    actions = sorted(ACTIONS_WITHOUT_RESOURCES) if describe else ["batch:ListServiceJobs"]
    return [
        iam.PolicyStatement(sid=READ_SERVICE_JOBS_SID, actions=actions, resources=["*"]),
        iam.PolicyStatement(
            sid=READ_QUEUES_SID, actions=["batch:GetJobQueueSnapshot"], resources=list(queue_arns)
        ),
        queued_training_jobs_statement(stack, team, READ_QUEUED_TRAINING_JOBS_SID,
                                       ["sagemaker:DescribeTrainingJob", "sagemaker:ListTags"]),
    ]


def queued_training_jobs_statement(
    stack: Stack, team: TeamSpec, sid: str, actions: Sequence[str]
) -> iam.PolicyStatement:
    """``actions`` on the training jobs Batch creates for the team's service jobs: Batch names them
    itself, so they are the team's by its tag."""
    return iam.PolicyStatement(
        sid=sid,
        actions=list(actions),
        resources=[stack.format_arn(service="sagemaker", resource="training-job", resource_name="*")],
        conditions={"StringEquals": {f"aws:ResourceTag/{TEAM_TAG}": team.name}},
    )


def read_reasons(team: TeamSpec) -> dict[str, str]:
    return {
        READ_SERVICE_JOBS_SID: "DescribeServiceJob and ListServiceJobs have no resource type in IAM (the "
        "Service Authorization Reference lists none)",
        READ_QUEUED_TRAINING_JOBS_SID: f"Batch names the training jobs it creates itself; team {team.name} "
        "reads only those tagged with its name (condition)",
    }


def grant_engineer_queue_access(team_access: Any, environment_name: str, queue_names: Sequence[str]) -> None:
    """Let a team's engineers see the environment's queues (`llmtrain queue`, `llmtrain status`) and
    cancel their own team's queued runs (`llmtrain stop`: TerminateServiceJob on service jobs tagged
    with the team's name). ``team_access`` is the team's ``TeamAccess``; the queues' ARNs are built
    from their names in its stack, so the access stack needs no reference to the launcher's."""
    stack, team = team_access.stack, team_access.team
    queue_arns = queue_arns_in(stack, environment_name, queue_names)
    statements = [
        *queue_read_statements(stack, team, queue_arns, describe=False),
        iam.PolicyStatement(
            sid=CANCEL_SERVICE_JOBS_SID,
            actions=["batch:TerminateServiceJob"],
            resources=[service_job_arns(stack)],
            conditions={"StringEquals": {f"aws:ResourceTag/{TEAM_TAG}": team.name}},
        ),
    ]
    reasons = {
        **read_reasons(team),
        CANCEL_SERVICE_JOBS_SID: f"Batch names service jobs by an id it chooses; team {team.name}'s "
        "engineers cancel only those tagged with its name (condition)",
    }
    team_access.add_engineer_statements(statements, reasons)


def _validate(props: TrainingQueuesProps) -> None:
    name = props.environment_name
    named = isinstance(name, str) and bool(ENVIRONMENT_NAME_PATTERN.fullmatch(name))
    require(named, _NAME, "environment_name",
            f"{name!r} must be an environment name: lowercase letters, digits and hyphens, at most 20")
    require(len(props.teams) > 0 and all(isinstance(t, TeamSpec) for t in props.teams), _NAME, "teams",
            "must list the teams (TeamSpec) that share the queues")
    names = [team.name for team in props.teams]
    require(len(set(names)) == len(names), _NAME, "teams", f"lists a team twice: {names}")
    require(is_whole_number(props.max_instances) and props.max_instances >= 1, _NAME, "max_instances",
            f"must be a whole number of instances of at least 1, got {props.max_instances!r}")
    require(len(props.job_queues) > 0 and all(isinstance(q, JobQueueSpec) for q in props.job_queues),
            _NAME, "job_queues", "must list at least one JobQueueSpec")
    queues = props.queue_names
    require(len(set(queues)) == len(queues), _NAME, "job_queues", f"names a queue twice: {list(queues)}")
    require(props.default_queue is None or props.default_queue in queues, _NAME, "default_queue",
            f"{props.default_queue!r} is not one of job_queues {list(queues)}")
    for team in props.teams:
        outside = sorted(set(team.queues) - set(queues))
        require(not outside, _NAME, "teams", f"team {team.name!r} names queues {outside} that are not "
                f"among job_queues {list(queues)}")
        too_large = team.max_instance_count is not None and team.max_instance_count > props.max_instances
        require(not too_large, _NAME, "teams", f"team {team.name!r} may run {team.max_instance_count} "
                f"instances, more than max_instances ({props.max_instances}): its runs could never start")
        longest = MAX_QUEUED_TEAM_JOB_NAME_PREFIX
        require(len(team.job_name_prefix) <= longest, _NAME, "teams",
                f"team {team.name!r}: job-name prefix {team.job_name_prefix!r} is longer than {longest} "
                f"characters; AWS Batch keeps the first {QUEUED_NAME_KEPT} characters of a queued job's "
                "name, so the team's role could write none of its queued jobs' logs: shorten the team's "
                "name or the environment's job_name_prefix")
    _validate_numbers(props)
    arn = props.existing_service_environment_arn
    require(arn is None or is_unresolved(arn) or (isinstance(arn, str) and ":service-environment/" in arn),
            _NAME, "existing_service_environment_arn",
            f"{arn!r} is not a Batch service environment ARN "
            "(arn:aws:batch:REGION:ACCOUNT:service-environment/NAME)")


def _validate_numbers(props: TrainingQueuesProps) -> None:
    ranges = {
        "share_decay_seconds": (0, policy.MAX_SHARE_DECAY_SECONDS),
        "compute_reservation": (0, policy.MAX_COMPUTE_RESERVATION),
        "capacity_wait_seconds": (policy.MIN_TIME_LIMIT_SECONDS, policy.MAX_TIME_LIMIT_SECONDS),
        "misconfiguration_wait_seconds": (policy.MIN_TIME_LIMIT_SECONDS, policy.MAX_TIME_LIMIT_SECONDS),
    }
    for name, (low, high) in ranges.items():
        value = getattr(props, name)
        require(is_whole_number(value) and low <= value <= high, _NAME, name,
                f"must be a whole number from {low} to {high}, got {value!r}")


__all__ = [
    "ACTIONS_WITHOUT_RESOURCES",
    "CANCEL_SERVICE_JOBS_SID",
    "JobQueueSpec",
    "READ_QUEUED_TRAINING_JOBS_SID",
    "READ_QUEUES_SID",
    "READ_SERVICE_JOBS_SID",
    "SUBMIT_SERVICE_JOBS_SID",
    "SUBMIT_TO_QUEUES_SID",
    "TAG_SERVICE_JOBS_SID",
    "TrainingQueues",
    "TrainingQueuesProps",
    "grant_engineer_queue_access",
    "queue_arns_in",
]
