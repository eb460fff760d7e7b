"""SageMaker remote debugging (an SSM session into a job's container) and training plans: endpoints
and permissions.

Remote debugging: SageMaker starts the SSM agent in the containers of a job created with
RemoteDebugConfig.EnableRemoteDebug; the agent opens its channels through `ssmmessages` (and
registers through `ssm`), so isolated subnets need both interface endpoints, and the execution role
the `ssmmessages:*Channel` actions. An engineer opens a session with `ssm:StartSession` on the target
`sagemaker-training-job:<job>_<host>`: the condition on `ssm:resourceTag/aws:ssmmessages:target-id`
limits that to jobs named with the environment's prefix (`llmtrain debug`).

Training plans: engineers list and describe them (`llmtrain plans`).
"""

from __future__ import annotations

from aws_cdk import ArnFormat, Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from constructs import Construct

from training_constructs._props import check_job_name_prefix
from training_constructs.packages import interface_endpoints

_NAME = "TrainingDebugging"
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


class TrainingDebugging(Construct):
    """The SSM interface endpoints remote debugging needs in isolated subnets (``endpoints``)."""

    def __init__(self, scope: Construct, construct_id: str, *, vpc: ec2.IVpc, subnets: ec2.SubnetSelection,
                 endpoint_security_group: ec2.ISecurityGroup | None) -> None:
        super().__init__(scope, construct_id)
        self.endpoints = ({} if endpoint_security_group is None else interface_endpoints(
            self, ENDPOINT_SERVICES, vpc=vpc, subnets=subnets, security_group=endpoint_security_group))


def container_statements() -> list[iam.PolicyStatement]:
    """The execution role's: the SSM agent in the container opens its channels (no resource ARNs)."""
    return [iam.PolicyStatement(sid="RemoteDebugChannels", actions=list(CONTAINER_CHANNEL_ACTIONS),
                                resources=["*"])]


def session_statements(stack: Stack, job_name_prefix: str) -> list[iam.PolicyStatement]:
    """The engineers': sessions into the environment's jobs only, and ending their own sessions."""
    check_job_name_prefix(_NAME, job_name_prefix)
    session_arn = stack.format_arn(service="ssm", resource="session", resource_name="${aws:userid}-*")
    return [
        iam.PolicyStatement(sid="RemoteDebugStartSession", actions=["ssm:StartSession"], resources=["*"],
                            conditions={"StringLike": {
                                SSM_TARGET_KEY: [f"sagemaker-training-job:{job_name_prefix}-*"]}}),
        iam.PolicyStatement(sid="RemoteDebugEndSession",
                            actions=["ssm:TerminateSession", "ssm:ResumeSession"], resources=[session_arn]),
    ]


def training_plan_statements(stack: Stack) -> list[iam.PolicyStatement]:
    """The engineers': list the account's training plans (no resource-level permission) and read one."""
    plans = stack.format_arn(service="sagemaker", resource="training-plan", resource_name="*",
                             arn_format=ArnFormat.SLASH_RESOURCE_NAME)
    return [
        iam.PolicyStatement(sid="TrainingPlansList", actions=["sagemaker:ListTrainingPlans"],
                            resources=["*"]),
        iam.PolicyStatement(sid="TrainingPlansDescribe", actions=["sagemaker:DescribeTrainingPlan"],
                            resources=[plans]),
    ]
