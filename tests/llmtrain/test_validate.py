"""Request validation: botocore's constraints that ParamValidator skips, and the platform's rules."""

from __future__ import annotations

import copy

import pytest
from botocore.validate import ParamValidator
from templates_support import catalog, platform_context

from llmtrain.core.errors import RequestValidationError
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.validate import (
    create_training_job_shape,
    degree_problems,
    efa_problems,
    job_name_problems,
    shape_problems,
    storage_problems,
    validate_request,
)

PLATFORM = platform_context()


@pytest.fixture(scope="module")
def request_template() -> dict:
    return render(catalog().resolve("byo-script"), RunInput(run_name="r1"), PLATFORM)


def _with(request: dict, path: str, value) -> dict:
    changed = copy.deepcopy(request)
    node = changed
    *parents, last = path.split(".")
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value
    return changed


# Each violates metadata that botocore's ParamValidator does not check (max, pattern, enum, map size).
CONSTRAINT_CASES = [
    (
        "ResourceConfig.KeepAlivePeriodInSeconds",
        30000,
        "CreateTrainingJob.ResourceConfig.KeepAlivePeriodInSeconds is 30000; SageMaker allows at most 21600",
    ),
    (
        "TrainingJobName",
        "bad_name",
        "CreateTrainingJob.TrainingJobName 'bad_name' does not match SageMaker's pattern",
    ),
    (
        "TrainingJobName",
        "a" * 64,
        "CreateTrainingJob.TrainingJobName is 64 characters long; SageMaker allows at most 63",
    ),
    ("ResourceConfig.InstanceType", "ml.p9.mega", "'ml.p9.mega' is not one of SageMaker's values"),
    ("AlgorithmSpecification.TrainingInputMode", "Stream", "'Stream' is not one of SageMaker's values"),
    ("RetryStrategy.MaximumRetryAttempts", 31, "MaximumRetryAttempts is 31; SageMaker allows at most 30"),
    ("Tags.0.Value", "a,b", "CreateTrainingJob.Tags[0].Value 'a,b' does not match SageMaker's pattern"),
    ("HyperParameters.long", "x" * 2501, "is 2501 characters long; SageMaker allows at most 2500"),
    (
        "HyperParameters",
        {f"k{i}": "1" for i in range(101)},
        "CreateTrainingJob.HyperParameters holds 101 entries; SageMaker allows at most 100",
    ),
    (
        "RoleArn",
        "arn:aws:iam::123:role/x",
        "CreateTrainingJob.RoleArn 'arn:aws:iam::123:role/x' does not match",
    ),
    (
        "VpcConfig.Subnets",
        [f"subnet-{i}" for i in range(17)],
        "VpcConfig.Subnets holds 17 items; SageMaker allows at most 16",
    ),
    (
        "CheckpointConfig.S3Uri",
        "ftp://x/y",
        "CheckpointConfig.S3Uri 'ftp://x/y' does not match SageMaker's pattern",
    ),
]


@pytest.mark.parametrize(("path", "value", "message"), CONSTRAINT_CASES, ids=[c[0] for c in CONSTRAINT_CASES])
def test_constraints_botocore_skips_are_enforced(request_template, path, value, message):
    bad = _with(request_template, path, value)
    assert not ParamValidator().validate(bad, create_training_job_shape()).has_errors(), (
        "botocore's ParamValidator alone would have let this through"
    )
    problems = shape_problems(bad)
    assert any(message in p for p in problems), problems


def test_botocore_own_findings_are_kept(request_template):
    bad = _with(request_template, "ResourceConfig.InstanceCount", "2")
    bad.pop("RoleArn")
    problems = shape_problems(bad)
    assert any('Missing required parameter in input: "RoleArn"' in p for p in problems)
    assert any("Invalid type for parameter ResourceConfig.InstanceCount" in p for p in problems)


def test_validate_request_lists_every_problem(request_template):
    bad = _with(request_template, "TrainingJobName", "other-prefix-r1-a1")
    bad = _with(bad, "ResourceConfig.KeepAlivePeriodInSeconds", 7200)
    with pytest.raises(RequestValidationError) as error:
        validate_request(bad, PLATFORM)
    assert len(error.value.problems) == 2
    assert "must start with the environment's prefix 'llmtrain-test-'" in str(error.value)
    assert "keep_alive_seconds 7200 exceeds this environment's warm-pool cap of 3600 seconds" in str(
        error.value
    )


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("llmtrain-test-" + "a" * 50, "is 64 characters; SageMaker allows 63"),
        ("llmtrain-test-run_1-a1", "must be letters, digits and dashes"),
        ("llmtrain-test-run-", "must be letters, digits and dashes"),
        ("someone-else-r1-a1", "must start with the environment's prefix 'llmtrain-test-'"),
    ],
)
def test_bad_job_names(name, message):
    problems = job_name_problems(name, "llmtrain-test")
    assert any(message in p for p in problems), problems
    assert job_name_problems("llmtrain-test-r1-a1", "llmtrain-test") == []


def test_efa_rule():
    assert efa_problems("ml.g5.12xlarge", 1) == []
    assert efa_problems("ml.p4d.24xlarge", 16) == []
    assert "needs an EFA-capable instance type" in efa_problems("ml.g5.12xlarge", 2)[0]


@pytest.mark.parametrize(
    ("degrees", "world", "ok"),
    [
        ({"shard_degree": 0, "replicate_degree": 1, "tensor_parallel_degree": 1}, 16, True),
        ({"shard_degree": 2, "replicate_degree": 0, "tensor_parallel_degree": 4}, 32, True),
        ({"shard_degree": 2, "replicate_degree": 0, "tensor_parallel_degree": 4}, 12, False),
        ({"shard_degree": 2, "replicate_degree": 2, "tensor_parallel_degree": 2}, 8, True),
        ({"shard_degree": 2, "replicate_degree": 2, "tensor_parallel_degree": 2}, 16, False),  # none derived
    ],
)
def test_degree_rule(degrees, world, ok):
    assert (degree_problems(degrees, world) == []) is ok


def test_instance_storage_rules():
    assert storage_problems("ml.c5.2xlarge", 500, volume_kms_key=True) == []
    problems = storage_problems("ml.g5.2xlarge", 1000, volume_kms_key=True)
    assert "volume_size_gb 1000 exceeds the 450 GB of instance storage of ml.g5.2xlarge" in problems[0]
    assert "SageMaker rejects a VolumeKmsKeyId" in problems[1]
