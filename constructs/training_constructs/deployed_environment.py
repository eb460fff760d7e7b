"""`DeployedEnvironmentRecord`: how the `llmtrain` CLI finds a deployed environment.

Writes the environment's record (`llmtrain.deployed`: the environment, its PlatformContext and
each team's launcher, datasets prefix and templates) as SSM String parameters under
`/llmtrain/<env>/`, one JSON object each, so that the CLI needs only credentials and an
environment name. Each value must fit SSM's 4 KB standard tier; values CloudFormation fills in at
deploy time (ARNs, bucket names, ids) are counted at `TOKEN_SIZE_ESTIMATE` characters, and a
record that could exceed the limit fails the synth naming the parameter.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aws_cdk import ArnFormat, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from llmtrain import deployed
from llmtrain.platform import ENVIRONMENT_NAME_PATTERN
from training_constructs._props import is_unresolved, require
from training_constructs.launcher import TrainingLauncher
from training_constructs.nag import acknowledge_wildcards

_NAME = "DeployedEnvironmentRecord"
# ARNs, bucket names and ids the stacks create are far shorter than this.
TOKEN_SIZE_ESTIMATE = 128
_READ_SID = "ReadDeployedEnvironment"


@dataclass(frozen=True)
class TeamEntry:
    """One team's part of the record (llmtrain.deployed.TeamAccess)."""

    name: str
    state_machine_arn: str
    allowed_templates: tuple[str, ...]
    datasets_prefix: str = ""  # default: teams/<name>/

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_templates", tuple(self.allowed_templates))
        object.__setattr__(
            self, "datasets_prefix", self.datasets_prefix or deployed.team_datasets_prefix(self.name)
        )
        require(
            bool(deployed.TEAM_NAME_PATTERN.fullmatch(self.name)),
            _NAME,
            "teams",
            f"team name {self.name!r} must be 1-32 lowercase letters, digits and '-', starting with a letter",
        )
        require(
            self.datasets_prefix.endswith("/") and not self.datasets_prefix.startswith("/"),
            _NAME,
            "teams",
            f"team {self.name!r}: datasets_prefix {self.datasets_prefix!r} must be a key prefix ending "
            "in '/'",
        )

    def to_dict(self) -> dict[str, Any]:
        return deployed.TeamAccess(
            self.name, self.state_machine_arn, self.datasets_prefix, self.allowed_templates
        ).to_dict()


@dataclass(frozen=True)
class DeployedEnvironmentProps:
    """What the record holds. `platform_context` is the PlatformContext as a dict (tokens allowed)."""

    environment_name: str
    job_name_prefix: str
    enabled_templates: tuple[str, ...]
    platform_context: Mapping[str, Any]
    notification_topic_arn: str
    teams: tuple[TeamEntry, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "enabled_templates", tuple(self.enabled_templates))
        object.__setattr__(self, "teams", tuple(self.teams))
        require(
            bool(ENVIRONMENT_NAME_PATTERN.fullmatch(self.environment_name)),
            _NAME,
            "environment_name",
            f"{self.environment_name!r} must be lowercase letters, digits and '-' (it names the SSM path)",
        )
        require(bool(self.enabled_templates), _NAME, "enabled_templates", "must name at least one template")
        require(bool(self.teams), _NAME, "teams", "must hold at least one team")
        names = [team.name for team in self.teams]
        require(len(set(names)) == len(names), _NAME, "teams", f"team names must be unique, got {names}")
        for team in self.teams:
            foreign = sorted(set(team.allowed_templates) - set(self.enabled_templates))
            require(
                not foreign,
                _NAME,
                "teams",
                f"team {team.name!r} is allowed templates the environment does not enable: {foreign}",
            )

    @classmethod
    def for_launcher(
        cls, launcher: TrainingLauncher, *, environment_name: str, enabled_templates: Sequence[str]
    ) -> DeployedEnvironmentProps:
        """An environment with one launcher, used by one team: `default`, datasets `teams/default/`."""
        return cls(
            environment_name=environment_name,
            job_name_prefix=launcher.job_name_prefix,
            enabled_templates=tuple(enabled_templates),
            platform_context=launcher.platform_context,
            notification_topic_arn=launcher.topic.topic_arn,
            teams=(
                TeamEntry(
                    name=deployed.DEFAULT_TEAM,
                    state_machine_arn=launcher.state_machine.state_machine_arn,
                    allowed_templates=tuple(enabled_templates),
                ),
            ),
        )


class DeployedEnvironmentRecord(Construct):
    """The environment's record in SSM Parameter Store, for the CLI.

    Attributes: ``parameters`` (parameter name -> ``ssm.StringParameter``), ``path``
    (``/llmtrain/<env>``). ``grant_read(policy)`` lets a managed policy (the engineers') read it.
    """

    def __init__(self, scope: Construct, construct_id: str, *, props: DeployedEnvironmentProps) -> None:
        super().__init__(scope, construct_id)
        self.props = props
        self.path = deployed.environment_path(props.environment_name)
        stack = Stack.of(self)
        values = deployed.parameter_values(
            environment=props.environment_name,
            region=stack.region,
            account=stack.account,
            job_name_prefix=props.job_name_prefix,
            enabled_templates=props.enabled_templates,
            platform=props.platform_context,
            notification_topic_arn=props.notification_topic_arn,
            teams=[team.to_dict() for team in props.teams],
        )
        self.parameters: dict[str, ssm.StringParameter] = {}
        for name, value in values.items():
            size = estimated_size(value)
            require(
                size <= deployed.STANDARD_PARAMETER_LIMIT,
                _NAME,
                "teams" if "/teams/" in name else "platform_context",
                f"parameter {name} could reach {size} characters, over SSM's standard limit of "
                f"{deployed.STANDARD_PARAMETER_LIMIT}: shorten it (fewer subnets or templates per team)",
            )
            self.parameters[name] = ssm.StringParameter(
                self,
                _construct_id(name[len(self.path) + 1 :]),
                parameter_name=name,
                string_value=stack.to_json_string(value),
                tier=ssm.ParameterTier.STANDARD,
                description=f"llmtrain: environment {props.environment_name}, read by the llmtrain CLI",
            )

    def grant_read(self, policy: iam.ManagedPolicy) -> None:
        """Let `policy` read the record (GetParametersByPath on the path, GetParameter(s) below it)."""
        stack = Stack.of(policy)
        path = self.path.lstrip("/")

        def arn(name: str) -> str:
            return stack.format_arn(
                service="ssm",
                resource="parameter",
                resource_name=name,
                arn_format=ArnFormat.SLASH_RESOURCE_NAME,
            )

        policy.add_statements(
            iam.PolicyStatement(
                sid=_READ_SID,
                actions=["ssm:GetParametersByPath", "ssm:GetParameters", "ssm:GetParameter"],
                resources=[arn(path), arn(f"{path}/*")],
            )
        )
        acknowledge_wildcards(
            policy,
            {
                _READ_SID: "The llmtrain CLI reads the environment's record, every parameter under its own "
                f"path {self.path}/ (one per team)"
            },
        )


def estimated_size(value: Any) -> int:
    """The JSON size of `value` once deployed, counting each unresolved token at its estimate."""
    return len(json.dumps(_with_estimates(value)))


def _with_estimates(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _with_estimates(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_with_estimates(item) for item in value]
    if is_unresolved(value):
        return "x" * TOKEN_SIZE_ESTIMATE
    return value


def _construct_id(relative_name: str) -> str:
    """`teams/default` -> `Teams-default`: a construct id per parameter, stable across deploys."""
    return "-".join(part[:1].upper() + part[1:] for part in re.split(r"/", relative_name))
