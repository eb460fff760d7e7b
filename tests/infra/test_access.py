"""TrainingAccess: per team an execution role and an engineers' policy, and the environment's guard rail."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import aws_cdk as cdk
import pytest
from aws_cdk import aws_iam as iam
from infra_helpers import ENV, as_list, resources_of_type, statements_by_sid, synthesize

from llmtrain.core.preparation import preparation_instance_types
from training_constructs import (
    PropsError,
    TrainingAccess,
    TrainingAccessProps,
    TrainingNetwork,
    TrainingNetworkProps,
    TrainingStorage,
    warm_pool_cap_statement,
)
from training_constructs.images import (
    DLC_REGISTRY_ACCOUNTS,
    DLC_REPOSITORIES,
    SMP_REGISTRY_ACCOUNTS,
    SMP_REPOSITORY,
)
from training_constructs.teams import TeamSpec

ENVS = ["dev", "prod"]
STATE_MACHINE = "arn:aws:states:us-east-1:111111111111:stateMachine:llmtrain-a-launcher"


def team_cases(environments):
    return [(env, team.name) for env in ENVS for team in environments[env].teams]


TEAM_CASES = [("dev", "default"), ("prod", "pretrain"), ("prod", "finetune")]


def execution_statements(template, team):
    return statements_by_sid(template, "AWS::IAM::Policy", f"AccessTeam{team.capitalize()}ExecutionPolicy")


def engineer_statements(template, team="default", prefix="Access"):
    return statements_by_sid(
        template, "AWS::IAM::ManagedPolicy", f"{prefix}Team{team.capitalize()}EngineerPolicy"
    )


def guardrail_statements_of(template, prefix="Access"):
    return statements_by_sid(template, "AWS::IAM::ManagedPolicy", f"{prefix}GuardrailPolicy")


def as_text(value):
    """A template value as text, to look for the logical IDs that its references name."""
    return json.dumps(value)


def execution_role(template, team):
    [(logical_id, role)] = [
        (logical_id, role)
        for logical_id, role in resources_of_type(template, "AWS::IAM::Role").items()
        if logical_id.startswith(f"AccessTeam{team.capitalize()}ExecutionRole")
    ]
    return logical_id, role


def test_the_cases_cover_every_team_of_the_configs(environments):
    assert sorted(team_cases(environments)) == sorted(TEAM_CASES)


@pytest.mark.parametrize(("env", "team"), TEAM_CASES)
def test_only_sagemaker_of_this_account_can_assume_a_teams_role(platform, environments, env, team):
    _, role = execution_role(platform.template_json(env, "access"), team)
    [statement] = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert statement["Principal"] == {"Service": "sagemaker.amazonaws.com"}
    assert statement["Action"] == "sts:AssumeRole"
    assert statement["Condition"] == {"StringEquals": {"aws:SourceAccount": environments[env].account}}


def team_object_arns(resources) -> dict[str, str]:
    """{bucket logical id prefix: key pattern} of object ARNs written `<Bucket.Arn>/<pattern>`."""
    found = {}
    for arn in as_list(resources):
        parts = arn["Fn::Join"][1]
        bucket = parts[0]["Fn::ImportValue"] if "Fn::ImportValue" in parts[0] else json.dumps(parts[0])
        name = next(n for n in ("Datasets", "Checkpoints", "Artifacts", "Code") if n in bucket)
        found[name] = parts[1]
    return found


@pytest.mark.parametrize(("env", "team"), TEAM_CASES)
def test_a_teams_role_reads_and_writes_only_its_prefix(platform, env, team):
    statements = execution_statements(platform.template_json(env, "access"), team)
    prefix = f"/teams/{team}/*"
    reads = statements["ReadTeamData"]
    assert reads["Action"] == "s3:GetObject"
    assert team_object_arns(reads["Resource"]) == {
        "Datasets": prefix,
        "Checkpoints": prefix,
        "Artifacts": prefix,
        "Code": "/templates/*",
    }
    checkpoints = statements["WriteTeamCheckpoints"]
    assert set(checkpoints["Action"]) == {"s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"}
    assert team_object_arns(checkpoints["Resource"]) == {"Checkpoints": prefix}
    artifacts = statements["WriteTeamArtifacts"]
    assert set(artifacts["Action"]) == {"s3:PutObject", "s3:AbortMultipartUpload"}
    assert team_object_arns(artifacts["Resource"]) == {"Artifacts": prefix}
    writers = [
        s for s in statements.values() if {"s3:PutObject", "s3:DeleteObject"} & set(as_list(s["Action"]))
    ]
    assert {s["Sid"] for s in writers} == {"WriteTeamCheckpoints", "WriteTeamArtifacts"}
    # Listing is limited to the team's prefix too (moto does not evaluate s3:prefix: asserted here).
    listing = statements["ListTeamData"]
    assert listing["Action"] == "s3:ListBucket"
    assert listing["Condition"] == {"StringLike": {"s3:prefix": [f"teams/{team}/*"]}}
    assert statements["ListTemplateCode"]["Condition"] == {"StringLike": {"s3:prefix": ["templates/*"]}}
    listers = [s["Sid"] for s in statements.values() if "s3:ListBucket" in as_list(s["Action"])]
    assert sorted(listers) == ["ListJumpStartModels", "ListTeamData", "ListTemplateCode"]
    # A JumpStart base model (`base_model=<model id>`): read-only, JumpStart's buckets of the region.
    jumpstart = as_text(statements["ListJumpStartModels"]["Resource"])
    assert "jumpstart-cache-prod-" in jumpstart and "jumpstart-private-cache-prod-" in jumpstart
    assert statements["ReadJumpStartModels"]["Action"] == "s3:GetObject"
    assert all("jumpstart-" in as_text(arn) and "/*" in as_text(arn)
               for arn in statements["ReadJumpStartModels"]["Resource"])


@pytest.mark.parametrize(("env", "team"), TEAM_CASES)
def test_a_teams_role_uses_the_platform_key(platform, env, team):
    statements = execution_statements(platform.template_json(env, "access"), team)
    assert set(statements["UsePlatformKey"]["Action"]) == {
        "kms:Decrypt",
        "kms:GenerateDataKey",
        "kms:DescribeKey",
    }
    assert "PlatformKeyArn" in as_text(statements["UsePlatformKey"]["Resource"])
    assert statements["GrantKeyToVolumes"]["Condition"] == {"Bool": {"kms:GrantIsForAWSResource": "true"}}


@pytest.mark.parametrize(("env", "team"), TEAM_CASES)
def test_a_teams_role_pulls_only_the_deep_learning_container_repositories(platform, environments, env, team):
    region = environments[env].region
    statements = execution_statements(platform.template_json(env, "access"), team)
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


@pytest.mark.parametrize(("env", "team"), TEAM_CASES)
def test_a_teams_role_writes_its_jobs_logs_and_metrics(platform, environments, env, team):
    config = environments[env]
    statements = execution_statements(platform.template_json(env, "access"), team)
    logs = statements["WriteTrainingLogs"]
    arns = [arn["Fn::Join"][1][-1] for arn in logs["Resource"]]
    group = f":logs:{config.region}:{config.account}:log-group:/aws/sagemaker/TrainingJobs"
    prefix = config.team(team).job_name_prefix
    # its own jobs' streams, and its queued jobs' (AWS Batch names them AWSBatch<name><attempt id>)
    assert arns == [group, f"{group}:log-stream:{prefix}-*", f"{group}:log-stream:AWSBatch{prefix}-*"]
    metrics = statements["PublishTrainingMetrics"]
    assert metrics["Action"] == "cloudwatch:PutMetricData" and metrics["Resource"] == "*"
    assert metrics["Condition"] == {"StringEquals": {"cloudwatch:namespace": "/aws/sagemaker/TrainingJobs"}}


@pytest.mark.parametrize(("env", "team"), TEAM_CASES)
def test_a_teams_role_manages_network_interfaces_in_the_platform_subnets(platform, environments, env, team):
    statements = execution_statements(platform.template_json(env, "access"), team)
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
def test_the_guardrail_denies_jobs_outside_the_environments_limits(platform, environments, env):
    config = environments[env]
    template = platform.template_json(env, "access")
    guardrail = guardrail_statements_of(template)
    create = "sagemaker:CreateTrainingJob"
    assert all(s["Effect"] == "Deny" and s["Resource"] == "*" for s in guardrail.values())
    assert guardrail["CapWarmPoolKeepAlive"] == {
        "Sid": "CapWarmPoolKeepAlive",
        "Effect": "Deny",
        "Action": [create, "sagemaker:UpdateTrainingJob"],
        "Resource": "*",
        # A string: the number as IAM's grammar writes it, which every CloudFormation implementation parses.
        "Condition": {
            "NumericGreaterThan": {"sagemaker:KeepAlivePeriod": str(config.warm_pools.max_keep_alive_seconds)}
        },
    }
    types = guardrail["OnlyPlatformInstanceTypes"]["Condition"]["ForAnyValue:StringNotEquals"][
        "sagemaker:InstanceTypes"
    ]
    teams = platform.stages[env].teams
    assert types == sorted({t for team in teams for t in team.instance_types})
    # Issue 35: processing jobs (data preparations) are held to the same network, keys and encryption,
    # on the CPU types the teams' preparations may use (not the training types).
    assert "sagemaker:CreateProcessingJob" not in guardrail["OnlyPlatformInstanceTypes"]["Action"]
    processing = guardrail["OnlyPreparationInstanceTypes"]
    assert processing["Action"] == "sagemaker:CreateProcessingJob"
    assert processing["Condition"]["ForAnyValue:StringNotEquals"]["sagemaker:InstanceTypes"] == sorted(
        {t for team in teams for t in preparation_instance_types(team.instance_types)})
    for sid in ("OnlyInTheTrainingVpc", "OnlyTrainingSubnets", "OnlyTrainingSecurityGroups",
                "OnlyPlatformOutputKey", "OnlyPlatformVolumeKey", *(["OnlyEncryptedInterContainerTraffic"]
                                           if config.network.inter_container_traffic_encryption else [])):
        assert guardrail[sid]["Action"] == [create, "sagemaker:CreateHyperParameterTuningJob",
                                            "sagemaker:CreateProcessingJob"], sid
    assert guardrail["OnlyInTheTrainingVpc"]["Condition"] == {"Null": {"sagemaker:VpcSubnets": "true"}}
    subnets = guardrail["OnlyTrainingSubnets"]["Condition"]["ForAnyValue:StringNotEquals"][
        "sagemaker:VpcSubnets"
    ]
    assert len(subnets) == len(config.network.availability_zones)
    groups = guardrail["OnlyTrainingSecurityGroups"]["Condition"]["ForAnyValue:StringNotEquals"]
    assert "TrainingSecurityGroup" in as_text(groups)
    assert "PlatformKeyArn" in as_text(guardrail["OnlyPlatformOutputKey"]["Condition"]["StringNotEquals"])
    # Issue 25: `StringNotEqualsIfExists` also denied requests without a volume key, which SageMaker
    # requires for instance types with local NVMe storage (g5, p4d, p5): no one under the guard rail
    # could create a job on them directly. Now a Deny only where the key is given (Null: false) and is
    # not the platform's. (moto's IAM evaluates StringEquals only, not StringNotEquals nor Null: the
    # statement is asserted here instead of probed.)
    volume = guardrail["OnlyPlatformVolumeKey"]["Condition"]
    assert set(volume) == {"StringNotEquals", "Null"}
    assert volume["Null"] == {"sagemaker:VolumeKmsKey": "false"}
    assert list(volume["StringNotEquals"]) == ["sagemaker:VolumeKmsKey"]
    assert "PlatformKeyArn" in as_text(volume["StringNotEquals"])
    assert not any("IfExists" in operator and "sagemaker:VolumeKmsKey" in keys
                   for s in guardrail.values() for operator, keys in s.get("Condition", {}).items())
    encryption = guardrail.get("OnlyEncryptedInterContainerTraffic")
    if config.network.inter_container_traffic_encryption:
        assert encryption["Condition"] == {
            "BoolIfExists": {"sagemaker:InterContainerTrafficEncryption": "false"}
        }
    else:
        assert encryption is None
    # Attached to every team's execution role; in every team's engineers' policy.
    guardrail_id = next(
        k for k in resources_of_type(template, "AWS::IAM::ManagedPolicy") if k.startswith("AccessGuardrail")
    )
    for team in config.teams:
        _, role = execution_role(template, team.name)
        assert role["Properties"]["ManagedPolicyArns"] == [{"Ref": guardrail_id}]
        engineers = engineer_statements(template, team.name)
        for sid, statement in guardrail.items():
            assert engineers[sid] == statement, (team.name, sid)


@pytest.mark.parametrize(("env", "team"), TEAM_CASES)
def test_a_teams_engineers_reach_only_its_jobs_logs_and_data(platform, environments, env, team):
    config = environments[env]
    prefix = config.team(team).job_name_prefix
    statements = engineer_statements(platform.template_json(env, "access"), team)
    jobs = statements["FollowTeamTrainingJobs"]
    assert set(jobs["Action"]) == {
        "sagemaker:DescribeTrainingJob",
        "sagemaker:ListTags",
        "sagemaker:StopTrainingJob",
    }
    assert (
        jobs["Resource"]["Fn::Join"][1][-1]
        == f":sagemaker:{config.region}:{config.account}:training-job/{prefix}-*"
    )
    assert statements["ListTrainingJobs"]["Resource"] == "*"
    # Issue 25: FilterLogEvents, authorized on the whole shared group, read other teams' logs. Events
    # are read stream by stream (GetLogEvents), of the team's jobs only; the group only lists streams.
    logs = statements["ReadTeamTrainingLogs"]
    assert logs["Action"] == "logs:GetLogEvents"
    streams = [arn["Fn::Join"][1][-1].split("log-stream:")[1] for arn in logs["Resource"]]
    assert streams == [f"{prefix}-*", f"AWSBatch{prefix}-*"]  # its jobs, and its queued jobs
    streams = statements["ListTrainingLogStreams"]
    assert streams["Action"] == "logs:DescribeLogStreams"
    assert streams["Resource"]["Fn::Join"][1][-1].endswith("log-group:/aws/sagemaker/TrainingJobs")
    log_actions = {a for s in statements.values() for a in as_list(s["Action"]) if a.startswith("logs:")}
    assert log_actions == {"logs:GetLogEvents", "logs:DescribeLogStreams"}
    team_prefix = f"/teams/{team}/*"
    assert team_object_arns(statements["ReadTeamData"]["Resource"]) == {
        "Datasets": team_prefix,
        "Checkpoints": team_prefix,
        "Artifacts": team_prefix,
    }
    assert team_object_arns(statements["UploadTeamDatasets"]["Resource"]) == {"Datasets": team_prefix}
    assert statements["ListTeamData"]["Condition"] == {"StringLike": {"s3:prefix": [f"teams/{team}/*"]}}
    assert statements["UseKeyThroughS3"]["Condition"] == {
        "StringEquals": {"kms:ViaService": f"s3.{config.region}.amazonaws.com"}
    }
    # The launcher of its own team only, by the name the launcher stack gives it.
    start = statements["StartTeamRuns1"]
    assert (
        start["Resource"]["Fn::Join"][1][-1]
        == f":states:{config.region}:{config.account}:stateMachine:{prefix}-launcher"
    )
    # Nothing that creates a job, passes a role, or deletes data.
    allowed = {a for s in statements.values() if s["Effect"] == "Allow" for a in as_list(s["Action"])}
    assert not {"sagemaker:CreateTrainingJob", "iam:PassRole", "s3:DeleteObject"} & allowed


def _condition_keys(node) -> set[str]:
    if isinstance(node, dict):
        found = {key for operator, keys in node.get("Condition", {}).items() for key in keys}
        return found | {k for value in node.values() for k in _condition_keys(value)}
    if isinstance(node, list):
        return {k for value in node for k in _condition_keys(value)}
    return set()


@pytest.mark.parametrize("env", ENVS)
def test_what_iam_cannot_hold_a_team_to_is_documented_as_the_launchers(platform, env):
    """Issue 25: the README said a team's instance cap and cost cap were enforced by IAM. SageMaker has
    no condition key for a job's instance count, IAM none for cost: no statement of the environment
    conditions on either, and the docs say the launcher enforces them."""
    templates = [platform.template_json(env, part) for part in ("access", "launcher")]
    keys = set().union(*map(_condition_keys, templates))
    assert {"sagemaker:InstanceTypes", "sagemaker:KeepAlivePeriod"} <= keys
    assert not [key for key in keys if "instancecount" in key.lower() or "cost" in key.lower()]
    root = Path(__file__).resolve().parents[2]
    readme = " ".join((root / "README.md").read_text().split())
    assert "its instance types and caps) is enforced by IAM" not in readme
    assert "the launcher also refuses a run above the team's instances per job or budget per run" in readme
    table = (root / "docs" / "infrastructure.md").read_text()
    assert "| instances per job (`max_instance_count`) | **no**" in table
    assert "| budget per run (`max_run_cost_usd`) | **no**" in table


@pytest.fixture(scope="module")
def launcher_wiring(tmp_path_factory):
    """The construct as another app uses it: two teams, a launcher role for one, explicit images."""
    outdir = tmp_path_factory.mktemp("access-variants")
    app = cdk.App(outdir=str(outdir))
    stack = cdk.Stack(app, "Wired", env=ENV)
    access = TrainingAccess(
        stack,
        "Access",
        access_props(
            stack,
            teams=[team_spec("a", max_keep_alive_seconds=300), team_spec("b")],
            max_keep_alive_seconds=600,
            image_repository_arns=["arn:aws:ecr:us-east-1:111111111111:repository/team-a/trainer"],
        ),
    )
    access.teams["a"].allow_launcher(STATE_MACHINE)
    launcher_role = iam.Role(stack, "LauncherRole", assumed_by=iam.ServicePrincipal("states.amazonaws.com"))
    access.teams["a"].grant_pass_execution_role(launcher_role)
    return synthesize(app, outdir, {("wired", "access"): stack}), access


def test_launcher_executions_are_granted_to_the_teams_engineers_only(launcher_wiring):
    synthesized, _ = launcher_wiring
    assert synthesized.synth_error is None, synthesized.synth_error
    template = synthesized.template_json("wired", "access")
    statements = engineer_statements(template, "a")
    assert statements["StartTeamRuns1"]["Resource"] == STATE_MACHINE
    assert set(statements["StartTeamRuns1"]["Action"]) == {
        "states:StartExecution",
        "states:ListExecutions",
    }
    follow = statements["FollowTeamRuns1"]
    assert set(follow["Action"]) == {
        "states:DescribeExecution",
        "states:StopExecution",
        "states:GetExecutionHistory",
    }
    assert (
        follow["Resource"]["Fn::Join"][1][-1]
        == ":states:us-east-1:111111111111:execution:llmtrain-a-launcher:*"
    )
    assert not any(
        sid.startswith(("StartTeamRuns", "FollowTeamRuns")) for sid in engineer_statements(template, "b")
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
        "Fn::GetAtt": [
            next(k for k in template["Resources"] if k.startswith("AccessTeamAExecutionRole")),
            "Arn",
        ]
    }
    assert statement["Condition"] == {"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}}


def test_explicit_image_repositories_replace_the_defaults(launcher_wiring):
    synthesized, access = launcher_wiring
    template = synthesized.template_json("wired", "access")
    pull = execution_statements(template, "a")["PullTrainingImages"]
    assert pull["Resource"] == "arn:aws:ecr:us-east-1:111111111111:repository/team-a/trainer"
    assert access.max_keep_alive_seconds == 600 and set(access.teams) == {"a", "b"}
    assert access.teams["a"].training_job_arn().endswith(":training-job/llmtrain-a-*")


def test_warm_pool_cap_statement_is_reusable():
    statement = warm_pool_cap_statement(1800).to_json()
    assert statement["Effect"] == "Deny"
    assert statement["Condition"] == {"NumericGreaterThan": {"sagemaker:KeepAlivePeriod": "1800"}}
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


def team_spec(name: str, **changes) -> TeamSpec:
    values = dict(
        name=name,
        job_name_prefix=f"llmtrain-{name}",
        instance_types=("ml.p4d.24xlarge",),
        max_keep_alive_seconds=600,
    )
    return TeamSpec(**{**values, **changes})


def access_props(stack, **overrides) -> TrainingAccessProps:
    storage = TrainingStorage(stack, "Storage")
    region = stack.region if not cdk.Token.is_unresolved(stack.region) else "us-east-1"
    network = TrainingNetwork(
        stack, "Network", TrainingNetworkProps(availability_zones=[f"{region}a", f"{region}b"])
    )
    props = dict(storage=storage, network=network, teams=[team_spec("a")], max_keep_alive_seconds=3600)
    return TrainingAccessProps(**{**props, **overrides})


INVALID_PROPS = [
    ({"max_keep_alive_seconds": 21601}, "max_keep_alive_seconds", "0 to 21600"),
    ({"max_keep_alive_seconds": -1}, "max_keep_alive_seconds", "0 to 21600"),
    ({"max_keep_alive_seconds": True}, "max_keep_alive_seconds", "whole number"),
    ({"teams": []}, "teams", "at least one TeamSpec"),
    ({"teams": [team_spec("a"), team_spec("a", job_name_prefix="other")]}, "teams", "names a team twice"),
    (
        {"teams": [team_spec("a"), team_spec("b", job_name_prefix="llmtrain-a")]},
        "teams",
        "share a job-name prefix",
    ),
    ({"teams": [team_spec("a", max_keep_alive_seconds=3601)]}, "teams", "above the environment's"),
    ({"network": "vpc-0123456789abcdef0"}, "network", "must be a TrainingNetwork or an ExistingNetwork"),
    ({"storage": "my-bucket"}, "storage", "must be a TrainingStorage or an ExistingStorage"),
    ({"teams": ["a"]}, "teams", "must hold TeamSpecs only"),
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
        TrainingAccess(stack, "Access", access_props(stack, **overrides))
    assert str(raised.value).startswith(f"TrainingAccess({field}=...):"), str(raised.value)
    assert explanation in str(raised.value)


INVALID_TEAMS = [
    ({"name": "ml-a"}, "name", "no hyphens"),
    ({"name": "Nlp"}, "name", "lowercase"),
    ({"name": "a" * 13}, "name", "1-12"),
    ({"job_name_prefix": "LLM_a"}, "job_name_prefix", "lowercase"),
    ({"instance_types": ()}, "instance_types", "must list SageMaker instance types"),
    # Issue 25: a mistyped type passed (only ml.* was checked) into the IAM conditions and the launcher.
    ({"instance_types": ("ml.g5.12xlarge", "ml.g5.12xlareg")}, "instance_types",
     "'ml.g5.12xlareg' is not an instance type the platform knows (did you mean 'ml.g5.12xlarge'?)"),
    ({"max_keep_alive_seconds": 21601}, "max_keep_alive_seconds", "0 to 21600"),
    ({"max_instance_count": 0}, "max_instance_count", "at least 1"),
    ({"max_run_cost_usd": 0}, "max_run_cost_usd", "positive number of US dollars"),
    ({"max_run_cost_usd": True}, "max_run_cost_usd", "positive number of US dollars"),
    ({"notification_email": "nobody"}, "notification_email", "not an e-mail address"),
]


@pytest.mark.parametrize(
    ("changes", "field", "explanation"), INVALID_TEAMS, ids=[f"{f}-{e}" for _, f, e in INVALID_TEAMS]
)
def test_invalid_teams_are_refused_naming_the_field(changes, field, explanation):
    with pytest.raises(PropsError) as raised:
        team_spec(changes.pop("name", "a"), **changes)
    assert str(raised.value).startswith(f"TeamSpec({field}=...):") and explanation in str(raised.value)


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
        TrainingAccess(stack, "Access", access_props(stack))
