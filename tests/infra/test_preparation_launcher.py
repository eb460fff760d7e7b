"""Each team's preparation state machine (`PreparationLauncher`), from the app synthesized once per
session (conftest): its definition, the roles' statements and conditions (moto evaluates no SageMaker
condition key, so they are asserted here; test_teams_deployed.py calls AWS as the roles in moto), the
engineers' grants and the guard rail's Denies of processing jobs. cdk-nag, cfn-lint and checkov run
over the same templates in test_launcher.py and test_platform.py. Executing the definition is
tests/llmtrain/test_preparation_cloud.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import aws_cdk as cdk
import pytest
from infra_helpers import as_list, resources_of_type

from llmtrain.core.deployed import LauncherOutput
from llmtrain.core.environments import StackOutput
from llmtrain.core.function_settings import ENV_PROCESSING_ROLE_ARN
from llmtrain.core.preparation import (
    CPU_INSTANCE_TYPES,
    PROCESSING_REQUEST_FIELDS,
    preparation_instance_types,
)
from training_constructs import PropsError
from training_constructs.preparation_launcher import (
    CREATE_PROCESSING_JOBS_SID,
    SYNC_PROCESSING_EVENTS_RULE,
    PreparationLauncherProps,
)

TEAM_CASES = [("dev", "default"), ("prod", "pretrain"), ("prod", "finetune")]


@pytest.fixture(scope="module")
def templates(platform) -> dict[str, dict]:
    return {name: _template_json(platform.stages[name].launcher) for name in ("dev", "prod")}


def _template_json(stack: cdk.Stack) -> dict:
    return json.loads((Path(cdk.Stage.of(stack).outdir) / stack.template_file).read_text())


def _team(template: dict, kind: str, team: str) -> dict[str, dict]:
    prefix = f"Preparations{team.capitalize()}"
    return {i: r for i, r in resources_of_type(template, kind).items() if i.startswith(prefix)}


def _statements_of_role(template: dict, role_id: str) -> dict[str, dict]:
    return {
        s["Sid"]: s
        for p in resources_of_type(template, "AWS::IAM::Policy").values()
        if {"Ref": role_id} in p["Properties"]["Roles"]
        for s in p["Properties"]["PolicyDocument"]["Statement"]
        if "Sid" in s
    }


def _machine(template: dict, team: str) -> dict:
    [machine] = _team(template, "AWS::StepFunctions::StateMachine", team).values()
    return machine


def _definition(template: dict, team: str) -> dict:
    parts = _machine(template, team)["Properties"]["DefinitionString"]["Fn::Join"][1]
    return json.loads("".join(p if isinstance(p, str) else json.dumps(p).replace('"', "'") for p in parts))


@pytest.mark.parametrize(("environment", "team"), TEAM_CASES)
def test_the_definition_validates_first_and_passes_every_request_field_but_the_role(
    templates, environments, environment, team
):
    template = templates[environment]
    properties = _machine(template, team)["Properties"]
    assert (
        properties["StateMachineName"]
        == f"{environments[environment].team(team).job_name_prefix}-preparations"
    )
    assert properties["TracingConfiguration"] == {"Enabled": True}
    assert properties["LoggingConfiguration"]["Level"] == "ALL"
    definition = _definition(template, team)
    states = definition["States"]
    assert definition["StartAt"] == "ReadInput" and states["ReadInput"]["Next"] == "Validate"
    assert states["Validate"]["Next"] == "Rejected"
    assert states["Rejected"]["Choices"][0]["Next"] == "NotifyFailure"  # no job after a refusal
    for state, request in (("CreateShardsJob", "$.shards"), ("CreateMergeJob", "$.merge")):
        job = states[state]
        assert job["Resource"] == "arn:aws:states:::sagemaker:createProcessingJob.sync" or (
            "sagemaker:createProcessingJob.sync" in job["Resource"]
        )
        parameters = job["Parameters"]
        assert {k.removesuffix(".$") for k in parameters} == {"RoleArn", *PROCESSING_REQUEST_FIELDS}
        assert all(parameters[f"{f}.$"] == f"{request}.{f}" for f in PROCESSING_REQUEST_FIELDS)
        assert "ProcessingRole" in parameters["RoleArn"]  # fixed by the definition, not the function
        assert job["Catch"][0]["ErrorEquals"] == ["States.ALL"]
    assert (
        states["CreateShardsJob"]["Next"] == "RecordSizes"
        and states["RecordSizes"]["Next"] == "CreateMergeJob"
    )
    assert states["CreateMergeJob"]["Next"] == "Complete" and states["Complete"]["Next"] == "NotifySuccess"
    # A failed job goes to the failure's summary, never to Complete (the marker).
    assert states["ShardsJobFailed"]["Next"] == states["MergeJobFailed"]["Next"] == "DescribeFailure"
    assert states["DescribeFailure"]["Next"] == "NotifyFailure"


@pytest.mark.parametrize(("environment", "team"), TEAM_CASES)
def test_the_state_machine_role_creates_the_teams_processing_jobs_only_under_every_condition_key(
    platform, templates, environments, environment, team
):
    config, template = environments[environment], templates[environment]
    spec = next(t for t in platform.stages[environment].teams if t.name == team)
    role_id = _machine(template, team)["Properties"]["RoleArn"]["Fn::GetAtt"][0]
    statements = _statements_of_role(template, role_id)
    prefix = config.team(team).job_name_prefix
    create = statements[CREATE_PROCESSING_JOBS_SID]
    assert create["Action"] == "sagemaker:CreateProcessingJob"
    assert (
        create["Resource"]["Fn::Join"][1][-1]
        == f":sagemaker:{config.region}:{config.account}:processing-job/{prefix}-*"
    )
    conditions = create["Condition"]
    all_of = conditions["ForAllValues:StringEquals"]
    assert all_of["sagemaker:InstanceTypes"] == list(preparation_instance_types(spec.instance_types))
    assert set(all_of["sagemaker:InstanceTypes"]) <= set(CPU_INSTANCE_TYPES)
    assert len(all_of["sagemaker:VpcSubnets"]) == len(config.network.availability_zones)
    assert "TrainingSecurityGroup" in json.dumps(all_of["sagemaker:VpcSecurityGroupIds"])
    assert set(conditions["Null"]) == {
        "sagemaker:InstanceTypes",
        "sagemaker:VpcSubnets",
        "sagemaker:VpcSecurityGroupIds",
    }
    exact = conditions["StringEquals"]
    assert "PlatformKeyArn" in json.dumps(exact["sagemaker:OutputKmsKey"])
    assert exact["aws:RequestTag/llmtrain:team"] == team
    assert exact["aws:RequestTag/llmtrain:environment"] == environment
    assert conditions["StringEqualsIfExists"] == {"sagemaker:VolumeKmsKey": exact["sagemaker:OutputKmsKey"]}
    assert "NumericLessThanEqualsIfExists" not in conditions  # processing jobs have no warm pool
    assert ("Bool" in conditions) is config.network.inter_container_traffic_encryption
    passing = statements["PassProcessingRoleToSageMaker"]
    [processing_role] = [i for i in _team(template, "AWS::IAM::Role", team) if "ProcessingRole" in i]
    assert passing["Resource"] == {"Fn::GetAtt": [processing_role, "Arn"]}
    assert passing["Condition"] == {"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}}
    assert statements["SyncWithProcessingJobEvents"]["Resource"]["Fn::Join"][1][-1].endswith(
        f":rule/{SYNC_PROCESSING_EVENTS_RULE}"
    )
    sagemaker = {a for s in statements.values() for a in as_list(s["Action"]) if a.startswith("sagemaker:")}
    assert sagemaker == {
        "sagemaker:CreateProcessingJob",
        "sagemaker:AddTags",
        "sagemaker:DescribeProcessingJob",
        "sagemaker:StopProcessingJob",
    }
    assert all(
        f"processing-job/{prefix}-*" in json.dumps(s["Resource"])
        for s in statements.values()
        if "sagemaker:" in json.dumps(s["Action"])
    )


@pytest.mark.parametrize(("environment", "team"), TEAM_CASES)
def test_the_processing_role_and_the_function_reach_the_teams_datasets_only(templates, environment, team):
    template = templates[environment]
    [(role_id, role)] = [
        (i, r) for i, r in _team(template, "AWS::IAM::Role", team).items() if "ProcessingRole" in i
    ]
    trust = role["Properties"]["AssumeRolePolicyDocument"]["Statement"][0]
    assert trust["Principal"] == {"Service": "sagemaker.amazonaws.com"}
    assert "aws:SourceAccount" in trust["Condition"]["StringEquals"]
    assert "GuardrailPolicy" in json.dumps(role["Properties"]["ManagedPolicyArns"])
    processing = _statements_of_role(template, role_id)
    datasets = f"teams/{team}/*"
    for sid in ("ReadTeamDatasets", "WriteTeamDatasets"):
        resource = json.dumps(processing[sid]["Resource"])
        assert "DatasetsBucket" in resource and resource.endswith(f'/{datasets}"]]}}')
    assert processing["ListTeamDatasets"]["Condition"] == {"StringLike": {"s3:prefix": [datasets]}}
    written = {
        json.dumps(s["Resource"]) for s in processing.values() if "s3:PutObject" in as_list(s["Action"])
    }
    assert len(written) == 1 and "Checkpoints" not in str(written) and "Artifacts" not in str(written)

    [function] = _team(template, "AWS::Lambda::Function", team).values()
    assert function["Properties"]["Handler"] == "llmtrain.handlers.preparation.handler"
    environment_variables = function["Properties"]["Environment"]["Variables"]
    assert role_id in json.dumps(environment_variables[ENV_PROCESSING_ROLE_ARN])
    steps = _statements_of_role(template, function["Properties"]["Role"]["Fn::GetAtt"][0])
    actions = {a for s in steps.values() for a in as_list(s["Action"])}
    assert actions == {
        "logs:CreateLogStream",
        "logs:PutLogEvents",
        "s3:ListBucket",
        "s3:GetObject",
        "s3:PutObject",
        "s3:DeleteObject",
        "kms:Decrypt",
        "kms:GenerateDataKey",
        "sagemaker:ListProcessingJobs",
    }
    puts = json.dumps(steps["WriteSizesAndMarkers"]["Resource"])
    assert (
        f"/teams/{team}/*/.preparation/sizes.json" in puts
        and f"/teams/{team}/*/llmtrain-dataset.json" in puts
    )
    # Before the marker, only the shard files and .dedup/ the dataset does not use (remove_unused_files).
    [deletes] = [s for s in steps.values() if "s3:DeleteObject" in as_list(s["Action"])]
    assert deletes["Sid"] == "RemoveUnusedFiles" and as_list(deletes["Action"]) == ["s3:DeleteObject"]
    removed = [json.dumps(r) for r in deletes["Resource"]]
    assert len(removed) == 2
    assert f"/teams/{team}/*/shard_*" in removed[0] and f"/teams/{team}/*/.dedup/*" in removed[1]
    assert all("DatasetsBucket" in r for r in removed)


@pytest.mark.parametrize(("environment", "team"), TEAM_CASES)
def test_a_teams_engineers_start_and_follow_its_preparations_and_create_no_job(
    platform, environments, environment, team
):
    access = _template_json(platform.stages[environment].access)
    [policy] = [
        p
        for i, p in resources_of_type(access, "AWS::IAM::ManagedPolicy").items()
        if i.startswith(f"AccessTeam{team.capitalize()}EngineerPolicy")
    ]
    statements = [s for s in policy["Properties"]["PolicyDocument"]["Statement"]]
    by_sid = {s.get("Sid"): s for s in statements}
    prefix = environments[environment].team(team).job_name_prefix
    start = by_sid["StartTeamPreparations"]
    assert set(start["Action"]) == {"states:StartExecution", "states:ListExecutions"}
    assert json.dumps(start["Resource"]).endswith(f':stateMachine:{prefix}-preparations"]]}}')
    assert "states:StopExecution" in by_sid["FollowTeamPreparations"]["Action"]
    assert f"processing-job/{prefix}-*" in json.dumps(by_sid["FollowTeamProcessingJobs"]["Resource"])
    allowed = {a for s in statements if s["Effect"] == "Allow" for a in as_list(s["Action"])}
    assert not allowed & {"sagemaker:CreateProcessingJob", "iam:PassRole", "sagemaker:StopProcessingJob"}
    # The guard rail's Denies (in the policy too) hold processing jobs to the environment's limits.
    denies = {s["Sid"]: s for s in statements if s["Effect"] == "Deny"}
    for sid in (
        "OnlyInTheTrainingVpc",
        "OnlyTrainingSubnets",
        "OnlyTrainingSecurityGroups",
        "OnlyPlatformOutputKey",
        "OnlyPlatformVolumeKey",
        "OnlyPreparationInstanceTypes",
    ):
        assert "sagemaker:CreateProcessingJob" in as_list(denies[sid]["Action"]), sid
    assert "sagemaker:CreateProcessingJob" not in as_list(denies["OnlyPlatformInstanceTypes"]["Action"])
    types = denies["OnlyPreparationInstanceTypes"]["Condition"]["ForAnyValue:StringNotEquals"][
        "sagemaker:InstanceTypes"
    ]
    # The teams' preparation types: dev's team lists ml.c5.2xlarge (byo-script runs on it), so its
    # preparations run there; prod's teams list GPU types only, so theirs run on every CPU type.
    teams = platform.stages[environment].teams
    assert types == sorted({t for spec in teams for t in preparation_instance_types(spec.instance_types)})
    assert set(types) == ({"ml.c5.2xlarge"} if environment == "dev" else set(CPU_INSTANCE_TYPES))
    if environments[environment].network.inter_container_traffic_encryption:
        assert "sagemaker:CreateProcessingJob" in as_list(
            denies["OnlyEncryptedInterContainerTraffic"]["Action"]
        )


@pytest.mark.parametrize(("environment", "team"), TEAM_CASES)
def test_the_state_machine_is_in_the_outputs_and_the_record_for_the_cli(templates, environment, team):
    template = templates[environment]
    key = StackOutput.team_output(team, LauncherOutput.PREPARATION_STATE_MACHINE_ARN)
    [machine_id] = _team(template, "AWS::StepFunctions::StateMachine", team)
    assert template["Outputs"][key]["Value"] == {"Ref": machine_id}
    [parameter] = [
        p
        for p in resources_of_type(template, "AWS::SSM::Parameter").values()
        if p["Properties"]["Name"] == f"/llmtrain/{environment}/teams/{team}"
    ]
    assert machine_id in json.dumps(parameter["Properties"]["Value"])
    assert "preparation_state_machine_arn" in json.dumps(parameter["Properties"]["Value"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"launcher": "a launcher"},
            r"PreparationLauncher\(launcher=...\): must be the team's TrainingLauncher",
        ),
        ({"state_machine_name": "bad name"}, r"PreparationLauncher\(state_machine_name=...\)"),
        ({"image_repository_arns": []}, r"PreparationLauncher\(image_repository_arns=...\)"),
    ],
)
def test_invalid_props_fail_naming_the_field(platform, overrides, message):
    launcher = platform.stages["dev"].launcher.launchers["default"]
    with pytest.raises(PropsError, match=message):
        PreparationLauncherProps(**{"launcher": launcher, **overrides})
