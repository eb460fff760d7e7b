"""Who may do what, per team: SageMaker execution roles, ML engineers' policies, and the guard rail."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from aws_cdk import ArnFormat, Aws, Fn, Stack, Tags
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from llmtrain.core.jumpstart import MANIFEST_KEY, content_bucket, gated_content_bucket
from llmtrain.core.platform import MAX_KEEP_ALIVE_SECONDS, team_job_log_streams
from llmtrain.core.preparation import CPU_INSTANCE_TYPES, preparation_instance_types
from training_constructs._props import (
    checked_props,
    freeze_sequences,
    is_unresolved,
    is_whole_number,
    require,
)
from training_constructs.images import DLC_REGISTRY_ACCOUNTS, training_image_repositories
from training_constructs.nag import acknowledge_wildcards, checked_reasons
from training_constructs.resources import NetworkResources, StorageResources, check_network, check_storage
from training_constructs.teams import TeamSpec

_NAME = "TrainingAccess"
TRAINING_LOG_GROUP = "/aws/sagemaker/TrainingJobs"
TRAINING_METRIC_NAMESPACE = "/aws/sagemaker/TrainingJobs"
# Where JobTemplate uploads every template version's code in the code bucket (llmtrain.core.render.code_key).
TEMPLATE_CODE_PREFIX = "templates/"
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
    "sagemaker:ListHyperParameterTuningJobs": "List calls have no resource; descriptions are scoped to the "
    "prefix",
    "sagemaker:ListProcessingJobs": "List calls have no resource; descriptions are scoped to the prefix",
}
_DESCRIBE_VPC_ACTIONS = [
    action for action in ACTIONS_WITHOUT_RESOURCE_LEVEL_PERMISSIONS if action.startswith("ec2:Describe")
]


def warm_pool_cap_statement(max_keep_alive_seconds: int) -> iam.PolicyStatement:
    """A Deny of training jobs whose warm pool would outlive ``max_keep_alive_seconds``.

    SageMaker evaluates ``sagemaker:KeepAlivePeriod`` (the request's
    ``ResourceConfig.KeepAlivePeriodInSeconds``) on CreateTrainingJob and UpdateTrainingJob; a
    request without a warm pool has no such key and is not affected. Attach it to any principal
    that may call SageMaker directly. The number is written as a string, as IAM's grammar does.
    """
    _check_cap("max_keep_alive_seconds", max_keep_alive_seconds)
    return iam.PolicyStatement(
        sid="CapWarmPoolKeepAlive",
        effect=iam.Effect.DENY,
        actions=["sagemaker:CreateTrainingJob", "sagemaker:UpdateTrainingJob"],
        resources=["*"],
        conditions={"NumericGreaterThan": {"sagemaker:KeepAlivePeriod": str(max_keep_alive_seconds)}},
    )


def guardrail_statements(
    *,
    max_keep_alive_seconds: int,
    instance_types: Sequence[str],
    subnet_ids: Sequence[str],
    security_group_ids: Sequence[str],
    key_arn: str,
    inter_container_traffic_encryption: bool,
    processing_instance_types: Sequence[str] | None = None,
) -> list[iam.PolicyStatement]:
    """Denies of any training, tuning or processing job the environment would not create: the limits
    that the teams' job-creating roles carry as conditions, for anyone who calls SageMaker directly.

    Each Deny names one limit (Sid): the warm-pool cap; the environment's instance types (for
    processing jobs, the data preparations', ``processing_instance_types``: default every CPU type the
    platform knows); a job outside the training VPC, its subnets or its security group; an output or
    volume key other than the platform's; and, where the environment asks for it, a job without
    inter-container traffic encryption.
    """
    # A tuning job's trials are training jobs: SageMaker evaluates the same keys on its creation, and on a
    # processing job's (a data preparation's) but the warm pool's.
    training = ["sagemaker:CreateTrainingJob", "sagemaker:CreateHyperParameterTuningJob"]
    create = [*training, "sagemaker:CreateProcessingJob"]

    def deny(sid: str, conditions: dict, actions: Sequence[str] = create) -> iam.PolicyStatement:
        return iam.PolicyStatement(
            sid=sid, effect=iam.Effect.DENY, actions=list(actions), resources=["*"], conditions=conditions
        )

    statements = [
        warm_pool_cap_statement(max_keep_alive_seconds),
        deny("OnlyPlatformInstanceTypes",
             {"ForAnyValue:StringNotEquals": {"sagemaker:InstanceTypes": list(instance_types)}}, training),
        deny("OnlyPreparationInstanceTypes",
             {"ForAnyValue:StringNotEquals": {"sagemaker:InstanceTypes": list(
                 CPU_INSTANCE_TYPES if processing_instance_types is None else processing_instance_types)}},
             ["sagemaker:CreateProcessingJob"]),
        deny("OnlyInTheTrainingVpc", {"Null": {"sagemaker:VpcSubnets": "true"}}),
        deny(
            "OnlyTrainingSubnets",
            {"ForAnyValue:StringNotEquals": {"sagemaker:VpcSubnets": list(subnet_ids)}},
        ),
        deny("OnlyTrainingSecurityGroups",
             {"ForAnyValue:StringNotEquals": {"sagemaker:VpcSecurityGroupIds": list(security_group_ids)}}),
        deny("OnlyPlatformOutputKey", {"StringNotEquals": {"sagemaker:OutputKmsKey": key_arn}}),
        # Only a volume key that is given and not the platform's: SageMaker refuses any volume key for
        # instance types with local NVMe storage (g5, p4d, p4de, p5 ...), whose requests carry none.
        # (StringNotEqualsIfExists, and StringNotEquals alone, also match a request without the key.)
        deny(
            "OnlyPlatformVolumeKey",
            {
                "StringNotEquals": {"sagemaker:VolumeKmsKey": key_arn},
                "Null": {"sagemaker:VolumeKmsKey": "false"},
            },
        ),
    ]
    if inter_container_traffic_encryption:
        statements.append(
            deny("OnlyEncryptedInterContainerTraffic",
                 {"BoolIfExists": {"sagemaker:InterContainerTrafficEncryption": "false"}})
        )
    return statements


@dataclass(frozen=True, kw_only=True)
class TrainingAccessProps:
    """What ``TrainingAccess`` builds; validated when built (``PropsError`` names the field).

    ``storage``: the platform's data key and buckets (``TrainingStorage`` or ``ExistingStorage``).
    ``network``: where jobs run (``TrainingNetwork`` or ``ExistingNetwork``): its subnets and training
      security group.
    ``teams``: one ``TeamSpec`` per team (unique names and job-name prefixes).
    ``max_keep_alive_seconds``: the environment's warm-pool cap (0..21600); no team's may exceed it.
    ``inter_container_traffic_encryption``: the guard rail denies jobs without it.
    ``image_repository_arns``: the ECR repositories the execution roles may pull from (default: the
      region's Deep Learning Container repositories).
    """

    storage: StorageResources
    network: NetworkResources
    teams: Sequence[TeamSpec]
    max_keep_alive_seconds: int
    inter_container_traffic_encryption: bool = False
    image_repository_arns: Sequence[str] | None = None

    def __post_init__(self) -> None:
        freeze_sequences(_NAME, self)
        check_storage(_NAME, self.storage)
        check_network(_NAME, self.network)
        _check_cap("max_keep_alive_seconds", self.max_keep_alive_seconds)
        _check_teams(self.teams, self.max_keep_alive_seconds)
        _check_repository_arns(self.image_repository_arns)


class TrainingAccess(Construct):
    """Who may do what, per team: an execution role and an engineers' policy for each ``TeamSpec``,
    and the environment's guard rail for anyone who calls SageMaker directly.

    Each team's execution role (trusted by ``sagemaker.amazonaws.com`` for this account only) reads
    and writes only its team's prefix ``teams/<team>/`` in the datasets, checkpoints and artifacts
    buckets, and reads the templates' code; it uses the data key, pulls the Deep Learning Container
    images, writes the training job logs and metrics, and manages the network interfaces VPC mode
    needs, in the network's subnets with its security group. Each team's engineers' policy starts and
    follows that team's launcher runs (``TeamAccess.allow_launcher``), reads and stops its jobs, reads
    their logs, and reads and uploads its data.

    ``guardrail_policy`` denies every training job the environment would not create (warm pool over
    ``max_keep_alive_seconds``, other instance types than the teams', outside the VPC, other keys,
    unencrypted inter-container traffic when ``inter_container_traffic_encryption``); it is attached
    to every execution role and its statements are in every engineers' policy. Attach it to any
    other role or permission set that may call SageMaker.

    Attributes: ``teams`` (``TeamAccess`` by team name), ``guardrail_policy``,
    ``max_keep_alive_seconds``, ``props``.
    """

    def __init__(self, scope: Construct, construct_id: str, props: TrainingAccessProps) -> None:
        super().__init__(scope, construct_id)
        self.props = checked_props(_NAME, props, TrainingAccessProps)
        self.stack = Stack.of(self)
        self.max_keep_alive_seconds = props.max_keep_alive_seconds
        network = props.network
        limits = dict(
            max_keep_alive_seconds=props.max_keep_alive_seconds,
            instance_types=sorted({t for team in props.teams for t in team.instance_types}),
            processing_instance_types=sorted(
                {t for team in props.teams for t in preparation_instance_types(team.instance_types)}),
            subnet_ids=[subnet.subnet_id for subnet in network.subnets],
            security_group_ids=[network.security_group.security_group_id],
            key_arn=props.storage.data_key.key_arn,
            inter_container_traffic_encryption=props.inter_container_traffic_encryption,
        )
        self.guardrail_policy = iam.ManagedPolicy(
            self,
            "GuardrailPolicy",
            description="Denies SageMaker training, tuning and processing jobs outside the platform's limits "
            "(warm pools, instance types, VPC, keys, inter-container encryption)",
            statements=guardrail_statements(**limits),
        )
        image_repositories = tuple(props.image_repository_arns or self._region_image_repositories())
        self.teams = {
            team.name: TeamAccess(
                self,
                f"Team{team.construct_suffix}",
                TeamAccessProps(
                    team=team,
                    storage=props.storage,
                    network=network,
                    image_repository_arns=image_repositories,
                    guardrail_policy=self.guardrail_policy,
                    guardrail_statements=tuple(guardrail_statements(**limits)),
                ),
            )
            for team in props.teams
        }

    def _region_image_repositories(self) -> list[str]:
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


@dataclass(frozen=True, kw_only=True)
class TeamAccessProps:
    """What one team's ``TeamAccess`` is made of (``TrainingAccess`` builds it, one per team)."""

    team: TeamSpec
    storage: StorageResources
    network: NetworkResources
    image_repository_arns: Sequence[str]
    guardrail_policy: iam.IManagedPolicy
    guardrail_statements: Sequence[iam.PolicyStatement]

    def __post_init__(self) -> None:
        freeze_sequences("TeamAccess", self)
        require(isinstance(self.team, TeamSpec), "TeamAccess", "team",
                f"must be a TeamSpec, got {type(self.team).__name__}")
        check_storage("TeamAccess", self.storage)
        check_network("TeamAccess", self.network)


class TeamAccess(Construct):
    """One team's execution role and engineers' policy (made by ``TrainingAccess``).

    Attributes: ``team`` (its ``TeamSpec``), ``execution_role``, ``execution_policy`` (its inline
    policy), ``engineer_policy``, ``props``. The environment's optional features add their statements
    with ``add_execution_statements`` and ``add_engineer_statements`` (``training_constructs.packages``,
    ``.mlflow``, ``.debugging``: ``grant_*``).
    """

    def __init__(self, scope: Construct, construct_id: str, props: TeamAccessProps) -> None:
        super().__init__(scope, construct_id)
        self.props = checked_props("TeamAccess", props, TeamAccessProps)
        self.stack = Stack.of(self)
        team = self.team = props.team
        self._storage = props.storage
        self._launchers = 0
        self.execution_role = iam.Role(
            self,
            "ExecutionRole",
            assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com").with_conditions(
                {"StringEquals": {"aws:SourceAccount": self.stack.account}}
            ),
            description=f"SageMaker training jobs of team {team.name} of the LLM training platform",
            managed_policies=[props.guardrail_policy],
        )
        # Why each statement names a wildcard (cdk-nag AwsSolutions-IAM5), by Sid: read when cdk-nag
        # runs, so statements added later (add_execution_statements, add_engineer_statements) count.
        self._execution_reasons: dict[str, str] = {}
        self._engineer_reasons: dict[str, str] = {}
        self.execution_policy = iam.Policy(
            self,
            "ExecutionPolicy",
            roles=[self.execution_role],
            statements=[
                *self._storage_statements(),
                *_key_statements(props.storage.data_key),
                *_image_statements(list(props.image_repository_arns)),
                *self._observability_statements(),
                *self._network_statements(),
                *self._jumpstart_statements(),
            ],
        )
        self._acknowledge_execution_wildcards()
        acknowledge_wildcards(self.execution_policy, self._execution_reasons)
        self.engineer_policy = iam.ManagedPolicy(
            self,
            "EngineerPolicy",
            description=f"ML engineers of team {team.name}: start and follow the team's launcher runs, read "
            "and stop its training jobs, read their logs, read and upload its data",
            statements=[*self._engineer_statements(), *props.guardrail_statements],
        )
        self._acknowledge_engineer_wildcards()
        acknowledge_wildcards(self.engineer_policy, self._engineer_reasons)
        for construct in (self.execution_role, self.engineer_policy):
            for key, value in team.tags.items():
                Tags.of(construct).add(key, value)

    # -- what other constructs call -------------------------------------------------------------

    def allow_launcher(self, state_machine_arn: str) -> None:
        """Let the team's engineers start, list, describe and stop executions of its launcher."""
        self._launchers += 1
        follow_sid = f"FollowTeamRuns{self._launchers}"
        executions = self.stack.format_arn(
            service="states",
            resource="execution",
            arn_format=ArnFormat.COLON_RESOURCE_NAME,
            resource_name=f"{Fn.select(6, Fn.split(':', state_machine_arn))}:*",
        )
        self.engineer_policy.add_statements(
            iam.PolicyStatement(
                sid=f"StartTeamRuns{self._launchers}",
                actions=["states:StartExecution", "states:ListExecutions"],
                resources=[state_machine_arn],
            ),
            iam.PolicyStatement(
                sid=follow_sid,
                actions=["states:DescribeExecution", "states:StopExecution", "states:GetExecutionHistory"],
                resources=[executions],
            ),
        )
        self._engineer_reasons[follow_sid] = (
            f"Engineers of team {self.team.name} follow every run (execution) of the team's launcher; "
            "execution names are chosen per run"
        )

    def allow_preparations(self, state_machine_arn: str) -> None:
        """Let the team's engineers start, list, describe and stop its data preparations (the executions
        of its ``PreparationLauncher``'s state machine) and read its processing jobs
        (`llmtrain data prepare --cloud`, `llmtrain data status`)."""
        executions = self.stack.format_arn(
            service="states",
            resource="execution",
            arn_format=ArnFormat.COLON_RESOURCE_NAME,
            resource_name=f"{Fn.select(6, Fn.split(':', state_machine_arn))}:*",
        )
        self.engineer_policy.add_statements(
            iam.PolicyStatement(sid="StartTeamPreparations",
                                actions=["states:StartExecution", "states:ListExecutions"],
                                resources=[state_machine_arn]),
            iam.PolicyStatement(sid="FollowTeamPreparations",
                                actions=["states:DescribeExecution", "states:StopExecution",
                                         "states:GetExecutionHistory"],
                                resources=[executions]),
            iam.PolicyStatement(
                sid="FollowTeamProcessingJobs",
                actions=["sagemaker:DescribeProcessingJob"],
                resources=[self.stack.format_arn(service="sagemaker", resource="processing-job",
                                                 resource_name=f"{self.team.job_name_prefix}-*")],
            ),
            iam.PolicyStatement(
                sid="ListProcessingJobs", actions=["sagemaker:ListProcessingJobs"], resources=["*"]
            ),
        )
        self._engineer_reasons.update({
            "FollowTeamPreparations": f"Engineers of team {self.team.name} follow every preparation "
            "(execution) of the team's preparation state machine; execution names are chosen per preparation",
            "FollowTeamProcessingJobs": f"Engineers follow the processing jobs of team {self.team.name}: the "
            "names share the team's prefix and differ per preparation",
            "ListProcessingJobs": ACTIONS_WITHOUT_RESOURCE_LEVEL_PERMISSIONS["sagemaker:ListProcessingJobs"],
        })

    def add_execution_statements(
        self, statements: Sequence[iam.PolicyStatement], wildcard_reasons: Mapping[str, str]
    ) -> None:
        """Add what the team's jobs need for a feature of the environment (the package mirror, MLflow,
        remote debugging) to its execution role's policy; ``wildcard_reasons`` says, by Sid, why a
        statement names a wildcard (cdk-nag AwsSolutions-IAM5)."""
        self._execution_reasons.update(checked_reasons(wildcard_reasons))
        self.execution_policy.add_statements(*statements)

    def add_engineer_statements(
        self, statements: Sequence[iam.PolicyStatement], wildcard_reasons: Mapping[str, str]
    ) -> None:
        """Add to the team's engineers' policy (training plans, remote debugging sessions); as
        ``add_execution_statements``."""
        self._engineer_reasons.update(checked_reasons(wildcard_reasons))
        self.engineer_policy.add_statements(*statements)

    def grant_pass_execution_role(self, grantee: iam.IGrantable) -> iam.Grant:
        """Let ``grantee`` (the team's launcher) hand the execution role to SageMaker, and to nothing else."""
        return iam.Grant.add_to_principal(
            grantee=grantee,
            actions=["iam:PassRole"],
            resource_arns=[self.execution_role.role_arn],
            conditions={"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}},
        )

    def training_job_arn(self, name_pattern: str = "-*") -> str:
        """ARN of the team's training jobs: those whose names start with its prefix and a hyphen."""
        return self.stack.format_arn(
            service="sagemaker",
            resource="training-job",
            resource_name=f"{self.team.job_name_prefix}{name_pattern}",
        )

    # -- the execution role ---------------------------------------------------------------------

    def _team_objects(self, *buckets: s3.IBucket) -> list[str]:
        return [bucket.arn_for_objects(f"{self.team.data_prefix}*") for bucket in buckets]

    def _list_team_prefix(self, sid: str, *buckets: s3.IBucket) -> iam.PolicyStatement:
        return iam.PolicyStatement(
            sid=sid,
            actions=["s3:ListBucket"],
            resources=[bucket.bucket_arn for bucket in buckets],
            conditions={"StringLike": {"s3:prefix": [f"{self.team.data_prefix}*"]}},
        )

    def _storage_statements(self) -> list[iam.PolicyStatement]:
        r = self._storage
        data = (r.datasets_bucket, r.checkpoints_bucket, r.artifacts_bucket)
        return [
            self._list_team_prefix("ListTeamData", *data),
            iam.PolicyStatement(
                sid="LocatePlatformBuckets",
                actions=["s3:GetBucketLocation"],
                resources=[b.bucket_arn for b in (*data, r.code_bucket)],
            ),
            iam.PolicyStatement(
                sid="ListTemplateCode",
                actions=["s3:ListBucket"],
                resources=[r.code_bucket.bucket_arn],
                conditions={"StringLike": {"s3:prefix": [f"{TEMPLATE_CODE_PREFIX}*"]}},
            ),
            # Artifacts are read too: a fine-tuning job starts from an earlier run's model.
            iam.PolicyStatement(
                sid="ReadTeamData",
                actions=["s3:GetObject"],
                resources=[
                    *self._team_objects(*data),
                    r.code_bucket.arn_for_objects(f"{TEMPLATE_CODE_PREFIX}*"),
                ],
            ),
            iam.PolicyStatement(
                sid="WriteTeamCheckpoints",
                actions=["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
                resources=self._team_objects(r.checkpoints_bucket),
            ),
            iam.PolicyStatement(
                sid="WriteTeamArtifacts",
                actions=["s3:PutObject", "s3:AbortMultipartUpload"],
                resources=self._team_objects(r.artifacts_bucket),
            ),
        ]

    def _team_log_streams(self, log_group: str) -> list[str]:
        patterns = team_job_log_streams(self.team.job_name_prefix)
        return [f"{log_group}:log-stream:{pattern}" for pattern in patterns]

    def _observability_statements(self) -> list[iam.PolicyStatement]:
        log_group = _log_group_arn(self.stack)
        return [
            iam.PolicyStatement(
                sid="WriteTrainingLogs",
                actions=[
                    "logs:CreateLogGroup",
                    "logs:CreateLogStream",
                    "logs:PutLogEvents",
                    "logs:DescribeLogStreams",
                ],
                # SageMaker writes a job's log with its execution role: a queued job's too (Batch
                # names it; llmtrain.core.platform.team_job_log_streams).
                resources=[log_group, *self._team_log_streams(log_group)],
            ),
            iam.PolicyStatement(
                sid="PublishTrainingMetrics",
                actions=["cloudwatch:PutMetricData"],
                resources=["*"],
                conditions={"StringEquals": {"cloudwatch:namespace": TRAINING_METRIC_NAMESPACE}},
            ),
        ]

    def _network_statements(self) -> list[iam.PolicyStatement]:
        def ec2_arns(kind: str, ids: list[str]) -> list[str]:
            return [
                self.stack.format_arn(service="ec2", resource=kind, resource_name=i) for i in ids or ["*"]
            ]

        interfaces = ec2_arns("network-interface", [])
        network = self.props.network
        return [
            iam.PolicyStatement(
                sid="CreateJobNetworkInterfaces",
                actions=["ec2:CreateNetworkInterface"],
                resources=[
                    *interfaces,
                    *ec2_arns("subnet", [s.subnet_id for s in network.subnets]),
                    *ec2_arns("security-group", [network.security_group.security_group_id]),
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

    def _jumpstart_statements(self) -> list[iam.PolicyStatement]:
        """A run may start from a SageMaker JumpStart base model (`base_model=<model id>`): its weights
        are read from JumpStart's buckets in the region (the gated one only through a channel that
        accepts the model's EULA)."""
        region = self.stack.region
        buckets = [f"arn:{Aws.PARTITION}:s3:::{name}" for name in (content_bucket(region),
                                                                    gated_content_bucket(region))]
        return [
            iam.PolicyStatement(sid="ListJumpStartModels", actions=["s3:ListBucket"], resources=buckets),
            iam.PolicyStatement(sid="ReadJumpStartModels", actions=["s3:GetObject"],
                                resources=[f"{bucket}/*" for bucket in buckets]),
        ]

    def _acknowledge_execution_wildcards(self) -> None:
        team = self.team.name
        self._execution_reasons.update(
            {
                "ReadTeamData": f"Training reads objects under team {team}'s own prefix of the platform's "
                "buckets, and the templates' code (named per template and version)",
                "WriteTeamCheckpoints": f"Checkpoints are written under team {team}'s own prefix of the "
                "checkpoints bucket, per run",
                "WriteTeamArtifacts": f"Model artifacts are written under team {team}'s own prefix of the "
                "artifacts bucket, per run",
                "EcrLogin": ACTIONS_WITHOUT_RESOURCE_LEVEL_PERMISSIONS["ecr:GetAuthorizationToken"],
                "PublishTrainingMetrics": ACTIONS_WITHOUT_RESOURCE_LEVEL_PERMISSIONS[
                    "cloudwatch:PutMetricData"
                ],
                "DescribeJobNetwork": ACTIONS_WITHOUT_RESOURCE_LEVEL_PERMISSIONS["ec2:DescribeSubnets"],
                "WriteTrainingLogs": "SageMaker writes one log stream per job and instance, named at "
                f"run time after the job, under team {team}'s job-name prefix",
                "CreateJobNetworkInterfaces": "SageMaker creates a network interface per instance, whose id "
                "is not known in advance (subnets and groups are exact)",
                "ManageJobNetworkInterfaces": "SageMaker manages the network interfaces it created per "
                "instance, whose ids are not known in advance",
                "ReadJumpStartModels": "A run's JumpStart base model is read from JumpStart's public (and, "
                "with its EULA accepted, gated) buckets of the region; the model is chosen per run",
            },
        )

    # -- the engineers' policy ------------------------------------------------------------------

    def _engineer_statements(self) -> list[iam.PolicyStatement]:
        log_group = _log_group_arn(self.stack)
        r = self._storage
        data = (r.datasets_bucket, r.checkpoints_bucket, r.artifacts_bucket)
        return [
            iam.PolicyStatement(
                sid="FollowTeamTrainingJobs",
                actions=["sagemaker:DescribeTrainingJob", "sagemaker:ListTags", "sagemaker:StopTrainingJob"],
                resources=[self.training_job_arn()],
            ),
            iam.PolicyStatement(
                sid="ListTrainingJobs", actions=["sagemaker:ListTrainingJobs"], resources=["*"]
            ),
            # `llmtrain tune` and `llmtrain status` of a tune: the team's tuning jobs and their trials.
            iam.PolicyStatement(
                sid="FollowTeamTuningJobs",
                actions=["sagemaker:DescribeHyperParameterTuningJob",
                         "sagemaker:ListTrainingJobsForHyperParameterTuningJob"],
                resources=[self.stack.format_arn(service="sagemaker", resource="hyper-parameter-tuning-job",
                                                 resource_name=f"{self.team.job_name_prefix}-*")],
            ),
            iam.PolicyStatement(
                sid="ListTuningJobs", actions=["sagemaker:ListHyperParameterTuningJobs"], resources=["*"]
            ),
            # `base_model=<JumpStart model id>` and `llmtrain models ls`: JumpStart's catalogue.
            iam.PolicyStatement(
                sid="ReadJumpStartCatalogue", actions=["s3:GetObject"],
                resources=[f"arn:{Aws.PARTITION}:s3:::{content_bucket(self.stack.region)}/{MANIFEST_KEY}",
                           f"arn:{Aws.PARTITION}:s3:::{content_bucket(self.stack.region)}/*specs*.json"],
            ),
            # SageMaker writes every job's log into one group; FilterLogEvents is authorized on the
            # whole group, GetLogEvents per stream: the team reads its own jobs' streams only, and
            # lists the streams' names (job names, which ListTrainingJobs shows anyway) to find them.
            iam.PolicyStatement(
                sid="ListTrainingLogStreams", actions=["logs:DescribeLogStreams"], resources=[log_group]
            ),
            iam.PolicyStatement(
                sid="ReadTeamTrainingLogs",
                actions=["logs:GetLogEvents"],
                resources=self._team_log_streams(log_group),
            ),
            self._list_team_prefix("ListTeamData", *data),
            iam.PolicyStatement(
                sid="ReadTeamData", actions=["s3:GetObject"], resources=self._team_objects(*data)
            ),
            # `llmtrain data upload`: a team brings its datasets; nothing an engineer can delete.
            iam.PolicyStatement(
                sid="UploadTeamDatasets",
                actions=["s3:PutObject", "s3:AbortMultipartUpload"],
                resources=self._team_objects(r.datasets_bucket),
            ),
            iam.PolicyStatement(
                sid="UseKeyThroughS3",
                actions=["kms:Decrypt", "kms:GenerateDataKey"],
                resources=[r.data_key.key_arn],
                conditions={"StringEquals": {"kms:ViaService": f"s3.{self.stack.region}.amazonaws.com"}},
            ),
        ]

    def _acknowledge_engineer_wildcards(self) -> None:
        team = self.team.name
        self._engineer_reasons.update(
            {
                "ListTrainingJobs": ACTIONS_WITHOUT_RESOURCE_LEVEL_PERMISSIONS["sagemaker:ListTrainingJobs"],
                "ListTuningJobs": ACTIONS_WITHOUT_RESOURCE_LEVEL_PERMISSIONS[
                    "sagemaker:ListHyperParameterTuningJobs"],
                "FollowTeamTuningJobs": f"Engineers follow the tuning jobs of team {team}: the names share "
                "the team's prefix and differ per tune",
                "ReadJumpStartCatalogue": "JumpStart's model specs, one JSON file per model version, under "
                "its public content bucket's folders",
                "FollowTeamTrainingJobs": f"Engineers follow the training jobs of team {team}: the names "
                "share the team's prefix and differ per run",
                "ReadTeamTrainingLogs": f"Engineers read the logs of team {team}'s jobs: the streams share "
                "the team's job-name prefix and differ per run",
                "ReadTeamData": f"Engineers read team {team}'s data, models and checkpoints, under its own "
                "prefix of the platform's buckets",
                "UploadTeamDatasets": f"Engineers upload datasets under team {team}'s own prefix of the "
                "datasets bucket, one key per file",
            },
        )


def _key_statements(key: kms.IKey) -> list[iam.PolicyStatement]:
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
            conditions={"Bool": {"kms:GrantIsForAWSResource": "true"}},
        ),
    ]


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


def _log_group_arn(stack: Stack) -> str:
    return stack.format_arn(
        service="logs",
        resource="log-group",
        resource_name=TRAINING_LOG_GROUP,
        arn_format=ArnFormat.COLON_RESOURCE_NAME,
    )


def _check_teams(teams: Sequence[TeamSpec], cap: int) -> None:
    require(len(teams) > 0, _NAME, "teams", "must list at least one TeamSpec")
    others = [type(team).__name__ for team in teams if not isinstance(team, TeamSpec)]
    require(not others, _NAME, "teams", f"must hold TeamSpecs only, got {others}")
    names = [team.name for team in teams]
    require(len(set(names)) == len(names), _NAME, "teams", f"names a team twice: {names}")
    prefixes = [team.job_name_prefix for team in teams]
    require(
        len(set(prefixes)) == len(prefixes), _NAME, "teams", f"two teams share a job-name prefix: {prefixes}"
    )
    for team in teams:
        require(
            team.max_keep_alive_seconds <= cap,
            _NAME,
            "teams",
            f"team {team.name!r} caps warm pools at {team.max_keep_alive_seconds} s, above the environment's "
            f"max_keep_alive_seconds ({cap})",
        )


def _check_repository_arns(arns: Sequence[str] | None) -> None:
    if arns is None:
        return
    require(len(arns) > 0, _NAME, "image_repository_arns", "must list at least one repository ARN")
    bad = [arn for arn in arns if not is_unresolved(arn) and not _REPOSITORY_ARN.fullmatch(arn)]
    require(
        not bad,
        _NAME,
        "image_repository_arns",
        f"{bad} are not ECR repository ARNs (arn:aws:ecr:<region>:<account>:repository/<name>)",
    )


def _check_cap(field: str, seconds: int) -> None:
    require(
        is_whole_number(seconds) and 0 <= seconds <= MAX_KEEP_ALIVE_SECONDS,
        _NAME,
        field,
        f"must be a whole number of seconds from 0 to {MAX_KEEP_ALIVE_SECONDS} "
        f"(SageMaker's limit for KeepAlivePeriodInSeconds), got {seconds!r}",
    )


__all__ = [
    "ACTIONS_WITHOUT_RESOURCE_LEVEL_PERMISSIONS",
    "TEMPLATE_CODE_PREFIX",
    "TeamAccess",
    "TeamAccessProps",
    "TrainingAccess",
    "TrainingAccessProps",
    "guardrail_statements",
    "warm_pool_cap_statement",
]
