"""Who may do what: the SageMaker execution role, the ML engineers' policy and the warm-pool guard rail."""

from __future__ import annotations

import re
from collections.abc import Sequence

from aws_cdk import ArnFormat, Fn, Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from llmtrain.platform import MAX_KEEP_ALIVE_SECONDS
from training_constructs._props import check_job_name_prefix, is_unresolved, is_whole_number, require
from training_constructs.images import DLC_REGISTRY_ACCOUNTS, training_image_repositories
from training_constructs.nag import acknowledge_wildcards

_NAME = "TrainingAccess"
TRAINING_LOG_GROUP = "/aws/sagemaker/TrainingJobs"
TRAINING_METRIC_NAMESPACE = "/aws/sagemaker/TrainingJobs"
_REPOSITORY_ARN = re.compile(r"^arn:aws[a-z-]*:ecr:[a-z0-9-]+:\d{12}:repository/[a-z0-9._/-]+\*?$")

# Actions whose only IAM resource is "*" (AWS offers no narrower one), with the reason. Tests
# check that every Allow on "*" in the platform is one of these.
ACTIONS_WITHOUT_RESOURCE_LEVEL_PERMISSIONS = {
    "ecr:GetAuthorizationToken": "ECR login tokens are account-wide; the images pulled are scoped",
    "cloudwatch:PutMetricData": "metrics have no ARN; limited to SageMaker's namespace by condition",
    "ec2:DescribeNetworkInterfaces": "EC2 Describe* calls support no resource-level permissions",
    "ec2:DescribeVpcs": "EC2 Describe* calls support no resource-level permissions",
    "ec2:DescribeDhcpOptions": "EC2 Describe* calls support no resource-level permissions",
    "ec2:DescribeSubnets": "EC2 Describe* calls support no resource-level permissions",
    "ec2:DescribeSecurityGroups": "EC2 Describe* calls support no resource-level permissions",
    "sagemaker:ListTrainingJobs": "List calls have no resource; descriptions are scoped to the prefix",
}
_DESCRIBE_VPC_ACTIONS = [
    action for action in ACTIONS_WITHOUT_RESOURCE_LEVEL_PERMISSIONS if action.startswith("ec2:Describe")
]


def warm_pool_cap_statement(max_keep_alive_seconds: int) -> iam.PolicyStatement:
    """A Deny of training jobs whose warm pool would outlive ``max_keep_alive_seconds``.

    SageMaker evaluates ``sagemaker:KeepAlivePeriod`` (the request's
    ``ResourceConfig.KeepAlivePeriodInSeconds``) on CreateTrainingJob and UpdateTrainingJob; a
    request without a warm pool has no such key and is not affected. Attach it to any principal
    that may call SageMaker directly.
    """
    _check_cap("max_keep_alive_seconds", max_keep_alive_seconds)
    return iam.PolicyStatement(
        sid="CapWarmPoolKeepAlive",
        effect=iam.Effect.DENY,
        actions=["sagemaker:CreateTrainingJob", "sagemaker:UpdateTrainingJob"],
        resources=["*"],
        conditions={"NumericGreaterThan": {"sagemaker:KeepAlivePeriod": max_keep_alive_seconds}},
    )


class TrainingAccess(Construct):
    """The SageMaker execution role, a managed policy for ML engineers, and the warm-pool cap.

    The execution role (trusted by ``sagemaker.amazonaws.com`` for this account only) may read
    datasets, code and earlier artifacts, read and write checkpoints, write artifacts, use the
    key, pull the Deep Learning Container images, write the training job logs and metrics, and
    manage the network interfaces VPC mode needs, in ``subnets`` with ``security_groups``
    when given. It also carries the warm-pool cap, since notebooks often call SageMaker with it.

    ``engineer_policy`` lets ML engineers start and follow launcher runs (see
    ``allow_launcher``), read training jobs whose names start with ``job_name_prefix``, and read
    their logs; it carries the warm-pool cap too. ``warm_pool_guardrail_policy`` holds only the
    cap, to attach to any other role that calls SageMaker.

    Attributes: ``execution_role``, ``engineer_policy``, ``warm_pool_guardrail_policy``,
    ``max_keep_alive_seconds``, ``job_name_prefix``.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        datasets_bucket: s3.IBucket,
        checkpoints_bucket: s3.IBucket,
        artifacts_bucket: s3.IBucket,
        code_bucket: s3.IBucket,
        key: kms.IKey,
        job_name_prefix: str,
        max_keep_alive_seconds: int,
        subnets: Sequence[ec2.ISubnet] = (),
        security_groups: Sequence[ec2.ISecurityGroup] = (),
        image_repository_arns: Sequence[str] | None = None,
        launcher_state_machine_arns: Sequence[str] = (),
    ) -> None:
        super().__init__(scope, construct_id)
        _check_cap("max_keep_alive_seconds", max_keep_alive_seconds)
        check_job_name_prefix(_NAME, job_name_prefix)
        self.stack = Stack.of(self)
        self.job_name_prefix = job_name_prefix
        self.max_keep_alive_seconds = max_keep_alive_seconds
        self._launchers = 0
        repositories = self._image_repositories(image_repository_arns)

        self.warm_pool_guardrail_policy = iam.ManagedPolicy(
            self,
            "WarmPoolGuardrailPolicy",
            description=f"Denies SageMaker warm pools kept alive longer than {max_keep_alive_seconds} s",
            statements=[warm_pool_cap_statement(max_keep_alive_seconds)],
        )
        self.execution_role = iam.Role(
            self,
            "ExecutionRole",
            assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com").with_conditions(
                {"StringEquals": {"aws:SourceAccount": self.stack.account}}
            ),
            description="SageMaker training jobs of the LLM training platform",
            managed_policies=[self.warm_pool_guardrail_policy],
        )
        policy = iam.Policy(
            self,
            "ExecutionPolicy",
            roles=[self.execution_role],
            statements=[
                *self._storage_statements(datasets_bucket, checkpoints_bucket, artifacts_bucket, code_bucket),
                *self._key_statements(key),
                *self._image_statements(repositories),
                *self._observability_statements(),
                *self._network_statements(subnets, security_groups),
            ],
        )
        self._acknowledge_execution_wildcards(policy)

        self.engineer_policy = iam.ManagedPolicy(
            self,
            "EngineerPolicy",
            description="ML engineers: start and follow launcher runs, read training jobs and their logs",
            statements=[*self._engineer_statements(), warm_pool_cap_statement(max_keep_alive_seconds)],
        )
        self._acknowledge_engineer_wildcards()
        for arn in launcher_state_machine_arns:
            self.allow_launcher(arn)

    # -- what other constructs call -------------------------------------------------------------

    def allow_launcher(self, state_machine_arn: str) -> None:
        """Let ML engineers start, list, describe and stop executions of one launcher state machine."""
        self._launchers += 1
        follow_sid = f"FollowLauncherRuns{self._launchers}"
        executions = self.stack.format_arn(
            service="states",
            resource="execution",
            arn_format=ArnFormat.COLON_RESOURCE_NAME,
            resource_name=f"{Fn.select(6, Fn.split(':', state_machine_arn))}:*",
        )
        self.engineer_policy.add_statements(
            iam.PolicyStatement(
                sid=f"StartLauncherRuns{self._launchers}",
                actions=["states:StartExecution", "states:ListExecutions"],
                resources=[state_machine_arn],
            ),
            iam.PolicyStatement(
                sid=follow_sid,
                actions=["states:DescribeExecution", "states:StopExecution", "states:GetExecutionHistory"],
                resources=[executions],
            ),
        )
        acknowledge_wildcards(
            self.engineer_policy,
            {
                follow_sid: "Engineers follow every run (execution) of the launcher state machine; "
                "execution names are chosen per run"
            },
        )

    def grant_pass_execution_role(self, grantee: iam.IGrantable) -> iam.Grant:
        """Let ``grantee`` (the launcher) hand the execution role to SageMaker, and to nothing else."""
        return iam.Grant.add_to_principal(
            grantee=grantee,
            actions=["iam:PassRole"],
            resource_arns=[self.execution_role.role_arn],
            conditions={"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}},
        )

    def training_job_arn(self, name_pattern: str = "*") -> str:
        """ARN of this platform's training jobs: those whose names start with the prefix."""
        return self.stack.format_arn(
            service="sagemaker",
            resource="training-job",
            resource_name=f"{self.job_name_prefix}{name_pattern}",
        )

    # -- the execution role ---------------------------------------------------------------------

    def _storage_statements(self, datasets, checkpoints, artifacts, code) -> list[iam.PolicyStatement]:
        def objects(*buckets):
            return [bucket.arn_for_objects("*") for bucket in buckets]

        return [
            iam.PolicyStatement(
                sid="ListPlatformBuckets",
                actions=["s3:ListBucket", "s3:GetBucketLocation"],
                resources=[b.bucket_arn for b in (datasets, checkpoints, artifacts, code)],
            ),
            # Artifacts are read too: a fine-tuning job starts from an earlier run's model.
            iam.PolicyStatement(
                sid="ReadTrainingInputs",
                actions=["s3:GetObject"],
                resources=objects(datasets, code, checkpoints, artifacts),
            ),
            iam.PolicyStatement(
                sid="WriteCheckpoints",
                actions=["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
                resources=objects(checkpoints),
            ),
            iam.PolicyStatement(
                sid="WriteArtifacts",
                actions=["s3:PutObject", "s3:AbortMultipartUpload"],
                resources=objects(artifacts),
            ),
        ]

    def _key_statements(self, key: kms.IKey) -> list[iam.PolicyStatement]:
        return [
            iam.PolicyStatement(
                sid="UsePlatformKey",
                actions=["kms:Decrypt", "kms:GenerateDataKey", "kms:DescribeKey"],
                resources=[key.key_arn],
            ),
            # SageMaker encrypts the instances' ML storage volumes with the key through a grant.
            iam.PolicyStatement(
                sid="GrantKeyToVolumes",
                actions=["kms:CreateGrant"],
                resources=[key.key_arn],
                conditions={"Bool": {"kms:GrantIsForAWSResource": True}},
            ),
        ]

    def _image_repositories(self, arns: Sequence[str] | None) -> list[str]:
        if arns is not None:
            require(len(arns) > 0, _NAME, "image_repository_arns", "must list at least one repository ARN")
            bad = [arn for arn in arns if not is_unresolved(arn) and not _REPOSITORY_ARN.fullmatch(arn)]
            require(
                not bad,
                _NAME,
                "image_repository_arns",
                f"{bad} are not ECR repository ARNs (arn:aws:ecr:<region>:<account>:repository/<name>)",
            )
            return list(arns)
        region = self.stack.region
        require(
            not is_unresolved(region),
            _NAME,
            "image_repository_arns",
            "the stack has no explicit region, so the Deep Learning Container registry is "
            "unknown: give the stack an env with a region, or list the repository ARNs",
        )
        require(
            region in DLC_REGISTRY_ACCOUNTS,
            _NAME,
            "image_repository_arns",
            f"no Deep Learning Container registry is known for region {region}: list the ARNs",
        )
        return [
            self.stack.format_arn(
                service="ecr", account=account, resource="repository", resource_name=repository
            )
            for account, repository in training_image_repositories(region)
        ]

    @staticmethod
    def _image_statements(repositories: list[str]) -> list[iam.PolicyStatement]:
        return [
            iam.PolicyStatement(
                sid="PullTrainingImages",
                actions=[
                    "ecr:BatchGetImage",
                    "ecr:GetDownloadUrlForLayer",
                    "ecr:BatchCheckLayerAvailability",
                ],
                resources=repositories,
            ),
            iam.PolicyStatement(sid="EcrLogin", actions=["ecr:GetAuthorizationToken"], resources=["*"]),
        ]

    def _observability_statements(self) -> list[iam.PolicyStatement]:
        log_group = self._log_group_arn()
        return [
            iam.PolicyStatement(
                sid="WriteTrainingLogs",
                actions=[
                    "logs:CreateLogGroup",
                    "logs:CreateLogStream",
                    "logs:PutLogEvents",
                    "logs:DescribeLogStreams",
                ],
                resources=[log_group, f"{log_group}:log-stream:*"],
            ),
            iam.PolicyStatement(
                sid="PublishTrainingMetrics",
                actions=["cloudwatch:PutMetricData"],
                resources=["*"],
                conditions={"StringEquals": {"cloudwatch:namespace": TRAINING_METRIC_NAMESPACE}},
            ),
        ]

    def _network_statements(
        self, subnets: Sequence[ec2.ISubnet], security_groups: Sequence[ec2.ISecurityGroup]
    ) -> list[iam.PolicyStatement]:
        def ec2_arns(kind: str, ids: list[str]) -> list[str]:
            return [
                self.stack.format_arn(service="ec2", resource=kind, resource_name=i) for i in ids or ["*"]
            ]

        interfaces = ec2_arns("network-interface", [])
        return [
            iam.PolicyStatement(
                sid="CreateJobNetworkInterfaces",
                actions=["ec2:CreateNetworkInterface"],
                resources=[
                    *interfaces,
                    *ec2_arns("subnet", [s.subnet_id for s in subnets]),
                    *ec2_arns("security-group", [g.security_group_id for g in security_groups]),
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
            iam.PolicyStatement(sid="DescribeJobNetwork", actions=_DESCRIBE_VPC_ACTIONS, resources=["*"]),
        ]

    def _log_group_arn(self) -> str:
        return self.stack.format_arn(
            service="logs",
            resource="log-group",
            resource_name=TRAINING_LOG_GROUP,
            arn_format=ArnFormat.COLON_RESOURCE_NAME,
        )

    def _acknowledge_execution_wildcards(self, policy: iam.Policy) -> None:
        acknowledge_wildcards(
            policy,
            {
                "ReadTrainingInputs": "Training reads objects under any key of the platform's own buckets, "
                "which are named exactly",
                "WriteCheckpoints": "Checkpoints are written under any key of the checkpoints bucket, "
                "which is named exactly",
                "WriteArtifacts": "Model artifacts are written under any key of the artifacts bucket, "
                "which is named exactly",
                "EcrLogin": ACTIONS_WITHOUT_RESOURCE_LEVEL_PERMISSIONS["ecr:GetAuthorizationToken"],
                "PublishTrainingMetrics": ACTIONS_WITHOUT_RESOURCE_LEVEL_PERMISSIONS[
                    "cloudwatch:PutMetricData"
                ],
                "DescribeJobNetwork": ACTIONS_WITHOUT_RESOURCE_LEVEL_PERMISSIONS["ec2:DescribeSubnets"],
                "WriteTrainingLogs": "SageMaker writes one log stream per job and instance, named at "
                "run time, inside the training-jobs log group",
                "CreateJobNetworkInterfaces": "SageMaker creates a network interface per instance, whose id "
                "is not known in advance (subnets and groups are exact when given)",
                "ManageJobNetworkInterfaces": "SageMaker manages the network interfaces it created per "
                "instance, whose ids are not known in advance",
            },
        )

    def _engineer_statements(self) -> list[iam.PolicyStatement]:
        log_group = self._log_group_arn()
        return [
            iam.PolicyStatement(
                sid="ReadPlatformTrainingJobs",
                actions=["sagemaker:DescribeTrainingJob", "sagemaker:ListTags"],
                resources=[self.training_job_arn()],
            ),
            iam.PolicyStatement(
                sid="ListTrainingJobs", actions=["sagemaker:ListTrainingJobs"], resources=["*"]
            ),
            iam.PolicyStatement(
                sid="ReadTrainingLogs",
                actions=["logs:DescribeLogStreams", "logs:FilterLogEvents", "logs:GetLogEvents"],
                resources=[log_group, f"{log_group}:log-stream:{self.job_name_prefix}*"],
            ),
        ]

    def _acknowledge_engineer_wildcards(self) -> None:
        acknowledge_wildcards(self.engineer_policy, ENGINEER_WILDCARD_REASONS)


# Why the engineers' statements name wildcards (by Sid); statements added later (stacks.services)
# acknowledge with these plus their own.
ENGINEER_WILDCARD_REASONS = {
    "ListTrainingJobs": ACTIONS_WITHOUT_RESOURCE_LEVEL_PERMISSIONS["sagemaker:ListTrainingJobs"],
    "ReadPlatformTrainingJobs": "Engineers read every training job of this platform: the names "
    "share the platform's prefix and differ per run",
    "ReadTrainingLogs": "Engineers read the logs of this platform's jobs: the streams share the "
    "platform's job-name prefix and differ per run",
}


def _check_cap(field: str, seconds: int) -> None:
    require(
        is_whole_number(seconds) and 0 <= seconds <= MAX_KEEP_ALIVE_SECONDS,
        _NAME,
        field,
        f"must be a whole number of seconds from 0 to {MAX_KEEP_ALIVE_SECONDS} "
        f"(SageMaker's limit for KeepAlivePeriodInSeconds), got {seconds!r}",
    )


__all__ = ["ACTIONS_WITHOUT_RESOURCE_LEVEL_PERMISSIONS", "TrainingAccess", "warm_pool_cap_statement"]
