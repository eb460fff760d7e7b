"""DeployedEnvironmentRecord: the environment's record for the CLI in SSM, readable by engineers.

The whole app is synthesized once (conftest.py, with cdk-nag; test_platform.py lints every
template). What the CLI reads back from a deployed record is tested in
tests/llmtrain/test_cli_deployed.py."""

from __future__ import annotations

import json
from pathlib import Path

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Template
from infra_helpers import ENV, resources_of_type, statements_by_sid

from llmtrain.core.catalog import Catalog
from llmtrain.core.deployed import STANDARD_PARAMETER_LIMIT, template_parameter_value
from training_constructs import PropsError
from training_constructs.deployed_environment import (
    DeployedEnvironmentRecord,
    DeployedEnvironmentRecordProps,
    TeamEntry,
)


def _template_json(stack: cdk.Stack) -> dict:
    return json.loads((Path(cdk.Stage.of(stack).outdir) / stack.template_file).read_text())


@pytest.mark.parametrize(("environment", "teams"), [("dev", ["default"]), ("prod", ["finetune", "pretrain"])])
def test_the_launcher_stack_writes_the_record_as_standard_string_parameters(platform, environment, teams):
    stage = platform.stages[environment]
    template = _template_json(stage.launcher)
    parameters = {
        r["Properties"]["Name"]: r["Properties"]
        for r in resources_of_type(template, "AWS::SSM::Parameter").values()
    }
    root = f"/llmtrain/{environment}"
    assert sorted(parameters) == [f"{root}/environment", *(f"{root}/teams/{team}" for team in teams)]
    assert {p["Type"] for p in parameters.values()} == {"String"}
    assert {p.get("Tier", "Standard") for p in parameters.values()} == {"Standard"}
    # Each team's entry is built from its launcher: the platform context its functions receive.
    for team in teams:
        entry = next(e for e in stage.launcher.environment_record.props.teams if e.name == team)
        launcher = stage.launcher.launchers[team]
        assert entry.platform_context == launcher.platform_context
        assert entry.state_machine_arn == launcher.state_machine.state_machine_arn
        assert entry.notification_topic_arn == launcher.topic.topic_arn


@pytest.mark.parametrize("environment", ["dev", "prod"])
def test_every_teams_engineers_may_read_the_record_and_nothing_else_of_ssm(platform, environment):
    statements = statements_by_sid(platform.template_json(environment, "access"), "AWS::IAM::ManagedPolicy")
    policies = resources_of_type(platform.template_json(environment, "access"), "AWS::IAM::ManagedPolicy")
    readers = [
        policy
        for policy in policies.values()
        if "ReadDeployedEnvironment"
        in {s.get("Sid") for s in policy["Properties"]["PolicyDocument"]["Statement"]}
    ]
    assert len(readers) == len(platform.stages[environment].teams)
    statement = statements["ReadDeployedEnvironment"]
    assert statement["Action"] == ["ssm:GetParametersByPath", "ssm:GetParameters", "ssm:GetParameter"]
    resources = [json.dumps(r) for r in statement["Resource"]]
    assert len(resources) == 2
    end = '"]]}'
    assert resources[0].endswith(f":parameter/llmtrain/{environment}{end}")
    assert resources[1].endswith(f":parameter/llmtrain/{environment}/*{end}")
    assert "Fn::ImportValue" not in json.dumps(statement)  # built in the access stack: no cross-stack export


def _entry(name: str = "default", templates=("gpt2-ddp",), **context) -> TeamEntry:
    return TeamEntry(
        name=name,
        state_machine_arn="arn:x",
        notification_topic_arn="arn:aws:sns:us-east-1:111111111111:t",
        platform_context={"environment": "dev", "team": name, "allowed_templates": [*templates], **context},
    )


def _props(**changes) -> DeployedEnvironmentRecordProps:
    values = {
        "environment_name": "dev",
        "job_name_prefix": "llmtrain-dev",
        "enabled_templates": ("gpt2-ddp",),
        "teams": (_entry(),),
    }
    return DeployedEnvironmentRecordProps(**(values | changes))


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cdk_consumer"


def _own(name: str = "acme-charlm", content: str = "sha256:1") -> dict:
    spec = Catalog.load(root=EXAMPLE / "templates", repo_root=EXAMPLE).get("acme-charlm").to_dict()
    return template_parameter_value({**spec, "name": name}, content)


def test_a_team_s_own_templates_are_written_for_the_cli():
    """One parameter per version, compressed (specs run to SSM's limit), read back by the CLI's
    `llmtrain.core.deployed` (end to end: tests/llmtrain/test_cli_own_catalog.py)."""
    stack = cdk.Stack(cdk.App(), "Record", env=ENV)
    DeployedEnvironmentRecord(stack, "Record", props=_props(own_templates=(_own(),)))
    parameters = {
        p["Properties"]["Name"]: p["Properties"]["Value"]
        for p in resources_of_type(Template.from_stack(stack).to_json(), "AWS::SSM::Parameter").values()
    }
    own = "/llmtrain/dev/templates/acme-charlm/1.0.0"
    assert sorted(parameters) == ["/llmtrain/dev/environment", "/llmtrain/dev/teams/default", own]
    assert json.loads(parameters[own]) == _own()


@pytest.mark.parametrize(
    ("own", "message"),
    [
        ((_own(), _own(content="sha256:2")), "['acme-charlm@1.0.0'] come from catalogs that disagree"),
        ((_own("gpt2-ddp"),), "['gpt2-ddp'] of your own catalog are named like templates of the platform's"),
    ],
)
def test_own_templates_are_one_version_one_content_and_never_a_platform_name(own, message):
    with pytest.raises(PropsError, match=r"DeployedEnvironmentRecord\(own_templates=") as error:
        _props(own_templates=own)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"environment_name": "Dev"}, "environment_name=...): 'Dev' must be lowercase"),
        ({"enabled_templates": ()}, "must name at least one template"),
        ({"teams": ()}, "must hold at least one team"),
        (
            {"teams": (_entry("nlp", templates=("byo-script",)),)},
            "team 'nlp' is allowed templates the environment does not enable: ['byo-script']",
        ),
        ({"teams": (_entry("a", templates=()),) * 2}, "team names must be unique"),
    ],
)
def test_props_are_checked_naming_the_field(changes, message):
    with pytest.raises(PropsError, match=r"DeployedEnvironmentRecord\(") as error:
        _props(**changes)
    assert message in str(error.value)


@pytest.mark.parametrize("name", ["NLP", "nlp-a", "averyveryverylongteam"])
def test_team_names_follow_the_teams_rule(name):
    with pytest.raises(PropsError, match=f"team name '{name}' must be 1-12 lowercase letters and digits"):
        _entry(name)


def test_a_teams_entry_carries_its_own_platform_context():
    with pytest.raises(PropsError, match="team 'nlp': its platform_context is team 'cv''s"):
        TeamEntry(
            name="nlp", state_machine_arn="x", notification_topic_arn="t", platform_context={"team": "cv"}
        )


def test_a_record_that_could_outgrow_ssms_standard_limit_fails_the_synth():
    """Deploy-time values count at their estimate: 40 subnet ids cannot fit one parameter."""
    stack = cdk.Stack(cdk.App(), "Record", env=ENV)
    subnets = [cdk.Fn.import_value(f"subnet-{index}") for index in range(40)]
    DeployedEnvironmentRecord(stack, "Small", props=_props())
    with pytest.raises(PropsError) as error:
        DeployedEnvironmentRecord(
            stack, "Big", props=_props(environment_name="big", teams=(_entry(subnet_ids=subnets),))
        )
    assert "parameter /llmtrain/big/teams/default could reach" in str(error.value)
    assert f"over SSM's standard limit of {STANDARD_PARAMETER_LIMIT}" in str(error.value)


@pytest.mark.parametrize(("environment", "version"), [("dev", 1), ("prod", 2)])
def test_the_record_is_schema_2_only_where_the_environment_has_queues(platform, environment, version):
    """An llmtrain from before queues reads dev's record as before, and asks prod's readers to upgrade
    (it would stop a queued run without cancelling its queued job)."""
    template = _template_json(platform.stages[environment].launcher)
    values = {
        r["Properties"]["Name"]: json.dumps(r["Properties"]["Value"])
        for r in resources_of_type(template, "AWS::SSM::Parameter").values()
    }
    assert f'\\"schema_version\\":{version}' in values[f"/llmtrain/{environment}/environment"]
    teams = [value for name, value in values.items() if "/teams/" in name]
    assert all(('\\"queues\\":{' in value) == (version == 2) for value in teams)
