"""`TrainingLauncher`: the Step Functions state machine that starts and follows training runs.

One launcher serves one team (`TeamSpec`): its state machine is the team's entry point, so an
engineers' policy can be scoped to it by ARN (Step Functions does not tell a state machine who
started it), and its role creates only the team's jobs, under SageMaker's IAM condition keys.

An execution's input is `{"template": NAME, "version": SEMVER|"latest", "run_name": NAME,
"overrides": {...}}` (`llmtrain.core.runs.ExecutionInput`). The state machine:

    ReadInput ─> Resolve ─> Rejected? ─> ChooseRequestLayout ─> CreateTrainingJob .sync ─> Summarize
                              │ yes          ^                       │ any failure            │
                              v              │                       v                        v
                        NotifyFailure <─ WaitBeforeRetry <─ NextAttempt (give up)      NotifySuccess

- ReadInput puts the execution input, whatever JSON it is, under `$.input`, so every later state
  has an object to add to (a list or a string as input would otherwise end in `States.Runtime`).
- Resolve checks the input, resolves the template in the registry, refuses a run that is in
  progress or completed or beyond the team's limits, and renders the CreateTrainingJob request:
  bad input ends here, before any job exists, with a summary whose error (`InvalidRunInput`, ...)
  and message say what to fix.
- CreateTrainingJob is a `CustomState` (the CDK task lacks KeepAlivePeriodInSeconds, CheckpointConfig,
  managed spot, RetryStrategy, ...) on `sagemaker:createTrainingJob.sync`, passing every field of
  the rendered request; it waits for the job to end, and stopping the execution stops the job.
  Step Functions cannot splat an object into a task's parameters (JSONPath), so there is one such
  state per request layout: the sets of top-level fields the registered templates render, computed
  at synth (`llmtrain.core.request_layouts.request_layouts`) and picked by a Choice.
- NextAttempt classifies a failure; capacity errors are retried with exponential backoff (a new
  job name per attempt, the run's checkpoint prefix shared so the job resumes), then on the
  template's fallback instance types; quota errors fail fast naming the quota and its numbers, or
  wait, by the template's policy; other failures end the run with the job's FailureReason.
- Both outcomes publish the run's summary to the SNS topic; it is the execution's output (or, on
  failure, the execution's error and cause).
- A tune (`llmtrain tune`: the input's `tune`) takes the same path with a tuning job for its attempt:
  ChooseRequestLayout picks a `TrialsRole-<layout>` Pass state (the role the trials run as, fixed by
  the definition) and a `CreateHyperParameterTuningJob-<layout>` state on
  `sagemaker:createHyperParameterTuningJob.sync`, one per `TUNING_LAYOUTS` entry, whose
  TrainingJobDefinition is the rendered one with that RoleArn merged over it. Summarize names the best
  trial. Tunes need a launcher without queues (a tuning job cannot be queued; Resolve refuses them).

Where the team's environment has queues (``queues``: a ``TrainingQueues``), an attempt is submitted
to AWS Batch instead of created, and followed:

    ... Rejected? ─> SubmitToQueue ─> Watch ─> InQueue? ── SUCCEEDED ─> Summarize ...
                        ^   │ error      ^        │ FAILED ─> NextAttempt ...
                        │   v            │        v otherwise
                  (retry)  NextAttempt   └── WaitInQueue ($.queue.wait_seconds)

- SubmitToQueue calls ``batch:SubmitServiceJob`` (an AWS SDK integration: Step Functions has no
  optimized one for service jobs) with the request Resolve or NextAttempt built and checked
  (``$.submission``: the rendered CreateTrainingJob request as the payload, the run's queue and
  priority, its tags), under the team's own share identifier, which the definition fixes.
- Watch (a function: ``llmtrain.handlers.queue.watch``) reads the service job: ``$.queue`` is the
  run's state (QUEUED with its place and the team's share usage, STARTING, TRAINING), and at the
  end the training job's description or the failure NextAttempt classifies. Capacity SageMaker
  lacks keeps the job waiting in its queue (Batch's doing), not a failed attempt; a job the queue's
  capacity time limit ended moves to the next fallback type, or ends the run.
- Stopping the execution does not end the service job: ``llmtrain stop`` terminates it first.

The job-template registry is the set of `JobTemplate`s given: their YAML is bundled into the
functions' code (`templates/<name>/<version>.yaml`), so `name@version` and `name@latest` resolve
to exactly the versions this deployment uploaded; the code itself is at the JobTemplate's
`templates/<name>/<version>/sourcedir.tar.gz` in the code bucket, where rendering points.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml
from aws_cdk import Aws, CfnResource, Duration, RemovalPolicy, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk import aws_stepfunctions_tasks as tasks
from constructs import Construct

import llmtrain.core.queue_policy as queue_policy
from llmtrain.core.catalog import LOCK_FILE, LockEntry, lock_text, snapshot_name
from llmtrain.core.errors import LlmtrainError
from llmtrain.core.function_settings import LauncherSettings, WatchSettings
from llmtrain.core.jumpstart import MANIFEST_KEY, content_bucket
from llmtrain.core.platform import FEATURE_FIELDS
from llmtrain.core.render import TAG_PREFIX, render
from llmtrain.core.request_layouts import TUNING_LAYOUTS, request_layouts
from llmtrain.core.run_settings import RunInput
from llmtrain.core.team_context import (
    PlatformResources,
    TeamSettings,
    placeholder_context,
    team_context_fields,
)
from training_constructs._functions import logged_function
from training_constructs._props import PropsError, checked_props, freeze_sequences, require
from training_constructs.job_template import JobTemplate
from training_constructs.lambda_code import LAMBDA_ARCHITECTURE, LAMBDA_RUNTIME, lambda_code
from training_constructs.nag import acknowledge_wildcards
from training_constructs.notifications import encrypted_topic
from training_constructs.queues import TrainingQueues
from training_constructs.resources import NetworkResources, StorageResources, check_network, check_storage
from training_constructs.teams import (
    CREATE_JOBS_SID,
    CREATE_TUNING_JOBS_SID,
    TeamSpec,
    job_creation_conditions,
)

_NAME = "TrainingLauncher"
_STATE_MACHINE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,80}$")
# Step Functions' .sync integration with SageMaker listens to job state changes through this
# managed EventBridge rule, which it creates in the account on first use.
SYNC_EVENTS_RULE = "StepFunctionsGetEventsForSageMakerTrainingJobsRule"
SYNC_TUNING_EVENTS_RULE = "StepFunctionsGetEventsForSageMakerTuningJobsRule"
# The functions vendor `regex` (llmtrain.core.validate reads AWS's Java-style patterns with it).
VENDORED_PACKAGES = ("yaml", "regex")
LAUNCHER_ERROR_SUBJECT = "llmtrain: a run failed (launcher error)"
# Where a tune's state holds the trials' role the definition fixes (merged into its TrainingJobDefinition).
TRIALS_ROLE_PATH = "$.trials_role"

# Actions this construct allows on "*" because AWS offers no narrower resource for them.
WILDCARD_RESOURCE_ACTIONS = {
    "sagemaker:ListTrainingJobs": "List calls have no resource; the resolve function lists the run's own "
    "jobs by name to refuse a second job for a run in progress",
    "sagemaker:ListHyperParameterTuningJobs": "List calls have no resource; the resolve function lists a "
    "tune's own tuning jobs by name (a tune in progress, the tunes it warm-starts from)",
    "logs:CreateLogDelivery": "Step Functions log delivery is configured account-wide (CDK's logging grant)",
    "logs:GetLogDelivery": "Step Functions log delivery is configured account-wide (CDK's logging grant)",
    "logs:UpdateLogDelivery": "Step Functions log delivery is configured account-wide (CDK's logging grant)",
    "logs:DeleteLogDelivery": "Step Functions log delivery is configured account-wide (CDK's logging grant)",
    "logs:ListLogDeliveries": "Step Functions log delivery is configured account-wide (CDK's logging grant)",
    "logs:PutResourcePolicy": "Step Functions log delivery is configured account-wide (CDK's logging grant)",
    "logs:DescribeResourcePolicies": "Step Functions log delivery is configured account-wide "
    "(CDK's logging grant)",
    "logs:DescribeLogGroups": "Step Functions log delivery is configured account-wide (CDK's logging grant)",
    "xray:PutTraceSegments": "X-Ray trace segments have no resource (CDK's tracing grant)",
    "xray:PutTelemetryRecords": "X-Ray telemetry has no resource (CDK's tracing grant)",
    "xray:GetSamplingRules": "X-Ray sampling rules have no resource (CDK's tracing grant)",
    "xray:GetSamplingTargets": "X-Ray sampling targets have no resource (CDK's tracing grant)",
}


@dataclass(frozen=True, kw_only=True)
class TrainingLauncherProps:
    """What one team's launcher is made of; validated when built (``PropsError`` names the field).

    ``job_templates``: the published template versions runs may use (the registry), ``JobTemplate``s.
    ``team``: the team this launcher serves (``TeamSpec``): its job-name prefix, instance types,
      warm-pool cap, instance cap, templates, notification address and run budget (Resolve refuses a
      run planned to cost more, ``run_budget_usd`` in the functions' platform context).
    ``execution_role``: the team's SageMaker execution role (the only role the launcher may pass).
    ``storage``: the platform's data key and buckets (``TrainingStorage`` or ``ExistingStorage``): job
      outputs and volumes are encrypted with the data key.
    ``network``: where the jobs' instances run (``TrainingNetwork`` or ``ExistingNetwork``).
    ``environment_name``: the environment (e.g. dev), in the jobs' tags and resource descriptions.
    ``inter_container_traffic_encryption``: every job encrypts traffic between its instances, and the
      role may create no other (the environment's setting, whatever a template says).
    ``state_machine_name``: a fixed name (so other stacks can build its ARN without a reference).
    ``existing_encryption_key``: encrypts the log groups and the topic instead of a key created here
      (with rotation); it must let CloudWatch Logs, and CloudWatch alarms publishing to the topic,
      use it.
    ``log_retention``: how long the state machine's and the functions' logs are kept.
    ``platform_features``: the environment's optional features, as PlatformContext fields
      (``llmtrain.core.platform.FEATURE_FIELDS``: the CodeArtifact repository, the MLflow tracking server,
      the training plans runs may use, remote debugging); rendered into every request.
    ``queues``: the environment's queues (``TrainingQueues``, which ``team`` shares): runs are submitted
      to them instead of creating their training jobs. None: no queues.
    """

    job_templates: Sequence[JobTemplate]
    team: TeamSpec
    execution_role: iam.IRole
    storage: StorageResources
    network: NetworkResources
    environment_name: str
    inter_container_traffic_encryption: bool = False
    state_machine_name: str | None = None
    existing_encryption_key: kms.IKey | None = None
    log_retention: logs.RetentionDays = logs.RetentionDays.ONE_YEAR
    platform_features: Mapping[str, Any] = field(default_factory=dict)
    queues: TrainingQueues | None = None

    def __post_init__(self) -> None:
        freeze_sequences(_NAME, self)
        object.__setattr__(self, "platform_features", dict(self.platform_features or {}))
        _validate(self)


class TrainingLauncher(Construct):
    """The launcher: job-template registry, state machine, functions and notification topic.

    Attributes: ``state_machine``, ``state_machine_role``, ``topic``, ``encryption_key``,
    ``resolve_function``, ``next_attempt_function``, ``summarize_function``, ``functions`` (by
    step), ``log_group`` (the state machine's), ``function_log_groups``, ``train_states`` (by
    layout), ``job_templates``, ``team``, ``platform_context`` (what the functions receive, with
    tokens), ``settings`` (the functions' ``llmtrain.core.function_settings.LauncherSettings``),
    ``props``; with queues also ``watch_function``, ``watch_settings`` (its
    ``llmtrain.core.function_settings.WatchSettings``) and ``submit_state``.
    """

    def __init__(self, scope: Construct, construct_id: str, props: TrainingLauncherProps) -> None:
        super().__init__(scope, construct_id)
        self.props = checked_props(_NAME, props, TrainingLauncherProps)
        self.stack = Stack.of(self)
        team = self.team = props.team
        self.job_templates = props.job_templates
        self.job_name_prefix = team.job_name_prefix
        self.inter_container_traffic_encryption = props.inter_container_traffic_encryption
        # The environment's optional features (EnvironmentConfig.platform_features: package
        # repository, MLflow, training plans, remote debugging), the same for every team.
        features = props.platform_features
        self.request_layouts = request_layouts([_synth_render(t, props) for t in self.job_templates])
        storage, network = props.storage, props.network
        self.queues = props.queues
        self.platform_context = team_context_fields(
            environment=props.environment_name,
            region=self.stack.region,
            account=self.stack.account,
            resources=PlatformResources(
                execution_role_arn=props.execution_role.role_arn,
                datasets_bucket=storage.datasets_bucket.bucket_name,
                checkpoints_bucket=storage.checkpoints_bucket.bucket_name,
                artifacts_bucket=storage.artifacts_bucket.bucket_name,
                code_bucket=storage.code_bucket.bucket_name,
                kms_key_arn=storage.data_key.key_arn,
                subnet_ids=[subnet.subnet_id for subnet in network.subnets],
                security_group_ids=[network.security_group.security_group_id],
            ),
            team=TeamSettings(
                name=team.name,
                job_name_prefix=team.job_name_prefix,
                warm_pool_cap_seconds=team.max_keep_alive_seconds,
                allowed_templates=sorted(team.templates or {t.spec.name for t in self.job_templates}),
                allowed_instance_types=list(team.instance_types),
                max_instance_count=team.max_instance_count,
                run_budget_usd=team.max_run_cost_usd,
                queues=self.queues.team_context(team.name) if self.queues is not None else None,
            ),
            inter_container_traffic_encryption=props.inter_container_traffic_encryption,
            features=features,
        )
        # What the functions read from their environment (the records write the variables).
        self.settings = LauncherSettings(
            platform_context=self.platform_context, request_layouts=self.request_layouts
        )
        notifications = encrypted_topic(
            self,
            display_name=f"LLM training runs ({props.environment_name}, team {team.name})",
            email=team.notification_email,
            key_id="Key",
            key_description=f"LLM training platform ({props.environment_name}): launcher logs and "
            "notifications",
            existing_key=props.existing_encryption_key,
            allow_cloudwatch_logs=True,
        )
        self.encryption_key, self.topic = notifications.key, notifications.topic
        self._log_retention = props.log_retention
        self.function_log_groups: dict[str, logs.LogGroup] = {}
        self._create_functions()
        self._create_state_machine(props.execution_role, props.state_machine_name, props.environment_name)
        self._grant_training(props)
        self._acknowledge_state_machine_findings()
        self._order_deployment()

    # -- the functions --------------------------------------------------------------------------

    def _create_functions(self) -> None:
        code = lambda_code(
            extra_files=_registry_files(self.job_templates), vendored_packages=VENDORED_PACKAGES
        )
        self.resolve_function = self._function(
            "ResolveFunction", code, "resolve",
            "Checks a run's input, resolves its template and renders its job",
        )
        self.resolve_function.add_to_role_policy(
            iam.PolicyStatement(sid="ListRunJobs", actions=["sagemaker:ListTrainingJobs"], resources=["*"])
        )
        # A run's earlier jobs say (by their tags) which template version the run keeps.
        self.resolve_function.add_to_role_policy(
            iam.PolicyStatement(
                sid="ReadRunJobTags", actions=["sagemaker:ListTags"], resources=[self._team_jobs()]
            )
        )
        # A run's base_model=<JumpStart model id> resolves against JumpStart's manifest and model specs
        # in the region (llmtrain.core.jumpstart): read-only, JumpStart's public catalogue.
        jumpstart = f"arn:{Aws.PARTITION}:s3:::{content_bucket(self.stack.region)}"
        self.resolve_function.add_to_role_policy(
            iam.PolicyStatement(sid="ReadJumpStartCatalogue", actions=["s3:GetObject"],
                                resources=[f"{jumpstart}/{MANIFEST_KEY}", f"{jumpstart}/*specs*.json"])
        )
        self._resolve_reasons = {
            "ListRunJobs": WILDCARD_RESOURCE_ACTIONS["sagemaker:ListTrainingJobs"],
            "ReadJumpStartCatalogue": "JumpStart's model specs, one JSON file per model version, under "
            "its public content bucket's folders",
            "ReadRunJobTags": "the tags of the team's jobs, named per run and attempt under the team's "
            "job-name prefix",
        }
        if self.queues is None:
            # A tune (no queues: tuning jobs cannot be queued) lists its own tuning jobs and those of
            # the tunes it warm-starts from.
            self.resolve_function.add_to_role_policy(
                iam.PolicyStatement(sid="ListTuneJobs", actions=["sagemaker:ListHyperParameterTuningJobs"],
                                    resources=["*"])
            )
            self._resolve_reasons["ListTuneJobs"] = WILDCARD_RESOURCE_ACTIONS[
                "sagemaker:ListHyperParameterTuningJobs"]
        acknowledge_wildcards(self.resolve_function.role, self._resolve_reasons)
        self.next_attempt_function = self._function(
            "NextAttemptFunction", code, "next_attempt", "Classifies a failed attempt and plans the retry"
        )
        # A hung job's retry would reuse its warm pool, the instances that may have hung it: ended first.
        self.next_attempt_function.add_to_role_policy(
            iam.PolicyStatement(sid="EndHungJobsWarmPools", actions=["sagemaker:UpdateTrainingJob"],
                                resources=[self._team_jobs()])
        )
        end_pool_reasons = {"EndHungJobsWarmPools": "the team's jobs, named per run and attempt under the "
                            "team's job-name prefix"}
        if self.queues is not None:  # a queued run's job is named by Batch: the team's by its tag
            end_pool_reasons.update(self.queues.grant_end_warm_pools(self.next_attempt_function,
                                                                     self.team.name))
        acknowledge_wildcards(self.next_attempt_function.role, end_pool_reasons)
        self.summarize_function = self._function("SummarizeFunction", code, "summarize", "Summarizes a run")
        self.functions = {
            "resolve": self.resolve_function,
            "next_attempt": self.next_attempt_function,
            "summarize": self.summarize_function,
        }
        if self.queues is not None:
            self.watch_settings = WatchSettings(platform_context=self.platform_context)
            self.watch_function = self._function(
                "WatchFunction", code, "watch", "Reads a queued run's service job", watch=self.watch_settings
            )
            self.functions["watch"] = self.watch_function
            # Resolve finds a run's earlier attempts among its service jobs; Watch follows them.
            self._resolve_reasons.update(self.queues.grant_follow(self.resolve_function, self.team.name))
            acknowledge_wildcards(self.watch_function.role,
                                  self.queues.grant_follow(self.watch_function, self.team.name))

    def _function(
        self, construct_id: str, code: lambda_.Code, step: str, description: str,
        watch: WatchSettings | None = None,
    ) -> lambda_.Function:
        """One of the launcher's functions: a step of ``LauncherSettings.HANDLERS`` with the launcher's
        settings, or the Watch function with its own (``watch``)."""
        handler, settings = (LauncherSettings.HANDLERS[step], self.settings) if watch is None else (
            watch.HANDLER, watch)
        function, log_group = logged_function(
            self,
            construct_id,
            code=code,
            handler=handler,
            description=f"Launcher: {description}",
            runtime=LAMBDA_RUNTIME,
            architecture=LAMBDA_ARCHITECTURE,
            memory_size=512,
            timeout=Duration.minutes(1),
            environment=settings.to_environment(json_text=self.stack.to_json_string),
            log_retention=self._log_retention,
            log_encryption_key=self.encryption_key,
        )
        self.function_log_groups[step] = log_group
        return function

    # -- the state machine ----------------------------------------------------------------------

    def _create_state_machine(
        self, execution_role: iam.IRole, name: str | None, environment_name: str
    ) -> None:
        self.log_group = logs.LogGroup(
            self,
            "StateMachineLogs",
            retention=self._log_retention,
            encryption_key=self.encryption_key,
            removal_policy=RemovalPolicy.RETAIN,
        )
        self.train_states: dict[str, sfn.CustomState] = {}
        self.state_machine = sfn.StateMachine(
            self,
            "StateMachine",
            state_machine_name=name,
            definition_body=sfn.DefinitionBody.from_chainable(self._definition(execution_role)),
            logs=sfn.LogOptions(
                destination=self.log_group, level=sfn.LogLevel.ALL, include_execution_data=True
            ),
            tracing_enabled=True,
            comment=f"LLM training platform ({environment_name}): start a training run from a job template",
        )
        self.state_machine_role = self.state_machine.role

    def _definition(self, execution_role: iam.IRole) -> sfn.IChainable:
        fail = sfn.Fail(
            self,
            "RunFailed",
            error_path="$.summary.error",
            cause_path="$.summary.message",
            comment="The run failed: the summary's error and message say why and what to do",
        )
        notify_failure = self._notify("NotifyFailure", fail)
        succeed = sfn.Succeed(self, "RunCompleted", output_path="$.summary")
        notify_success = self._notify("NotifySuccess", succeed)

        summarize = self._invoke(
            "Summarize",
            self.summarize_function,
            {"run": sfn.JsonPath.object_at("$.run"), "job": sfn.JsonPath.object_at("$.job")},
        )
        summarize.next(notify_success)
        next_attempt = self._invoke(
            "NextAttempt",
            self.next_attempt_function,
            {
                "run": sfn.JsonPath.object_at("$.run"),
                "request": sfn.JsonPath.object_at("$.request"),
                "failure": sfn.JsonPath.object_at("$.failure"),
            },
        )
        if self.queues is None:
            start_attempt = self._training_job_states(execution_role, next_attempt, summarize)
        else:
            start_attempt = self._queue_states(next_attempt, summarize)
        wait = sfn.Wait(
            self,
            "WaitBeforeRetry",
            time=sfn.WaitTime.seconds_path("$.wait_seconds"),
            comment="Backoff before the next attempt (never a tight loop)",
        )
        wait.next(start_attempt)
        next_attempt.next(
            sfn.Choice(self, "RetryOrGiveUp")
            .when(sfn.Condition.string_equals("$.decision", "retry"), wait)
            .otherwise(notify_failure)
        )

        read_input = sfn.Pass(
            self,
            "ReadInput",
            parameters={"input": sfn.JsonPath.entire_payload},
            comment="Any JSON value may start an execution: keep it under $.input, so every later state "
            "has an object to add to",
        )
        resolve = self._invoke(
            "Resolve",
            self.resolve_function,
            {
                "input": sfn.JsonPath.string_at("$.input"),
                "execution_arn": sfn.JsonPath.string_at("$$.Execution.Id"),
                "execution_name": sfn.JsonPath.string_at("$$.Execution.Name"),
            },
        )
        launcher_error = self._launcher_error(notify_failure)
        for step in (resolve, next_attempt, summarize, *self._watch_states):
            step.add_catch(launcher_error, errors=["States.ALL"], result_path="$.error")
        rejected = (
            sfn.Choice(self, "Rejected", comment="Bad input ends here, before any training job exists")
            .when(sfn.Condition.is_present("$.summary"), notify_failure)
            .otherwise(start_attempt)
        )
        return read_input.next(resolve).next(rejected)

    def _training_job_states(
        self, execution_role: iam.IRole, next_attempt: sfn.State, summarize: sfn.State
    ) -> sfn.Choice:
        """One CreateTrainingJob .sync state per request layout, and the Choice between them."""
        self._watch_states: list[sfn.TaskStateBase] = []
        choose_layout = sfn.Choice(
            self, "ChooseRequestLayout", comment="One CreateTrainingJob state per set of request fields"
        )
        for layout, fields in self.request_layouts.items():
            train = self._train_state(layout, fields, execution_role)
            train.add_catch(next_attempt, errors=["States.ALL"], result_path="$.failure")
            train.next(summarize)
            choose_layout.when(sfn.Condition.string_equals("$.layout", layout), train)
            self.train_states[layout] = train
        # `llmtrain tune`: the attempt is a SageMaker tuning job (llmtrain.lifecycle.tuning_jobs), whose
        # trials the tuning job creates; one state per layout of its request.
        self.tune_states: dict[str, sfn.CustomState] = {}
        for layout, fields in TUNING_LAYOUTS.items():
            tune = self._tune_state(layout, fields)
            tune.add_catch(next_attempt, errors=["States.ALL"], result_path="$.failure")
            tune.next(summarize)
            choose_layout.when(sfn.Condition.string_equals("$.layout", layout),
                               self._trials_role(layout, execution_role).next(tune))
            self.tune_states[layout] = tune
        choose_layout.otherwise(
            sfn.Fail(
                self,
                "UnknownRequestLayout",
                error="LauncherStateError",
                cause="the functions chose a request layout this state machine lacks",
            )
        )
        return choose_layout

    def _queue_states(self, next_attempt: sfn.State, summarize: sfn.State) -> sfn.CustomState:
        """Submit the attempt to the team's queue, then watch its service job until it ends."""
        submission = {
            f"{name}.$": f"$.submission.{key}"
            for name, key in (("JobName", "jobName"), ("JobQueue", "jobQueue"),
                              ("ServiceRequestPayload", "serviceRequestPayload"),
                              ("SchedulingPriority", "schedulingPriority"), ("Tags", "tags"))
        }
        self.submit_state = sfn.CustomState(
            self,
            "SubmitToQueue",
            state_json={
                "Type": "Task",
                "Comment": "Queue the attempt's training job (AWS Batch service job) under the team's share",
                "Resource": f"arn:{Aws.PARTITION}:states:::aws-sdk:batch:submitServiceJob",
                "Parameters": {
                    **submission,
                    "ServiceJobType": queue_policy.SERVICE_JOB_TYPE,
                    "ShareIdentifier": queue_policy.share_identifier(self.team.name),
                },
                "ResultSelector": {"job_id.$": "$.JobId", "job_arn.$": "$.JobArn", "phase": "QUEUED"},
                "ResultPath": "$.queue",
            },
        )
        self.submit_state.add_catch(next_attempt, errors=["States.ALL"], result_path="$.failure")
        watch = tasks.LambdaInvoke(
            self,
            "Watch",
            lambda_function=self.watch_function,
            payload=sfn.TaskInput.from_object({"queue": sfn.JsonPath.object_at("$.queue")}),
            payload_response_only=True,
            result_path="$.queue",
        )
        self._watch_states = [watch]
        succeeded = sfn.Pass(self, "ServiceJobSucceeded", input_path="$.queue.job", result_path="$.job")
        failed = sfn.Pass(self, "ServiceJobFailed", input_path="$.queue.failure", result_path="$.failure")
        waiting = sfn.Wait(
            self,
            "WaitInQueue",
            time=sfn.WaitTime.seconds_path("$.queue.wait_seconds"),
            comment="The run waits in its queue or trains: look again later ($.queue says how it stands)",
        )
        self.submit_state.next(watch)
        watch.next(
            sfn.Choice(self, "InQueue", comment="QUEUED, STARTING or TRAINING: wait; else the attempt ended")
            .when(sfn.Condition.string_equals("$.queue.phase", "SUCCEEDED"), succeeded.next(summarize))
            .when(sfn.Condition.string_equals("$.queue.phase", "FAILED"), failed.next(next_attempt))
            .otherwise(waiting.next(watch))
        )
        return self.submit_state

    def _invoke(self, state_id: str, function: lambda_.IFunction, payload: dict) -> tasks.LambdaInvoke:
        return tasks.LambdaInvoke(
            self,
            state_id,
            lambda_function=function,
            payload=sfn.TaskInput.from_object(payload),
            output_path="$.Payload",
        )

    def _train_state(self, layout: str, fields: Sequence[str], execution_role: iam.IRole) -> sfn.CustomState:
        # Every field comes from the rendered request except RoleArn: the state machine only ever
        # hands SageMaker the platform's execution role (the one role it may pass), whatever the
        # functions return. (The rendered request names the same role.)
        parameters = {f"{field}.$": f"$.request.{field}" for field in fields if field != "RoleArn"}
        return sfn.CustomState(
            self,
            f"CreateTrainingJob-{layout}",
            state_json={
                "Type": "Task",
                "Comment": "Start the training job and wait until it ends; stopping the execution stops it",
                "Resource": f"arn:{Aws.PARTITION}:states:::sagemaker:createTrainingJob.sync",
                "Parameters": {"RoleArn": execution_role.role_arn, **parameters},
                "ResultPath": "$.job",
            },
        )

    def _trials_role(self, layout: str, execution_role: iam.IRole) -> sfn.Pass:
        """The role of a tuning job's trials, fixed by the definition as the training state fixes
        RoleArn: `_tune_state` merges it over the rendered TrainingJobDefinition's."""
        return sfn.Pass(
            self,
            f"TrialsRole-{layout}",
            comment="The trials run as the platform's execution role, whatever the functions returned",
            result=sfn.Result.from_object({"RoleArn": execution_role.role_arn}),
            result_path=TRIALS_ROLE_PATH,
        )

    def _tune_state(self, layout: str, fields: Sequence[str]) -> sfn.CustomState:
        # Every field comes from the rendered request, and TrainingJobDefinition with its RoleArn
        # replaced (a shallow States.JsonMerge: the second object's keys win) by the role the
        # preceding Pass state fixed: the state machine only ever hands SageMaker the platform's
        # execution role for the trials, as for a training job. (The request names the same role.)
        parameters = {f"{field}.$": f"$.request.{field}" for field in fields}
        parameters["TrainingJobDefinition.$"] = (
            f"States.JsonMerge($.request.TrainingJobDefinition, {TRIALS_ROLE_PATH}, false)"
        )
        return sfn.CustomState(
            self,
            f"CreateHyperParameterTuningJob-{layout}",
            state_json={
                "Type": "Task",
                "Comment": "Start the tuning job and wait until it ends; stopping the execution stops it",
                "Resource": f"arn:{Aws.PARTITION}:states:::sagemaker:createHyperParameterTuningJob.sync",
                "Parameters": parameters,
                "ResultPath": "$.job",
            },
        )

    def _notify(self, state_id: str, then: sfn.State) -> tasks.SnsPublish:
        publish = tasks.SnsPublish(
            self,
            state_id,
            topic=self.topic,
            subject=sfn.JsonPath.string_at("$.summary.subject"),
            message=sfn.TaskInput.from_json_path_at("$.summary.message"),
            message_attributes={
                "status": tasks.MessageAttribute(value=sfn.JsonPath.string_at("$.summary.status"))
            },
            result_path=sfn.JsonPath.DISCARD,
        )
        # A notification that cannot be delivered must not change the run's outcome.
        publish.add_catch(then, errors=["States.ALL"], result_path="$.notification_error")
        return publish.next(then)

    def _launcher_error(self, notify_failure: sfn.State) -> sfn.Pass:
        # The subject is fixed: SNS refuses subjects over 100 characters, and an execution's name
        # (up to 80) cannot be shortened here; the message names the execution.
        return sfn.Pass(
            self,
            "DescribeLauncherError",
            parameters={
                "summary": {
                    "status": "Failed",
                    "error": sfn.JsonPath.string_at("$.error.Error"),
                    "message": sfn.JsonPath.format(
                        "Execution {} failed in the launcher: {}: {}",
                        sfn.JsonPath.string_at("$$.Execution.Name"),
                        sfn.JsonPath.string_at("$.error.Error"),
                        sfn.JsonPath.string_at("$.error.Cause"),
                    ),
                    "subject": LAUNCHER_ERROR_SUBJECT,
                }
            },
        ).next(notify_failure)

    # -- permissions ----------------------------------------------------------------------------

    def _team_jobs(self) -> str:
        return self.stack.format_arn(
            service="sagemaker", resource="training-job", resource_name=f"{self.team.job_name_prefix}-*"
        )

    def _team_tuning_jobs(self) -> str:
        return self.stack.format_arn(service="sagemaker", resource="hyper-parameter-tuning-job",
                                     resource_name=f"{self.team.job_name_prefix}-*")

    def _grant_training(self, props: TrainingLauncherProps) -> None:
        """The job-creating role: the team's jobs only, and only as the environment allows them.

        SageMaker evaluates the condition keys below on CreateTrainingJob, so a request the launcher
        did not render (a bug, or a changed function) is refused by IAM whatever it says. With queues
        the role creates no job: it submits to the team's queues (``TrainingQueues.grant_submit``),
        and Batch, passing the payload's role, needs the caller's PassRole of it: the team's only.
        """
        pass_role = iam.PolicyStatement(
            sid="PassTeamExecutionRoleToSageMaker",
            actions=["iam:PassRole"],
            resources=[props.execution_role.role_arn],
            conditions={"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}},
        )
        publish = iam.PolicyStatement(
            sid="PublishEncryptedNotifications",
            actions=["kms:GenerateDataKey", "kms:Decrypt"],
            resources=[self.encryption_key.key_arn],
        )
        self._queue_reasons: dict[str, str] = {}
        if self.queues is None:
            create, tag, follow, sync = self._training_job_statements(props)
            statements = [create, tag, follow, pass_role, sync, publish, *self._tuning_job_statements(props)]
        else:
            statements = [pass_role, publish]
            self._queue_reasons = self.queues.grant_submit(self.state_machine, self.team.name)
        for statement in statements:
            self.state_machine.add_to_role_policy(statement)

    def _training_job_statements(self, props: TrainingLauncherProps) -> list[iam.PolicyStatement]:
        jobs = self._team_jobs()
        rule = self.stack.format_arn(service="events", resource="rule", resource_name=SYNC_EVENTS_RULE)
        conditions = job_creation_conditions(**self._job_limits(props))
        return [
            iam.PolicyStatement(
                sid=CREATE_JOBS_SID,
                actions=["sagemaker:CreateTrainingJob"],
                resources=[jobs],
                conditions=conditions,
            ),
            iam.PolicyStatement(
                sid="TagTeamTrainingJobs",
                actions=["sagemaker:AddTags"],
                resources=[jobs],
                conditions={"StringEquals": {f"aws:RequestTag/{TAG_PREFIX}team": self.team.name}},
            ),
            iam.PolicyStatement(
                sid="FollowTeamTrainingJobs",
                actions=["sagemaker:DescribeTrainingJob", "sagemaker:StopTrainingJob"],
                resources=[jobs],
            ),
            iam.PolicyStatement(
                sid="SyncWithTrainingJobEvents",
                actions=["events:PutTargets", "events:PutRule", "events:DescribeRule"],
                resources=[rule, self.stack.format_arn(service="events", resource="rule",
                                                       resource_name=SYNC_TUNING_EVENTS_RULE)],
            ),
        ]

    def _job_limits(self, props: TrainingLauncherProps) -> dict[str, Any]:
        """What `job_creation_conditions` holds the team's jobs (and tuning jobs) to."""
        return {
            "team": self.team,
            "subnet_ids": list(self.platform_context["subnet_ids"]),
            "security_group_ids": list(self.platform_context["security_group_ids"]),
            "key_arn": props.storage.data_key.key_arn,
            "environment_name": props.environment_name,
            "inter_container_traffic_encryption": self.inter_container_traffic_encryption,
        }

    def _tuning_job_statements(self, props: TrainingLauncherProps) -> list[iam.PolicyStatement]:
        """`llmtrain tune`: the team's tuning jobs, under the training jobs' condition keys less the
        warm pool's (tuning jobs have none; SageMaker evaluates the others on them too)."""
        tuning_jobs = self._team_tuning_jobs()
        return [
            iam.PolicyStatement(
                sid=CREATE_TUNING_JOBS_SID,
                actions=["sagemaker:CreateHyperParameterTuningJob"],
                resources=[tuning_jobs],
                conditions=job_creation_conditions(**self._job_limits(props), warm_pools=False),
            ),
            iam.PolicyStatement(
                sid="TagTeamTuningJobs",
                actions=["sagemaker:AddTags"],
                resources=[tuning_jobs],
                conditions={"StringEquals": {f"aws:RequestTag/{TAG_PREFIX}team": self.team.name}},
            ),
            iam.PolicyStatement(
                sid="FollowTeamTuningJobs",
                actions=["sagemaker:DescribeHyperParameterTuningJob",
                         "sagemaker:StopHyperParameterTuningJob"],
                resources=[tuning_jobs],
            ),
        ]

    def _acknowledge_state_machine_findings(self) -> None:
        logging = (
            "Step Functions log delivery is configured account-wide: CDK's logging grant has no "
            "narrower resource"
        )
        acknowledge_wildcards(
            self.state_machine.role,
            {
                "logs:CreateLogDelivery": logging,
                "xray:PutTraceSegments": "X-Ray traces, telemetry and sampling rules have no resource "
                "(CDK's tracing grant)",
                "lambda:InvokeFunction": "Step Functions may invoke every version of the launcher's own "
                "three functions (CDK's grant names each function)",
                CREATE_JOBS_SID: "every attempt of every run gets a new job name under the team's "
                "job-name prefix, so the jobs are named by that prefix",
                "TagTeamTrainingJobs": "the team's jobs are tagged at creation; their names differ per run "
                "and attempt under the team's prefix",
                "FollowTeamTrainingJobs": "the team's jobs are named per run and attempt under the team's "
                "job-name prefix",
                CREATE_TUNING_JOBS_SID: "every tune gets a new tuning job name under the team's job-name "
                "prefix",
                "TagTeamTuningJobs": "the team's tuning jobs are tagged at creation; their names differ per "
                "tune under the team's prefix",
                "FollowTeamTuningJobs": "the team's tuning jobs are named per tune under the team's job-name "
                "prefix",
                **self._queue_reasons,
            },
        )

    def _order_deployment(self) -> None:
        """Depend on exactly what must exist first. CDK's dependency of a function (or the state
        machine) on its role is already implied by the GetAtt of the role's ARN (cfn-lint W3005); the
        one on the role's policy is needed. The state machine also waits for every JobTemplate's
        upload, so no run can start before its template's code is in the bucket."""
        uploads = []
        for template in self.job_templates:
            if Stack.of(template) is not self.stack:
                self.state_machine.node.add_dependency(template)  # a dependency between stacks
                continue
            uploads += [
                child
                for child in template.node.find_all()
                if isinstance(child, CfnResource) and child.cfn_resource_type.startswith("Custom::")
            ]
        for function in self.functions.values():
            _depend_on(function, [_default_policy(function.role)])
        _depend_on(self.state_machine, [_default_policy(self.state_machine.role), *uploads])


def _default_policy(role: iam.IRole) -> CfnResource:
    return role.node.find_child("DefaultPolicy").node.default_child


def _depend_on(construct: Construct, resources: Sequence[CfnResource]) -> None:
    stack = Stack.of(construct)
    construct.node.default_child.add_override("DependsOn", [stack.get_logical_id(r) for r in resources])


def _registry_files(job_templates: Sequence[JobTemplate]) -> dict[str, bytes]:
    """The registry as the functions see it: one YAML file per template version, with the lock of
    those versions and their frozen code (templates/catalog.lock, templates/_code/: the archives the
    JobTemplates upload), so that Resolve checks a run with the training program's contract of the
    very code the version runs (Catalog.program_contract), not the functions' own."""
    files = {}
    lock: dict[str, dict[str, LockEntry]] = {}
    for t in job_templates:
        files[f"templates/{t.spec.name}/{t.spec.version}.yaml"] = yaml.safe_dump(
            t.spec.to_dict(), sort_keys=True
        ).encode()
        lock.setdefault(t.spec.name, {})[t.spec.version] = t.lock_entry
        if t.spec.code.is_platform:
            files[f"templates/{snapshot_name(t.lock_entry.code)}"] = t.sourcedir_path.read_bytes()
    files[f"templates/{LOCK_FILE}"] = lock_text(lock).encode()
    return files


def _validate(props: TrainingLauncherProps) -> None:
    team = props.team
    require(isinstance(team, TeamSpec), _NAME, "team", f"must be a TeamSpec, got {type(team).__name__}")
    check_storage(_NAME, props.storage)
    check_network(_NAME, props.network)
    require(bool(props.environment_name), _NAME, "environment_name", "must not be empty")
    name = props.state_machine_name
    require(
        name is None or bool(_STATE_MACHINE_NAME.fullmatch(name)),
        _NAME,
        "state_machine_name",
        f"{name!r} must be 1-80 letters, digits, '-' or '_'",
    )
    templates = props.job_templates
    require(
        len(templates) > 0, _NAME, "job_templates", "must list at least one JobTemplate: runs start from one"
    )
    others = [type(t).__name__ for t in templates if not isinstance(t, JobTemplate)]
    require(not others, _NAME, "job_templates", f"must hold JobTemplates only, got {others}")
    refs = [t.spec.ref for t in templates]
    require(
        len(set(refs)) == len(refs),
        _NAME,
        "job_templates",
        f"lists a version twice: {sorted({r for r in refs if refs.count(r) > 1})}",
    )
    _validate_team_templates(templates, team)
    _validate_features(props.platform_features)
    _validate_queues(props.queues, team)


def _validate_queues(queues: TrainingQueues | None, team: TeamSpec) -> None:
    if queues is None:
        return
    require(isinstance(queues, TrainingQueues), _NAME, "queues",
            f"must be the environment's TrainingQueues, got {type(queues).__name__}")
    require(queues.teams.get(team.name) == team, _NAME, "queues",
            f"team {team.name!r} must share these queues with the same TeamSpec (its share weight, priority "
            f"and queues are the queues' to enforce); they have {sorted(queues.teams)}")


def _validate_team_templates(job_templates: Sequence[JobTemplate], team: TeamSpec) -> None:
    outside = sorted({t.spec.name for t in job_templates} - set(team.templates)) if team.templates else []
    require(
        not outside,
        _NAME,
        "job_templates",
        f"{outside} are not among team {team.name!r}'s templates {list(team.templates)}",
    )
    for template in job_templates:
        types = template.spec.instance_types
        require(
            bool(set(types) & set(team.instance_types)),
            _NAME,
            "job_templates",
            f"{template.spec.ref} runs on {', '.join(types)}, none of which team {team.name!r} may use "
            f"({', '.join(team.instance_types)}): add one to the team's instance types or drop the template",
        )


def _validate_features(features: Mapping[str, Any]) -> None:
    unknown = sorted(set(features) - set(FEATURE_FIELDS))
    require(not unknown, _NAME, "platform_features", f"{unknown} are not features: {list(FEATURE_FIELDS)}")
    try:
        placeholder_context(environment="synth", account="123456789012", region="us-east-1",
                                    resource_prefix="synth", warm_pool_cap_seconds=0, features=features)
    except LlmtrainError as error:
        raise PropsError(f"{_NAME}(platform_features=...): {error}") from error


def _synth_render(template: JobTemplate, props: TrainingLauncherProps) -> dict:
    """The version's request with its defaults and a placeholder platform of the team: its layout is
    what counts, and a version whose defaults the team cannot run fails the synth here."""
    team = props.team
    platform = placeholder_context(
        environment="synth",
        account="123456789012",
        region="us-east-1",
        resource_prefix="synth",
        warm_pool_cap_seconds=team.max_keep_alive_seconds,
        team=team.name,
        job_name_prefix=team.job_name_prefix,
        inter_container_traffic_encryption=props.inter_container_traffic_encryption,
        features=props.platform_features,
    )
    try:
        program = template.catalog.program_contract(template.spec)
        return render(template.spec, RunInput(run_name="synth-check"), platform, program)
    except LlmtrainError as error:
        raise PropsError(
            f"{_NAME}(job_templates=...): {template.spec.ref} cannot run with its defaults for team "
            f"{team.name!r}: {error}"
        ) from error


__all__ = [
    "CREATE_JOBS_SID",
    "LAUNCHER_ERROR_SUBJECT",
    "SYNC_EVENTS_RULE",
    "WILDCARD_RESOURCE_ACTIONS",
    "TrainingLauncher",
    "TrainingLauncherProps",
]
