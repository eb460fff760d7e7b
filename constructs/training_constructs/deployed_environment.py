"""`DeployedEnvironmentRecord`: how the `llmtrain` CLI finds a deployed environment.

Writes the environment's record (`llmtrain.core.deployed`: the environment, and per team its launcher,
notification topic and PlatformContext, whence its datasets prefix, templates and instance types;
and every template version the launchers run from a catalog other than the platform's, which no
CLI ships) as SSM String parameters under `/llmtrain/<env>/`, one JSON object each, so that the CLI
needs only credentials and an environment name. Each value must fit SSM's 4 KB standard tier; values
CloudFormation fills in at deploy time (ARNs, bucket names, ids) are counted at
`TOKEN_SIZE_ESTIMATE` characters, and a record that could exceed the limit fails the synth naming
the parameter.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aws_cdk import ArnFormat, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from llmtrain.core import deployed
from llmtrain.core.catalog import Catalog
from llmtrain.core.platform import ENVIRONMENT_NAME_PATTERN, TEAM_NAME_PATTERN
from training_constructs._props import checked_props, freeze_sequences, is_unresolved, require
from training_constructs.launcher import TrainingLauncher
from training_constructs.nag import acknowledge_wildcards
from training_constructs.preparation_launcher import PreparationLauncher

_NAME = "DeployedEnvironmentRecord"
# ARNs, bucket names and ids the stacks create are far shorter than this.
TOKEN_SIZE_ESTIMATE = 128
_READ_SID = "ReadDeployedEnvironment"


@dataclass(frozen=True)
class TeamEntry:
    """One team's part of the record (llmtrain.core.deployed.TeamAccess): its launcher's state machine and
    topic, and the PlatformContext its launcher's functions receive (as a dict; tokens allowed)."""

    name: str
    state_machine_arn: str
    notification_topic_arn: str
    platform_context: Mapping[str, Any]
    preparation_state_machine_arn: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "platform_context", dict(self.platform_context))
        require(
            bool(TEAM_NAME_PATTERN.fullmatch(self.name)),
            _NAME,
            "teams",
            f"team name {self.name!r} must be 1-12 lowercase letters and digits, starting with a letter",
        )
        require(
            self.platform_context.get("team") == self.name,
            _NAME,
            "teams",
            f"team {self.name!r}: its platform_context is team {self.platform_context.get('team')!r}'s",
        )

    @property
    def allowed_templates(self) -> tuple[str, ...]:
        return tuple(self.platform_context.get("allowed_templates", ()))

    @classmethod
    def for_launcher(
        cls, launcher: TrainingLauncher, preparations: PreparationLauncher | None = None
    ) -> TeamEntry:
        """The entry of the team `launcher` serves (and `preparations`, its preparation state machine)."""
        return cls(
            name=launcher.team.name,
            state_machine_arn=launcher.state_machine.state_machine_arn,
            notification_topic_arn=launcher.topic.topic_arn,
            platform_context=launcher.platform_context,
            preparation_state_machine_arn=(
                preparations.state_machine.state_machine_arn if preparations is not None else None),
        )

    def to_dict(self) -> dict[str, Any]:
        data = {
            "name": self.name,
            "state_machine_arn": self.state_machine_arn,
            "notification_topic_arn": self.notification_topic_arn,
            "platform": dict(self.platform_context),
        }
        if self.preparation_state_machine_arn is not None:
            data["preparation_state_machine_arn"] = self.preparation_state_machine_arn
        return data


@dataclass(frozen=True)
class DeployedEnvironmentRecordProps:
    """What the record holds: the environment, one entry per team (its launcher), and the template
    versions its launchers run from a team's own catalog (``own_templates``:
    `llmtrain.core.deployed.template_parameter_value`s; `for_launchers` finds them)."""

    environment_name: str
    job_name_prefix: str
    enabled_templates: tuple[str, ...]
    teams: tuple[TeamEntry, ...]
    own_templates: tuple[Mapping[str, Any], ...] = ()

    def __post_init__(self) -> None:
        freeze_sequences(_NAME, self)
        object.__setattr__(self, "own_templates", tuple(dict(t) for t in self.own_templates))
        _check_own_templates(self.own_templates)
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
    def for_launchers(
        cls,
        launchers: Sequence[TrainingLauncher],
        *,
        preparations: Mapping[str, PreparationLauncher] | None = None,
        environment_name: str,
        job_name_prefix: str,
        enabled_templates: Sequence[str],
    ) -> DeployedEnvironmentRecordProps:
        """The record of an environment whose teams are served by `launchers` (one per team) and
        `preparations` (by team name), with the versions their registries hold from a catalog other than
        the platform's."""
        own = {
            t.spec.ref: deployed.template_parameter_value(t.spec.to_dict(), t.content_hash)
            for launcher in launchers
            for t in launcher.job_templates
            if not t.catalog.is_platform
        }
        return cls(
            environment_name=environment_name,
            job_name_prefix=job_name_prefix,
            enabled_templates=tuple(enabled_templates),
            teams=tuple(TeamEntry.for_launcher(launcher, (preparations or {}).get(launcher.team.name))
                        for launcher in launchers),
            own_templates=tuple(own.values()),
        )


def _check_own_templates(templates: Sequence[Mapping[str, Any]]) -> None:
    """One content per version, and no name of the platform's catalog: the CLI finds a template by
    its name, in the catalog it ships first."""
    contents: dict[str, set[str]] = {}
    for template in templates:
        contents.setdefault(f"{template['name']}@{template['version']}", set()).add(template["content"])
    twice = sorted(ref for ref, found in contents.items() if len(found) > 1)
    require(not twice, _NAME, "own_templates", f"{twice} come from catalogs that disagree on their content")
    platform = set(Catalog.load().names())
    clash = sorted({t["name"] for t in templates} & platform)
    require(
        not clash,
        _NAME,
        "own_templates",
        f"{clash} of your own catalog are named like templates of the platform's catalog: rename them "
        "(a template is found by its name)",
    )


class DeployedEnvironmentRecord(Construct):
    """The environment's record in SSM Parameter Store, for the CLI.

    Attributes: ``parameters`` (parameter name -> ``ssm.StringParameter``), ``path``
    (``/llmtrain/<env>``), ``props``. ``grant_read(policy)`` lets a managed policy (the engineers') read it.
    """

    def __init__(self, scope: Construct, construct_id: str, props: DeployedEnvironmentRecordProps) -> None:
        super().__init__(scope, construct_id)
        self.props = checked_props(_NAME, props, DeployedEnvironmentRecordProps)
        self.path = deployed.environment_path(props.environment_name)
        stack = Stack.of(self)
        values = deployed.parameter_values(
            environment=props.environment_name,
            region=stack.region,
            account=stack.account,
            job_name_prefix=props.job_name_prefix,
            enabled_templates=props.enabled_templates,
            teams=[team.to_dict() for team in props.teams],
            own_templates=props.own_templates,
        )
        self.parameters: dict[str, ssm.StringParameter] = {}
        for name, value in values.items():
            size = estimated_size(value)
            require(
                size <= deployed.STANDARD_PARAMETER_LIMIT,
                _NAME,
                _field_of(name),
                f"parameter {name} could reach {size} characters, over SSM's standard limit of "
                f"{deployed.STANDARD_PARAMETER_LIMIT}: shorten it (fewer subnets, templates or instance "
                "types per team; a shorter template)",
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
        """Let `policy` read the record (GetParametersByPath on the path, GetParameter(s) below it).

        The whole record, every team's entry included: the CLI lists the teams to a caller who must
        choose one, and an entry holds names and ARNs, no secret; what a team may do is enforced on
        the resources themselves (its launcher, its prefixes, its roles)."""
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


def _field_of(parameter: str) -> str:
    for folder, field in (("teams", "teams"), ("templates", "own_templates")):
        if f"/{folder}/" in parameter:
            return field
    return "enabled_templates"


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
    """`teams/default` -> `Teams-default` (`templates/t/1.0.0` -> `Templates-t-1.0.0`): a construct id
    per parameter, stable across deploys."""
    return "-".join(part[:1].upper() + part[1:] for part in re.split(r"/", relative_name))


def __getattr__(name: str) -> Any:
    """``DeployedEnvironmentProps``: the record's props before they were named after the construct
    (``<Construct>Props``); deprecated in 2.0.0 (CHANGELOG.md), removed in 3.0.0."""
    if name == "DeployedEnvironmentProps":
        warnings.warn(
            "training_constructs.DeployedEnvironmentProps is deprecated: use DeployedEnvironmentRecordProps "
            "(the props of DeployedEnvironmentRecord; same fields, same for_launchers); "
            "the old name goes in 3.0.0",
            DeprecationWarning,
            stacklevel=2,
        )
        return DeployedEnvironmentRecordProps
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
