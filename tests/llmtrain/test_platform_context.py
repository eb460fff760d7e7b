"""PlatformContext: what rendering needs from an environment, validated and JSON round-trippable."""

from __future__ import annotations

import json

import pytest
from templates_support import platform_context

from llmtrain.core.errors import PlatformContextError
from llmtrain.core.platform import PlatformContext, is_job_name_prefix, team_job_log_streams
from llmtrain.core.team_context import placeholder_context


def test_round_trip_through_json():
    context = platform_context()
    again = PlatformContext.from_dict(json.loads(json.dumps(context.to_dict())))
    assert again == context
    assert again.subnet_ids == ("subnet-0aaaaaaaaaaaaaaa1", "subnet-0aaaaaaaaaaaaaaa2")
    assert again.dry_run is False


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"region": "mars-1"}, "region 'mars-1' must be an AWS region"),
        ({"account": "12345"}, "account '12345' must be a 12-digit AWS account id"),
        ({"execution_role_arn": "role/x"}, "execution_role_arn 'role/x' must be an IAM role ARN"),
        ({"kms_key_arn": "alias/x"}, "kms_key_arn 'alias/x' must be a KMS key ARN"),
        ({"code_bucket": "Bad_Bucket"}, "code_bucket 'Bad_Bucket' must be an S3 bucket name"),
        ({"subnet_ids": ()}, "subnet_ids must hold 1..16 ids, got 0"),
        ({"security_group_ids": ("group-1",)}, "security_group_ids entry 'group-1' is not a valid id"),
        ({"warm_pool_cap_seconds": 30000}, "warm_pool_cap_seconds 30000 must be an integer in 0..21600"),
        ({"job_name_prefix": "x" * 38}, "job_name_prefix"),
        # SageMaker lowercases job names inside ARNs, where the IAM policies match the prefix.
        ({"job_name_prefix": "LLMTrain"}, "job_name_prefix 'LLMTrain' must be 1-37 lowercase"),
        ({"team": "ml-a"}, "team 'ml-a' must be 1-12 lowercase letters and digits"),
        ({"team": "Nlp"}, "team 'Nlp'"),
        ({"max_instance_count": 0}, "max_instance_count 0 must be a whole number of at least 1"),
    ],
)
def test_bad_fields_are_named(changes, message):
    with pytest.raises(PlatformContextError, match=message):
        platform_context(**changes)


def test_from_dict_names_unknown_and_missing_fields():
    data = platform_context().to_dict()
    with pytest.raises(PlatformContextError, match="unknown platform context field.*: vpc"):
        PlatformContext.from_dict({**data, "vpc": "vpc-1"})
    del data["kms_key_arn"]
    with pytest.raises(PlatformContextError, match="lacks field.*: kms_key_arn"):
        PlatformContext.from_dict(data)


def test_placeholder_is_marked_as_a_dry_run():
    context = placeholder_context(
        environment="dev",
        account="111111111111",
        region="eu-west-1",
        resource_prefix="llmtrain-dev",
        warm_pool_cap_seconds=3600,
    )
    assert context.dry_run is True
    assert "DRYRUN" in context.execution_role_arn
    assert context.code_bucket == "llmtrain-dev-code-111111111111-eu-west-1"
    # The implicit team of an environment without `teams:` is `default`, with its own job-name prefix.
    assert (context.team, context.job_name_prefix) == ("default", "llmtrain-dev-default")
    assert context.datasets_uri == "s3://llmtrain-dev-datasets-111111111111-eu-west-1/teams/default/"


def test_a_team_context_round_trips_with_its_limits():
    context = platform_context(
        team="nlp",
        job_name_prefix="llmtrain-dev-nlp",
        allowed_templates=("gpt2-ddp",),
        allowed_instance_types=("ml.g5.12xlarge",),
        max_instance_count=2,
        inter_container_traffic_encryption=True,
    )
    again = PlatformContext.from_dict(json.loads(json.dumps(context.to_dict())))
    assert again == context and again.data_prefix == "teams/nlp/"
    # A context written before teams existed still reads, as the default team without limits.
    legacy = {k: v for k, v in context.to_dict().items() if k not in (
        "team", "allowed_templates", "allowed_instance_types", "max_instance_count",
        "inter_container_traffic_encryption")}
    assert PlatformContext.from_dict(legacy).team == "default"


@pytest.mark.parametrize("prefix", ["llmtrain-dev", "a", "team--a", "7" * 24])
def test_job_name_prefixes_the_config_the_constructs_and_the_context_accept(prefix):
    assert is_job_name_prefix(prefix)
    assert platform_context(job_name_prefix=prefix).job_name_prefix == prefix


@pytest.mark.parametrize("prefix", ["LLMTrain", "-dev", "dev-", "x" * 38, "", "team_a", "dev.1", 7, None])
def test_job_name_prefixes_everyone_refuses(prefix):
    assert not is_job_name_prefix(prefix, 37)
    with pytest.raises(PlatformContextError, match="job_name_prefix"):
        platform_context(job_name_prefix=prefix)


QUEUES = {
    "queue_arns": {"standard": "arn:aws:batch:us-east-1:111111111111:job-queue/llmtrain-dev-standard"},
    "default_queue": "standard",
    "share_identifier": "default",
    "max_priority": 10,
    "max_instances": 16,
    "capacity_wait_seconds": 3600,
}


def test_a_teams_queues_round_trip_and_are_left_out_without_queues():
    assert "queues" not in platform_context().to_dict()  # a context without queues reads as before
    context = platform_context(queues=QUEUES)
    again = PlatformContext.from_dict(json.loads(json.dumps(context.to_dict())))
    assert again == context and again.queues.queue_arn(None) == QUEUES["queue_arns"]["standard"]
    assert again.queues.queue_arn("standard") == QUEUES["queue_arns"]["standard"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"queue_arns": {}}, "queue_arns must map at least one queue"),
        ({"queue_arns": {"standard": "arn:aws:batch:us-east-1:111111111111:compute-environment/x"}},
         "is not a job queue ARN"),
        ({"default_queue": "urgent"}, "default_queue 'urgent' is not one of the team's queues"),
        ({"max_priority": 10000}, "max_priority must be a whole number from 0 to 9999"),
        ({"max_instances": 0}, "max_instances must be a positive whole number"),
    ],
)
def test_bad_queues_are_named(changes, message):
    with pytest.raises(PlatformContextError, match=message):
        platform_context(queues={**QUEUES, **changes})
    with pytest.raises(PlatformContextError, match="queues must have exactly the fields"):
        platform_context(queues={**QUEUES, "extra": 1})


def test_a_teams_log_streams_include_its_queued_jobs_where_batchs_name_keeps_the_prefix():
    """AWS Batch names a queued job AWSBatch<the payload's name, cut to 23 characters><attempt id>."""
    assert team_job_log_streams("llmtrain-prod-pretrain") == (
        "llmtrain-prod-pretrain-*", "AWSBatchllmtrain-prod-pretrain-*")
    assert team_job_log_streams("acme-training-platform-a") == ("acme-training-platform-a-*",)


def test_a_context_is_put_together_in_one_place():
    """Every team's context comes from llmtrain.core.team_context (the CLI, the local runner, the
    planner, the constructs and the tests): nothing else calls PlatformContext(...) by its fields."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    callers = []
    for folder in ("llmtrain", "constructs/training_constructs", "stacks", "tests", "bench", "scripts"):
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id == "PlatformContext"):
                    callers.append(str(path.relative_to(root)))
    assert callers == []
