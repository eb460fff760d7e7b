"""The job-events function's work: the platform's training jobs reaching an end state.

An EventBridge rule sends "SageMaker Training Job State Change" events for the platform's jobs (name
prefix) that Completed, Failed or Stopped. This function classifies failures from their
FailureReason, publishes a metric per outcome and per failure class, and sends a notification to the
platform's topic. It sees every job of the platform, also those started outside the launcher.

Failure classes (`llmtrain.core.failures.classify_job_failure`, the table the launcher reads too):

- `capacity`: SageMaker could not provision the instances (CapacityError, InsufficientInstanceCapacity);
  retrying later or on another instance type helps.
- `plan_capacity`: a job in a training plan (`ResourceConfig.TrainingPlanArn`) found no free instance
  of its plan: a capacity failure, or its pending time (`MaxPendingTimeInSeconds`) ran out. Retrying
  elsewhere would leave the reserved capacity; the plan's instances are what to look at.
- `quota`: a Service Quota was exceeded (ResourceLimitExceeded); ask for an increase or wait.
- `rule`: a rule of the training program stopped it (`RuleTriggered: ...`, llmtrain.core.program_failures).
- `hang`: the training program's hang watchdog ended it (`HungCollective: ...`); a launcher run is
  retried once.
- `algorithm`: the training code or its input failed (AlgorithmError, ClientError); fix the job.
- `internal`: a SageMaker internal error, or a reason we do not recognise.

Metrics (namespace `METRIC_NAMESPACE`, default `LLMTrain/Jobs`), per `Environment`: `JobsCompleted`,
`JobsStopped`, `JobsFailed`; per `Environment` and `FailureClass`: `JobFailures`.

Per-template training metrics: SageMaker publishes a job's metric definitions under
`/aws/sagemaker/TrainingJobs` with the single dimension `Host` (`<job name>/algo-<n>`), and the job
name does not carry the template. So this function also republishes each ended job's final metric
values (`FinalMetricDataList`, e.g. the last loss and tokens/s) under `TRAINING_METRIC_NAMESPACE`
(default `LLMTrain/Training`), by their metric-definition names, with the dimensions `Environment`
and `Template` (from the job's `llmtrain:template` tag, which `llmtrain.core.render` sets).

The function's settings are `llmtrain.core.function_settings.JobEventSettings` (an empty `topic_arn`: no
notification); its entry point is `llmtrain.handlers.job_events.handler`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from botocore.exceptions import ClientError

from llmtrain.core.failures import FailureClass, classify_job_failure
from llmtrain.core.function_settings import END_STATES, EVENT_DETAIL_TYPE, EVENT_SOURCE, JobEventSettings
from llmtrain.core.program_failures import HUNG_COLLECTIVE, MEANING, RULE_TRIGGERED
from llmtrain.operations.metrics import Metric, put_metrics

LOGGER = logging.getLogger(__name__)
LOGGER.setLevel(logging.INFO)

# The tag `llmtrain.core.render` puts on every job it renders (its TAG_PREFIX + "template"). Not imported
# from there: render needs the compiled `regex` package, which this function's code does not ship.
TEMPLATE_TAG = "llmtrain:template"
# The tag render puts on every job with its environment: how a queued run's job, which AWS Batch
# creates and names, is known as the platform's.
ENVIRONMENT_TAG = "llmtrain:environment"
_SNS_SUBJECT_LIMIT = 100


@dataclass(frozen=True)
class JobOutcome:
    """A training job's end as the state-change event tells it."""

    job_name: str
    job_arn: str
    status: str
    failure_reason: str | None
    failure_class: FailureClass | None
    instance_type: str | None
    instance_count: int | None
    billable_seconds: int | None
    tags: dict[str, str] | None
    final_metrics: dict[str, float] | None

    @classmethod
    def from_detail(cls, detail: Mapping[str, Any]) -> JobOutcome:
        status = detail["TrainingJobStatus"]
        reason = detail.get("FailureReason")
        resources = detail.get("ResourceConfig") or {}
        count = resources.get("InstanceCount")
        billable = detail.get("BillableTimeInSeconds")
        failure_class = (
            classify_job_failure(reason, in_training_plan=bool(resources.get("TrainingPlanArn")))
            if status == "Failed"
            else None
        )
        return cls(
            job_name=detail["TrainingJobName"],
            job_arn=detail.get("TrainingJobArn", ""),
            status=status,
            failure_reason=reason,
            failure_class=failure_class,
            instance_type=resources.get("InstanceType"),
            instance_count=int(count) if count is not None else None,
            billable_seconds=int(billable) if billable is not None else None,
            tags=_tags(detail["Tags"]) if "Tags" in detail else None,
            final_metrics=_final_metrics(detail["FinalMetricDataList"])
            if "FinalMetricDataList" in detail
            else None,
        )

    def metrics(self, environment: str) -> list[Metric]:
        metrics = [Metric(f"Jobs{self.status}", 1, "Count", {"Environment": environment})]
        if self.failure_class is not None:
            dimensions = {"Environment": environment, "FailureClass": self.failure_class.value}
            metrics.append(Metric("JobFailures", 1, "Count", dimensions))
        return metrics

    def subject(self, environment: str) -> str:
        outcome = self.status if self.failure_class is None else f"{self.status} ({self.failure_class.value})"
        subject = f"[{environment}] training job {self.job_name} {outcome}"
        return subject if len(subject) <= _SNS_SUBJECT_LIMIT else subject[: _SNS_SUBJECT_LIMIT - 3] + "..."

    def message(self, environment: str, region: str) -> str:
        lines = [f"Training job {self.job_name} ended: {self.status}.", f"Environment: {environment}"]
        if self.failure_class is not None:
            lines.append(f"Failure class: {self.failure_class.value} ({_ADVICE[self.failure_class]})")
            lines.append(f"Failure reason: {self.failure_reason or '(none given)'}")
        if self.instance_type:
            lines.append(f"Instances: {self.instance_count or 1} x {self.instance_type}")
        if self.billable_seconds is not None:
            lines.append(f"Billable seconds: {self.billable_seconds}")
        lines += [f"Tag {key}: {value}" for key, value in sorted((self.tags or {}).items())]
        lines.append(
            f"Console: https://{region}.console.aws.amazon.com/sagemaker/home?region={region}"
            f"#/jobs/{self.job_name}"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "training_job_name": self.job_name,
            "status": self.status,
            "failure_class": self.failure_class.value if self.failure_class else None,
            "failure_reason": self.failure_reason,
        }


_ADVICE = {
    FailureClass.CAPACITY: "SageMaker had no capacity for the instance type; retry later or elsewhere",
    FailureClass.PLAN_CAPACITY: "its training plan had no free instance within the job's pending time; see "
    "the plan's instances with `llmtrain plans` and start the run again",
    FailureClass.QUOTA: "a Service Quota was exceeded; run `llmtrain quotas` and request an increase",
    FailureClass.RULE: MEANING[RULE_TRIGGERED],
    FailureClass.HANG: MEANING[HUNG_COLLECTIVE],
    FailureClass.ALGORITHM: "the training code or its input failed; read the job's logs",
    FailureClass.INTERNAL: "SageMaker reported an internal error or an unrecognised reason; retry",
}


def _tags(raw: Any) -> dict[str, str]:
    # Events carry tags as a map; DescribeTrainingJob-shaped payloads as a list of Key/Value pairs.
    if isinstance(raw, Mapping):
        return {str(k): str(v) for k, v in raw.items()}
    if isinstance(raw, list):
        return {str(t["Key"]): str(t["Value"]) for t in raw if isinstance(t, Mapping) and "Key" in t}
    return {}


def _final_metrics(data: Any) -> dict[str, float]:
    return {item["MetricName"]: float(item["Value"]) for item in data or () if "Value" in item}


def training_metrics(outcome: JobOutcome, environment: str, sagemaker: Any) -> list[Metric]:
    """The job's final metric values, by template; none when the job carries no template tag.

    The event may leave out the tags or the final metrics; they are then read from SageMaker.
    """
    tags = (
        outcome.tags
        if outcome.tags is not None
        else _tags(sagemaker.list_tags(ResourceArn=outcome.job_arn).get("Tags") if outcome.job_arn else None)
    )
    template = tags.get(TEMPLATE_TAG)
    if not template:
        return []
    final = outcome.final_metrics
    if final is None:
        description = sagemaker.describe_training_job(TrainingJobName=outcome.job_name)
        final = _final_metrics(description.get("FinalMetricDataList"))
    dimensions = {"Environment": environment, "Template": template}
    return [Metric(name, value, "None", dimensions) for name, value in sorted(final.items())]


def outcome_of(event: Mapping[str, Any], job_name_prefix: str, environment: str) -> JobOutcome | str:
    """The job's outcome, or why the event is not one this function handles. The platform's jobs are
    named with its prefix, or (a queued run's, named by AWS Batch) tagged with its environment."""
    if event.get("source") != EVENT_SOURCE or event.get("detail-type") != EVENT_DETAIL_TYPE:
        return f"not a {EVENT_DETAIL_TYPE!r} event from {EVENT_SOURCE}"
    detail = event.get("detail") or {}
    name = detail.get("TrainingJobName", "")
    tagged = _tags(detail.get("Tags")).get(ENVIRONMENT_TAG) == environment
    if not (name.startswith(job_name_prefix) or tagged):
        return (f"training job {name!r} is not one of the platform's (prefix {job_name_prefix!r}, "
                f"tag {ENVIRONMENT_TAG}={environment!r})")
    if detail.get("TrainingJobStatus") not in END_STATES:
        return f"training job {name!r} is {detail.get('TrainingJobStatus')!r}, not an end state"
    return JobOutcome.from_detail(detail)


def handle_event(
    event: Mapping[str, Any],
    settings: JobEventSettings,
    *,
    cloudwatch: Any,
    sns: Any,
    sagemaker: Any,
    region: str,
) -> dict[str, Any]:
    outcome = outcome_of(event, settings.job_name_prefix, settings.environment)
    if isinstance(outcome, str):
        LOGGER.info("ignored: %s", outcome)
        return {"ignored": outcome}
    now = datetime.now(UTC)
    put_metrics(cloudwatch, settings.namespace, outcome.metrics(settings.environment), now)
    if settings.topic_arn:
        notify(sns, settings.topic_arn, outcome, settings.environment, region)
    try:
        training = training_metrics(outcome, settings.environment, sagemaker)
    except ClientError as error:
        # Dashboards lose one point; the outcome metric and the notification above are what matter.
        LOGGER.warning("final metrics of %s could not be read: %s", outcome.job_name, error)
        training = []
    put_metrics(cloudwatch, settings.training_namespace, training, now)
    return outcome.to_dict() | {"training_metrics": {m.name: m.value for m in training}}


def notify(sns: Any, topic_arn: str, outcome: JobOutcome, environment: str, region: str) -> None:
    sns.publish(
        TopicArn=topic_arn,
        Subject=outcome.subject(environment),
        Message=outcome.message(environment, region),
        MessageAttributes={
            "status": {"DataType": "String", "StringValue": outcome.status},
            "failure_class": {
                "DataType": "String",
                "StringValue": outcome.failure_class.value if outcome.failure_class else "none",
            },
        },
    )
