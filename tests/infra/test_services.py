"""The services stack and the feature permissions (issue 19): a CodeArtifact PyPI mirror for isolated
subnets, a SageMaker MLflow tracking server, remote-debugging endpoints, training plans; cdk-nag and
cfn-lint on an environment of two teams with every feature on (each team's roles get the features'
permissions, scoped to the team), and the dev environment's package path end to end (the repository,
its endpoints, the role's permissions and the ARN the launcher renders into jobs)."""

from __future__ import annotations

import json
from pathlib import Path

import aws_cdk as cdk
import pytest
from cfnlint.api import ManualArgs, lint
from infra_helpers import CONFIG_DIR, checkov_reports, resources_of_type, statements_by_sid, synthesize

from llmtrain.core.environments import load_environment, parse_environment
from llmtrain.core.function_settings import ENV_PLATFORM_CONTEXT
from stacks.platform import PlatformStage

ACCOUNT = "333333333333"
TEAMS = ("nlp", "vision")
PLAN = f"arn:aws:sagemaker:eu-west-1:{ACCOUNT}:training-plan/p5-week"


@pytest.fixture(scope="module")
def featured(tmp_path_factory):
    """A stage with every feature switched on (synthesized once, with cdk-nag)."""
    config = parse_environment({
        "name": "lab", "account": ACCOUNT, "region": "eu-west-1",
        "network": {"vpc_cidr": "10.50.0.0/16", "availability_zones": ["eu-west-1a", "eu-west-1b"]},
        "job_templates": {"enabled": ["llama-pretrain-fsdp"]}, "job_name_prefix": "llmtrain-lab",
        "mlflow": {"tracking_server": True, "size": "Medium"}, "remote_debug": {"enabled": True},
        "training_plans": {"p5-week": PLAN},
        "teams": {"nlp": {}, "vision": {}},
    })
    outdir = tmp_path_factory.mktemp("cdk.out")
    app = cdk.App(outdir=str(outdir))
    stage = PlatformStage(app, config=config)
    stacks = {("lab", part): getattr(stage, part) for part in ("network", "access", "services", "launcher")}
    return synthesize(app, outdir, stacks), stage


def _template(stack: cdk.Stack) -> dict:
    return json.loads((Path(cdk.Stage.of(stack).outdir) / stack.template_file).read_text())


def _service_names(template: dict) -> set[str]:
    names = set()
    for resource in resources_of_type(template, "AWS::EC2::VPCEndpoint").values():
        name = resource["Properties"]["ServiceName"]
        names.add(name if isinstance(name, str) else "".join(
            part if isinstance(part, str) else "<region>" for part in name["Fn::Join"][1]))
    return names


def test_every_feature_passes_cdk_nag_and_cfn_lint(featured):
    synthesized, _ = featured
    assert synthesized.synth_error is None, synthesized.synth_error
    assert synthesized.nag_violations() == []
    for (_, part), stack in synthesized.stacks.items():
        errors = [f"{part}: {m.rule.id} {m.message} at {m.path}"
                  for m in lint(json.dumps(_template(stack)), config=ManualArgs(regions=["eu-west-1"]))
                  if m.rule.id.startswith("E")]
        assert errors == []


def test_every_feature_passes_checkov(featured):
    """The MLflow server, its role and the SSM endpoints exist only where a switch is on: checkov reads
    them here (config/'s environments are checked in test_platform.py)."""
    synthesized, _ = featured
    assemblies = sorted(synthesized.outdir.glob("assembly-*"))
    assert assemblies
    for report in checkov_reports(assemblies):
        assert report.read_every_resource, report.folder.name
        assert report.failed == []
        assert report.passed > 100, report.folder.name


def test_services_stack_holds_the_mirror_the_tracking_server_and_their_endpoints(featured):
    _, stage = featured
    template = _template(stage.services)
    [repository] = resources_of_type(template, "AWS::CodeArtifact::Repository").values()
    assert repository["Properties"]["RepositoryName"] == "pypi-mirror"
    assert repository["Properties"]["ExternalConnections"] == ["public:pypi"]
    [domain] = resources_of_type(template, "AWS::CodeArtifact::Domain").values()
    assert domain["Properties"]["DomainName"] == "llmtrain-lab"
    assert {domain["DeletionPolicy"], repository["DeletionPolicy"]} == {"Retain"}
    [server] = resources_of_type(template, "AWS::SageMaker::MlflowTrackingServer").values()
    assert server["Properties"]["TrackingServerName"] == "llmtrain-lab"
    assert server["Properties"]["TrackingServerSize"] == "Medium"
    assert _service_names(template) == {
        "com.amazonaws.eu-west-1.codeartifact.api", "com.amazonaws.eu-west-1.codeartifact.repositories",
        "aws.sagemaker.eu-west-1.experiments",  # where the MLflow client reaches the tracking server
        "com.amazonaws.eu-west-1.ssm", "com.amazonaws.eu-west-1.ssmmessages"}
    for endpoint in resources_of_type(template, "AWS::EC2::VPCEndpoint").values():
        assert endpoint["Properties"]["PrivateDnsEnabled"] is True


@pytest.mark.parametrize("team", TEAMS)
def test_each_teams_execution_role_may_install_packages_log_to_mlflow_and_open_debug_channels(featured, team):
    _, stage = featured
    statements = statements_by_sid(_template(stage.access), "AWS::IAM::Policy",
                                   f"AccessTeam{team.capitalize()}")
    assert statements["PackagesToken"]["Action"] == "codeartifact:GetAuthorizationToken"
    assert "domain/llmtrain-lab" in json.dumps(statements["PackagesToken"]["Resource"])
    # Reading is granted on the repository itself (CodeArtifact reads a repository whole).
    assert "repository/llmtrain-lab/pypi-mirror" in json.dumps(statements["PackagesRead"]["Resource"])
    assert "package/" not in json.dumps(statements["PackagesRead"]["Resource"])
    assert statements["PackagesBearerToken"]["Condition"] == {
        "StringEquals": {"sts:AWSServiceName": "codeartifact.amazonaws.com"}}
    assert "mlflow-tracking-server/llmtrain-lab" in json.dumps(statements["MlflowTracking"]["Resource"])
    assert "sagemaker-mlflow:LogBatch" in statements["MlflowTracking"]["Action"]
    assert sorted(statements["RemoteDebugChannels"]["Action"]) == [
        "ssmmessages:CreateControlChannel", "ssmmessages:CreateDataChannel",
        "ssmmessages:OpenControlChannel", "ssmmessages:OpenDataChannel"]
    # In the team's own execution policy, beside its storage statements: no environment-wide policy.
    assert "ReadTeamData" in statements
    assert not [r for r in resources_of_type(_template(stage.access), "AWS::IAM::Policy") if "Feature" in r]


@pytest.mark.parametrize("team", TEAMS)
def test_a_teams_engineers_open_sessions_only_into_its_jobs_and_describe_only_offered_plans(featured, team):
    _, stage = featured
    statements = statements_by_sid(_template(stage.access), "AWS::IAM::ManagedPolicy",
                                   f"AccessTeam{team.capitalize()}")
    start = statements["RemoteDebugStartSession"]
    assert start["Condition"] == {"StringLike": {
        "ssm:resourceTag/aws:ssmmessages:target-id": [f"sagemaker-training-job:llmtrain-lab-{team}-*"]}}
    assert "session/${aws:userid}-*" in json.dumps(statements["RemoteDebugEndSession"]["Resource"])
    assert statements["TrainingPlansList"]["Action"] == "sagemaker:ListTrainingPlans"
    assert statements["TrainingPlansDescribe"]["Resource"] == PLAN


def test_without_plans_engineers_list_plans_and_describe_none(platform):
    """config/dev.yaml offers no training plan: its engineers may list the account's plans only."""
    statements = statements_by_sid(platform.template_json("dev", "access"), "AWS::IAM::ManagedPolicy")
    assert statements["TrainingPlansList"]["Resource"] == "*"
    assert "TrainingPlansDescribe" not in statements and "RemoteDebugStartSession" not in statements


def test_codeartifact_endpoints_allow_only_this_accounts_principals(featured):
    _, stage = featured
    policies = {}
    for logical_id, endpoint in resources_of_type(_template(stage.services), "AWS::EC2::VPCEndpoint").items():
        policies[logical_id.split("Endpoint")[0]] = endpoint["Properties"].get("PolicyDocument")
    codeartifact = [policy for name, policy in policies.items() if "CodeArtifact" in name]
    assert len(codeartifact) == 2
    for policy in codeartifact:
        [statement] = policy["Statement"]
        assert statement["Action"] == ["codeartifact:*", "sts:GetServiceBearerToken"]
        assert statement["Condition"] == {"StringEquals": {"aws:PrincipalAccount": ACCOUNT}}
    # Services whose endpoints take no documented policy keep AWS's default one.
    assert [name for name, policy in policies.items() if policy is None and "CodeArtifact" not in name]


@pytest.mark.parametrize("team", TEAMS)
def test_each_teams_launcher_renders_jobs_with_the_features_the_stacks_provide(featured, team):
    _, stage = featured
    launcher = stage.launcher.launchers[team]
    template = _template(stage.launcher)
    function = next(f for logical_id, f in resources_of_type(template, "AWS::Lambda::Function").items()
                    if f["Properties"]["Handler"] == "llmtrain.handlers.launcher.resolve"
                    and logical_id.startswith(f"Launcher{team.capitalize()}"))
    context = json.dumps(function["Properties"]["Environment"]["Variables"][ENV_PLATFORM_CONTEXT])
    assert f"arn:aws:codeartifact:eu-west-1:{ACCOUNT}:repository/llmtrain-lab/pypi-mirror" in context
    assert f"arn:aws:sagemaker:eu-west-1:{ACCOUNT}:mlflow-tracking-server/llmtrain-lab" in context
    assert PLAN in context and '\\"remote_debug\\":true' in context
    # A request with MlflowConfig has a state of its own layout in the state machine.
    assert any("MlflowConfig" in fields for fields in launcher.request_layouts.values())


def test_dev_isolated_subnets_get_codeartifact_endpoints_and_permissions(platform):
    """config/dev.yaml has no NAT gateway: the acceptance check of issue 19 on the real app."""
    dev = load_environment(CONFIG_DIR / "dev.yaml")
    assert dev.network.nat_gateways == 0
    services = platform.template_json("dev", "services")
    assert {r["Properties"]["RepositoryName"] for r in
            resources_of_type(services, "AWS::CodeArtifact::Repository").values()} == {"pypi-mirror"}
    assert _service_names(services) == {"com.amazonaws.us-east-1.codeartifact.api",
                                        "com.amazonaws.us-east-1.codeartifact.repositories"}
    role = statements_by_sid(platform.template_json("dev", "access"), "AWS::IAM::Policy")
    assert {"PackagesToken", "PackagesRead", "PackagesBearerToken"} <= set(role)
    launcher = platform.stages["dev"].launcher
    function = next(f for f in resources_of_type(_template(launcher), "AWS::Lambda::Function").values()
                    if f["Properties"]["Handler"] == "llmtrain.handlers.launcher.resolve")
    context = json.dumps(function["Properties"]["Environment"]["Variables"][ENV_PLATFORM_CONTEXT])
    assert dev.platform_features()["package_repository_arn"] in context
