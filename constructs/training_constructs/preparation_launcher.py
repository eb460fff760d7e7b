"""`PreparationLauncher`: a team's cloud data preparations (`llmtrain data prepare --cloud`), started
and followed like its runs, beside its `TrainingLauncher`.

An execution's input is `llmtrain.core.preparation.PreparationInput` (`{"template": "name@version",
"preparation": {...}}`, built by the CLI). The state machine:

    ReadInput ─> Validate ─> Rejected? ─> Rerun? ─> [RecordPreviousSizes] ─> CreateShardsJob .sync
                                │ yes                                            │
                                v                                                v
    Fail <─ NotifyFailure <─────┴─── DescribeFailure <── (a job failed) ── RecordSizes
                                                                                 │
    Succeed <─ NotifySuccess <─ Complete (the marker) <─ CreateMergeJob .sync <──┘

- Validate (the function, step `validate`: `llmtrain.lifecycle.preparation_steps`) checks the input
  again as the CLI did (the team's datasets prefix for the input and the tokenizer, CPU instance
  types of the team, its instance cap, the options), resolves the template in the launcher's
  registry, lists the input itself (the volume and the estimate come from that listing, which
  the team's budget then caps), finds a rerun from the dataset's prefix, refuses a preparation
  in progress, and renders both CreateProcessingJob requests: bad input ends here, before any job.
- The jobs are `CustomState`s on `sagemaker:createProcessingJob.sync` passing every field of the
  rendered request but the role, which the definition fixes (the processing role: the only role the
  state machine may pass); stopping the execution stops the job.
- RecordSizes writes `sizes.json` (what the merge and a rerun check the units' shards against);
  Complete removes the files the dataset does not use (with `--dedup`, the shards the merge
  replaced and `.dedup/`) and writes the dataset's marker last: a failed or stopped job leaves no
  marker, so nothing half-written is listed as a dataset, and the same command resumes it (its
  shards job redoes only the units whose shards are missing).
- Both outcomes publish a summary to the launcher's topic.

IAM: the state machine's role creates processing jobs only under the team's job-name prefix, with
SageMaker's condition keys (the team's CPU instance types, the VPC's subnets and security group, the
platform key for volumes and outputs, inter-container traffic encryption where the environment asks,
the team's and environment's tags), and passes only the processing role, to SageMaker only. The
processing role reads the team's datasets prefix and writes it (training jobs never write datasets:
their execution role stays read-only there); the function reads and lists that prefix, writes only
`sizes.json` and the marker in it, and deletes only shard files and `.dedup/` there (those the
finished dataset does not use: the shards a deduplicating merge replaced, the signatures).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from aws_cdk import Aws, Duration, RemovalPolicy, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk import aws_stepfunctions_tasks as tasks
from constructs import Construct

from llmtrain.core.function_settings import PreparationSettings
from llmtrain.core.preparation import (
    DATASET_MANIFEST,
    DEDUP_FOLDER,
    PROCESSING_REQUEST_FIELDS,
    SHARD_PREFIX,
    SIZES_FILE,
    STATE_FOLDER,
    preparation_instance_types,
)
from llmtrain.core.render import TAG_PREFIX
from training_constructs._functions import logged_function
from training_constructs._props import checked_props, freeze_sequences, require
from training_constructs.lambda_code import LAMBDA_ARCHITECTURE, LAMBDA_RUNTIME, lambda_code
from training_constructs.launcher import VENDORED_PACKAGES, TrainingLauncher, _registry_files
from training_constructs.nag import acknowledge_wildcards
from training_constructs.processing_role import list_team_datasets, processing_role, team_datasets
from training_constructs.teams import job_creation_conditions

_NAME = "PreparationLauncher"
_STATE_MACHINE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,80}$")
# The Sid of the statement that lets a team's preparation state machine create its processing jobs.
CREATE_PROCESSING_JOBS_SID = "CreateTeamProcessingJobs"
# Step Functions' .sync integration with SageMaker Processing listens through this managed rule.
SYNC_PROCESSING_EVENTS_RULE = "StepFunctionsGetEventsForSageMakerProcessingJobsRule"


@dataclass(frozen=True, kw_only=True)
class PreparationLauncherProps:
    """What one team's preparations are made of; validated when built (``PropsError`` names the field).

    ``launcher``: the team's ``TrainingLauncher``, beside which preparations run: its team (job-name
      prefix, instance types, instance cap, budget), its platform context (datasets prefix, key,
      subnets, security group), its registry (the template versions whose images run preparations),
      its topic and key (the summaries are published there; the logs are encrypted with it).
    ``guardrail_policy``: the environment's guard rail (``TrainingAccess.guardrail_policy``), attached
      to the processing role; None: none attached.
    ``image_repository_arns``: the ECR repositories the processing role may pull from (default: the
      region's Deep Learning Container repositories).
    ``existing_processing_role``: the role the processing jobs run as, instead of one created here; it
      must read and write the team's datasets prefix, use the data key and pull the images.
    ``state_machine_name``: a fixed name (so other stacks can build its ARN without a reference).
    ``log_retention``: how long the state machine's and the function's logs are kept.
    """

    launcher: TrainingLauncher
    guardrail_policy: iam.IManagedPolicy | None = None
    image_repository_arns: Sequence[str] | None = None
    existing_processing_role: iam.IRole | None = None
    state_machine_name: str | None = None
    log_retention: logs.RetentionDays = logs.RetentionDays.ONE_YEAR

    def __post_init__(self) -> None:
        freeze_sequences(_NAME, self)
        require(
            isinstance(self.launcher, TrainingLauncher),
            _NAME,
            "launcher",
            f"must be the team's TrainingLauncher, got {type(self.launcher).__name__}",
        )
        name = self.state_machine_name
        require(
            name is None or bool(_STATE_MACHINE_NAME.fullmatch(name)),
            _NAME,
            "state_machine_name",
            f"{name!r} must be 1-80 letters, digits, '-' or '_'",
        )
        arns = self.image_repository_arns
        require(
            arns is None or len(arns) > 0,
            _NAME,
            "image_repository_arns",
            "must list at least one repository ARN, or be None for the region's",
        )


class PreparationLauncher(Construct):
    """A team's preparation state machine, its function and its processing role (module docstring).

    Attributes: ``state_machine``, ``state_machine_role``, ``function``, ``function_log_group``,
    ``log_group`` (the state machine's), ``processing_role`` (and ``processing_policy``, None for an
    existing role: ``training_constructs.processing_role``), ``settings`` (the function's
    ``PreparationSettings``), ``instance_types`` (what the team's preparations may run on),
    ``shards_state``, ``merge_state``, ``team``, ``props``.
    """

    def __init__(self, scope: Construct, construct_id: str, props: PreparationLauncherProps) -> None:
        super().__init__(scope, construct_id)
        self.props = checked_props(_NAME, props, PreparationLauncherProps)
        self.stack = Stack.of(self)
        launcher = self.launcher = props.launcher
        self.team = launcher.team
        self._storage, self._network = launcher.props.storage, launcher.props.network
        self.instance_types = preparation_instance_types(self.team.instance_types)
        self._log_retention = props.log_retention
        if props.existing_processing_role is not None:
            self.processing_role, self.processing_policy = props.existing_processing_role, None
        else:
            self.processing_role, self.processing_policy = processing_role(
                self,
                construct=_NAME,
                team=self.team,
                storage=self._storage,
                network=self._network,
                guardrail_policy=props.guardrail_policy,
                image_repository_arns=props.image_repository_arns,
            )
        self.settings = PreparationSettings(
            platform_context=launcher.platform_context, processing_role_arn=self.processing_role.role_arn
        )
        self._create_function()
        self._create_state_machine(props.state_machine_name)
        self._grant_processing()
        self._order_deployment()

    # -- the function -------------------------------------------------------------------------------

    def _create_function(self) -> None:
        # The launcher's code asset (the same files: CDK stages it once): llmtrain and the registry.
        code = lambda_code(
            extra_files=_registry_files(self.launcher.job_templates), vendored_packages=VENDORED_PACKAGES
        )
        self.function, self.function_log_group = logged_function(
            self,
            "StepsFunction",
            code=code,
            handler=PreparationSettings.HANDLER,
            description="Preparations: validates a cloud data preparation, records its sizes and marks the "
            "dataset complete",
            runtime=LAMBDA_RUNTIME,
            architecture=LAMBDA_ARCHITECTURE,
            memory_size=512,
            timeout=Duration.minutes(5),
            environment=self.settings.to_environment(json_text=self.stack.to_json_string),
            log_retention=self._log_retention,
            log_encryption_key=self.launcher.encryption_key,
        )
        datasets = self._storage.datasets_bucket
        prefix = self.team.data_prefix
        for statement in (
            list_team_datasets("ListTeamDatasets", self._storage, self.team),
            iam.PolicyStatement(
                sid="ReadTeamDatasets",
                actions=["s3:GetObject"],
                resources=[team_datasets(self._storage, self.team)],
            ),
            # Only the two files the steps write, in each dataset's folder of the team's prefix.
            iam.PolicyStatement(
                sid="WriteSizesAndMarkers",
                actions=["s3:PutObject"],
                resources=[
                    datasets.arn_for_objects(f"{prefix}*/{STATE_FOLDER}/{SIZES_FILE}"),
                    datasets.arn_for_objects(f"{prefix}*/{DATASET_MANIFEST}"),
                ],
            ),
            # Before the marker, what the dataset does not use (remove_unused_files): the shard files no
            # manifest lists (those a deduplicating merge replaced, upload temporaries) and `.dedup/`.
            iam.PolicyStatement(
                sid="RemoveUnusedFiles",
                actions=["s3:DeleteObject"],
                resources=[
                    datasets.arn_for_objects(f"{prefix}*/{SHARD_PREFIX}*"),
                    datasets.arn_for_objects(f"{prefix}*/{DEDUP_FOLDER}/*"),
                ],
            ),
            iam.PolicyStatement(
                sid="UseKeyThroughS3",
                actions=["kms:Decrypt", "kms:GenerateDataKey"],
                resources=[self._storage.data_key.key_arn],
                conditions={"StringEquals": {"kms:ViaService": f"s3.{self.stack.region}.amazonaws.com"}},
            ),
            iam.PolicyStatement(
                sid="ListProcessingJobs", actions=["sagemaker:ListProcessingJobs"], resources=["*"]
            ),
        ):
            self.function.add_to_role_policy(statement)
        acknowledge_wildcards(
            self.function.role,
            {
                "ReadTeamDatasets": "Validate lists and reads the preparation's files under team "
                f"{self.team.name}'s own prefix of the datasets bucket",
                "WriteSizesAndMarkers": "sizes.json and the dataset's marker, in each dataset's folder "
                f"(named per preparation) of team {self.team.name}'s prefix",
                "RemoveUnusedFiles": "the shard files and .dedup/ of each dataset's folder (named per "
                f"preparation) of team {self.team.name}'s prefix, removed before the marker when unused",
                "ListProcessingJobs": "List calls have no resource; Validate refuses a preparation whose "
                "jobs are still running",
            },
        )

    # -- the state machine --------------------------------------------------------------------------

    def _create_state_machine(self, name: str | None) -> None:
        self.log_group = logs.LogGroup(
            self,
            "StateMachineLogs",
            retention=self._log_retention,
            encryption_key=self.launcher.encryption_key,
            removal_policy=RemovalPolicy.RETAIN,
        )
        self.state_machine = sfn.StateMachine(
            self,
            "StateMachine",
            state_machine_name=name,
            definition_body=sfn.DefinitionBody.from_chainable(self._definition()),
            logs=sfn.LogOptions(
                destination=self.log_group, level=sfn.LogLevel.ALL, include_execution_data=True
            ),
            tracing_enabled=True,
            comment=f"LLM training platform ({self.launcher.props.environment_name}): prepare a dataset of "
            f"team {self.team.name} on SageMaker Processing",
        )
        self.state_machine_role = self.state_machine.role

    def _step(self, state_id: str, step: str, payload: dict, **kwargs) -> tasks.LambdaInvoke:
        return tasks.LambdaInvoke(
            self,
            state_id,
            lambda_function=self.function,
            payload=sfn.TaskInput.from_object({"step": step, **payload}),
            **kwargs,
        )

    def _definition(self) -> sfn.IChainable:
        fail = sfn.Fail(
            self,
            "PreparationFailed",
            error_path="$.summary.error",
            cause_path="$.summary.message",
            comment="The preparation failed: the summary's error and message say why and what to do",
        )
        notify_failure = self._notify("NotifyFailure", fail)
        succeed = sfn.Succeed(self, "PreparationCompleted", output_path="$.summary")
        notify_success = self._notify("NotifySuccess", succeed)
        preparation = {"preparation": sfn.JsonPath.object_at("$.preparation")}

        describe_task = self._step(
            "DescribeFailure",
            "failed",
            {
                **preparation,
                "stage": sfn.JsonPath.string_at("$.stage"),
                "failure": sfn.JsonPath.object_at("$.failure"),
            },
            output_path="$.Payload",
        )
        describe_failure = describe_task.next(notify_failure)
        launcher_error = sfn.Pass(
            self,
            "DescribeLauncherError",
            parameters={
                "summary": {
                    "status": "Failed",
                    "error": sfn.JsonPath.string_at("$.error.Error"),
                    "message": sfn.JsonPath.format(
                        "Execution {} failed in the preparation state machine: {}: {}",
                        sfn.JsonPath.string_at("$$.Execution.Name"),
                        sfn.JsonPath.string_at("$.error.Error"),
                        sfn.JsonPath.string_at("$.error.Cause"),
                    ),
                    "subject": "llmtrain: a dataset preparation failed (launcher error)",
                }
            },
        ).next(notify_failure)

        complete = self._step(
            "Complete",
            "complete",
            {
                **preparation,
                "shards_job": sfn.JsonPath.object_at("$.shards_job"),
                "merge_job": sfn.JsonPath.object_at("$.merge_job"),
            },
            output_path="$.Payload",
        )
        complete.next(notify_success)
        self.merge_state = self._job_state("CreateMergeJob", "$.merge", "$.merge_job")
        self.merge_state.add_catch(
            self._failed_stage("MergeJobFailed", "merge", describe_failure),
            errors=["States.ALL"],
            result_path="$.failure",
        )
        self.merge_state.next(complete)
        record_sizes = self._step("RecordSizes", "sizes", preparation, result_path=sfn.JsonPath.DISCARD)
        record_sizes.next(self.merge_state)
        self.shards_state = self._job_state("CreateShardsJob", "$.shards", "$.shards_job")
        self.shards_state.add_catch(
            self._failed_stage("ShardsJobFailed", "shard", describe_failure),
            errors=["States.ALL"],
            result_path="$.failure",
        )
        self.shards_state.next(record_sizes)
        previous_sizes = self._step(
            "RecordPreviousSizes", "sizes", preparation, result_path=sfn.JsonPath.DISCARD
        )
        previous_sizes.next(self.shards_state)

        validate = self._step(
            "Validate",
            "validate",
            {
                "input": sfn.JsonPath.object_at("$.input"),
                "execution_name": sfn.JsonPath.string_at("$$.Execution.Name"),
            },
            output_path="$.Payload",
        )
        for step in (validate, record_sizes, previous_sizes, complete, describe_task):
            step.add_catch(launcher_error, errors=["States.ALL"], result_path="$.error")
        read_input = sfn.Pass(
            self,
            "ReadInput",
            parameters={"input": sfn.JsonPath.entire_payload},
            comment="Any JSON value may start an execution: keep it under $.input",
        )
        rerun = (
            sfn.Choice(
                self,
                "Rerun",
                comment="A rerun's shards job checks the units written before against sizes.json",
            )
            .when(sfn.Condition.boolean_equals("$.rerun", True), previous_sizes)
            .otherwise(self.shards_state)
        )
        rejected = (
            sfn.Choice(self, "Rejected", comment="Bad input ends here, before any processing job exists")
            .when(sfn.Condition.is_present("$.summary"), notify_failure)
            .otherwise(rerun)
        )
        return read_input.next(validate).next(rejected)

    def _failed_stage(self, state_id: str, stage: str, then: sfn.State) -> sfn.Pass:
        return sfn.Pass(self, state_id, result=sfn.Result.from_string(stage), result_path="$.stage").next(
            then
        )

    def _job_state(self, state_id: str, request: str, result: str) -> sfn.CustomState:
        # Every field comes from the rendered request except RoleArn: the state machine only ever hands
        # SageMaker the processing role (the one role it may pass), whatever the function returns.
        parameters = {f"{name}.$": f"{request}.{name}" for name in PROCESSING_REQUEST_FIELDS}
        return sfn.CustomState(
            self,
            state_id,
            state_json={
                "Type": "Task",
                "Comment": "Start the processing job and wait until it ends; stopping the execution stops it",
                "Resource": f"arn:{Aws.PARTITION}:states:::sagemaker:createProcessingJob.sync",
                "Parameters": {"RoleArn": self.processing_role.role_arn, **parameters},
                "ResultPath": result,
            },
        )

    def _notify(self, state_id: str, then: sfn.State) -> tasks.SnsPublish:
        publish = tasks.SnsPublish(
            self,
            state_id,
            topic=self.launcher.topic,
            subject=sfn.JsonPath.string_at("$.summary.subject"),
            message=sfn.TaskInput.from_json_path_at("$.summary.message"),
            message_attributes={
                "status": tasks.MessageAttribute(value=sfn.JsonPath.string_at("$.summary.status"))
            },
            result_path=sfn.JsonPath.DISCARD,
        )
        # A notification that cannot be delivered must not change the preparation's outcome.
        publish.add_catch(then, errors=["States.ALL"], result_path="$.notification_error")
        return publish.next(then)

    # -- permissions --------------------------------------------------------------------------------

    def team_processing_jobs(self) -> str:
        """ARN of the team's processing jobs: those named with its job-name prefix and a hyphen."""
        return self.stack.format_arn(
            service="sagemaker", resource="processing-job", resource_name=f"{self.team.job_name_prefix}-*"
        )

    def _grant_processing(self) -> None:
        """The state machine's role: the team's processing jobs only, as the environment allows them."""
        jobs = self.team_processing_jobs()
        context = self.launcher.platform_context
        conditions = job_creation_conditions(
            team=self.team,
            subnet_ids=list(context["subnet_ids"]),
            security_group_ids=list(context["security_group_ids"]),
            key_arn=self._storage.data_key.key_arn,
            environment_name=self.launcher.props.environment_name,
            inter_container_traffic_encryption=self.launcher.inter_container_traffic_encryption,
            warm_pools=False,
            instance_types=self.instance_types,
        )
        rule = self.stack.format_arn(
            service="events", resource="rule", resource_name=SYNC_PROCESSING_EVENTS_RULE
        )
        statements = [
            iam.PolicyStatement(
                sid=CREATE_PROCESSING_JOBS_SID,
                actions=["sagemaker:CreateProcessingJob"],
                resources=[jobs],
                conditions=conditions,
            ),
            iam.PolicyStatement(
                sid="TagTeamProcessingJobs",
                actions=["sagemaker:AddTags"],
                resources=[jobs],
                conditions={"StringEquals": {f"aws:RequestTag/{TAG_PREFIX}team": self.team.name}},
            ),
            iam.PolicyStatement(
                sid="FollowTeamProcessingJobs",
                actions=["sagemaker:DescribeProcessingJob", "sagemaker:StopProcessingJob"],
                resources=[jobs],
            ),
            iam.PolicyStatement(
                sid="SyncWithProcessingJobEvents",
                actions=["events:PutTargets", "events:PutRule", "events:DescribeRule"],
                resources=[rule],
            ),
            iam.PolicyStatement(
                sid="PassProcessingRoleToSageMaker",
                actions=["iam:PassRole"],
                resources=[self.processing_role.role_arn],
                conditions={"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}},
            ),
            iam.PolicyStatement(
                sid="PublishEncryptedNotifications",
                actions=["kms:GenerateDataKey", "kms:Decrypt"],
                resources=[self.launcher.encryption_key.key_arn],
            ),
        ]
        for statement in statements:
            self.state_machine.add_to_role_policy(statement)
        acknowledge_wildcards(
            self.state_machine.role,
            {
                "logs:CreateLogDelivery": "Step Functions log delivery is configured account-wide: CDK's "
                "logging grant has no narrower resource",
                "xray:PutTraceSegments": "X-Ray traces, telemetry and sampling rules have no resource "
                "(CDK's tracing grant)",
                "lambda:InvokeFunction": "Step Functions may invoke every version of the preparations' own "
                "function (CDK's grant names the function)",
                CREATE_PROCESSING_JOBS_SID: "every preparation's jobs get new names (dataset, stage, time) "
                "under the team's job-name prefix",
                "TagTeamProcessingJobs": "the team's processing jobs are tagged at creation; their names "
                "differ per preparation under the team's prefix",
                "FollowTeamProcessingJobs": "the team's processing jobs are named per preparation under the "
                "team's job-name prefix",
            },
        )

    def _order_deployment(self) -> None:
        """The function and the state machine wait for their roles' policies (as the launcher's do)."""
        for construct, role in (
            (self.function, self.function.role),
            (self.state_machine, self.state_machine.role),
        ):
            policy = role.node.find_child("DefaultPolicy").node.default_child
            construct.node.default_child.add_override("DependsOn", [self.stack.get_logical_id(policy)])


__all__ = [
    "CREATE_PROCESSING_JOBS_SID",
    "SYNC_PROCESSING_EVENTS_RULE",
    "PreparationLauncher",
    "PreparationLauncherProps",
]
