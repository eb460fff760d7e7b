"""TrainingAccess: the execution role, the engineers' policy and the warm-pool cap."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import aws_cdk as cdk
import pytest
from aws_cdk import aws_iam as iam
from infra_helpers import ENV, as_list, resources_of_type, statements_by_sid, synthesize

from training_constructs import PropsError, TrainingAccess, TrainingStorage, warm_pool_cap_statement
from training_constructs.images import (
    DLC_REGISTRY_ACCOUNTS,
    DLC_REPOSITORIES,
    SMP_REGISTRY_ACCOUNTS,
    SMP_REPOSITORY,
)

ENVS = ["dev", "prod"]
STATE_MACHINE = "arn:aws:states:us-east-1:111111111111:stateMachine:llmtrain-launcher"


def execution_statements(platform, env):
    return statements_by_sid(
        platform.template_json(env, "access"), "AWS::IAM::Policy", "AccessExecutionPolicy"
    )


def engineer_statements(template):
    return statements_by_sid(template, "AWS::IAM::ManagedPolicy", "AccessEngineerPolicy")


def as_text(value):
    """A template value as text, to look for the logical IDs that its references name."""
    return json.dumps(value)


@pytest.mark.parametrize("env", ENVS)
def test_only_sagemaker_of_this_account_can_assume_the_role(platform, environments, env):
    template = platform.template_json(env, "access")
    [role] = resources_of_type(template, "AWS::IAM::Role").values()
    [statement] = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert statement["Principal"] == {"Service": "sagemaker.amazonaws.com"}
    assert statement["Action"] == "sts:AssumeRole"
    assert statement["Condition"] == {"StringEquals": {"aws:SourceAccount": environments[env].account}}


@pytest.mark.parametrize("env", ENVS)
def test_role_reads_inputs_and_writes_only_checkpoints_and_artifacts(platform, env):
    statements = execution_statements(platform, env)
    reads = as_text(statements["ReadTrainingInputs"]["Resource"])
    for name in ("Datasets", "Code", "Checkpoints", "Artifacts"):
        assert f"{name}BucketArn" in reads, name
    assert statements["ReadTrainingInputs"]["Action"] == "s3:GetObject"
    checkpoints = statements["WriteCheckpoints"]
    assert set(checkpoints["Action"]) == {"s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"}
    assert "CheckpointsBucketArn" in as_text(checkpoints["Resource"])
    artifacts = statements["WriteArtifacts"]
    assert set(artifacts["Action"]) == {"s3:PutObject", "s3:AbortMultipartUpload"}
    assert "ArtifactsBucketArn" in as_text(artifacts["Resource"])
    writers = [
        s for s in statements.values() if {"s3:PutObject", "s3:DeleteObject"} & set(as_list(s["Action"]))
    ]
    assert {s["Sid"] for s in writers} == {"WriteCheckpoints", "WriteArtifacts"}
    for statement in writers:
        assert "Datasets" not in as_text(statement["Resource"]) and "Code" not in as_text(
            statement["Resource"]
        )


@pytest.mark.parametrize("env", ENVS)
def test_role_uses_the_platform_key(platform, env):
    statements = execution_statements(platform, env)
    assert set(statements["UsePlatformKey"]["Action"]) == {
        "kms:Decrypt",
        "kms:GenerateDataKey",
        "kms:DescribeKey",
    }
    assert "PlatformKeyArn" in as_text(statements["UsePlatformKey"]["Resource"])
    assert statements["GrantKeyToVolumes"]["Condition"] == {"Bool": {"kms:GrantIsForAWSResource": True}}


@pytest.mark.parametrize("env", ENVS)
def test_role_pulls_only_the_deep_learning_container_repositories(platform, environments, env):
    region = environments[env].region
    statements = execution_statements(platform, env)
    pull = statements["PullTrainingImages"]
    assert set(pull["Action"]) == {
        "ecr:BatchGetImage",
        "ecr:GetDownloadUrlForLayer",
        "ecr:BatchCheckLayerAvailability",
    }
    repositories = {arn["Fn::Join"][1][-1] for arn in pull["Resource"]}
    assert repositories == {
        f":ecr:{region}:763104351884:repository/pytorch-training",
        f":ecr:{region}:763104351884:repository/huggingface-pytorch-training",
        f":ecr:{region}:658645717510:repository/smdistributed-modelparallel",
    }
    assert statements["EcrLogin"] == {
        "Sid": "EcrLogin",
        "Effect": "Allow",
        "Action": "ecr:GetAuthorizationToken",
        "Resource": "*",
    }


@pytest.mark.parametrize("env", ENVS)
def test_role_writes_training_logs_and_metrics(platform, environments, env):
    config = environments[env]
    statements = execution_statements(platform, env)
    logs = statements["WriteTrainingLogs"]
    arns = [arn["Fn::Join"][1][-1] for arn in logs["Resource"]]
    group = f":logs:{config.region}:{config.account}:log-group:/aws/sagemaker/TrainingJobs"
    assert arns == [group, f"{group}:log-stream:*"]
    metrics = statements["PublishTrainingMetrics"]
    assert metrics["Action"] == "cloudwatch:PutMetricData" and metrics["Resource"] == "*"
    assert metrics["Condition"] == {"StringEquals": {"cloudwatch:namespace": "/aws/sagemaker/TrainingJobs"}}


@pytest.mark.parametrize("env", ENVS)
def test_role_manages_network_interfaces_in_the_platform_subnets(platform, environments, env):
    statements = execution_statements(platform, env)
    create = statements["CreateJobNetworkInterfaces"]
    assert create["Action"] == "ec2:CreateNetworkInterface"
    resources = as_text(create["Resource"])
    assert resources.count(":subnet/") == len(environments[env].network.availability_zones)
    assert resources.count(":security-group/") == 1 and "TrainingSecurityGroup" in resources
    assert "subnet/*" not in resources and "security-group/*" not in resources
    manage = statements["ManageJobNetworkInterfaces"]
    assert set(manage["Action"]) == {
        "ec2:CreateNetworkInterfacePermission",
        "ec2:DeleteNetworkInterface",
        "ec2:DeleteNetworkInterfacePermission",
    }
    assert manage["Resource"]["Fn::Join"][1][-1].endswith(":network-interface/*")
    assert set(statements["DescribeJobNetwork"]["Action"]) == {
        "ec2:DescribeNetworkInterfaces",
        "ec2:DescribeVpcs",
        "ec2:DescribeDhcpOptions",
        "ec2:DescribeSubnets",
        "ec2:DescribeSecurityGroups",
    }


@pytest.mark.parametrize("env", ENVS)
def test_warm_pool_cap_denies_longer_keep_alive_for_role_and_engineers(platform, environments, env):
    cap = environments[env].warm_pools.max_keep_alive_seconds
    template = platform.template_json(env, "access")
    expected = {
        "Sid": "CapWarmPoolKeepAlive",
        "Effect": "Deny",
        "Action": ["sagemaker:CreateTrainingJob", "sagemaker:UpdateTrainingJob"],
        "Resource": "*",
        "Condition": {"NumericGreaterThan": {"sagemaker:KeepAlivePeriod": cap}},
    }
    guardrail = statements_by_sid(template, "AWS::IAM::ManagedPolicy", "AccessWarmPoolGuardrailPolicy")
    assert guardrail == {"CapWarmPoolKeepAlive": expected}
    assert engineer_statements(template)["CapWarmPoolKeepAlive"] == expected
    [role] = resources_of_type(template, "AWS::IAM::Role").values()
    guardrail_id = next(
        iter(
            resources_of_type(template, "AWS::IAM::ManagedPolicy").keys()
            & {k for k in template["Resources"] if k.startswith("AccessWarmPoolGuardrail")}
        )
    )
    assert {"Ref": guardrail_id} in role["Properties"]["ManagedPolicyArns"]


@pytest.mark.parametrize("env", ENVS)
def test_engineers_read_only_the_platform_jobs_and_logs(platform, environments, env):
    config = environments[env]
    statements = engineer_statements(platform.template_json(env, "access"))
    read = statements["ReadPlatformTrainingJobs"]
    assert set(read["Action"]) == {"sagemaker:DescribeTrainingJob", "sagemaker:ListTags"}
    assert read["Resource"]["Fn::Join"][1][-1] == (
        f":sagemaker:{config.region}:{config.account}:training-job/{config.job_name_prefix}*"
    )
    assert statements["ListTrainingJobs"]["Resource"] == "*"
    logs = statements["ReadTrainingLogs"]
    assert set(logs["Action"]) == {"logs:DescribeLogStreams", "logs:FilterLogEvents", "logs:GetLogEvents"}
    assert logs["Resource"][1]["Fn::Join"][1][-1].endswith(
        f"log-group:/aws/sagemaker/TrainingJobs:log-stream:{config.job_name_prefix}*"
    )
    # Nothing that starts, stops or changes a training job directly.
    allowed = {a for s in statements.values() if s["Effect"] == "Allow" for a in as_list(s["Action"])}
    assert not {"sagemaker:CreateTrainingJob", "sagemaker:StopTrainingJob", "iam:PassRole"} & allowed


@pytest.fixture(scope="module")
def launcher_wiring(tmp_path_factory):
    """The construct as the launcher will use it: a state machine for engineers, PassRole for its role."""
    outdir = tmp_path_factory.mktemp("access-variants")
    app = cdk.App(outdir=str(outdir))
    stack = cdk.Stack(app, "Wired", env=ENV)
    storage = TrainingStorage(stack, "Storage")
    access = TrainingAccess(
        stack,
        "Access",
        datasets_bucket=storage.datasets_bucket,
        checkpoints_bucket=storage.checkpoints_bucket,
        artifacts_bucket=storage.artifacts_bucket,
        code_bucket=storage.code_bucket,
        key=storage.key,
        job_name_prefix="team-a",
        max_keep_alive_seconds=600,
        launcher_state_machine_arns=[STATE_MACHINE],
        image_repository_arns=["arn:aws:ecr:us-east-1:111111111111:repository/team-a/trainer"],
    )
    launcher_role = iam.Role(stack, "LauncherRole", assumed_by=iam.ServicePrincipal("states.amazonaws.com"))
    access.grant_pass_execution_role(launcher_role)
    return synthesize(app, outdir, {("wired", "access"): stack}), access


def test_launcher_executions_are_granted_to_engineers(launcher_wiring):
    synthesized, _ = launcher_wiring
    assert synthesized.synth_error is None, synthesized.synth_error
    template = synthesized.template_json("wired", "access")
    statements = engineer_statements(template)
    assert statements["StartLauncherRuns1"]["Resource"] == STATE_MACHINE
    assert set(statements["StartLauncherRuns1"]["Action"]) == {
        "states:StartExecution",
        "states:ListExecutions",
    }
    follow = statements["FollowLauncherRuns1"]
    assert set(follow["Action"]) == {
        "states:DescribeExecution",
        "states:StopExecution",
        "states:GetExecutionHistory",
    }
    assert (
        follow["Resource"]["Fn::Join"][1][-1]
        == ":states:us-east-1:111111111111:execution:llmtrain-launcher:*"
    )


def test_pass_role_goes_to_sagemaker_only(launcher_wiring):
    synthesized, _ = launcher_wiring
    template = synthesized.template_json("wired", "access")
    launcher_policy = next(
        p
        for logical_id, p in resources_of_type(template, "AWS::IAM::Policy").items()
        if logical_id.startswith("LauncherRole")
    )
    [statement] = launcher_policy["Properties"]["PolicyDocument"]["Statement"]
    assert statement["Action"] == "iam:PassRole"
    assert statement["Resource"] == {
        "Fn::GetAtt": [next(k for k in template["Resources"] if k.startswith("AccessExecutionRole")), "Arn"]
    }
    assert statement["Condition"] == {"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}}


def test_explicit_image_repositories_replace_the_defaults(launcher_wiring):
    synthesized, access = launcher_wiring
    template = synthesized.template_json("wired", "access")
    pull = statements_by_sid(template, "AWS::IAM::Policy", "AccessExecutionPolicy")["PullTrainingImages"]
    assert pull["Resource"] == "arn:aws:ecr:us-east-1:111111111111:repository/team-a/trainer"
    assert access.max_keep_alive_seconds == 600 and access.job_name_prefix == "team-a"
    assert access.training_job_arn().endswith(":training-job/team-a*")


def test_warm_pool_cap_statement_is_reusable():
    statement = warm_pool_cap_statement(1800).to_json()
    assert statement["Effect"] == "Deny"
    assert statement["Condition"] == {"NumericGreaterThan": {"sagemaker:KeepAlivePeriod": 1800}}
    with pytest.raises(PropsError, match=r"max_keep_alive_seconds=.*21600"):
        warm_pool_cap_statement(21601)


def _sdk_registries(file_name: str, repository: str, min_major: int) -> dict[str, str]:
    # Read the SDK's own tables without importing it (slow, and it warns about v2 on import).
    package = Path(importlib.util.find_spec("sagemaker").submodule_search_locations[0])
    config = json.loads((package / "image_uri_config" / file_name).read_text())
    accounts: dict[str, set[str]] = {}
    for version, spec in config["training"]["versions"].items():
        if spec.get("repository") == repository and int(version.split(".")[0]) >= min_major:
            for region, account in spec["registries"].items():
                accounts.setdefault(region, set()).add(account)
    assert all(len(values) == 1 for values in accounts.values()), accounts
    return {region: values.pop() for region, values in accounts.items()}


def test_image_registries_match_the_sagemaker_sdk():
    pytorch = _sdk_registries("pytorch.json", "pytorch-training", 2)
    commercial = {r: a for r, a in pytorch.items() if not r.startswith("us-iso")}
    assert dict(DLC_REGISTRY_ACCOUNTS) == commercial
    assert _sdk_registries("pytorch-smp.json", SMP_REPOSITORY, 2) == dict(SMP_REGISTRY_ACCOUNTS)
    assert DLC_REPOSITORIES == ("pytorch-training", "huggingface-pytorch-training")


def access_props(stack, **overrides):
    storage = TrainingStorage(stack, "Storage")
    props = dict(
        datasets_bucket=storage.datasets_bucket,
        checkpoints_bucket=storage.checkpoints_bucket,
        artifacts_bucket=storage.artifacts_bucket,
        code_bucket=storage.code_bucket,
        key=storage.key,
        job_name_prefix="llmtrain-dev",
        max_keep_alive_seconds=3600,
    )
    return {**props, **overrides}


INVALID_PROPS = [
    ({"max_keep_alive_seconds": 21601}, "max_keep_alive_seconds", "0 to 21600"),
    ({"max_keep_alive_seconds": -1}, "max_keep_alive_seconds", "0 to 21600"),
    ({"max_keep_alive_seconds": True}, "max_keep_alive_seconds", "whole number"),
    ({"job_name_prefix": "LLM_train"}, "job_name_prefix", "lowercase"),
    ({"job_name_prefix": "x" * 25}, "job_name_prefix", "1-24"),
    ({"image_repository_arns": []}, "image_repository_arns", "at least one"),
    (
        {"image_repository_arns": ["763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training"]},
        "image_repository_arns",
        "not ECR repository ARNs",
    ),
]


@pytest.mark.parametrize(
    ("overrides", "field", "explanation"),
    INVALID_PROPS,
    ids=[f"{field}-{explanation}" for _, field, explanation in INVALID_PROPS],
)
def test_invalid_props_fail_at_synth_naming_the_field(overrides, field, explanation):
    stack = cdk.Stack(cdk.App(), "Invalid", env=ENV)
    with pytest.raises(PropsError) as raised:
        TrainingAccess(stack, "Access", **access_props(stack, **overrides))
    assert str(raised.value).startswith(f"TrainingAccess({field}=...):"), str(raised.value)
    assert explanation in str(raised.value)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            cdk.Environment(account="111111111111", region="xx-nowhere-1"),
            "no Deep Learning Container registry",
        ),
        (None, "no explicit region"),
    ],
)
def test_image_registry_must_be_known_for_the_region(env, message):
    stack = cdk.Stack(cdk.App(), "Region", env=env)
    with pytest.raises(PropsError, match=message):
        TrainingAccess(stack, "Access", **access_props(stack))
