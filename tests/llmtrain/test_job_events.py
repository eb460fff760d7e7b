"""The job-events function: failure classes, metrics in moto's CloudWatch, the notification in moto's SNS.

The notification is read back from an SQS queue subscribed to the topic in moto, so what is checked is
what a subscriber receives.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import boto3
import pytest
from moto import mock_aws
from sagemaker_fleet_support import TrainingFleet

from llmtrain.core import failures
from llmtrain.core.failures import FailureClass
from llmtrain.core.failures import classify_job_failure as classify_failure
from llmtrain.core.function_settings import JOB_NAMESPACE, TRAINING_NAMESPACE, JobEventSettings
from llmtrain.handlers import job_events as job_event_handler
from llmtrain.operations import job_events

REGION = "us-east-1"
PREFIX = "llmtrain-dev-"

CAPACITY = (
    "CapacityError: Unable to provision requested ML compute capacity. Please retry using a different ML "
    "instance type."
)
QUOTA = (
    "ResourceLimitExceeded: The account-level service limit 'ml.p4d.24xlarge for training job usage' is 2 "
    "Instances, with current utilization of 2 Instances and a request delta of 2 Instances."
)
# The training program's own reasons (output/failure), as SageMaker wraps them.
RULE_STOP = ("AlgorithmError: RuleTriggered: loss_spike at step 120: loss 9.1 is above 3 x its running mean "
             "2.9 (action stop)")
HANG = ("AlgorithmError: HungCollective: nothing finished for 20 minutes on rank 3 (host algo-2) after "
        "step 1200")


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (CAPACITY, FailureClass.CAPACITY),
        (
            "InsufficientInstanceCapacity: We currently do not have sufficient p4d capacity",
            FailureClass.CAPACITY,
        ),
        (
            "ClientError: CapacityError: Unable to provision requested ML compute capacity",
            FailureClass.CAPACITY,
        ),
        (QUOTA, FailureClass.QUOTA),
        (
            "AlgorithmError: ExecuteUserScriptError: Command 'torchrun' returned exit code 1",
            FailureClass.ALGORITHM,
        ),
        ("ClientError: Data download failed: NoSuchKey s3://datasets/train", FailureClass.ALGORITHM),
        (RULE_STOP, FailureClass.RULE),
        (HANG, FailureClass.HANG),
        ("AlgorithmError: RuleTriggered without its colon is not the program's", FailureClass.ALGORITHM),
        ("InternalServerError: We encountered an internal error. Please try again.", FailureClass.INTERNAL),
        ("Something SageMaker never said before", FailureClass.INTERNAL),
        (None, FailureClass.INTERNAL),
    ],
)
def test_failure_reasons_are_classified(reason, expected):
    assert classify_failure(reason) is expected
    # The launcher reads the same table: the job's class decides its retry.
    caught = {"Error": "States.TaskFailed",
              "Cause": json.dumps({"TrainingJobStatus": "Failed", "FailureReason": reason})}
    kind = {FailureClass.CAPACITY: "capacity", FailureClass.QUOTA: "quota", FailureClass.RULE: "rule_stopped",
            FailureClass.HANG: "hung"}.get(expected, "job_failed")
    assert failures.classify_failure(caught).kind == kind


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (CAPACITY, FailureClass.PLAN_CAPACITY),
        ("Training job exceeded MaxPendingTimeInSeconds while Pending for its training plan",
         FailureClass.PLAN_CAPACITY),
        (QUOTA, FailureClass.QUOTA),
        ("AlgorithmError: ExecuteUserScriptError: Command 'torchrun' returned exit code 1",
         FailureClass.ALGORITHM),
    ],
)
def test_a_job_in_a_training_plan_that_found_no_instance_is_a_plan_capacity_failure(reason, expected):
    """Not `capacity`: retrying elsewhere would leave the reserved capacity; the advice names the plans."""
    assert classify_failure(reason, in_training_plan=True) is expected
    detail = {"TrainingJobName": "llmtrain-dev-r1-a1", "TrainingJobStatus": "Failed", "FailureReason": reason,
              "ResourceConfig": {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 2,
                                 "TrainingPlanArn": "arn:aws:sagemaker:us-east-1:1:training-plan/week"}}
    outcome = job_events.JobOutcome.from_detail(detail)
    assert outcome.failure_class is expected
    if expected is FailureClass.PLAN_CAPACITY:
        assert "llmtrain plans" in outcome.message("dev", REGION)


def state_change(name: str, status: str, reason: str | None = None, **detail) -> dict:
    now = datetime.now(UTC)
    body = {
        "TrainingJobName": name,
        "TrainingJobArn": f"arn:aws:sagemaker:{REGION}:123456789012:training-job/{name}",
        "TrainingJobStatus": status,
        "SecondaryStatus": status,
        "ResourceConfig": {"InstanceType": "ml.p4d.24xlarge", "InstanceCount": 2, "VolumeSizeInGB": 100},
        "CreationTime": int((now - timedelta(hours=1)).timestamp() * 1000),
        "BillableTimeInSeconds": 1234,
        "Tags": {"llmtrain:template": "llama-pretrain-fsdp", "llmtrain:run": "nightly"},
        "FinalMetricDataList": [
            {"MetricName": "train:loss", "Value": 2.75, "Timestamp": int(now.timestamp() * 1000)},
            {
                "MetricName": "train:tokens_per_sec",
                "Value": 51234.5,
                "Timestamp": int(now.timestamp() * 1000),
            },
        ],
        **detail,
    }
    if reason is not None:
        body["FailureReason"] = reason
    return {
        "version": "0",
        "id": "6a7e8feb-b491-4cf7-a9f1-bf3703467718",
        "detail-type": "SageMaker Training Job State Change",
        "source": "aws.sagemaker",
        "account": "123456789012",
        "time": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "region": REGION,
        "resources": [body["TrainingJobArn"]],
        "detail": body,
    }


@pytest.fixture
def aws(monkeypatch):
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "JOB_NAME_PREFIX": PREFIX,
        "ENVIRONMENT_NAME": "dev",
    }.items():
        monkeypatch.setenv(key, value)
    with mock_aws():
        sns = boto3.client("sns", region_name=REGION)
        sqs = boto3.client("sqs", region_name=REGION)
        topic_arn = sns.create_topic(Name="llmtrain-dev-notifications")["TopicArn"]
        queue_url = sqs.create_queue(QueueName="subscriber")["QueueUrl"]
        queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"][
            "QueueArn"
        ]
        sns.subscribe(TopicArn=topic_arn, Protocol="sqs", Endpoint=queue_arn)
        monkeypatch.setenv("NOTIFICATION_TOPIC_ARN", topic_arn)
        yield sqs, queue_url


def received(sqs, queue_url) -> list[dict]:
    messages = sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10).get("Messages", [])
    return [json.loads(message["Body"]) for message in messages]


def metric_sum(name: str, namespace: str = JOB_NAMESPACE, **dimensions: str) -> float:
    now = datetime.now(UTC)
    stats = boto3.client("cloudwatch", region_name=REGION).get_metric_statistics(
        Namespace=namespace,
        MetricName=name,
        Dimensions=[{"Name": k, "Value": v} for k, v in dimensions.items()],
        StartTime=now - timedelta(minutes=10),
        EndTime=now + timedelta(minutes=10),
        Period=3600,
        Statistics=["Sum"],
    )
    return sum(point["Sum"] for point in stats["Datapoints"])


def test_a_capacity_failure_is_counted_by_class_and_notified(aws):
    sqs, queue_url = aws

    result = job_event_handler.handler(state_change(f"{PREFIX}nightly-1", "Failed", CAPACITY), None)

    assert result == {
        "training_job_name": f"{PREFIX}nightly-1",
        "status": "Failed",
        "failure_class": "capacity",
        "failure_reason": CAPACITY,
        "training_metrics": {"train:loss": 2.75, "train:tokens_per_sec": 51234.5},
    }
    assert metric_sum("JobFailures", Environment="dev", FailureClass="capacity") == 1
    assert metric_sum("JobFailures", Environment="dev", FailureClass="quota") == 0
    assert metric_sum("JobsFailed", Environment="dev") == 1
    [notification] = received(sqs, queue_url)
    assert notification["Subject"] == f"[dev] training job {PREFIX}nightly-1 Failed (capacity)"
    message = notification["Message"]
    assert f"Failure reason: {CAPACITY}" in message
    assert "Failure class: capacity (SageMaker had no capacity" in message
    assert "Instances: 2 x ml.p4d.24xlarge" in message
    assert "Billable seconds: 1234" in message
    assert "Tag llmtrain:template: llama-pretrain-fsdp" in message
    assert (
        f"https://{REGION}.console.aws.amazon.com/sagemaker/home?region={REGION}#/jobs/{PREFIX}nightly-1"
        in message
    )
    assert notification["MessageAttributes"]["failure_class"]["Value"] == "capacity"


def test_a_rule_stop_and_a_hang_are_notified_with_what_they_mean(aws):
    sqs, queue_url = aws
    job_event_handler.handler(state_change(f"{PREFIX}spiky-1", "Failed", RULE_STOP), None)
    job_event_handler.handler(state_change(f"{PREFIX}stuck-1", "Failed", HANG), None)

    assert metric_sum("JobFailures", Environment="dev", FailureClass="rule") == 1
    assert metric_sum("JobFailures", Environment="dev", FailureClass="hang") == 1
    notifications = {n["Subject"]: n["Message"] for n in received(sqs, queue_url)}
    rule = notifications[f"[dev] training job {PREFIX}spiky-1 Failed (rule)"]
    assert "Failure class: rule (a rule of the training program stopped the run" in rule
    assert f"Failure reason: {RULE_STOP}" in rule
    hang = notifications[f"[dev] training job {PREFIX}stuck-1 Failed (hang)"]
    assert "every rank's Python stacks are in the job's log" in hang
    assert "retries such a run once from its last checkpoint" in hang


def test_each_class_has_its_own_metric(aws):
    for number, reason in enumerate([QUOTA, QUOTA, "AlgorithmError: boom", "InternalServerError: oops"]):
        job_event_handler.handler(state_change(f"{PREFIX}run-{number}", "Failed", reason), None)

    assert metric_sum("JobFailures", Environment="dev", FailureClass="quota") == 2
    assert metric_sum("JobFailures", Environment="dev", FailureClass="algorithm") == 1
    assert metric_sum("JobFailures", Environment="dev", FailureClass="internal") == 1
    assert metric_sum("JobsFailed", Environment="dev") == 4


def test_completed_and_stopped_jobs_are_counted_and_notified_without_a_class(aws):
    sqs, queue_url = aws

    job_event_handler.handler(state_change(f"{PREFIX}good-1", "Completed"), None)
    job_event_handler.handler(state_change(f"{PREFIX}halted-1", "Stopped"), None)

    assert metric_sum("JobsCompleted", Environment="dev") == 1
    assert metric_sum("JobsStopped", Environment="dev") == 1
    assert metric_sum("JobsFailed", Environment="dev") == 0
    subjects = sorted(n["Subject"] for n in received(sqs, queue_url))
    assert subjects == [
        f"[dev] training job {PREFIX}good-1 Completed",
        f"[dev] training job {PREFIX}halted-1 Stopped",
    ]


@pytest.mark.parametrize(
    ("event", "why"),
    [
        (state_change("another-team-job", "Failed", CAPACITY), "not one of the platform's"),
        (
            state_change("AWSBatch-other-env-job", "Failed", CAPACITY,
                         Tags={"llmtrain:environment": "prod", "llmtrain:template": "gpt2-ddp"}),
            "not one of the platform's",
        ),
        (state_change(f"{PREFIX}busy-1", "InProgress"), "not an end state"),
        (
            {"source": "aws.sagemaker", "detail-type": "SageMaker Endpoint State Change", "detail": {}},
            "not a",
        ),
    ],
)
def test_other_events_are_ignored(aws, event, why):
    sqs, queue_url = aws

    result = job_event_handler.handler(event, None)

    assert why in result["ignored"]
    assert received(sqs, queue_url) == []
    assert (
        boto3.client("cloudwatch", region_name=REGION).list_metrics(Namespace=JOB_NAMESPACE)[
            "Metrics"
        ]
        == []
    )


def test_a_queued_runs_job_named_by_batch_is_known_by_its_environment_tag(aws):
    """AWS Batch creates and names a queued run's training job; the job carries the tags the launcher
    rendered, and the environment's tag makes it one of the platform's."""
    sqs, queue_url = aws
    name = "AWSBatch-nightly-a1-4c7599ae"
    tags = {"llmtrain:environment": "dev", "llmtrain:template": "gpt2-ddp", "llmtrain:run": "nightly"}

    result = job_event_handler.handler(state_change(name, "Failed", CAPACITY, Tags=tags), None)

    assert result["training_job_name"] == name and result["failure_class"] == "capacity"
    assert metric_sum("JobFailures", Environment="dev", FailureClass="capacity") == 1
    assert training_metric("train:loss", "gpt2-ddp") == 2.75
    [notification] = received(sqs, queue_url)
    assert notification["Subject"] == f"[dev] training job {name} Failed (capacity)"


def test_without_a_topic_only_metrics_are_published(aws, monkeypatch):
    sqs, queue_url = aws
    monkeypatch.setenv("NOTIFICATION_TOPIC_ARN", "")

    job_event_handler.handler(state_change(f"{PREFIX}nightly-2", "Failed", QUOTA), None)

    assert metric_sum("JobFailures", Environment="dev", FailureClass="quota") == 1
    assert received(sqs, queue_url) == []


def training_metric(name: str, template: str) -> float:
    return metric_sum(name, TRAINING_NAMESPACE, Environment="dev", Template=template)


def test_final_training_metrics_are_published_per_template(aws):
    job_event_handler.handler(state_change(f"{PREFIX}nightly-1", "Completed"), None)

    assert training_metric("train:loss", "llama-pretrain-fsdp") == 2.75
    assert training_metric("train:tokens_per_sec", "llama-pretrain-fsdp") == 51234.5
    assert training_metric("train:loss", "gpt2-ddp") == 0


def test_tags_and_final_metrics_missing_from_the_event_are_read_from_sagemaker(aws):
    name = f"{PREFIX}ddp-1"
    fleet = TrainingFleet(boto3.client("sagemaker", region_name=REGION))
    fleet.create(name, tags={"llmtrain:template": "gpt2-ddp", "llmtrain:run": "ddp"})
    fleet.set_final_metrics(name, {"train:loss": 3.5, "train:tokens_per_sec": 900.0})
    event = state_change(name, "Completed")
    del event["detail"]["Tags"], event["detail"]["FinalMetricDataList"]

    result = job_event_handler.handler(event, None)

    assert result["training_metrics"] == {"train:loss": 3.5, "train:tokens_per_sec": 900.0}
    assert training_metric("train:loss", "gpt2-ddp") == 3.5


def test_a_job_that_cannot_be_read_still_gets_its_outcome_metric_and_notification(aws):
    sqs, queue_url = aws
    event = state_change(f"{PREFIX}vanished-1", "Failed", QUOTA)
    del event["detail"]["FinalMetricDataList"]  # and moto holds no such job to describe

    result = job_event_handler.handler(event, None)

    assert result["failure_class"] == "quota" and result["training_metrics"] == {}
    assert metric_sum("JobFailures", Environment="dev", FailureClass="quota") == 1
    assert len(received(sqs, queue_url)) == 1


def test_jobs_without_a_template_tag_publish_no_training_metrics(aws):
    event = state_change(f"{PREFIX}manual-1", "Completed", Tags={"team": "research"})

    assert job_event_handler.handler(event, None)["training_metrics"] == {}
    assert (
        boto3.client("cloudwatch", region_name=REGION).list_metrics(
            Namespace=TRAINING_NAMESPACE
        )["Metrics"]
        == []
    )


def test_the_template_tag_is_the_one_render_sets():
    from llmtrain.core.render import TAG_PREFIX

    assert job_events.TEMPLATE_TAG == f"{TAG_PREFIX}template"
    assert job_events.ENVIRONMENT_TAG == f"{TAG_PREFIX}environment"


def test_a_long_subject_is_cut_to_the_sns_limit():
    name = PREFIX + "r" * 50
    outcome = job_events.JobOutcome.from_detail(state_change(name, "Failed", QUOTA)["detail"])
    subject = outcome.subject("a-rather-long-environment-name")
    assert len(subject) == 100 and subject.endswith("...")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"ENVIRONMENT_NAME": "dev"}, "JOB_NAME_PREFIX: give"),
        ({"JOB_NAME_PREFIX": PREFIX}, "ENVIRONMENT_NAME: give"),
    ],
)
def test_bad_settings_name_the_variable(environ, message):
    with pytest.raises(ValueError, match=message):
        JobEventSettings.from_environment(environ)
