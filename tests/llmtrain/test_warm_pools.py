"""The warm-pool reaper against training jobs in moto.

Jobs are created in moto through CreateTrainingJob and given Available or ended warm pools; moto
5.2.5 has no UpdateTrainingJob, so sagemaker_fleet_support adds it to moto with SageMaker's documented
effect (a keep-alive of 0 ends an Available pool) and records the requests it receives. The reaper
runs through its Lambda entry point with moto's SageMaker and CloudWatch.
"""

from __future__ import annotations

from datetime import UTC, datetime

import boto3
import pytest
from botocore.stub import Stubber
from moto import mock_aws
from sagemaker_fleet_support import REGION, TrainingFleet, install_update_training_job, minutes_ago

from llmtrain.core.function_settings import WARM_POOL_NAMESPACE, ReaperSettings
from llmtrain.handlers import warm_pools as reaper_handler
from llmtrain.operations import warm_pools

P4D = "ml.p4d.24xlarge"
G5 = "ml.g5.48xlarge"
PREFIX = "llmtrain-dev-"
BUDGET_SECONDS = 3600


@pytest.fixture
def fleet(monkeypatch):
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "JOB_NAME_PREFIX": PREFIX,
        "IDLE_BUDGET_SECONDS": str(BUDGET_SECONDS),
        "ENVIRONMENT_NAME": "dev",
        "INSTANCE_TYPES": f"{P4D},{G5}",
        "DRY_RUN": "false",
    }.items():
        monkeypatch.setenv(key, value)
    with mock_aws():
        yield TrainingFleet(boto3.client("sagemaker", region_name=REGION))


def build_pools(fleet: TrainingFleet, now: datetime) -> None:
    fleet.with_available_warm_pool(
        f"{PREFIX}idle-1", instance_type=P4D, count=2, ended_at=minutes_ago(now, 90), now=now
    )
    fleet.with_available_warm_pool(
        f"{PREFIX}fresh-1", instance_type=P4D, ended_at=minutes_ago(now, 10), now=now
    )
    fleet.with_available_warm_pool(
        f"{PREFIX}idle-g5-1", instance_type=G5, ended_at=minutes_ago(now, 61), now=now
    )
    # Another team's pool: over the budget, but not the platform's to end.
    fleet.with_available_warm_pool(
        "other-team-idle", instance_type=P4D, ended_at=minutes_ago(now, 180), now=now
    )
    fleet.with_ended_warm_pool(f"{PREFIX}gone-1", instance_type=P4D, ended_at=minutes_ago(now, 300))
    fleet.running(f"{PREFIX}running-1", instance_type=P4D, count=4)


def statuses(fleet: TrainingFleet) -> dict[str, str | None]:
    names = [
        f"{PREFIX}idle-1",
        f"{PREFIX}fresh-1",
        f"{PREFIX}idle-g5-1",
        "other-team-idle",
        f"{PREFIX}gone-1",
    ]
    return {name: fleet.warm_pool_status(name) for name in names}


def latest(metric: str, **dimensions: str) -> float | None:
    stats = boto3.client("cloudwatch", region_name=REGION).get_metric_statistics(
        Namespace=WARM_POOL_NAMESPACE,
        MetricName=metric,
        Dimensions=[{"Name": k, "Value": v} for k, v in dimensions.items()],
        StartTime=minutes_ago(datetime.now(UTC), 10),
        EndTime=minutes_ago(datetime.now(UTC), -10),
        Period=60,
        Statistics=["Maximum"],
    )
    points = sorted(stats["Datapoints"], key=lambda p: p["Timestamp"])
    return points[-1]["Maximum"] if points else None


def test_the_dry_run_reports_what_a_real_run_then_ends(fleet, monkeypatch):
    update_requests = install_update_training_job(monkeypatch)
    build_pools(fleet, datetime.now(UTC))
    before = statuses(fleet)

    preview = reaper_handler.handler({"dry_run": True}, None)

    assert preview["dry_run"] is True and update_requests == []
    assert statuses(fleet) == before
    previewed = {p["training_job_name"]: p for p in preview["warm_pools"]}
    assert set(previewed) == {f"{PREFIX}idle-1", f"{PREFIX}fresh-1", f"{PREFIX}idle-g5-1"}
    would_end = {name for name, p in previewed.items() if p["over_budget"]}
    assert would_end == {f"{PREFIX}idle-1", f"{PREFIX}idle-g5-1"}
    assert not any(p["ended"] for p in previewed.values())
    assert 5390 <= previewed[f"{PREFIX}idle-1"]["idle_seconds"] <= 5460
    assert latest("WarmPoolsOverBudget", Environment="dev") == 2.0
    assert latest("WarmPoolsEnded", Environment="dev") == 0.0

    real = reaper_handler.handler({}, None)  # DRY_RUN=false in the environment

    assert real["dry_run"] is False
    assert {p["training_job_name"] for p in real["warm_pools"] if p["ended"]} == would_end
    assert sorted(r["TrainingJobName"] for r in update_requests) == sorted(would_end)
    assert all(r["ResourceConfig"] == {"KeepAlivePeriodInSeconds": 0} for r in update_requests)
    assert statuses(fleet) == before | dict.fromkeys(would_end, "Terminated")
    assert latest("WarmPoolsEnded", Environment="dev") == 1.0 * len(would_end)

    after = reaper_handler.handler({}, None)
    assert [p["training_job_name"] for p in after["warm_pools"]] == [f"{PREFIX}fresh-1"]


def test_retained_billable_seconds_are_published_per_instance_type_and_in_total(fleet):
    now = datetime.now(UTC)
    build_pools(fleet, now)

    reaper_handler.handler({"dry_run": True}, None)

    # Retained seconds times instances: 2 x 90 min and 1 x 10 min on p4d; 1 x 61 min on g5.
    p4d_seconds = latest("RetainedBillableSeconds", Environment="dev", InstanceType=P4D)
    assert p4d_seconds == 2 * 90 * 60 + 10 * 60
    assert latest("RetainedBillableSeconds", Environment="dev", InstanceType=G5) == 61 * 60
    assert latest("RetainedBillableSeconds", Environment="dev") == p4d_seconds + 61 * 60
    assert latest("WarmPoolsAvailable", Environment="dev", InstanceType=P4D) == 2.0
    assert latest("WarmPoolInstancesAvailable", Environment="dev", InstanceType=P4D) == 3.0


def test_configured_instance_types_without_pools_publish_zero(fleet):
    result = reaper_handler.handler({}, None)

    assert result["warm_pools"] == []
    assert latest("WarmPoolsAvailable", Environment="dev", InstanceType=G5) == 0.0
    assert latest("RetainedBillableSeconds", Environment="dev") == 0.0


def test_a_pool_taken_between_listing_and_ending_is_reported_not_crashed_on():
    # Stubbed SageMaker: the pool is listed and described as Available, then reused by another job
    # before UpdateTrainingJob reaches it.
    sagemaker = boto3.client(
        "sagemaker", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x"
    )
    now = datetime.now(UTC)
    name = f"{PREFIX}raced-1"
    with Stubber(sagemaker) as stubber:
        stubber.add_response(
            "list_training_jobs",
            {
                "TrainingJobSummaries": [
                    {
                        "TrainingJobName": name,
                        "TrainingJobArn": f"arn:aws:sagemaker:{REGION}:123456789012:training-job/{name}",
                        "CreationTime": now,
                        "TrainingJobStatus": "Completed",
                    }
                ]
            },
            {"WarmPoolStatusEquals": "Available", "MaxResults": 100},
        )
        stubber.add_response(
            "describe_training_job",
            {
                "TrainingJobName": name,
                "TrainingJobArn": f"arn:aws:sagemaker:{REGION}:123456789012:training-job/{name}",
                "TrainingJobStatus": "Completed",
                "SecondaryStatus": "Completed",
                "AlgorithmSpecification": {"TrainingInputMode": "File"},
                "ModelArtifacts": {"S3ModelArtifacts": "s3://a/b"},
                "ResourceConfig": {
                    "InstanceType": P4D,
                    "InstanceCount": 1,
                    "VolumeSizeInGB": 100,
                    "KeepAlivePeriodInSeconds": 7200,
                },
                "WarmPoolStatus": {"Status": "Available", "ResourceRetainedBillableTimeInSeconds": 4000},
                "StoppingCondition": {"MaxRuntimeInSeconds": 3600},
                "CreationTime": minutes_ago(now, 200),
                "TrainingEndTime": minutes_ago(now, 67),
            },
            {"TrainingJobName": name},
        )
        stubber.add_client_error(
            "update_training_job",
            "ValidationException",
            "The warm pool is in use.",
            expected_params={"TrainingJobName": name, "ResourceConfig": {"KeepAlivePeriodInSeconds": 0}},
        )

        [decision] = warm_pools.reap(
            sagemaker, job_name_prefix=PREFIX, idle_budget_seconds=BUDGET_SECONDS, dry_run=False, now=now
        )

    assert decision.over_budget and not decision.ended
    assert "ValidationException" in decision.error and "in use" in decision.error


def test_the_budget_is_a_strict_limit(fleet):
    now = datetime.now(UTC)
    fleet.with_available_warm_pool(f"{PREFIX}edge-1", ended_at=minutes_ago(now, 30), now=now)
    decisions = warm_pools.reap(
        fleet.client, job_name_prefix=PREFIX, idle_budget_seconds=30 * 60 + 5, dry_run=True, now=now
    )
    assert [d.over_budget for d in decisions] == [False]
    decisions = warm_pools.reap(
        fleet.client, job_name_prefix=PREFIX, idle_budget_seconds=30 * 60 - 1, dry_run=True, now=now
    )
    assert [d.over_budget for d in decisions] == [True]


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"IDLE_BUDGET_SECONDS": "60", "ENVIRONMENT_NAME": "dev"}, "JOB_NAME_PREFIX: give"),
        (
            {"JOB_NAME_PREFIX": PREFIX, "IDLE_BUDGET_SECONDS": "1h", "ENVIRONMENT_NAME": "dev"},
            "IDLE_BUDGET_SECONDS: '1h' is not a whole number",
        ),
        (
            {"JOB_NAME_PREFIX": PREFIX, "IDLE_BUDGET_SECONDS": "-5", "ENVIRONMENT_NAME": "dev"},
            "IDLE_BUDGET_SECONDS: must be >= 0",
        ),
        (
            {
                "JOB_NAME_PREFIX": PREFIX,
                "IDLE_BUDGET_SECONDS": "60",
                "ENVIRONMENT_NAME": "dev",
                "DRY_RUN": "1",
            },
            "DRY_RUN: write true or false, got '1'",
        ),
        ({"JOB_NAME_PREFIX": PREFIX, "IDLE_BUDGET_SECONDS": "60"}, "ENVIRONMENT_NAME: give"),
    ],
)
def test_bad_settings_name_the_variable(environ, message):
    with pytest.raises(ValueError, match=message):
        ReaperSettings.from_environment(environ)


def test_a_non_boolean_dry_run_in_the_event_is_refused(fleet):
    with pytest.raises(ValueError, match="dry_run: must be true or false"):
        reaper_handler.handler({"dry_run": "yes"}, None)
