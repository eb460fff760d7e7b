"""The role a team's processing jobs (its cloud data preparations, `PreparationLauncher`) run as:
the team's datasets prefix read and written (the training jobs' execution role only reads it), the
data key, the Deep Learning Container images, the jobs' logs and metrics, and the network interfaces
VPC mode needs; the guard rail attached.
"""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import ArnFormat, Stack
from aws_cdk import aws_iam as iam
from constructs import Construct

from llmtrain.core.platform import team_job_log_streams
from training_constructs._props import is_unresolved, require
from training_constructs.access import _image_statements, _key_statements
from training_constructs.images import DLC_REGISTRY_ACCOUNTS, training_image_repositories
from training_constructs.nag import acknowledge_wildcards
from training_constructs.resources import NetworkResources, StorageResources
from training_constructs.teams import TeamSpec

PROCESSING_LOG_GROUP = "/aws/sagemaker/ProcessingJobs"
PROCESSING_METRIC_NAMESPACE = "/aws/sagemaker/ProcessingJobs"


def team_datasets(storage: StorageResources, team: TeamSpec) -> str:
    """The objects of the team's datasets prefix."""
    return storage.datasets_bucket.arn_for_objects(f"{team.data_prefix}*")


def list_team_datasets(sid: str, storage: StorageResources, team: TeamSpec) -> iam.PolicyStatement:
    return iam.PolicyStatement(
        sid=sid,
        actions=["s3:ListBucket"],
        resources=[storage.datasets_bucket.bucket_arn],
        conditions={"StringLike": {"s3:prefix": [f"{team.data_prefix}*"]}},
    )


def processing_role(
    scope: Construct,
    *,
    construct: str,
    team: TeamSpec,
    storage: StorageResources,
    network: NetworkResources,
    guardrail_policy: iam.IManagedPolicy | None,
    image_repository_arns: Sequence[str] | None,
) -> tuple[iam.Role, iam.Policy]:
    """The role (``ProcessingRole``) and its policy (``ProcessingPolicy``) under ``scope``;
    ``construct`` names the construct in errors about its props."""
    stack = Stack.of(scope)
    name = team.name
    role = iam.Role(
        scope,
        "ProcessingRole",
        assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com").with_conditions(
            {"StringEquals": {"aws:SourceAccount": stack.account}}
        ),
        description=f"SageMaker processing jobs (data preparations) of team {name} of the LLM training "
        "platform",
        managed_policies=[guardrail_policy] if guardrail_policy is not None else None,
    )
    log_group = stack.format_arn(
        service="logs",
        resource="log-group",
        resource_name=PROCESSING_LOG_GROUP,
        arn_format=ArnFormat.COLON_RESOURCE_NAME,
    )
    streams = [f"{log_group}:log-stream:{p}" for p in team_job_log_streams(team.job_name_prefix)]

    def ec2(kind: str, ids: Sequence[str]) -> list[str]:
        return [stack.format_arn(service="ec2", resource=kind, resource_name=i) for i in ids]

    interfaces = ec2("network-interface", ["*"])
    repositories = list(image_repository_arns or _region_image_repositories(stack, construct))
    policy = iam.Policy(
        scope,
        "ProcessingPolicy",
        roles=[role],
        statements=[
            list_team_datasets("ListTeamDatasets", storage, team),
            iam.PolicyStatement(
                sid="ReadTeamDatasets", actions=["s3:GetObject"], resources=[team_datasets(storage, team)]
            ),
            iam.PolicyStatement(
                sid="WriteTeamDatasets",
                actions=["s3:PutObject", "s3:AbortMultipartUpload"],
                resources=[team_datasets(storage, team)],
            ),
            *_key_statements(storage.data_key),
            *_image_statements(repositories),
            iam.PolicyStatement(
                sid="WriteProcessingLogs",
                actions=[
                    "logs:CreateLogGroup",
                    "logs:CreateLogStream",
                    "logs:PutLogEvents",
                    "logs:DescribeLogStreams",
                ],
                resources=[log_group, *streams],
            ),
            iam.PolicyStatement(
                sid="PublishProcessingMetrics",
                actions=["cloudwatch:PutMetricData"],
                resources=["*"],
                conditions={"StringEquals": {"cloudwatch:namespace": PROCESSING_METRIC_NAMESPACE}},
            ),
            iam.PolicyStatement(
                sid="CreateJobNetworkInterfaces",
                actions=["ec2:CreateNetworkInterface"],
                resources=[
                    *interfaces,
                    *ec2("subnet", [s.subnet_id for s in network.subnets]),
                    *ec2("security-group", [network.security_group.security_group_id]),
                ],
            ),
            iam.PolicyStatement(
                sid="ManageJobNetworkInterfaces",
                actions=[
                    "ec2:CreateNetworkInterfacePermission",
                    "ec2:DeleteNetworkInterface",
                    "ec2:DeleteNetworkInterfacePermission",
                ],
                resources=interfaces,
            ),
            iam.PolicyStatement(
                sid="DescribeJobNetwork",
                actions=[
                    "ec2:DescribeNetworkInterfaces",
                    "ec2:DescribeVpcs",
                    "ec2:DescribeDhcpOptions",
                    "ec2:DescribeSubnets",
                    "ec2:DescribeSecurityGroups",
                ],
                resources=["*"],
            ),
        ],
    )
    acknowledge_wildcards(
        policy,
        {
            "ReadTeamDatasets": f"Preparations read the input files and tokenizer under team {name}'s own "
            "prefix of the datasets bucket, chosen per preparation",
            "WriteTeamDatasets": f"Preparations write the dataset's shards and state under team {name}'s own "
            "prefix of the datasets bucket, one key per file",
            "EcrLogin": "ECR login tokens are account-wide; the images pulled are scoped",
            "PublishProcessingMetrics": "metrics have no ARN; limited to SageMaker Processing's namespace by "
            "condition",
            "DescribeJobNetwork": "EC2 Describe* calls support no resource-level permissions",
            "WriteProcessingLogs": "SageMaker writes one log stream per job and instance, named at run time "
            f"after the job, under team {name}'s job-name prefix",
            "CreateJobNetworkInterfaces": "SageMaker creates a network interface per instance, whose id is "
            "not known in advance (subnets and groups are exact)",
            "ManageJobNetworkInterfaces": "SageMaker manages the network interfaces it created per instance, "
            "whose ids are not known in advance",
        },
    )
    return role, policy


def _region_image_repositories(stack: Stack, construct: str) -> list[str]:
    region = stack.region
    require(
        not is_unresolved(region) and region in DLC_REGISTRY_ACCOUNTS,
        construct,
        "image_repository_arns",
        f"no Deep Learning Container registry is known for region {region}: give the stack an env "
        "with a region, or list the repository ARNs",
    )
    return [
        stack.format_arn(service="ecr", account=account, resource="repository", resource_name=repository)
        for account, repository in training_image_repositories(region)
    ]


__all__ = ["PROCESSING_LOG_GROUP", "list_team_datasets", "processing_role", "team_datasets"]
