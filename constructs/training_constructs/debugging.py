"""SageMaker remote debugging (an SSM session into a job's container) and training plans: endpoints
and permissions, per team.

Remote debugging: SageMaker starts the SSM agent in the containers of a job created with
RemoteDebugConfig.EnableRemoteDebug; the agent opens its channels through `ssmmessages` (and
registers through `ssm`), so isolated subnets need both interface endpoints, and the team's
execution role the `ssmmessages:*Channel` actions. An engineer opens a session with
`ssm:StartSession` on the target `sagemaker-training-job:<job>_<host>`: the condition on
`ssm:resourceTag/aws:ssmmessages:target-id` limits that to jobs named with the team's prefix
(`llmtrain debug`).

Training plans: a team's engineers list the account's plans and describe the ones the environment
offers to runs (`llmtrain plans`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aws_cdk import Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from constructs import Construct

from llmtrain.core.platform import REMOTE_DEBUG_TARGET_PREFIX
from training_constructs._props import checked_props, is_unresolved, require
from training_constructs.access import TeamAccess
from training_constructs.network import endpoints_in_network
from training_constructs.resources import NetworkResources, check_network

_NAME = "TrainingDebugging"
# Neither endpoint gets a policy: the SSM agent in a SageMaker container calls them with credentials
# SageMaker manages, and SSM's documentation names no endpoint policy for `ssmmessages` (a policy on an
# endpoint whose service does not support one fails the deployment). Their security group admits
# HTTPS from the VPC only; who may open a session is decided by the engineers' policies.
ENDPOINT_SERVICES = {
    "Ssm": ec2.InterfaceVpcEndpointAwsService.SSM,
    "SsmMessages": ec2.InterfaceVpcEndpointAwsService.SSM_MESSAGES,
}
SSM_TARGET_KEY = "ssm:resourceTag/aws:ssmmessages:target-id"
CONTAINER_CHANNEL_ACTIONS = (
    "ssmmessages:CreateControlChannel",
    "ssmmessages:CreateDataChannel",
    "ssmmessages:OpenControlChannel",
    "ssmmessages:OpenDataChannel",
)
_TRAINING_PLAN_ARN_PREFIX = ":training-plan/"
# Why each statement names a wildcard (cdk-nag AwsSolutions-IAM5), by statement Sid.
EXECUTION_WILDCARD_REASONS = {
    "RemoteDebugChannels": "ssmmessages channel actions have no resource-level permission (SageMaker's "
    "remote debugging documentation grants them on *)",
}
ENGINEER_WILDCARD_REASONS = {
    "RemoteDebugStartSession": "SSM session targets of training jobs are not ARNs; the condition on "
    "aws:ssmmessages:target-id limits sessions to the team's jobs",
    "RemoteDebugEndSession": "sessions are named after their user at start (${aws:userid}-*): only one's own",
    "TrainingPlansList": "sagemaker:ListTrainingPlans has no resource-level permission",
}


@dataclass(frozen=True, kw_only=True)
class TrainingDebuggingProps:
    """``network`` (``TrainingNetwork`` or ``ExistingNetwork``) is where the SSM endpoints go."""

    network: NetworkResources

    def __post_init__(self) -> None:
        check_network(_NAME, self.network)


class TrainingDebugging(Construct):
    """The SSM interface endpoints remote debugging needs in isolated subnets.

    Attributes: ``endpoints`` (by the names in ``ENDPOINT_SERVICES``; empty when the network has no
    endpoint security group: a VPC that brings its own endpoints), ``props``.
    """

    def __init__(self, scope: Construct, construct_id: str, props: TrainingDebuggingProps) -> None:
        super().__init__(scope, construct_id)
        self.props = checked_props(_NAME, props, TrainingDebuggingProps)
        self.endpoints = endpoints_in_network(self, props.network, ENDPOINT_SERVICES, policy_actions={})


def container_statements() -> list[iam.PolicyStatement]:
    """The execution role's: the SSM agent in the container opens its channels (no resource ARNs)."""
    return [iam.PolicyStatement(sid="RemoteDebugChannels", actions=list(CONTAINER_CHANNEL_ACTIONS),
                                resources=["*"])]


def session_statements(stack: Stack, job_name_prefix: str) -> list[iam.PolicyStatement]:
    """The engineers': sessions into the team's jobs only (`<prefix>-*`), and ending their own sessions."""
    session_arn = stack.format_arn(service="ssm", resource="session", resource_name="${aws:userid}-*")
    return [
        iam.PolicyStatement(sid="RemoteDebugStartSession", actions=["ssm:StartSession"], resources=["*"],
                            conditions={"StringLike": {
                                SSM_TARGET_KEY: [f"{REMOTE_DEBUG_TARGET_PREFIX}{job_name_prefix}-*"]}}),
        iam.PolicyStatement(sid="RemoteDebugEndSession",
                            actions=["ssm:TerminateSession", "ssm:ResumeSession"], resources=[session_arn]),
    ]


def training_plan_statements(plan_arns: Sequence[str]) -> list[iam.PolicyStatement]:
    """The engineers': list the account's training plans (no resource-level permission) and describe the
    ones the environment offers (``plan_arns``), by their ARNs."""
    statements = [
        iam.PolicyStatement(sid="TrainingPlansList", actions=["sagemaker:ListTrainingPlans"],
                            resources=["*"]),
    ]
    if plan_arns:
        statements.append(iam.PolicyStatement(sid="TrainingPlansDescribe",
                                              actions=["sagemaker:DescribeTrainingPlan"],
                                              resources=list(plan_arns)))
    return statements


def grant_remote_debug(team: TeamAccess) -> None:
    """The team's jobs open SSM channels; its engineers open sessions into its running jobs."""
    team.add_execution_statements(container_statements(), EXECUTION_WILDCARD_REASONS)
    team.add_engineer_statements(session_statements(team.stack, team.team.job_name_prefix),
                                 ENGINEER_WILDCARD_REASONS)


def grant_training_plans(team: TeamAccess, plan_arns: Sequence[str]) -> None:
    """The team's engineers list the account's training plans and describe the environment's."""
    bad = [arn for arn in plan_arns if not is_unresolved(arn) and _TRAINING_PLAN_ARN_PREFIX not in arn]
    require(not bad, _NAME, "plan_arns", f"{bad} are not training plan ARNs (...:training-plan/NAME)")
    team.add_engineer_statements(training_plan_statements(plan_arns), ENGINEER_WILDCARD_REASONS)


__all__ = [
    "ENDPOINT_SERVICES",
    "TrainingDebugging",
    "TrainingDebuggingProps",
    "container_statements",
    "grant_remote_debug",
    "grant_training_plans",
    "session_statements",
    "training_plan_statements",
]
