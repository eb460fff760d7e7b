"""The launcher stack of every environment, from the app synthesized once per session (conftest).

The state machine's definition, its role, the functions, the topic and the logs are asserted in the
synthesized templates; cdk-nag and cfn-lint run over them; the functions' code asset is loaded the
way Lambda loads it. Executing the definition is tests/llmtrain/test_launcher_state_machine.py.
"""

from __future__ import annotations

import json
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

from llmtrain.catalog import Catalog
from llmtrain.environments import load_environment
from llmtrain.handlers.launcher import ENV_PLATFORM_CONTEXT, ENV_REQUEST_LAYOUTS
from llmtrain.launcher_client import LauncherOutput
from training_constructs import PropsError
from training_constructs.launcher import SYNC_EVENTS_RULE, TrainingLauncher

ENVIRONMENTS = ("dev", "prod")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def templates(platform) -> dict[str, dict]:
    return {name: _template_json(platform.stages[name].launcher) for name in ENVIRONMENTS}


def _template_json(stack: cdk.Stack) -> dict:
    return json.loads((Path(cdk.Stage.of(stack).outdir) / stack.template_file).read_text())


def _one(template: dict, resource_type: str) -> tuple[str, dict]:
    [(logical_id, resource)] = resources_of_type(template, resource_type).items()
    return logical_id, resource


def _definition(template: dict) -> dict:
    """The state machine definition, references shown as <Ref>/<Logical.Attr> (as cdk-nag names them)."""
    _, machine = _one(template, "AWS::StepFunctions::StateMachine")
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


def _functions(template: dict) -> dict[str, dict]:
    """The launcher's functions by handler (resolve, next_attempt, summarize)."""
    return {
        resource["Properties"]["Handler"].rsplit(".", 1)[1]: resource
        for resource in resources_of_type(template, "AWS::Lambda::Function").values()
        if resource["Properties"]["Handler"].startswith("llmtrain.handlers.launcher.")
    }


def _state_machine_statements(template: dict) -> list[dict]:
    machine_role = _one(template, "AWS::StepFunctions::StateMachine")[1]["Properties"]["RoleArn"][
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


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_logging_all_events_encrypted_and_tracing_on(templates, environments, environment):
    template = templates[environment]
    _, machine = _one(template, "AWS::StepFunctions::StateMachine")
    properties = machine["Properties"]
    assert properties["StateMachineName"] == f"{environments[environment].job_name_prefix}-launcher"
    assert properties["TracingConfiguration"] == {"Enabled": True}
    logging = properties["LoggingConfiguration"]
    assert logging["Level"] == "ALL" and logging["IncludeExecutionData"] is True
    log_group_id = logging["Destinations"][0]["CloudWatchLogsLogGroup"]["LogGroupArn"]["Fn::GetAtt"][0]
    key_id, key = _one(template, "AWS::KMS::Key")
    assert key["Properties"]["EnableKeyRotation"] is True
    for log_group in resources_of_type(template, "AWS::Logs::LogGroup").values():
        assert log_group["Properties"]["KmsKeyId"] == {"Fn::GetAtt": [key_id, "Arn"]}
        assert log_group["Properties"]["RetentionInDays"] == 365
    assert log_group_id in template["Resources"]


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_every_rendered_field_reaches_create_training_job(templates, environment):
    template = templates[environment]
    layouts = json.loads(
        _functions(template)["resolve"]["Properties"]["Environment"]["Variables"][ENV_REQUEST_LAYOUTS]
    )
    states = _definition(template)["States"]
    train_states = {name: state for name, state in states.items() if name.startswith("CreateTrainingJob-")}
    assert set(train_states) == {f"CreateTrainingJob-{layout}" for layout in layouts}
    for layout, fields in layouts.items():
        state = train_states[f"CreateTrainingJob-{layout}"]
        assert state["Resource"] == "arn:<AWS::Partition>:states:::sagemaker:createTrainingJob.sync"
        passed = {key.removesuffix(".$"): value for key, value in state["Parameters"].items()}
        assert set(passed) == set(fields)
        assert all(passed[f] == f"$.request.{f}" for f in fields if f != "RoleArn")
        # The role is fixed in the definition: only the platform's execution role is ever passed.
        assert passed["RoleArn"].startswith("<ImportValue:") and "ExecutionRole" in passed["RoleArn"]
        for field in ("CheckpointConfig", "RetryStrategy", "EnableManagedSpotTraining", "ResourceConfig"):
            assert field in passed, field
        assert state["Catch"] == [
            {"ErrorEquals": ["States.ALL"], "ResultPath": "$.failure", "Next": "NextAttempt"}
        ]
        assert state["Next"] == "Summarize" and state["ResultPath"] == "$.job"


def test_the_flow_resolves_first_retries_with_backoff_and_notifies(templates):
    definition = _definition(templates["dev"])
    states = definition["States"]
    assert definition["StartAt"] == "Resolve"
    resolve = states["Resolve"]
    assert resolve["Next"] == "ChooseRequestLayout"
    rejection = next(c for c in resolve["Catch"] if "InvalidRunInput" in c["ErrorEquals"])
    assert set(rejection["ErrorEquals"]) == {"InvalidRunInput", "RunAlreadyInProgress", "RunAlreadyCompleted"}
    assert not rejection["Next"].startswith("CreateTrainingJob")
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


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_state_machine_role_is_scoped_as_designed(templates, environments, environment):
    config = environments[environment]
    statements = {s.get("Sid"): s for s in _state_machine_statements(templates[environment])}
    jobs = statements["RunPlatformTrainingJobs"]
    assert set(jobs["Action"]) == {
        "sagemaker:CreateTrainingJob",
        "sagemaker:DescribeTrainingJob",
        "sagemaker:StopTrainingJob",
        "sagemaker:AddTags",
    }
    assert jobs["Resource"]["Fn::Join"][1][-1] == (
        f":sagemaker:{config.region}:{config.account}:training-job/{config.job_name_prefix}-*"
    )
    passing = statements["PassExecutionRoleToSageMaker"]
    assert passing["Action"] == "iam:PassRole"
    assert "ExecutionRole" in passing["Resource"]["Fn::ImportValue"]
    assert passing["Condition"] == {"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}}
    sync = statements["SyncWithTrainingJobEvents"]
    assert set(sync["Action"]) == {"events:PutTargets", "events:PutRule", "events:DescribeRule"}
    assert sync["Resource"]["Fn::Join"][1][-1].endswith(f":rule/{SYNC_EVENTS_RULE}")
    sagemaker_actions = {
        a for s in statements.values() for a in as_list(s["Action"]) if a.startswith("sagemaker:")
    }
    assert sagemaker_actions == set(jobs["Action"])
    invoked = [
        s for s in _state_machine_statements(templates[environment]) if s["Action"] == "lambda:InvokeFunction"
    ]
    assert len(invoked) == 3


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_functions_get_the_platform_context_and_least_privilege(templates, environments, environment):
    config, template = environments[environment], templates[environment]
    functions = _functions(template)
    assert set(functions) == {"resolve", "next_attempt", "summarize"}
    for handler, function in functions.items():
        properties = function["Properties"]
        context = json.dumps(properties["Environment"]["Variables"][ENV_PLATFORM_CONTEXT])
        for export in (
            "ExecutionRole",
            "DatasetsBucket",
            "CheckpointsBucket",
            "ArtifactsBucket",
            "CodeBucket",
            "PlatformKey",
            "TrainingSecurityGroup",
        ):
            assert export in context, (handler, export)
        assert f'\\"job_name_prefix\\":\\"{config.job_name_prefix}\\"' in context
        assert f'\\"warm_pool_cap_seconds\\":{config.warm_pools.max_keep_alive_seconds}' in context
        assert properties["Runtime"] == f"python{sys.version_info.major}.{sys.version_info.minor}"
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
        assert actions == (expected | {"sagemaker:ListTrainingJobs"} if handler == "resolve" else expected)


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_engineers_may_start_and_follow_runs_of_this_launcher(platform, environments, environment):
    access = _template_json(platform.stages[environment].access)
    _, policy = next(
        (i, p)
        for i, p in resources_of_type(access, "AWS::IAM::ManagedPolicy").items()
        if "EngineerPolicy" in i
    )
    statements = {s.get("Sid"): s for s in policy["Properties"]["PolicyDocument"]["Statement"]}
    start = statements["StartLauncherRuns1"]
    assert set(start["Action"]) == {"states:StartExecution", "states:ListExecutions"}
    assert json.dumps(start["Resource"]).endswith(
        f':stateMachine:{environments[environment].job_name_prefix}-launcher"]]}}'
    )
    assert {"states:StopExecution", "states:DescribeExecution"} <= set(
        statements["FollowLauncherRuns1"]["Action"]
    )


# -- topic and outputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_topic_is_encrypted_tls_only_and_mails_the_environment(templates, environments, environment):
    template = templates[environment]
    topic_id, topic = _one(template, "AWS::SNS::Topic")
    key_id, _ = _one(template, "AWS::KMS::Key")
    assert topic["Properties"]["KmsMasterKeyId"] == {"Fn::GetAtt": [key_id, "Arn"]}
    _, policy = _one(template, "AWS::SNS::TopicPolicy")
    denies = [s for s in policy["Properties"]["PolicyDocument"]["Statement"] if s["Effect"] == "Deny"]
    assert denies[0]["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    subscriptions = [s["Properties"] for s in resources_of_type(template, "AWS::SNS::Subscription").values()]
    assert subscriptions == [
        {
            "Protocol": "email",
            "TopicArn": {"Ref": topic_id},
            "Endpoint": environments[environment].notifications.email,
        }
    ]
    outputs = template["Outputs"]
    machine_id, _ = _one(template, "AWS::StepFunctions::StateMachine")
    assert outputs[LauncherOutput.STATE_MACHINE_ARN]["Value"] == {"Ref": machine_id}
    assert outputs[LauncherOutput.TOPIC_ARN]["Value"] == {"Ref": topic_id}


# -- the functions' code ----------------------------------------------------------------------------------


def test_the_code_asset_loads_the_handlers_with_vendored_packages_and_the_registry(
    platform, templates, environments
):
    code = _functions(templates["dev"])["resolve"]["Properties"]["Code"]
    asset = platform.outdir / f"asset.{code['S3Key'].removesuffix('.zip')}"
    # As Lambda loads it: the asset first on the path (boto3 and botocore come from the runtime).
    probe = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import yaml, regex; "
        "from llmtrain.handlers import launcher; from llmtrain.catalog import Catalog; "
        "root = launcher.BUNDLED_TEMPLATES_DIR; "
        "refs = [t.ref for t in Catalog.load(root=root, repo_root=root.parent).all()]; "
        "print(json.dumps([yaml.__file__, regex.__file__, launcher.__file__, refs]))"
    )
    result = subprocess.run(
        [sys.executable, "-I", "-c", probe, str(asset)], capture_output=True, text=True, check=True
    )
    *files, refs = json.loads(result.stdout)
    assert all(path.startswith(str(asset)) for path in files), files
    catalog = Catalog.load()
    assert sorted(refs) == sorted(
        f"{name}@{version}"
        for name in environments["dev"].enabled_templates
        for version in catalog.versions(name)
    )


# -- props validation ---------------------------------------------------------------------------------------


def _props(stack: cdk.Stack, **overrides) -> dict:
    key = kms.Key(stack, "Key")
    buckets = {name: s3.Bucket(stack, name) for name in ("datasets", "checkpoints", "artifacts", "code")}
    props = dict(
        job_templates=[],
        execution_role=iam.Role(stack, "Exec", assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com")),
        datasets_bucket=buckets["datasets"],
        checkpoints_bucket=buckets["checkpoints"],
        artifacts_bucket=buckets["artifacts"],
        code_bucket=buckets["code"],
        data_key=key,
        subnets=[ec2.Subnet.from_subnet_id(stack, "Subnet", "subnet-0123456789abcdef0")],
        security_groups=[ec2.SecurityGroup.from_security_group_id(stack, "Sg", "sg-0123456789abcdef0")],
        environment_name="test",
        job_name_prefix="llmtrain-test",
        warm_pool_cap_seconds=3600,
    )
    props.update(overrides)
    return props


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"job_name_prefix": "Bad_Prefix"}, r"TrainingLauncher\(job_name_prefix=...\): 'Bad_Prefix' must be"),
        (
            {"warm_pool_cap_seconds": 30000},
            r"TrainingLauncher\(warm_pool_cap_seconds=...\): must be a whole number",
        ),
        ({"subnets": []}, r"TrainingLauncher\(subnets=...\): must hold 1 to 16 subnets"),
        (
            {"notification_email": "nobody"},
            r"TrainingLauncher\(notification_email=...\): 'nobody' is not an e-mail",
        ),
        ({"state_machine_name": "has spaces"}, r"TrainingLauncher\(state_machine_name=...\)"),
        ({"run_budget_usd": 0}, r"TrainingLauncher\(run_budget_usd=...\): must be a positive number"),
        ({}, r"TrainingLauncher\(job_templates=...\): must list at least one JobTemplate"),
    ],
)
def test_invalid_props_fail_at_synth_naming_the_field(overrides, message):
    stack = cdk.Stack(cdk.App(), "Invalid", env=ENV)
    with pytest.raises(PropsError, match=message):
        TrainingLauncher(stack, "Launcher", **_props(stack, **overrides))


def test_environment_files_enable_only_catalog_templates():
    # The stage builds one JobTemplate per version of every enabled template: a typo fails at synth.
    catalog = Catalog.load()
    for name in ENVIRONMENTS:
        for template in load_environment(ROOT / "config" / f"{name}.yaml").enabled_templates:
            assert catalog.versions(template)
