"""DeployedEnvironmentRecord: the environment's record for the CLI in SSM, readable by engineers.

The whole app is synthesized once (conftest.py, with cdk-nag; test_platform.py lints every
template). What the CLI reads back from a deployed record is tested in
tests/llmtrain/test_cli_deployed.py."""

from __future__ import annotations

import json
from pathlib import Path

import aws_cdk as cdk
import pytest
from infra_helpers import ENV, resources_of_type, statements_by_sid

from llmtrain.deployed import STANDARD_PARAMETER_LIMIT
from training_constructs import PropsError
from training_constructs.deployed_environment import (
    DeployedEnvironmentProps,
    DeployedEnvironmentRecord,
    TeamEntry,
)


def _template_json(stack: cdk.Stack) -> dict:
    return json.loads((Path(cdk.Stage.of(stack).outdir) / stack.template_file).read_text())


@pytest.mark.parametrize("environment", ["dev", "prod"])
def test_the_launcher_stack_writes_the_record_as_standard_string_parameters(platform, environment):
    template = _template_json(platform.stages[environment].launcher)
    parameters = {
        r["Properties"]["Name"]: r["Properties"]
        for r in resources_of_type(template, "AWS::SSM::Parameter").values()
    }
    root = f"/llmtrain/{environment}"
    assert sorted(parameters) == [f"{root}/environment", f"{root}/platform", f"{root}/teams/default"]
    assert {p["Type"] for p in parameters.values()} == {"String"}
    assert {p.get("Tier", "Standard") for p in parameters.values()} == {"Standard"}


def test_engineers_may_read_the_record_and_nothing_else_of_ssm(platform):
    statement = statements_by_sid(platform.template_json("dev", "access"), "AWS::IAM::ManagedPolicy")[
        "ReadDeployedEnvironment"
    ]
    assert statement["Action"] == ["ssm:GetParametersByPath", "ssm:GetParameters", "ssm:GetParameter"]
    resources = [json.dumps(r) for r in statement["Resource"]]
    assert len(resources) == 2
    assert resources[0].endswith(':parameter/llmtrain/dev"]]}') and resources[1].endswith(
        ':parameter/llmtrain/dev/*"]]}'
    )
    assert "Fn::ImportValue" not in json.dumps(statement)  # built in the access stack: no cross-stack export


def _props(**changes) -> DeployedEnvironmentProps:
    values = {
        "environment_name": "dev",
        "job_name_prefix": "llmtrain-dev",
        "enabled_templates": ("gpt2-ddp",),
        "platform_context": {"environment": "dev"},
        "notification_topic_arn": "arn:aws:sns:us-east-1:111111111111:t",
        "teams": (TeamEntry(name="default", state_machine_arn="arn:x", allowed_templates=("gpt2-ddp",)),),
    }
    return DeployedEnvironmentProps(**(values | changes))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"environment_name": "Dev"}, "environment_name=...): 'Dev' must be lowercase"),
        ({"enabled_templates": ()}, "must name at least one template"),
        ({"teams": ()}, "must hold at least one team"),
        (
            {"teams": (TeamEntry(name="nlp", state_machine_arn="a", allowed_templates=("byo-script",)),)},
            "team 'nlp' is allowed templates the environment does not enable: ['byo-script']",
        ),
        (
            {"teams": (TeamEntry(name="a", state_machine_arn="x", allowed_templates=()),) * 2},
            "team names must be unique",
        ),
    ],
)
def test_props_are_checked_naming_the_field(changes, message):
    with pytest.raises(PropsError, match=r"DeployedEnvironmentRecord\(") as error:
        _props(**changes)
    assert message in str(error.value)


def test_a_team_gets_its_own_datasets_prefix():
    assert TeamEntry(name="nlp", state_machine_arn="x", allowed_templates=()).datasets_prefix == "teams/nlp/"
    with pytest.raises(PropsError, match="team name 'NLP'"):
        TeamEntry(name="NLP", state_machine_arn="x", allowed_templates=())


def test_a_record_that_could_outgrow_ssms_standard_limit_fails_the_synth():
    """Deploy-time values count at their estimate: 40 subnet ids cannot fit one parameter."""
    stack = cdk.Stack(cdk.App(), "Record", env=ENV)
    subnets = [cdk.Fn.import_value(f"subnet-{index}") for index in range(40)]
    DeployedEnvironmentRecord(stack, "Small", props=_props())
    with pytest.raises(PropsError) as error:
        DeployedEnvironmentRecord(
            stack, "Big", props=_props(environment_name="big", platform_context={"subnet_ids": subnets})
        )
    assert "parameter /llmtrain/big/platform could reach" in str(error.value)
    assert f"over SSM's standard limit of {STANDARD_PARAMETER_LIMIT}" in str(error.value)
