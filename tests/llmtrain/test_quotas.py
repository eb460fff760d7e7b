"""The quota-usage function against moto, with Service Quotas answered by botocore's Stubber.

Training jobs are created in moto through CreateTrainingJob and put into the states the function
reads (see sagemaker_fleet_support). moto 5.2.5's Service Quotas knows only the `vpc` service and has
no ListServiceQuotas, so the Service Quotas client is a real botocore client with a Stubber: its
requests are still validated against the service's shapes, and the answers have the real shape.
CloudWatch is moto's: the metrics are read back from it.
"""

from __future__ import annotations

import json
import zlib
from datetime import UTC, datetime

import boto3
import pytest
from botocore.stub import Stubber
from moto import mock_aws
from sagemaker_fleet_support import REGION, TrainingFleet, minutes_ago

from llmtrain.core.function_settings import QUOTA_NAMESPACE, QuotaSettings, UsageKind
from llmtrain.handlers import quotas as quota_handler
from llmtrain.operations import quotas
from llmtrain.operations.quotas import QuotaCache, collect_usage

P4D = "ml.p4d.24xlarge"
P5 = "ml.p5.48xlarge"


def now() -> datetime:
    """Read when used, not at import: a long test session must not age the fleet or the metric window."""
    return datetime.now(UTC)


@pytest.fixture
def aws(monkeypatch):
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }.items():
        monkeypatch.setenv(key, value)
    with mock_aws():
        yield


@pytest.fixture
def fleet(aws):
    return TrainingFleet(boto3.client("sagemaker", region_name=REGION))


@pytest.fixture
def service_quotas():
    client = boto3.client("service-quotas", region_name=REGION)
    with Stubber(client) as stubber:
        yield client, stubber
        stubber.assert_no_pending_responses()


def quota(name: str, value: float, **extra) -> dict:
    return {
        "ServiceCode": "sagemaker",
        "QuotaName": name,
        "QuotaCode": f"L-{zlib.crc32(name.encode()):08X}",
        "Value": value,
        **extra,
    }


DEFAULTS = [
    quota(f"{P4D} for training job usage", 0),
    quota(f"{P4D} for spot training job usage", 4),
    quota(f"{P4D} for training warm pool usage", 0),
    quota(f"{P5} for training job usage", 0),
    quota(f"{P5} for spot training job usage", 0),
    quota(f"{P5} for training warm pool usage", 0),
]
# Applied values of the quotas that were raised; the spot quota of p4d keeps its default.
APPLIED = [quota(f"{P4D} for training job usage", 8), quota(f"{P4D} for training warm pool usage", 4)]


def expect_listing(stubber: Stubber, defaults=DEFAULTS, applied=APPLIED) -> None:
    stubber.add_response(
        "list_aws_default_service_quotas", {"Quotas": defaults}, {"ServiceCode": "sagemaker"}
    )
    # Two pages, so the paginator's NextToken round trip is exercised.
    stubber.add_response(
        "list_service_quotas", {"Quotas": applied[:1], "NextToken": "page-2"}, {"ServiceCode": "sagemaker"}
    )
    stubber.add_response(
        "list_service_quotas", {"Quotas": applied[1:]}, {"ServiceCode": "sagemaker", "NextToken": "page-2"}
    )


def build_fleet(fleet: TrainingFleet) -> None:
    fleet.running("llmtrain-dev-pretrain-1", instance_type=P4D, count=2)
    fleet.running("another-team-job", instance_type=P4D, count=1)  # the quota is account-wide
    fleet.running("llmtrain-dev-spot-1", instance_type=P4D, count=1, spot=True)
    fleet.running(
        "llmtrain-dev-hetero-1",
        instance_groups=[
            {"InstanceGroupName": "gpu", "InstanceType": P4D, "InstanceCount": 1},
            {"InstanceGroupName": "cpu", "InstanceType": "ml.c5.xlarge", "InstanceCount": 2},
        ],
    )
    fleet.running("llmtrain-dev-small-1", instance_type="ml.g5.xlarge", count=3)
    fleet.with_available_warm_pool(
        "llmtrain-dev-pool-1", instance_type=P4D, count=2, ended_at=minutes_ago(now(), 20), now=now()
    )
    fleet.with_ended_warm_pool(
        "llmtrain-dev-old-pool-1", instance_type=P4D, count=4, ended_at=minutes_ago(now(), 90)
    )
    fleet.create("llmtrain-dev-done-1", instance_type=P4D, count=8)  # Completed, no pool: holds nothing


def numbers(row: dict) -> tuple:
    return row["in_use"], row["quota"], row["utilization_percent"]


def by_key(usages):
    return {(u.instance_type, u.kind): u for u in usages}


def read_metric(name: str, instance_type: str, kind: str) -> list[float]:
    stats = boto3.client("cloudwatch", region_name=REGION).get_metric_statistics(
        Namespace=QUOTA_NAMESPACE,
        MetricName=name,
        Dimensions=[{"Name": "InstanceType", "Value": instance_type}, {"Name": "UsageKind", "Value": kind}],
        StartTime=minutes_ago(now(), 10),
        EndTime=minutes_ago(now(), -10),
        Period=60,
        Statistics=["Maximum"],
    )
    return [point["Maximum"] for point in stats["Datapoints"]]


def unreadable_quotas() -> list[float]:
    stats = boto3.client("cloudwatch", region_name=REGION).get_metric_statistics(
        Namespace=QUOTA_NAMESPACE,
        MetricName="UnreadableQuotas",
        StartTime=minutes_ago(now(), 10),
        EndTime=minutes_ago(now(), -10),
        Period=60,
        Statistics=["Maximum"],
    )
    return [point["Maximum"] for point in stats["Datapoints"]]


def test_the_handler_publishes_utilisation_of_running_jobs_spot_jobs_and_warm_pools(
    fleet, service_quotas, monkeypatch
):
    client, stubber = service_quotas
    build_fleet(fleet)
    expect_listing(stubber)
    real_client = boto3.client
    monkeypatch.setattr(
        quota_handler.boto3,
        "client",
        lambda name, *a, **k: client if name == "service-quotas" else real_client(name, *a, **k),
    )
    monkeypatch.setattr(quota_handler, "_CACHE", None)
    monkeypatch.setenv("INSTANCE_TYPES", f"{P4D},{P5}")

    result = quota_handler.handler({}, None)

    rows = {(row["instance_type"], row["usage_kind"]): row for row in result["usages"]}
    assert set(rows) == {(t, k.value) for t in (P4D, P5) for k in UsageKind}
    # 2 + 1 (another team) + 1 (one group of the heterogeneous job) on demand, against an applied 8.
    assert numbers(rows[P4D, "training"]) == (4, 8.0, 50.0)
    assert numbers(rows[P4D, "spot"]) == (1, 4.0, 25.0)  # the default value: never raised
    assert numbers(rows[P4D, "warm-pool"]) == (2, 4.0, 50.0)
    assert numbers(rows[P5, "training"]) == (0, 0.0, 0.0)
    assert rows[P4D, "training"]["quota_name"] == "ml.p4d.24xlarge for training job usage"
    assert result["unreadable_quotas"] == []

    assert read_metric("Utilization", P4D, "training") == [50.0]
    assert read_metric("InstancesInUse", P4D, "warm-pool") == [2.0]
    assert read_metric("Quota", P4D, "spot") == [4.0]
    assert read_metric("QuotaUnreadable", P4D, "training") == [0.0]
    assert unreadable_quotas() == [0.0]
    # Types the templates do not use are counted but not published.
    listed = boto3.client("cloudwatch", region_name=REGION).list_metrics(Namespace=QUOTA_NAMESPACE)
    published_types = {
        d["Value"] for m in listed["Metrics"] for d in m["Dimensions"] if d["Name"] == "InstanceType"
    }
    assert published_types == {P4D, P5}


def test_a_quota_that_cannot_be_listed_is_reported_and_usage_still_published(fleet, service_quotas):
    client, stubber = service_quotas
    build_fleet(fleet)
    stubber.add_client_error(
        "list_aws_default_service_quotas",
        "AccessDeniedException",
        "User is not authorized to perform: servicequotas:ListAWSDefaultServiceQuotas",
    )

    usages = collect_usage(
        sagemaker=fleet.client, service_quotas=client, instance_types=[P4D], cache=QuotaCache(3600)
    )
    quotas.publish(boto3.client("cloudwatch", region_name=REGION), QUOTA_NAMESPACE, usages, now())

    usage = by_key(usages)[P4D, UsageKind.TRAINING]
    assert (usage.in_use, usage.quota, usage.utilization_percent) == (4, None, None)
    assert "could not be listed" in usage.error and "AccessDeniedException" in usage.error
    assert all(u.error for u in usages)
    assert read_metric("QuotaUnreadable", P4D, "training") == [1.0]
    assert read_metric("InstancesInUse", P4D, "training") == [4.0]
    assert read_metric("Utilization", P4D, "training") == []
    assert unreadable_quotas() == [3.0]  # training, spot and warm pool of the one instance type


def test_one_unreadable_or_unknown_quota_does_not_hide_the_others(fleet, service_quotas):
    client, stubber = service_quotas
    fleet.running("llmtrain-dev-pretrain-1", instance_type=P4D, count=2)
    broken = quota(
        f"{P4D} for spot training job usage",
        0,
        ErrorReason={"ErrorCode": "SERVICE_QUOTA_NOT_AVAILABLE_ERROR", "ErrorMessage": "try later"},
    )
    defaults = [q for q in DEFAULTS if "warm pool" not in q["QuotaName"] and "spot" not in q["QuotaName"]]
    expect_listing(stubber, defaults=defaults + [broken], applied=APPLIED[:1] * 2)

    usages = by_key(
        collect_usage(
            sagemaker=fleet.client, service_quotas=client, instance_types=[P4D], cache=QuotaCache(3600)
        )
    )

    assert usages[P4D, UsageKind.TRAINING].quota == 8.0 and usages[P4D, UsageKind.TRAINING].error is None
    assert "SERVICE_QUOTA_NOT_AVAILABLE_ERROR" in usages[P4D, UsageKind.SPOT].error
    assert usages[P4D, UsageKind.WARM_POOL].error == (
        "no quota named 'ml.p4d.24xlarge for training warm pool usage' in Service Quotas for 'sagemaker' "
        "in this region"
    )


def test_quotas_are_listed_once_per_ttl_and_a_failed_listing_is_retried(service_quotas):
    client, stubber = service_quotas
    clock = [1000.0]
    cache = QuotaCache(ttl_seconds=300, clock=lambda: clock[0])

    stubber.add_client_error("list_aws_default_service_quotas", "ThrottlingException", "Rate exceeded")
    with pytest.raises(quotas.QuotaListingError, match="ThrottlingException"):
        cache.quotas(client)

    expect_listing(stubber)
    first = cache.quotas(client)
    clock[0] += 299
    assert cache.quotas(client) is first  # the Stubber would fail on an unexpected second listing
    stubber.assert_no_pending_responses()

    expect_listing(stubber, applied=[quota(f"{P4D} for training job usage", 16)] * 2)
    clock[0] += 1
    assert cache.quotas(client)[f"{P4D} for training job usage"]["Value"] == 16


def test_utilisation_of_a_zero_quota():
    assert quotas.QuotaUsage(P4D, UsageKind.TRAINING, 0, 0.0).utilization_percent == 0.0
    assert quotas.QuotaUsage(P4D, UsageKind.TRAINING, 1, 0.0).utilization_percent == 100.0
    assert quotas.QuotaUsage(P4D, UsageKind.TRAINING, 3, 4.0).utilization_percent == 75.0


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({}, "INSTANCE_TYPES: give at least one"),
        (
            {"INSTANCE_TYPES": "p4d.24xlarge"},
            "INSTANCE_TYPES: 'p4d.24xlarge' is not a SageMaker instance type",
        ),
        (
            {"INSTANCE_TYPES": P4D, "QUOTA_CACHE_TTL_SECONDS": "1h"},
            "QUOTA_CACHE_TTL_SECONDS: '1h' is not a whole",
        ),
        ({"INSTANCE_TYPES": P4D, "QUOTA_CACHE_TTL_SECONDS": "-1"}, "QUOTA_CACHE_TTL_SECONDS: must be >= 0"),
    ],
)
def test_bad_settings_name_the_variable(environ, message):
    with pytest.raises(ValueError, match=message):
        QuotaSettings.from_environment(environ)


def test_settings_from_and_to_the_environment():
    settings = QuotaSettings.from_environment(
        {"INSTANCE_TYPES": f" {P4D}, {P5} ", "METRIC_NAMESPACE": "X/Y", "QUOTA_CACHE_TTL_SECONDS": "60"}
    )
    assert settings == QuotaSettings(instance_types=(P4D, P5), namespace="X/Y", cache_ttl_seconds=60)
    assert QuotaSettings.from_environment(settings.to_environment()) == settings


# -- `llmtrain quotas` ------------------------------------------------------------------------------

DEV_ACCOUNT = "111111111111"  # config/dev.yaml; moto answers as this account (MOTO_ACCOUNT_ID)


@pytest.fixture
def dev_account(monkeypatch):
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "MOTO_ACCOUNT_ID": DEV_ACCOUNT,
    }.items():
        monkeypatch.setenv(key, value)
    with mock_aws():
        yield TrainingFleet(boto3.client("sagemaker", region_name=REGION), account=DEV_ACCOUNT)


def route_service_quotas(monkeypatch, client) -> None:
    """The CLI builds its own clients: hand it the stubbed Service Quotas client, moto for the rest."""
    real = boto3.session.Session.client

    def client_for(self, name, *args, **kwargs):
        return client if name == "service-quotas" else real(self, name, *args, **kwargs)

    monkeypatch.setattr(boto3.session.Session, "client", client_for)


def dev_instance_types() -> tuple[str, ...]:
    from llmtrain.core.catalog import Catalog
    from llmtrain.core.environments import load_environment
    from llmtrain.core.sourcedir import repository_root

    enabled = load_environment(repository_root() / "config" / "dev.yaml").enabled_templates
    return Catalog.load().instance_types(enabled)


def test_the_cli_prints_usage_against_quota_and_marks_the_threshold(
    dev_account, service_quotas, monkeypatch, capsys
):
    client, stubber = service_quotas
    dev_account.running("llmtrain-dev-big-a1", instance_type=P4D, count=4)
    dev_account.with_available_warm_pool(
        "llmtrain-dev-pool-a1", instance_type=P4D, ended_at=minutes_ago(now(), 5), now=now()
    )
    defaults = [quota(quotas.quota_name(t, kind), 2) for t in dev_instance_types() for kind in UsageKind]
    expect_listing(stubber, defaults=defaults, applied=[quota(f"{P4D} for training job usage", 4)] * 2)
    route_service_quotas(monkeypatch, client)

    from llmtrain.cli import main

    assert main(["quotas", "--env", "dev"]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"Environment dev (account {DEV_ACCOUNT}, {REGION})"
    rows = {tuple(line.split()[:2]): line.split() for line in lines[2:]}
    assert len(rows) == 3 * len(dev_instance_types())
    assert rows[P4D, "training"][2:5] == ["4", "4", "100%"]
    assert "at or above the 80% alarm threshold" in " ".join(rows[P4D, "training"])
    assert rows[P4D, "warm-pool"][2:5] == ["1", "2", "50%"]
    assert rows["ml.g5.2xlarge", "spot"][2:5] == ["0", "2", "0%"]


def test_the_cli_prints_json(dev_account, service_quotas, monkeypatch, capsys):
    client, stubber = service_quotas
    dev_account.running("llmtrain-dev-big-a1", instance_type=P4D, count=1, spot=True)
    stubber.add_client_error("list_aws_default_service_quotas", "AccessDeniedException", "no")
    route_service_quotas(monkeypatch, client)

    from llmtrain.cli import main

    assert main(["quotas", "--env", "dev", "--json"]) == 0

    rows = {(r["instance_type"], r["usage_kind"]): r for r in json.loads(capsys.readouterr().out)}
    assert rows[P4D, "spot"]["in_use"] == 1 and rows[P4D, "spot"]["quota"] is None
    assert "AccessDeniedException" in rows[P4D, "spot"]["error"]
    assert rows[P4D, "spot"]["over_threshold"] is False


def test_the_cli_without_credentials_says_what_to_do(monkeypatch, tmp_path, capsys):
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)

    from llmtrain.cli import main

    assert main(["quotas", "--env", "dev"]) == 1  # an AWS problem, not bad input (llmtrain.cli)
    error = capsys.readouterr().err
    assert error.startswith("llmtrain quotas: error: checking your AWS credentials: no AWS credentials found")
    assert "configure them (`aws configure`, `aws sso login` or AWS_PROFILE)" in error


def test_the_cli_refuses_credentials_of_another_account(monkeypatch, capsys):
    monkeypatch.setenv("MOTO_ACCOUNT_ID", "999999999999")
    for key, value in {
        "AWS_ACCESS_KEY_ID": "t",
        "AWS_SECRET_ACCESS_KEY": "t",
        "AWS_DEFAULT_REGION": REGION,
    }.items():
        monkeypatch.setenv(key, value)
    from llmtrain.cli import main

    with mock_aws():
        assert main(["quotas", "--env", "dev"]) == 2
    assert "credentials are for account 999999999999 but environment 'dev' is in account 111111111111" in (
        capsys.readouterr().err
    )


def test_the_cli_names_the_known_environments(capsys):
    from llmtrain.cli import main

    assert main(["quotas", "--env", "staging"]) == 2
    assert "--env staging: no " in capsys.readouterr().err
