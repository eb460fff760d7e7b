"""The launcher stack of every environment, from the app synthesized once per session (conftest).

The state machine's definition, its role, the functions, the topic and the logs are asserted in the
synthesized templates; cdk-nag and cfn-lint run over them; the functions' code asset is loaded the
way Lambda loads it. Executing the definition is tests/llmtrain/test_launcher_state_machine.py (and,
with queues, test_launcher_queue.py). dev's launchers create their training jobs; prod's submit
them to the environment's queues.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import aws_cdk as cdk
import pytest
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from cfnlint.api import ManualArgs, lint
from infra_helpers import ENV, as_list, resources_of_type

from llmtrain.core.catalog import Catalog
from llmtrain.core.deployed import LauncherOutput
from llmtrain.core.environments import StackOutput, load_environment
from llmtrain.core.function_settings import ENV_PLATFORM_CONTEXT, ENV_REQUEST_LAYOUTS
from llmtrain.core.request_layouts import TUNING_LAYOUTS
from training_constructs import PropsError
from training_constructs.job_template import JobTemplate, JobTemplateProps
from training_constructs.lambda_code import LAMBDA_RUNTIME
from training_constructs.launcher import (
    LAUNCHER_ERROR_SUBJECT,
    SYNC_EVENTS_RULE,
    TrainingLauncher,
    TrainingLauncherProps,
)
from training_constructs.queues import SUBMIT_SERVICE_JOBS_SID, SUBMIT_TO_QUEUES_SID, TAG_SERVICE_JOBS_SID
from training_constructs.resources import ExistingNetwork, ExistingStorage
from training_constructs.teams import CREATE_JOBS_SID, CREATE_TUNING_JOBS_SID, TeamSpec

ENVIRONMENTS = ("dev", "prod")
TEAM_CASES = [("dev", "default"), ("prod", "pretrain"), ("prod", "finetune")]
# dev's launcher creates training jobs; prod's submits them to its queues.
DIRECT_CASES = [("dev", "default")]
QUEUED_CASES = [("prod", "pretrain"), ("prod", "finetune")]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def templates(platform) -> dict[str, dict]:
    return {name: _template_json(platform.stages[name].launcher) for name in ENVIRONMENTS}


def _template_json(stack: cdk.Stack) -> dict:
    return json.loads((Path(cdk.Stage.of(stack).outdir) / stack.template_file).read_text())


def _one(template: dict, resource_type: str, team: str = "default") -> tuple[str, dict]:
    """The one resource of that type in a team's launcher (logical IDs start `Launcher<Team>`)."""
    prefix = f"Launcher{team.capitalize()}"
    [(logical_id, resource)] = [
        (logical_id, resource)
        for logical_id, resource in resources_of_type(template, resource_type).items()
        if logical_id.startswith(prefix)
    ]
    return logical_id, resource


def _team_resources(template: dict, resource_type: str, team: str) -> dict[str, dict]:
    prefix = f"Launcher{team.capitalize()}"
    return {i: r for i, r in resources_of_type(template, resource_type).items() if i.startswith(prefix)}


def _definition(template: dict, team: str = "default") -> dict:
    """The state machine definition, references shown as <Ref>/<Logical.Attr> (as cdk-nag names them)."""
    _, machine = _one(template, "AWS::StepFunctions::StateMachine", team)
    parts = machine["Properties"]["DefinitionString"]["Fn::Join"][1]
    return json.loads("".join(part if isinstance(part, str) else _placeholder(part) for part in parts))


def _placeholder(reference: dict) -> str:
    if "Ref" in reference:
        return f"<{reference['Ref']}>"
    if "Fn::GetAtt" in reference:
        return "<{}.{}>".format(*reference["Fn::GetAtt"])
    if "Fn::ImportValue" in reference:
        return f"<ImportValue:{reference['Fn::ImportValue']}>"
    raise AssertionError(f"unexpected reference in the definition: {reference}")


def _functions(template: dict, team: str = "default") -> dict[str, dict]:
    """A team's launcher functions by handler (resolve, next_attempt, summarize)."""
    return {
        resource["Properties"]["Handler"].rsplit(".", 1)[1]: resource
        for resource in _team_resources(template, "AWS::Lambda::Function", team).values()
        if resource["Properties"]["Handler"].startswith("llmtrain.handlers.launcher.")
    }


def _state_machine_statements(template: dict, team: str = "default") -> list[dict]:
    machine_role = _one(template, "AWS::StepFunctions::StateMachine", team)[1]["Properties"]["RoleArn"][
        "Fn::GetAtt"
    ][0]
    policies = [
        p
        for p in resources_of_type(template, "AWS::IAM::Policy").values()
        if {"Ref": machine_role} in p["Properties"]["Roles"]
    ]
    return [
        statement for policy in policies for statement in policy["Properties"]["PolicyDocument"]["Statement"]
    ]


# -- cdk-nag, cfn-lint ----------------------------------------------------------------------------------


def test_cdk_nag_has_no_unacknowledged_finding_in_the_launcher_stacks(platform):
    assert [v for v in platform.nag_violations() if "/Launcher/" in json.dumps(v)] == []


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_cfn_lint_reports_nothing_of_ours(templates, environment):
    matches = lint(json.dumps(templates[environment]), config=ManualArgs(regions=["us-east-1", "us-west-2"]))
    # W3005 on aws-cdk-lib's own BucketDeployment provider (the JobTemplates' upload): not ours to change.
    ours = [str(m) for m in matches if not (m.rule.id == "W3005" and "CustomCDKBucketDeployment" in str(m))]
    assert ours == []


# -- the state machine ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("environment", "team"), TEAM_CASES)
def test_one_launcher_per_team_logging_all_events_encrypted_and_tracing_on(
    templates, environments, environment, team
):
    template = templates[environment]
    machines = resources_of_type(template, "AWS::StepFunctions::StateMachine")
    # One launcher per team, and beside each its preparation state machine (test_preparation_launcher.py).
    assert len([m for m in machines if m.startswith("Launcher")]) == len(environments[environment].teams)
    assert len(machines) == 2 * len(environments[environment].teams)
    _, machine = _one(template, "AWS::StepFunctions::StateMachine", team)
    properties = machine["Properties"]
    assert (
        properties["StateMachineName"] == f"{environments[environment].team(team).job_name_prefix}-launcher"
    )
    assert properties["TracingConfiguration"] == {"Enabled": True}
    logging = properties["LoggingConfiguration"]
    assert logging["Level"] == "ALL" and logging["IncludeExecutionData"] is True
    log_group_id = logging["Destinations"][0]["CloudWatchLogsLogGroup"]["LogGroupArn"]["Fn::GetAtt"][0]
    key_id, key = _one(template, "AWS::KMS::Key", team)
    assert key["Properties"]["EnableKeyRotation"] is True
    for log_group in _team_resources(template, "AWS::Logs::LogGroup", team).values():
        assert log_group["Properties"]["KmsKeyId"] == {"Fn::GetAtt": [key_id, "Arn"]}
        assert log_group["Properties"]["RetentionInDays"] == 365
    assert log_group_id in template["Resources"]


@pytest.mark.parametrize(("environment", "team"), DIRECT_CASES)
def test_every_rendered_field_reaches_create_training_job(templates, environment, team):
    template = templates[environment]
    layouts = json.loads(
        _functions(template, team)["resolve"]["Properties"]["Environment"]["Variables"][ENV_REQUEST_LAYOUTS]
    )
    states = _definition(template, team)["States"]
    train_states = {name: state for name, state in states.items() if name.startswith("CreateTrainingJob-")}
    assert set(train_states) == {f"CreateTrainingJob-{layout}" for layout in layouts}
    for layout, fields in layouts.items():
        state = train_states[f"CreateTrainingJob-{layout}"]
        assert state["Resource"] == "arn:<AWS::Partition>:states:::sagemaker:createTrainingJob.sync"
        passed = {key.removesuffix(".$"): value for key, value in state["Parameters"].items()}
        assert set(passed) == set(fields)
        assert all(passed[f] == f"$.request.{f}" for f in fields if f != "RoleArn")
        # The role is fixed in the definition: only the team's execution role is ever passed.
        assert passed["RoleArn"].startswith("<ImportValue:")
        assert f"Team{team.capitalize()}ExecutionRole" in passed["RoleArn"]
        for field in ("CheckpointConfig", "RetryStrategy", "EnableManagedSpotTraining", "ResourceConfig"):
            assert field in passed, field
        assert state["Catch"] == [
            {"ErrorEquals": ["States.ALL"], "ResultPath": "$.failure", "Next": "NextAttempt"}
        ]
        assert state["Next"] == "Summarize" and state["ResultPath"] == "$.job"


@pytest.mark.parametrize(("environment", "team"), DIRECT_CASES)
def test_a_tune_reaches_create_hyper_parameter_tuning_job_with_the_teams_role(templates, environment, team):
    states = _definition(templates[environment], team)["States"]
    choices = {choice["StringEquals"]: choice["Next"] for choice in states["ChooseRequestLayout"]["Choices"]}
    for layout, fields in TUNING_LAYOUTS.items():
        # The definition fixes the trials' role, as for a training job: a Pass state holds the team's
        # execution role, merged over the rendered TrainingJobDefinition's.
        role = states[choices[layout]]
        assert choices[layout] == f"TrialsRole-{layout}" and role["Type"] == "Pass"
        assert role["ResultPath"] == "$.trials_role" and list(role["Result"]) == ["RoleArn"]
        assert role["Result"]["RoleArn"].startswith("<ImportValue:")
        assert f"Team{team.capitalize()}ExecutionRole" in role["Result"]["RoleArn"]
        state = states[role["Next"]]
        assert role["Next"] == f"CreateHyperParameterTuningJob-{layout}"
        assert state["Resource"] == (
            "arn:<AWS::Partition>:states:::sagemaker:createHyperParameterTuningJob.sync"
        )
        passed = {key.removesuffix(".$"): value for key, value in state["Parameters"].items()}
        assert set(passed) == set(fields)
        assert all(passed[f] == f"$.request.{f}" for f in fields if f != "TrainingJobDefinition")
        assert passed["TrainingJobDefinition"] == (
            "States.JsonMerge($.request.TrainingJobDefinition, $.trials_role, false)"
        )
        assert state["Catch"] == [
            {"ErrorEquals": ["States.ALL"], "ResultPath": "$.failure", "Next": "NextAttempt"}
        ]
        assert state["Next"] == "Summarize" and state["ResultPath"] == "$.job"


@pytest.mark.parametrize(("environment", "team"), QUEUED_CASES)
def test_a_launcher_with_queues_has_no_tuning_states(templates, environment, team):
    states = _definition(templates[environment], team)["States"]
    assert not [name for name in states if "Tuning" in name or name.startswith("TrialsRole")]


def test_the_flow_reads_any_input_resolves_first_retries_with_backoff_and_notifies(templates):
    definition = _definition(templates["dev"])
    states = definition["States"]
    # Any JSON starts an execution; it is kept under $.input so that every later state has an object.
    assert definition["StartAt"] == "ReadInput"
    assert states["ReadInput"]["Parameters"] == {"input.$": "$"} and states["ReadInput"]["Next"] == "Resolve"
    resolve = states["Resolve"]
    assert resolve["Parameters"]["Payload"] == {
        "input.$": "$.input",
        "execution_arn.$": "$$.Execution.Id",
        "execution_name.$": "$$.Execution.Name",
    }
    assert resolve["Next"] == "Rejected"
    assert resolve["Catch"] == [
        {"ErrorEquals": ["States.ALL"], "ResultPath": "$.error", "Next": "DescribeLauncherError"}
    ]
    # A refusal is a summary from Resolve: notified, then the execution fails with its error.
    assert states["Rejected"]["Choices"] == [
        {"Variable": "$.summary", "IsPresent": True, "Next": "NotifyFailure"}
    ]
    assert states["Rejected"]["Default"] == "ChooseRequestLayout"
    # The launcher error's subject is fixed: an 80-character execution name cannot overflow SNS's 100.
    assert states["DescribeLauncherError"]["Parameters"]["summary"]["subject"] == LAUNCHER_ERROR_SUBJECT
    assert len(LAUNCHER_ERROR_SUBJECT) <= 100
    assert states["RetryOrGiveUp"]["Choices"] == [
        {"Variable": "$.decision", "StringEquals": "retry", "Next": "WaitBeforeRetry"}
    ]
    assert states["RetryOrGiveUp"]["Default"] == "NotifyFailure"
    assert states["WaitBeforeRetry"] == {
        "Type": "Wait",
        "Comment": states["WaitBeforeRetry"]["Comment"],
        "SecondsPath": "$.wait_seconds",
        "Next": "ChooseRequestLayout",
    }
    topic_id, _ = _one(templates["dev"], "AWS::SNS::Topic")
    for name, then in (("NotifySuccess", "RunCompleted"), ("NotifyFailure", "RunFailed")):
        notify = states[name]
        assert notify["Resource"] == "arn:<AWS::Partition>:states:::sns:publish"
        assert notify["Parameters"]["TopicArn"] == f"<{topic_id}>"
        assert notify["Parameters"]["Message.$"] == "$.summary.message"
        assert notify["Next"] == then
    assert states["RunCompleted"] == {"Type": "Succeed", "OutputPath": "$.summary"}
    assert states["RunFailed"]["ErrorPath"] == "$.summary.error"
    assert states["RunFailed"]["CausePath"] == "$.summary.message"


# -- permissions ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("environment", "team"), QUEUED_CASES)
def test_with_queues_every_attempt_is_submitted_under_the_teams_share_and_watched(
    templates, environment, team
):
    states = _definition(templates[environment], team)["States"]
    direct = [name for name in states if name.startswith(("CreateTrainingJob", "ChooseRequestLayout"))]
    assert direct == []
    assert states["Rejected"]["Default"] == states["WaitBeforeRetry"]["Next"] == "SubmitToQueue"
    submit = states["SubmitToQueue"]
    assert submit["Resource"] == "arn:<AWS::Partition>:states:::aws-sdk:batch:submitServiceJob"
    # The request Resolve (or NextAttempt) built and checked; the share identifier fixed to the team's.
    assert submit["Parameters"] == {
        "JobName.$": "$.submission.jobName",
        "JobQueue.$": "$.submission.jobQueue",
        "ServiceRequestPayload.$": "$.submission.serviceRequestPayload",
        "SchedulingPriority.$": "$.submission.schedulingPriority",
        "Tags.$": "$.submission.tags",
        "ServiceJobType": "SAGEMAKER_TRAINING",
        "ShareIdentifier": team,
    }
    assert submit["ResultSelector"] == {"job_id.$": "$.JobId", "job_arn.$": "$.JobArn", "phase": "QUEUED"}
    assert submit["ResultPath"] == "$.queue" and submit["Next"] == "Watch"
    assert submit["Catch"] == [
        {"ErrorEquals": ["States.ALL"], "ResultPath": "$.failure", "Next": "NextAttempt"}
    ]
    watch = states["Watch"]
    assert watch["Parameters"] == {"queue.$": "$.queue"} and watch["ResultPath"] == "$.queue"
    assert watch["Next"] == "InQueue" and watch["Catch"][0]["Next"] == "DescribeLauncherError"
    assert states["InQueue"]["Choices"] == [
        {"Variable": "$.queue.phase", "StringEquals": "SUCCEEDED", "Next": "ServiceJobSucceeded"},
        {"Variable": "$.queue.phase", "StringEquals": "FAILED", "Next": "ServiceJobFailed"},
    ]
    assert states["InQueue"]["Default"] == "WaitInQueue"
    waiting, succeeded = states["WaitInQueue"], states["ServiceJobSucceeded"]
    failed = states["ServiceJobFailed"]
    assert (waiting["SecondsPath"], waiting["Next"]) == ("$.queue.wait_seconds", "Watch")
    assert (succeeded["InputPath"], succeeded["ResultPath"], succeeded["Next"]) == ("$.queue.job", "$.job",
                                                                                     "Summarize")
    assert (failed["InputPath"], failed["ResultPath"], failed["Next"]) == ("$.queue.failure", "$.failure",
                                                                            "NextAttempt")


@pytest.mark.parametrize(("environment", "team"), QUEUED_CASES)
def test_with_queues_the_role_submits_to_the_teams_queues_only_and_creates_no_job(
    templates, environments, environment, team
):
    """Batch evaluates these keys on SubmitServiceJob; moto does not, so they are asserted here."""
    config = environments[environment]
    team_config = config.team(team)
    statements = {s.get("Sid"): s for s in _state_machine_statements(templates[environment], team)}
    actions = {a for s in statements.values() for a in as_list(s["Action"])}
    assert not {a for a in actions if a.startswith("sagemaker:") or a.startswith("events:")}
    priority = {"NumericLessThanEquals": {"batch:SchedulingPriority": str(team_config.max_priority)}}
    to_queues = statements[SUBMIT_TO_QUEUES_SID]
    assert to_queues["Action"] == "batch:SubmitServiceJob"
    queues = [json.dumps(arn) for arn in as_list(to_queues["Resource"])]
    assert len(queues) == len(config.team_queues(team_config))
    assert all(f"Queue{name.capitalize()}" in " ".join(queues) for name in config.team_queues(team_config))
    assert to_queues["Condition"] == {**priority, "StringEquals": {"aws:RequestTag/llmtrain:team": team}}
    service_jobs = statements[SUBMIT_SERVICE_JOBS_SID]
    assert service_jobs["Resource"]["Fn::Join"][1][-1].endswith(":service-job/*")
    assert service_jobs["Condition"] == {
        **priority,
        "StringEquals": {"batch:ShareIdentifier": team, "aws:RequestTag/llmtrain:team": team},
    }
    # A job is tagged as it is submitted (no tags yet) and never re-tagged: a job another team's launcher
    # submitted carries that team's tag, and whoever holds the team's tag may cancel it (issue 36).
    assert statements[TAG_SERVICE_JOBS_SID]["Condition"] == {
        "StringEquals": {"aws:RequestTag/llmtrain:team": team},
        "StringEqualsIfExists": {"aws:ResourceTag/llmtrain:team": team},
    }
    # Batch needs the submitter's PassRole of the payload's role: the team's execution role only.
    passing = statements["PassTeamExecutionRoleToSageMaker"]
    assert f"Team{team.capitalize()}ExecutionRole" in passing["Resource"]["Fn::ImportValue"]
    assert passing["Condition"] == {"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}}
    invoked = [s for s in _state_machine_statements(templates[environment], team)
               if s["Action"] == "lambda:InvokeFunction"]
    assert len(invoked) == 4  # resolve, next attempt, summarize, watch


@pytest.mark.parametrize(("environment", "team"), DIRECT_CASES)
def test_the_job_creating_role_carries_every_condition_key(
    platform, templates, environments, environment, team
):
    """SageMaker evaluates these keys on CreateTrainingJob; moto does not, so they are asserted here."""
    config = environments[environment]
    spec = next(t for t in platform.stages[environment].teams if t.name == team)
    statements = {s.get("Sid"): s for s in _state_machine_statements(templates[environment], team)}
    create = statements[CREATE_JOBS_SID]
    assert create["Action"] == "sagemaker:CreateTrainingJob"
    prefix = config.team(team).job_name_prefix
    assert create["Resource"]["Fn::Join"][1][-1] == (
        f":sagemaker:{config.region}:{config.account}:training-job/{prefix}-*"
    )
    conditions = create["Condition"]
    all_of = conditions["ForAllValues:StringEquals"]
    assert all_of["sagemaker:InstanceTypes"] == list(spec.instance_types)
    assert len(all_of["sagemaker:VpcSubnets"]) == len(config.network.availability_zones)
    assert all("Subnet" in json.dumps(s) for s in all_of["sagemaker:VpcSubnets"])
    assert "TrainingSecurityGroup" in json.dumps(all_of["sagemaker:VpcSecurityGroupIds"])
    assert conditions["Null"] == {
        "sagemaker:InstanceTypes": "false",
        "sagemaker:VpcSubnets": "false",
        "sagemaker:VpcSecurityGroupIds": "false",
    }
    exact = conditions["StringEquals"]
    assert "PlatformKeyArn" in json.dumps(exact["sagemaker:OutputKmsKey"])
    assert exact["aws:RequestTag/llmtrain:team"] == team
    assert exact["aws:RequestTag/llmtrain:environment"] == environment
    assert conditions["StringEqualsIfExists"]["sagemaker:VolumeKmsKey"] == exact["sagemaker:OutputKmsKey"]
    assert conditions["NumericLessThanEqualsIfExists"] == {
        "sagemaker:KeepAlivePeriod": str(config.team(team).max_keep_alive_seconds)
    }
    if config.network.inter_container_traffic_encryption:
        assert conditions["Bool"] == {"sagemaker:InterContainerTrafficEncryption": "true"}
    else:
        assert "Bool" not in conditions
    assert statements["TagTeamTrainingJobs"]["Condition"] == {
        "StringEquals": {"aws:RequestTag/llmtrain:team": team}
    }
    follow = statements["FollowTeamTrainingJobs"]
    assert set(follow["Action"]) == {"sagemaker:DescribeTrainingJob", "sagemaker:StopTrainingJob"}
    passing = statements["PassTeamExecutionRoleToSageMaker"]
    assert passing["Action"] == "iam:PassRole"
    assert f"Team{team.capitalize()}ExecutionRole" in passing["Resource"]["Fn::ImportValue"]
    assert passing["Condition"] == {"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}}
    sync = statements["SyncWithTrainingJobEvents"]
    assert set(sync["Action"]) == {"events:PutTargets", "events:PutRule", "events:DescribeRule"}
    rules = [arn["Fn::Join"][1][-1] for arn in sync["Resource"]]
    assert rules[0].endswith(f":rule/{SYNC_EVENTS_RULE}")
    assert rules[1].endswith(":rule/StepFunctionsGetEventsForSageMakerTuningJobsRule")
    sagemaker = {a for s in statements.values() for a in as_list(s["Action"]) if a.startswith("sagemaker:")}
    assert sagemaker == {
        "sagemaker:CreateTrainingJob",
        "sagemaker:AddTags",
        "sagemaker:DescribeTrainingJob",
        "sagemaker:StopTrainingJob",
        "sagemaker:CreateHyperParameterTuningJob",
        "sagemaker:DescribeHyperParameterTuningJob",
        "sagemaker:StopHyperParameterTuningJob",
    }
    all_jobs = [s for s in statements.values() if "sagemaker:" in json.dumps(s.get("Action"))]
    assert all(f"training-job/{prefix}-*" in json.dumps(s["Resource"])
               or f"hyper-parameter-tuning-job/{prefix}-*" in json.dumps(s["Resource"]) for s in all_jobs)
    # `llmtrain tune`: the tuning jobs are created under the same condition keys (SageMaker evaluates
    # them on CreateHyperParameterTuningJob), less the warm pool's, which tuning jobs have not.
    tune = statements[CREATE_TUNING_JOBS_SID]
    assert tune["Action"] == "sagemaker:CreateHyperParameterTuningJob"
    assert tune["Resource"]["Fn::Join"][1][-1] == (
        f":sagemaker:{config.region}:{config.account}:hyper-parameter-tuning-job/{prefix}-*"
    )
    assert tune["Condition"] == {k: v for k, v in conditions.items() if k != "NumericLessThanEqualsIfExists"}
    assert statements["TagTeamTuningJobs"]["Condition"] == statements["TagTeamTrainingJobs"]["Condition"]
    invoked = [
        s
        for s in _state_machine_statements(templates[environment], team)
        if s["Action"] == "lambda:InvokeFunction"
    ]
    assert len(invoked) == 3


@pytest.mark.parametrize(("environment", "team"), TEAM_CASES)
def test_functions_get_the_teams_platform_context_and_least_privilege(
    templates, environments, environment, team
):
    config, template = environments[environment], templates[environment]
    team_config = config.team(team)
    functions = _functions(template, team)
    assert set(functions) == {"resolve", "next_attempt", "summarize"}
    for handler, function in functions.items():
        properties = function["Properties"]
        context = json.dumps(properties["Environment"]["Variables"][ENV_PLATFORM_CONTEXT])
        for export in (
            f"Team{team.capitalize()}ExecutionRole",
            "DatasetsBucket",
            "CheckpointsBucket",
            "ArtifactsBucket",
            "CodeBucket",
            "PlatformKey",
            "TrainingSecurityGroup",
        ):
            assert export in context, (handler, export)
        assert f'\\"job_name_prefix\\":\\"{team_config.job_name_prefix}\\"' in context
        assert f'\\"team\\":\\"{team}\\"' in context
        assert f'\\"warm_pool_cap_seconds\\":{team_config.max_keep_alive_seconds}' in context
        encryption = "true" if config.network.inter_container_traffic_encryption else "false"
        assert f'\\"inter_container_traffic_encryption\\":{encryption}' in context
        # The team's run budget, else the environment's (prod: finetune has its own).
        budget = {"default": 20000, "pretrain": 250000, "finetune": 25000}[team]
        assert team_config.max_run_cost_usd == budget
        assert f'\\"run_budget_usd\\":{budget}' in context
        assert properties["Runtime"] == LAMBDA_RUNTIME.name
        role_id = properties["Role"]["Fn::GetAtt"][0]
        role_policies = [
            p
            for p in resources_of_type(template, "AWS::IAM::Policy").values()
            if {"Ref": role_id} in p["Properties"]["Roles"]
        ]
        actions = {
            a
            for p in role_policies
            for s in p["Properties"]["PolicyDocument"]["Statement"]
            for a in as_list(s["Action"])
        }
        expected = {"logs:CreateLogStream", "logs:PutLogEvents"}
        # Resolve also reads JumpStart's catalogue (base models), and without queues lists a tune's
        # tuning jobs (an environment with queues refuses tunes).
        resolve = expected | {"sagemaker:ListTrainingJobs", "sagemaker:ListTags", "s3:GetObject"}
        if config.queues is not None:  # a run's attempts are its service jobs too
            resolve |= {"batch:ListServiceJobs", "batch:DescribeServiceJob", "batch:GetJobQueueSnapshot",
                        "sagemaker:DescribeTrainingJob"}
            assert '\\"queues\\":{' in context and f'\\"share_identifier\\":\\"{team}\\"' in context
        else:
            resolve |= {"sagemaker:ListHyperParameterTuningJobs"}
            assert '\\"queues\\"' not in context
        # NextAttempt ends a hung job's warm pool before its retry: the team's jobs only.
        next_attempt = expected | {"sagemaker:UpdateTrainingJob"}
        assert actions == {"resolve": resolve, "next_attempt": next_attempt}.get(handler, expected)
        if handler == "next_attempt":
            updates = [s for p in role_policies for s in p["Properties"]["PolicyDocument"]["Statement"]
                       if s["Action"] == "sagemaker:UpdateTrainingJob"]
            assert f"training-job/{team_config.job_name_prefix}-*" in json.dumps(updates[0]["Resource"])
            # with queues, also the jobs Batch names, those tagged with the team only
            tagged = [{"StringEquals": {"aws:ResourceTag/llmtrain:team": team}}]
            assert [u.get("Condition") for u in updates[1:]] == (tagged if config.queues else [])


@pytest.mark.parametrize(("environment", "team"), TEAM_CASES)
def test_a_teams_engineers_may_start_and_follow_runs_of_its_launcher_only(
    platform, environments, environment, team
):
    access = _template_json(platform.stages[environment].access)
    policies = {
        i: p for i, p in resources_of_type(access, "AWS::IAM::ManagedPolicy").items() if "EngineerPolicy" in i
    }
    assert len(policies) == len(environments[environment].teams)
    policy = next(p for i, p in policies.items() if i.startswith(f"AccessTeam{team.capitalize()}"))
    statements = {s.get("Sid"): s for s in policy["Properties"]["PolicyDocument"]["Statement"]}
    start = statements["StartTeamRuns1"]
    assert set(start["Action"]) == {"states:StartExecution", "states:ListExecutions"}
    prefix = environments[environment].team(team).job_name_prefix
    assert json.dumps(start["Resource"]).endswith(f':stateMachine:{prefix}-launcher"]]}}')
    assert {"states:StopExecution", "states:DescribeExecution"} <= set(
        statements["FollowTeamRuns1"]["Action"]
    )
    assert "StartTeamRuns2" not in statements


# -- topic and outputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("environment", "team"), TEAM_CASES)
def test_a_teams_topic_is_encrypted_tls_only_and_mails_the_team(templates, environments, environment, team):
    template = templates[environment]
    topic_id, topic = _one(template, "AWS::SNS::Topic", team)
    key_id, _ = _one(template, "AWS::KMS::Key", team)
    assert topic["Properties"]["KmsMasterKeyId"] == {"Fn::GetAtt": [key_id, "Arn"]}
    _, policy = _one(template, "AWS::SNS::TopicPolicy", team)
    denies = [s for s in policy["Properties"]["PolicyDocument"]["Statement"] if s["Effect"] == "Deny"]
    assert denies[0]["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    subscriptions = [
        s["Properties"] for s in _team_resources(template, "AWS::SNS::Subscription", team).values()
    ]
    assert subscriptions == [
        {
            "Protocol": "email",
            "TopicArn": {"Ref": topic_id},
            "Endpoint": environments[environment].team(team).notification_email,
        }
    ]
    outputs = template["Outputs"]
    machine_id, _ = _one(template, "AWS::StepFunctions::StateMachine", team)
    assert outputs[StackOutput.team_output(team, LauncherOutput.STATE_MACHINE_ARN)]["Value"] == {
        "Ref": machine_id
    }
    assert outputs[StackOutput.team_output(team, LauncherOutput.TOPIC_ARN)]["Value"] == {"Ref": topic_id}


# -- the functions' code ----------------------------------------------------------------------------------


def test_the_code_asset_loads_the_handlers_with_vendored_packages_and_the_registry(
    platform, templates, environments, tmp_path
):
    """As Lambda loads the asset: the asset first on the path (boto3 and botocore come from the
    runtime). The vendored `regex` is compiled for the Lambda runtime (test_lambda_code.py), which this
    interpreter cannot load: the copy probed here leaves it out and takes this interpreter's."""
    code = _functions(templates["dev"])["resolve"]["Properties"]["Code"]
    asset = platform.outdir / f"asset.{code['S3Key'].removesuffix('.zip')}"
    assert list((asset / "regex").glob("_regex.cpython-*-aarch64-linux-gnu.so"))
    probed = tmp_path / "asset"
    shutil.copytree(asset, probed, ignore=shutil.ignore_patterns("regex", "regex-*"))
    probe = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import yaml; "
        "from llmtrain.handlers import launcher, queue; from llmtrain.core.catalog import Catalog; "
        "from llmtrain.planner import prices; table = prices.load(); "
        "root = launcher.BUNDLED_TEMPLATES_DIR; "
        "refs = [t.ref for t in Catalog.load(root=root, repo_root=root.parent).all()]; "
        "print(json.dumps([yaml.__file__, launcher.__file__, queue.__file__, prices.__file__, refs]))"
    )
    result = subprocess.run(
        [sys.executable, "-I", "-c", probe, str(probed)], capture_output=True, text=True, check=True
    )
    *files, refs = json.loads(result.stdout)
    assert all(path.startswith(str(probed)) for path in files), files
    catalog = Catalog.load()
    assert sorted(refs) == sorted(
        f"{name}@{version}"
        for name in environments["dev"].enabled_templates
        for version in catalog.versions(name)
    )


# -- props validation ---------------------------------------------------------------------------------------


def _existing(stack: cdk.Stack) -> tuple[ExistingStorage, ExistingNetwork]:
    """The platform's resources as another app brings them: imported, once per stack."""
    if stack.node.try_find_child("Vpc") is None:
        kms.Key(stack, "Key")
        ec2.Vpc.from_vpc_attributes(
            stack, "Vpc", vpc_id="vpc-0123456789abcdef0", availability_zones=["us-east-1a"],
            private_subnet_ids=["subnet-0123456789abcdef0"],
        )
        ec2.SecurityGroup.from_security_group_id(stack, "Sg", "sg-0123456789abcdef0")
    vpc = stack.node.find_child("Vpc")
    buckets = {
        f"{name}_bucket": s3.Bucket.from_bucket_name(stack, name, f"existing-{name}")
        if stack.node.try_find_child(name) is None
        else stack.node.find_child(name)
        for name in ("datasets", "checkpoints", "artifacts", "code")
    }
    storage = ExistingStorage(data_key=stack.node.find_child("Key"), **buckets)
    network = ExistingNetwork(
        vpc=vpc, subnets=vpc.private_subnets, security_group=stack.node.find_child("Sg")
    )
    return storage, network


def _props(stack: cdk.Stack, **overrides) -> TrainingLauncherProps:
    storage, network = _existing(stack)
    props = dict(
        job_templates=[],
        team=_team(),
        execution_role=iam.Role(stack, "Exec", assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com")),
        storage=storage,
        network=network,
        environment_name="test",
    )
    props.update(overrides)
    return TrainingLauncherProps(**props)


def _team(**changes) -> TeamSpec:
    values = dict(
        name="a",
        job_name_prefix="llmtrain-a",
        instance_types=("ml.g5.12xlarge",),
        max_keep_alive_seconds=3600,
    )
    return TeamSpec(**{**values, **changes})


def _gpt2(stack: cdk.Stack) -> list[JobTemplate]:
    storage, _ = _existing(stack)
    return [JobTemplate(stack, "Gpt2", JobTemplateProps(template="gpt2-ddp@1.1.0", storage=storage))]


def _lora(stack: cdk.Stack) -> list[JobTemplate]:
    """A version with a warm pool (1800 s) by default."""
    storage, _ = _existing(stack)
    props = JobTemplateProps(template="llama-finetune-lora@1.1.0", storage=storage)
    return [JobTemplate(stack, "Lora", props)]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"team": "a"}, r"TrainingLauncher\(team=...\): must be a TeamSpec"),
        ({"network": "vpc-1"}, r"TrainingLauncher\(network=...\): must be a TrainingNetwork or an Existing"),
        ({"storage": "bucket"}, r"TrainingLauncher\(storage=...\): must be a TrainingStorage or an Existing"),
        ({"job_templates": ["gpt2-ddp@1.1.0"]}, r"TrainingLauncher\(job_templates=...\): must hold JobTem"),
        (
            {"job_templates": _gpt2, "platform_features": {"gpus": 8}},
            r"TrainingLauncher\(platform_features=...\): \['gpus'\] are not features",
        ),
        ({"state_machine_name": "has spaces"}, r"TrainingLauncher\(state_machine_name=...\)"),
        ({}, r"TrainingLauncher\(job_templates=...\): must list at least one JobTemplate"),
        (
            {
                "job_templates": _gpt2,
                "team": _team(templates=("byo-script",)),
            },
            r"TrainingLauncher\(job_templates=...\): \['gpt2-ddp'\] are not among team 'a''s templates",
        ),
        (
            {
                "job_templates": _gpt2,
                "team": _team(instance_types=("ml.c5.2xlarge",)),
            },
            r"gpt2-ddp@1.1.0 runs on ml.g5.12xlarge, .* none of which team 'a' may use",
        ),
        (
            {
                "job_templates": _lora,
                "team": _team(max_keep_alive_seconds=60),
            },
            r"(?s)llama-finetune-lora@1.1.0 cannot run with its defaults for team 'a': .*keep_alive_seconds",
        ),
    ],
)
def test_invalid_props_fail_at_synth_naming_the_field(overrides, message):
    stack = cdk.Stack(cdk.App(), "Invalid", env=ENV)
    if callable(overrides.get("job_templates")):
        overrides = {**overrides, "job_templates": overrides["job_templates"](stack)}
    with pytest.raises(PropsError, match=message):
        TrainingLauncher(stack, "Launcher", _props(stack, **overrides))


def test_environment_files_enable_only_catalog_templates():
    # The stage builds one JobTemplate per version of every enabled template: a typo fails at synth.
    catalog = Catalog.load()
    for name in ENVIRONMENTS:
        for template in load_environment(ROOT / "config" / f"{name}.yaml").enabled_templates:
            assert catalog.versions(template)
