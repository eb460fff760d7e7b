"""Guard rails and observability: quota usage and alarms, the warm-pool reaper, job events, a dashboard.

``TrainingOperations`` deploys three functions (their code is ``llmtrain.handlers`` and
``llmtrain.operations``, staged by ``lambda_code`` without Docker; their settings are the records of
``llmtrain.core.function_settings``, which write the functions' environments):

- the quota-usage function, on a schedule: instances in use per instance type and usage kind
  (training jobs, spot training jobs, warm pools) against their Service Quotas, as metrics in
  ``LLMTrain/Quotas``; one alarm per instance type when any of its three utilisations reaches the
  threshold, and one when a quota cannot be read;
- the warm-pool reaper, on a schedule: ends the platform's warm pools idle longer than the budget
  (or only reports them, in dry-run mode) and publishes the retained billable time;
- the job-events function, on an EventBridge rule for the platform's jobs reaching an end state:
  failures by class, final training metrics by template, and a notification.

Alarms and notifications go to one SNS topic: the one given (e.g. the launcher's), or one created
here (KMS-encrypted, TLS only, with an optional e-mail subscription).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from aws_cdk import ArnFormat, Duration, Stack
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_cloudwatch_actions as cloudwatch_actions
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sqs as sqs
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk import custom_resources as cr
from constructs import Construct

from llmtrain.core import function_settings as functions
from llmtrain.core.function_settings import JobEventSettings, QuotaSettings, ReaperSettings, UsageKind
from llmtrain.core.platform import (
    EMAIL_PATTERN,
    ENVIRONMENT_NAME_PATTERN,
    LOG_RETENTION_DAYS,
    MAX_KEEP_ALIVE_SECONDS,
)
from training_constructs._functions import logged_function, stack_log_group
from training_constructs._props import (
    check_instance_types,
    check_job_name_prefix,
    checked_props,
    freeze_sequences,
    is_whole_number,
    require,
)
from training_constructs.access import TRAINING_LOG_GROUP
from training_constructs.encryption import allow_service, create_encryption_key
from training_constructs.lambda_code import LAMBDA_ARCHITECTURE, LAMBDA_RUNTIME, lambda_code
from training_constructs.nag import (
    FUNCTION_CHECKOV_REASONS,
    acknowledge,
    acknowledge_checkov,
    acknowledge_wildcards,
)
from training_constructs.notifications import encrypted_topic
from training_constructs.operations_dashboard import (
    OperationsDashboard,
    OperationsDashboardProps,
    TemplateMetrics,
)
from training_constructs.teams import ENVIRONMENT_TAG

_NAME = "TrainingOperations"
_ACKNOWLEDGED_MARKER = "TrainingOperationsNagAcknowledgments"
_TRAINING_LOG_GROUP_ARNS = (
    "the one log group SageMaker writes training jobs to, by name; CloudWatch Logs evaluates some group "
    "actions on the group's ARN with ':*'"
)
# The construct id of AwsCustomResource's singleton function at the stack's root (aws-cdk-lib's).
_SDK_CALL_PROVIDER = "AWS679f53fac002430cb0da5b7982bd2287"
DEFAULT_QUOTA_INTERVAL_MINUTES = 5
DEFAULT_REAPER_INTERVAL_MINUTES = 10

_QUOTA_LISTS = "Service Quotas list calls support no resource-level permissions"
# Actions the functions need on "*", because AWS offers no narrower resource for them. The infra
# tests' allow-list of Resource "*" actions includes these, with the same reasons.
WILDCARD_RESOURCE_ACTIONS = {
    "sagemaker:ListTrainingJobs": "List calls have no resource; descriptions are scoped",
    "servicequotas:ListServiceQuotas": _QUOTA_LISTS,
    "servicequotas:ListAWSDefaultServiceQuotas": _QUOTA_LISTS,
    "cloudwatch:PutMetricData": "metrics have no ARN; limited to the platform's namespaces by condition",
}


@dataclass(frozen=True, kw_only=True)
class TrainingOperationsProps:
    """What the environment's guard rails watch; validated when built (``PropsError`` names the field).

    ``environment_name``: the environment, a metric dimension and part of resource names.
    ``job_name_prefix``: the platform's training-job name prefix; jobs are ``<prefix>-<run>-a<n>``
      (every team's prefix starts with it).
    ``instance_types``: the SageMaker instance types the enabled templates use (quotas are watched
      and alarmed for each).
    ``quota_alarm_threshold_percent``: alarm when usage reaches this share of a quota (0 < x <= 100).
    ``warm_pool_idle_budget_seconds``: the reaper ends the platform's pools idle longer than this.
    ``reaper_dry_run``: the reaper only reports what it would end.
    ``existing_topic``: where alarms and job notifications go instead of a topic created here.
    ``notification_email``: subscribed to the topic created here (not with ``existing_topic``).
    ``state_machines``: the launchers (one per team), whose executions the dashboard shows.
    ``template_metrics``: per enabled template, its loss and tokens/s metric names (dashboard).
    ``quota_interval`` / ``reaper_interval``: how often the scheduled functions run (whole minutes).
    ``code``: the functions' code (default: ``lambda_code()``, the installed llmtrain package).
    ``log_retention``: how long the functions' logs are kept.
    ``existing_log_key``: encrypts the functions' log groups instead of a key created here; it must
      let CloudWatch Logs use it.
    ``training_log_retention_days``: how long SageMaker's log group of every training job of the
      account and region (``/aws/sagemaker/TrainingJobs``) keeps them, one of CloudWatch's periods
      (``llmtrain.core.platform.LOG_RETENTION_DAYS``); set at deploy time, creating the group first if no
      job has yet. None leaves the group as it is (e.g. when another stack manages it).
    """

    environment_name: str
    job_name_prefix: str
    instance_types: Sequence[str]
    quota_alarm_threshold_percent: float
    warm_pool_idle_budget_seconds: int
    reaper_dry_run: bool = False
    existing_topic: sns.ITopic | None = None
    notification_email: str | None = None
    state_machines: Sequence[sfn.IStateMachine] = ()
    template_metrics: Sequence[TemplateMetrics] = ()
    quota_interval: Duration = field(default_factory=lambda: Duration.minutes(DEFAULT_QUOTA_INTERVAL_MINUTES))
    reaper_interval: Duration = field(
        default_factory=lambda: Duration.minutes(DEFAULT_REAPER_INTERVAL_MINUTES)
    )
    code: lambda_.Code | None = None
    log_retention: logs.RetentionDays = logs.RetentionDays.THREE_MONTHS
    existing_log_key: kms.IKey | None = None
    training_log_retention_days: int | None = 365

    def __post_init__(self) -> None:
        freeze_sequences(_NAME, self)
        _validate(self)


class TrainingOperations(Construct):
    """Quota alarms, the warm-pool reaper, job events and the operations dashboard of one environment.

    Attributes: ``topic``, ``topic_key`` (None with ``existing_topic``), ``log_key``, ``quota_function``,
    ``reaper_function``, ``job_events_function``, ``log_groups``, ``quota_schedule``,
    ``reaper_schedule``, ``job_events_rule``, ``job_events_dead_letters`` (the queue of job events the
    rule could not deliver and the function failed on), ``dead_letter_key``, ``dead_letter_alarm``,
    ``training_log_group`` and ``training_log_retention`` (the custom resources that create SageMaker's
    training log group if needed and set its retention; None without ``training_log_retention_days``),
    ``quota_alarms`` (by instance type), ``unreadable_quota_alarm``, ``function_error_alarms`` (by
    function name), ``dashboard``, ``props``.
    """

    def __init__(self, scope: Construct, construct_id: str, props: TrainingOperationsProps) -> None:
        super().__init__(scope, construct_id)
        self.props = checked_props(_NAME, props, TrainingOperationsProps)
        self.stack = Stack.of(self)
        self.environment_name = props.environment_name
        self.job_name_prefix = props.job_name_prefix
        self.instance_types = tuple(dict.fromkeys(props.instance_types))
        self.quota_alarm_threshold_percent = float(props.quota_alarm_threshold_percent)
        self._code = props.code or lambda_code()
        self._log_retention = props.log_retention
        self.log_groups: dict[str, logs.LogGroup] = {}
        self.log_key = props.existing_log_key or create_encryption_key(
            self, "LogsKey", allow_cloudwatch_logs=True,
            description=f"LLM training platform ({props.environment_name}): operations function logs",
        )
        if props.existing_topic is not None:
            self.topic_key, self.topic = None, props.existing_topic
        else:
            created = encrypted_topic(
                self,
                display_name=f"LLM training platform ({props.environment_name})",
                email=props.notification_email,
                key_id="TopicKey",
                key_description=f"LLM training platform ({props.environment_name}): operations topic",
            )
            self.topic_key, self.topic = created.created_key, created.topic
        self.dead_letter_key, self.job_events_dead_letters = self._dead_letter_queue()
        quota_interval = props.quota_interval
        self.quota_function = self._quota_function(quota_interval)
        self.reaper_function = self._reaper_function(
            props.warm_pool_idle_budget_seconds, props.reaper_dry_run
        )
        self.job_events_function = self._job_events_function()
        self.quota_schedule = self._schedule("QuotaSchedule", self.quota_function, quota_interval)
        self.reaper_schedule = self._schedule("ReaperSchedule", self.reaper_function, props.reaper_interval)
        self.job_events_rule = self._job_events_rule()
        self.training_log_group, self.training_log_retention = self._training_log_retention(
            props.training_log_retention_days
        )
        self._alarms(quota_interval)
        self.dashboard = OperationsDashboard(
            self,
            "Dashboard",
            OperationsDashboardProps(
                environment_name=props.environment_name,
                job_name_prefix=props.job_name_prefix,
                instance_types=self.instance_types,
                threshold_percent=self.quota_alarm_threshold_percent,
                quota_interval=quota_interval,
                state_machines=props.state_machines,
                template_metrics=props.template_metrics,
                functions=(self.quota_function, self.reaper_function, self.job_events_function),
            ),
        ).dashboard

    # -- the functions --------------------------------------------------------------------------

    def _function(
        self,
        construct_id: str,
        *,
        handler: str,
        description: str,
        timeout: Duration,
        environment: Mapping[str, str],
        dead_letter_queue: sqs.IQueue | None = None,
    ) -> lambda_.Function:
        function, log_group = logged_function(
            self,
            construct_id,
            code=self._code,
            handler=handler,
            description=f"{description} ({self.environment_name})",
            runtime=LAMBDA_RUNTIME,
            architecture=LAMBDA_ARCHITECTURE,
            memory_size=256,
            timeout=timeout,
            environment=environment,
            log_retention=self._log_retention,
            log_encryption_key=self.log_key,
            dead_letter_queue=dead_letter_queue,
        )
        self.log_groups[construct_id] = log_group
        _depend_on_policy_only(function)
        return function

    def _put_metrics_statement(self, *namespaces: str) -> iam.PolicyStatement:
        return iam.PolicyStatement(
            sid="PublishPlatformMetrics",
            actions=["cloudwatch:PutMetricData"],
            resources=["*"],
            conditions={"StringEquals": {"cloudwatch:namespace": list(namespaces)}},
        )

    def _training_jobs_arn(self, name_pattern: str) -> str:
        return self.stack.format_arn(
            service="sagemaker",
            resource="training-job",
            resource_name=name_pattern,
            arn_format=ArnFormat.SLASH_RESOURCE_NAME,
        )

    def _quota_function(self, interval: Duration) -> lambda_.Function:
        function = self._function(
            "QuotaFunction",
            handler=QuotaSettings.HANDLER,
            timeout=Duration.minutes(2),
            description="Training instances in use against their Service Quotas",
            environment=QuotaSettings(
                instance_types=self.instance_types, cache_ttl_seconds=max(3600, int(interval.to_seconds()))
            ).to_environment(),
        )
        all_jobs = self._training_jobs_arn("*")
        function.add_to_role_policy(
            iam.PolicyStatement(
                sid="ListTrainingJobs", actions=["sagemaker:ListTrainingJobs"], resources=["*"]
            )
        )
        function.add_to_role_policy(
            iam.PolicyStatement(
                sid="DescribeAccountTrainingJobs",
                actions=["sagemaker:DescribeTrainingJob"],
                resources=[all_jobs],
            )
        )
        function.add_to_role_policy(
            iam.PolicyStatement(
                sid="ReadServiceQuotas",
                actions=["servicequotas:ListServiceQuotas", "servicequotas:ListAWSDefaultServiceQuotas"],
                resources=["*"],
            )
        )
        function.add_to_role_policy(self._put_metrics_statement(functions.QUOTA_NAMESPACE))
        acknowledge_wildcards(
            function.role,
            {
                "ListTrainingJobs": WILDCARD_RESOURCE_ACTIONS["sagemaker:ListTrainingJobs"],
                "ReadServiceQuotas": WILDCARD_RESOURCE_ACTIONS["servicequotas:ListServiceQuotas"],
                "PublishPlatformMetrics": WILDCARD_RESOURCE_ACTIONS["cloudwatch:PutMetricData"],
                "DescribeAccountTrainingJobs": "Quotas are account-wide: every training job of the account, "
                "whoever started it, counts against them",
            },
        )
        return function

    def _reaper_function(self, idle_budget_seconds: int, dry_run: bool) -> lambda_.Function:
        prefix = f"{self.job_name_prefix}-"
        function = self._function(
            "ReaperFunction",
            handler=ReaperSettings.HANDLER,
            timeout=Duration.minutes(2),
            description="Ends warm pools idle beyond the idle budget",
            environment=ReaperSettings(
                job_name_prefix=prefix,
                idle_budget_seconds=idle_budget_seconds,
                environment=self.environment_name,
                instance_types=self.instance_types,
                dry_run=dry_run,
            ).to_environment(),
        )
        platform_jobs = self._training_jobs_arn(f"{prefix}*")
        function.add_to_role_policy(
            iam.PolicyStatement(
                sid="ListTrainingJobs", actions=["sagemaker:ListTrainingJobs"], resources=["*"]
            )
        )
        function.add_to_role_policy(
            iam.PolicyStatement(
                sid="EndPlatformWarmPools",
                actions=["sagemaker:DescribeTrainingJob", "sagemaker:UpdateTrainingJob"],
                resources=[platform_jobs],
            )
        )
        function.add_to_role_policy(self._put_metrics_statement(functions.WARM_POOL_NAMESPACE))
        acknowledge_wildcards(
            function.role,
            {
                "ListTrainingJobs": WILDCARD_RESOURCE_ACTIONS["sagemaker:ListTrainingJobs"],
                "PublishPlatformMetrics": WILDCARD_RESOURCE_ACTIONS["cloudwatch:PutMetricData"],
                "EndPlatformWarmPools": "The reaper ends this platform's warm pools only: their job names "
                "share the prefix and differ per run",
            },
        )
        return function

    def _job_events_function(self) -> lambda_.Function:
        prefix = f"{self.job_name_prefix}-"
        function = self._function(
            "JobEventsFunction",
            handler=JobEventSettings.HANDLER,
            timeout=Duration.seconds(30),
            description="Training job outcomes: failure classes, final metrics, notifications",
            environment=JobEventSettings(
                job_name_prefix=prefix, environment=self.environment_name, topic_arn=self.topic.topic_arn
            ).to_environment(),
            # EventBridge invokes it asynchronously: an event it still fails on after Lambda's retries
            # is kept here, not lost.
            dead_letter_queue=self.job_events_dead_letters,
        )
        function.add_to_role_policy(
            iam.PolicyStatement(
                sid="ReadPlatformTrainingJobs",
                actions=["sagemaker:DescribeTrainingJob", "sagemaker:ListTags"],
                resources=[self._training_jobs_arn(f"{prefix}*")],
            )
        )
        # A queued run's job is created, and named, by AWS Batch: it is the platform's by its tag.
        function.add_to_role_policy(
            iam.PolicyStatement(
                sid="ReadPlatformTaggedTrainingJobs",
                actions=["sagemaker:DescribeTrainingJob", "sagemaker:ListTags"],
                resources=[self._training_jobs_arn("*")],
                conditions={"StringEquals": {f"aws:ResourceTag/{ENVIRONMENT_TAG}": self.environment_name}},
            )
        )
        function.add_to_role_policy(
            self._put_metrics_statement(functions.JOB_NAMESPACE, functions.TRAINING_NAMESPACE)
        )
        self.topic.grant_publish(function)
        # Lambda sends the failed events with the function's role (CDK grants sqs:SendMessage only).
        self.dead_letter_key.grant(function, "kms:GenerateDataKey", "kms:Decrypt")
        acknowledge_wildcards(
            function.role,
            {
                "kms:GenerateDataKey*": "Publishing to the KMS-encrypted topic needs data keys of its key "
                "(CDK's grant_publish names that key)",
                "PublishPlatformMetrics": WILDCARD_RESOURCE_ACTIONS["cloudwatch:PutMetricData"],
                "ReadPlatformTrainingJobs": "The function reads this platform's jobs only: their names share "
                "the prefix and differ per run",
                "ReadPlatformTaggedTrainingJobs": "The function reads the jobs tagged with this environment "
                "only (a queued run's job, which AWS Batch names)",
            },
        )
        return function

    # -- what triggers the functions ------------------------------------------------------------

    def _schedule(self, construct_id: str, function: lambda_.IFunction, interval: Duration) -> events.Rule:
        return events.Rule(
            self,
            construct_id,
            schedule=events.Schedule.rate(interval),
            description=f"Runs {function.node.id} every {interval.to_minutes()} minutes",
            # A run that cannot be delivered before the next one is pointless: it is dropped.
            targets=[targets.LambdaFunction(function, retry_attempts=2, max_event_age=interval)],
        )

    def _job_events_rule(self) -> events.Rule:
        return events.Rule(
            self,
            "JobEventsRule",
            description=f"The platform's training jobs ({self.job_name_prefix}-*, or tagged with the "
            "environment) reaching an end state",
            event_pattern=events.EventPattern(
                source=[functions.EVENT_SOURCE],
                detail_type=[functions.EVENT_DETAIL_TYPE],
                detail={
                    "TrainingJobStatus": list(functions.END_STATES),
                    "$or": [
                        {"TrainingJobName": [{"prefix": f"{self.job_name_prefix}-"}]},
                        # a queued run's job, which AWS Batch names
                        {"Tags": {ENVIRONMENT_TAG: [self.environment_name]}},
                    ],
                },
            ),
            targets=[
                targets.LambdaFunction(
                    self.job_events_function,
                    retry_attempts=8,
                    max_event_age=Duration.hours(6),
                    # An event EventBridge could not deliver in that time is kept, not dropped.
                    dead_letter_queue=self.job_events_dead_letters,
                )
            ],
        )

    def _dead_letter_queue(self) -> tuple[kms.Key, sqs.Queue]:
        """Job events that could not be handled: those EventBridge could not deliver to the function
        and those the function failed on. Encrypted with a key of its own, which EventBridge may use
        for this environment's rules only; kept 14 days (SQS's longest), alarmed on."""
        key = create_encryption_key(
            self,
            "DeadLetterKey",
            description=f"LLM training platform ({self.environment_name}): job events dead-letter queue",
        )
        rules = self.stack.format_arn(service="events", resource="rule", resource_name="*")
        allow_service(
            key,
            sid="EventBridgeDeadLetters",
            service="events.amazonaws.com",
            actions=["kms:GenerateDataKey", "kms:Decrypt"],
            conditions={"ArnLike": {"aws:SourceArn": rules}},
        )
        queue = sqs.Queue(
            self,
            "JobEventsDeadLetters",
            encryption=sqs.QueueEncryption.KMS,
            encryption_master_key=key,
            enforce_ssl=True,
            retention_period=Duration.days(14),
        )
        acknowledge(
            queue,
            "AwsSolutions-SQS3",
            "it is the dead-letter queue of the job-events rule and function (EventBridge and Lambda "
            "dead-letter targets, which cdk-nag does not recognise as a queue's redrive)",
        )
        return key, queue

    def _training_log_retention(
        self, days: int | None
    ) -> tuple[cr.AwsCustomResource, cr.AwsCustomResource] | tuple[None, None]:
        """SageMaker creates `/aws/sagemaker/TrainingJobs` with a job's first log line and keeps it
        forever. At deploy time: create the group unless it exists (so a deploy never fails on one
        that does), then set its retention. With CDK's AwsCustomResource (one function per stack,
        whose logs go to a group of this construct), each call allowed on that group only."""
        if days is None:
            return None, None
        group_arn = self.stack.format_arn(
            service="logs", resource="log-group", resource_name=TRAINING_LOG_GROUP,
            arn_format=ArnFormat.COLON_RESOURCE_NAME,
        )
        provider_logs, _ = stack_log_group(
            self, "SdkCallLogs", retention=self._log_retention, encryption_key=self.log_key
        )

        def sdk_call(construct_id: str, action: str, parameters: Mapping, ignore: str | None = None):
            call = cr.AwsSdkCall(
                service="CloudWatchLogs",
                action=action,
                parameters={"logGroupName": TRAINING_LOG_GROUP, **parameters},
                physical_resource_id=cr.PhysicalResourceId.of(f"{TRAINING_LOG_GROUP}:{action}"),
                ignore_error_codes_matching=ignore,
            )
            allowed = iam.PolicyStatement(
                sid=construct_id,
                actions=[f"logs:{action[0].upper()}{action[1:]}"],
                resources=[group_arn, f"{group_arn}:*"],
            )
            resource = cr.AwsCustomResource(
                self,
                construct_id,
                on_create=call,
                on_update=call,
                policy=cr.AwsCustomResourcePolicy.from_statements([allowed]),
                install_latest_aws_sdk=False,
                log_group=provider_logs,
            )
            acknowledge_wildcards(resource, {construct_id: _TRAINING_LOG_GROUP_ARNS})
            return resource

        group = sdk_call("TrainingLogGroup", "createLogGroup", {}, ignore="ResourceAlreadyExistsException")
        retention = sdk_call("TrainingLogRetention", "putRetentionPolicy", {"retentionInDays": days})
        retention.node.add_dependency(group)
        _acknowledge_sdk_call_provider(self.stack)
        return group, retention

    # -- alarms ---------------------------------------------------------------------------------

    def _alarms(self, interval: Duration) -> None:
        action = cloudwatch_actions.SnsAction(self.topic)
        self.quota_alarms = {t: self._quota_alarm(t, interval) for t in self.instance_types}
        self.unreadable_quota_alarm = cloudwatch.Alarm(
            self,
            "UnreadableQuotaAlarm",
            alarm_name=f"{self.job_name_prefix}-quota-unreadable",
            alarm_description="Service Quotas could not be read for some instance types, so their usage is "
            "not checked; the quota function's log says why (permissions, throttling)",
            metric=cloudwatch.Metric(
                namespace=functions.QUOTA_NAMESPACE,
                metric_name="UnreadableQuotas",
                statistic="Maximum",
                period=interval,
            ),
            threshold=1,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            evaluation_periods=2,
            datapoints_to_alarm=2,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        self.function_error_alarms = {
            function.node.id: cloudwatch.Alarm(
                self,
                f"{function.node.id}Errors",
                alarm_name=f"{self.job_name_prefix}-{function.node.id}-errors",
                alarm_description=f"The guard-rail function {function.node.id} failed; its log says why",
                metric=function.metric_errors(period=Duration.minutes(5), statistic="Sum"),
                threshold=1,
                evaluation_periods=1,
                comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
            )
            for function in (self.quota_function, self.reaper_function, self.job_events_function)
        }
        self.dead_letter_alarm = cloudwatch.Alarm(
            self,
            "JobEventsDeadLettersAlarm",
            alarm_name=f"{self.job_name_prefix}-job-events-dead-letters",
            alarm_description="Job events were not handled (EventBridge could not deliver them, or the "
            "job-events function failed on them): their failure metrics and notifications are missing. "
            "Read them from the dead-letter queue; the function's log says why",
            metric=self.job_events_dead_letters.metric_approximate_number_of_messages_visible(
                period=Duration.minutes(5), statistic="Maximum"
            ),
            threshold=1,
            evaluation_periods=1,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        for alarm in [
            *self.quota_alarms.values(),
            self.unreadable_quota_alarm,
            *self.function_error_alarms.values(),
            self.dead_letter_alarm,
        ]:
            alarm.add_alarm_action(action)
            alarm.add_ok_action(action)

    def _quota_alarm(self, instance_type: str, interval: Duration) -> cloudwatch.Alarm:
        threshold = self.quota_alarm_threshold_percent
        return cloudwatch.Alarm(
            self,
            f"QuotaAlarm-{instance_type}",
            alarm_name=f"{self.job_name_prefix}-quota-{instance_type}",
            alarm_description=(
                f"{instance_type}: instances in use reached {threshold:g}% of a Service Quota "
                "(training jobs, spot training jobs or warm pools). "
                f"Run `llmtrain quotas --env {self.environment_name}`, "
                "end idle warm pools, or request a quota increase in Service Quotas."
            ),
            metric=utilization_expression(instance_type, interval),
            threshold=threshold,
            evaluation_periods=1,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )


def usage_metric(
    metric_name: str, instance_type: str, kind: UsageKind, period: Duration
) -> cloudwatch.Metric:
    """One quota-usage series the quota function publishes."""
    return cloudwatch.Metric(
        namespace=functions.QUOTA_NAMESPACE,
        metric_name=metric_name,
        dimensions_map={"InstanceType": instance_type, "UsageKind": kind.value},
        statistic="Maximum",
        period=period,
        label=kind.value,
    )


def utilization_expression(instance_type: str, period: Duration) -> cloudwatch.MathExpression:
    """The highest of the instance type's three utilisations (training, spot, warm pool), in percent."""
    using = {
        kind.value.replace("-", "_"): usage_metric("Utilization", instance_type, kind, period)
        for kind in UsageKind
    }
    return cloudwatch.MathExpression(
        expression=f"MAX([{', '.join(using)}])",
        using_metrics=using,
        period=period,
        label=f"{instance_type} highest utilisation (%)",
    )


def _acknowledge_sdk_call_provider(stack: Stack) -> None:
    """aws-cdk-lib's AwsCustomResource function is a singleton at the stack's root: its findings, once."""
    provider = stack.node.find_child(_SDK_CALL_PROVIDER)
    if provider.node.try_find_child(_ACKNOWLEDGED_MARKER) is not None:
        return
    Construct(provider, _ACKNOWLEDGED_MARKER)
    acknowledge(
        provider,
        "AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/"
        "AWSLambdaBasicExecutionRole]",
        "CDK's AwsCustomResource function uses the AWS managed basic execution role for its own logs only",
    )
    acknowledge(
        provider,
        "AwsSolutions-L1",
        "the AwsCustomResource function's runtime is chosen and updated by aws-cdk-lib, not by us",
    )
    acknowledge_checkov(provider, FUNCTION_CHECKOV_REASONS, resource_type="AWS::Lambda::Function")


def _depend_on_policy_only(function: lambda_.Function) -> None:
    # CDK makes the function depend on its role and the role's policy; the role dependency is already
    # implied by the function's GetAtt of the role ARN (cfn-lint W3005), the policy one is needed.
    policy = function.role.node.find_child("DefaultPolicy").node.default_child
    function.node.default_child.add_override("DependsOn", [Stack.of(function).get_logical_id(policy)])


def _validate(props: TrainingOperationsProps) -> None:
    name = props.environment_name
    require(
        isinstance(name, str) and bool(ENVIRONMENT_NAME_PATTERN.fullmatch(name)),
        _NAME,
        "environment_name",
        f"{name!r} must be 1-20 lowercase letters, digits and hyphens, starting with a letter",
    )
    check_job_name_prefix(_NAME, props.job_name_prefix)
    check_instance_types(_NAME, "instance_types", props.instance_types)
    threshold = props.quota_alarm_threshold_percent
    require(
        isinstance(threshold, int | float) and not isinstance(threshold, bool) and 0 < threshold <= 100,
        _NAME,
        "quota_alarm_threshold_percent",
        f"must be above 0 and at most 100, got {threshold!r}",
    )
    budget = props.warm_pool_idle_budget_seconds
    require(
        is_whole_number(budget) and 0 <= budget <= MAX_KEEP_ALIVE_SECONDS,
        _NAME,
        "warm_pool_idle_budget_seconds",
        f"must be whole seconds from 0 to {MAX_KEEP_ALIVE_SECONDS}, got {budget!r}",
    )
    _validate_notifications(props)
    days = props.training_log_retention_days
    require(
        days is None or (is_whole_number(days) and days in LOG_RETENTION_DAYS),
        _NAME,
        "training_log_retention_days",
        f"must be one of CloudWatch Logs' periods ({', '.join(map(str, LOG_RETENTION_DAYS))} days) or None, "
        f"got {days!r}",
    )
    for field_name in ("quota_interval", "reaper_interval"):
        seconds = getattr(props, field_name).to_seconds()
        require(
            seconds >= 60 and seconds % 60 == 0,
            _NAME,
            field_name,
            f"must be whole minutes, at least 1, got {seconds} s",
        )


def _validate_notifications(props: TrainingOperationsProps) -> None:
    email = props.notification_email
    require(
        email is None or bool(EMAIL_PATTERN.fullmatch(email)),
        _NAME,
        "notification_email",
        f"{email!r} is not an e-mail address",
    )
    require(
        props.existing_topic is None or email is None,
        _NAME,
        "notification_email",
        "is only for the topic created here; subscribe the address to the existing_topic you pass",
    )


__all__ = [
    "WILDCARD_RESOURCE_ACTIONS",
    "TemplateMetrics",
    "TrainingOperations",
    "TrainingOperationsProps",
    "utilization_expression",
]
