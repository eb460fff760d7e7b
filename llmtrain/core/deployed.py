"""What a deployed environment tells the CLI: the record the stacks write to SSM Parameter Store.

The cloud commands (`start`, `status`, `runs`, `templates --env`, `data upload|ls`) find an
environment from AWS alone, so an ML engineer needs only the CLI and credentials, never the
platform's repository. The stacks write the record (constructs/training_constructs/
deployed_environment.py) and `read_deployed_environment` reads it: both go through this module.

Parameters, one JSON object each, so that each stays within SSM's 4 KB standard-parameter limit
however many teams an environment has:

    /llmtrain/<env>/environment     schema_version, environment, region, account, job_name_prefix
                                    (the environment's), enabled_templates
    /llmtrain/<env>/teams/<team>    the team's launcher: its state machine ARN, its notification
                                    topic, its preparation state machine's ARN (optional: absent
                                    from records before it), and the team's PlatformContext
                                    (llmtrain.core.platform) that its launcher renders with: its
                                    execution role, job-name prefix, datasets prefix `teams/<team>/`,
                                    templates and instance types
    /llmtrain/<env>/templates/<name>/<version>
                                    a version the launchers run from a catalog other than the
                                    platform's (a team's own, which no CLI ships): its spec
                                    (compressed) and content hash, so the CLI lists, checks and
                                    starts it as it does the platform's (`own_catalog`)

A reader refuses a record whose `schema_version` is newer than it knows (upgrade the CLI). Version
2 adds a team's queues (`PlatformContext.queues`) and is written only where the environment has
them: a CLI from before queues would stop a queued run without cancelling its queued job, so it is
asked to upgrade; every other environment's record stays version 1, readable by older CLIs.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import ClientError

from llmtrain.core.catalog import Catalog
from llmtrain.core.errors import (
    ENGINEER_POLICY_HINT,
    LlmtrainError,
    PlatformContextError,
    TemplateSpecError,
    did_you_mean,
)
from llmtrain.core.platform import ENVIRONMENT_NAME_PATTERN, TEAM_NAME_PATTERN, PlatformContext
from llmtrain.core.spec import TemplateSpec

SCHEMA_VERSION = 2
# The version of a record without queues (what every CLI since version 1 reads correctly).
SCHEMA_VERSION_WITHOUT_QUEUES = 1
PARAMETER_ROOT = "/llmtrain"
ENVIRONMENT_PARAMETER = "environment"
TEAMS_FOLDER = "teams"
TEMPLATES_FOLDER = "templates"
# SSM standard parameters hold at most 4 KB; the stacks check every value against it at synth.
STANDARD_PARAMETER_LIMIT = 4096
_TEAM_FIELDS = ("name", "state_machine_arn", "notification_topic_arn", "platform")


# The launcher stack of an environment (its name part) and its outputs: the contract between
# stacks/launcher.py and the CLI's launcher client.
LAUNCHER_STACK_PART = "launcher"


class LauncherOutput:
    """Outputs of the launcher stack: the contract between stacks/launcher.py and this client."""

    STATE_MACHINE_ARN = "StateMachineArn"
    TOPIC_ARN = "NotificationTopicArn"
    PREPARATION_STATE_MACHINE_ARN = "PreparationStateMachineArn"


class DeployedEnvironmentError(LlmtrainError):
    """The deployed environment cannot be read, or is not what this CLI understands."""


def environment_path(environment: str) -> str:
    """The SSM path under which environment `environment` keeps its record (no trailing slash)."""
    return f"{PARAMETER_ROOT}/{environment}"


def team_name_problem(name: str) -> str | None:
    """Why `name` cannot name a team (the rule of config/<env>.yaml's `teams:`), or None."""
    if TEAM_NAME_PATTERN.fullmatch(name):
        return None
    return (
        f"--team {name!r} is not a team name: teams are named with 1-12 lowercase letters and digits, "
        "starting with a letter (no hyphens)"
    )


@dataclass(frozen=True)
class TeamAccess:
    """One team of an environment: its launcher, and the platform context its launcher renders with
    (what it may run, where its data lives)."""

    name: str
    state_machine_arn: str
    notification_topic_arn: str
    platform: PlatformContext
    # The team's preparation state machine (`llmtrain data prepare --cloud`); None in a record written
    # before preparations ran through it (an older CLI ignores the field).
    preparation_state_machine_arn: str | None = None

    @property
    def datasets_prefix(self) -> str:
        """`teams/<team>/`: the team's key prefix in the datasets bucket."""
        return self.platform.data_prefix

    @property
    def datasets_uri(self) -> str:
        return self.platform.datasets_uri

    @property
    def datasets_bucket(self) -> str:
        return self.platform.datasets_bucket

    @property
    def job_name_prefix(self) -> str:
        """The team's job-name prefix: its jobs are `<prefix>-<run>-a<attempt>`."""
        return self.platform.job_name_prefix

    @property
    def allowed_templates(self) -> tuple[str, ...]:
        return self.platform.allowed_templates

    @property
    def allowed_instance_types(self) -> tuple[str, ...]:
        return self.platform.allowed_instance_types

    def to_dict(self) -> dict[str, Any]:
        data = {
            "name": self.name,
            "state_machine_arn": self.state_machine_arn,
            "notification_topic_arn": self.notification_topic_arn,
            "platform": self.platform.to_dict(),
        }
        if self.preparation_state_machine_arn is not None:
            data["preparation_state_machine_arn"] = self.preparation_state_machine_arn
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str) -> TeamAccess:
        values = _fields(data, source, _TEAM_FIELDS)
        try:
            platform = PlatformContext.from_dict(values.pop("platform"))
        except PlatformContextError as error:
            raise DeployedEnvironmentError(f"{source}: {error}; redeploy the environment") from error
        if platform.team != values["name"]:
            raise DeployedEnvironmentError(
                f"{source}: the team's platform context is team {platform.team!r}'s; redeploy the environment"
            )
        preparations = data.get("preparation_state_machine_arn")
        if preparations is not None and not isinstance(preparations, str):
            raise DeployedEnvironmentError(
                f"{source}: preparation_state_machine_arn must be a string; redeploy the environment"
            )
        return cls(**values, platform=platform, preparation_state_machine_arn=preparations)


@dataclass(frozen=True)
class DeployedEnvironment:
    """One deployed environment, as its stacks describe it (see the module docstring)."""

    environment: str
    region: str
    account: str
    job_name_prefix: str
    enabled_templates: tuple[str, ...]
    teams: Mapping[str, TeamAccess] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    # Versions from a catalog other than the platform's, by `name@version`.
    own_templates: Mapping[str, TemplateSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "enabled_templates", tuple(self.enabled_templates))
        object.__setattr__(self, "teams", dict(self.teams))
        object.__setattr__(self, "own_templates", dict(self.own_templates))
        where = environment_path(self.environment)
        if not self.teams:
            raise DeployedEnvironmentError(f"{where} lists no team; redeploy the environment's stacks")
        for team in self.teams.values():
            mismatched = [
                name
                for name in ("environment", "region", "account")
                if getattr(self, name) != getattr(team.platform, name)
            ]
            if mismatched:
                raise DeployedEnvironmentError(
                    f"{where}/{TEAMS_FOLDER}/{team.name}: the team's platform context disagrees with the "
                    f"environment record on {', '.join(mismatched)}; redeploy the environment's stacks"
                )

    def team(self, name: str | None = None) -> TeamAccess:
        """The team called `name`; without a name the environment's only team."""
        teams = ", ".join(sorted(self.teams))
        if name is None:
            if len(self.teams) == 1:
                return next(iter(self.teams.values()))
            raise DeployedEnvironmentError(
                f"environment {self.environment!r} has several teams ({teams}): choose yours with --team"
            )
        if name not in self.teams:
            raise DeployedEnvironmentError(
                f"environment {self.environment!r} has no team {name!r}"
                f"{did_you_mean(name, self.teams)}; its teams: {teams}"
            )
        return self.teams[name]

    def own_catalog(self) -> Catalog:
        """The versions the environment runs from its teams' own catalogs, as a catalog to resolve
        `name@version|latest` in (specs only: their code is in the code bucket already)."""
        return Catalog.of(self.own_templates.values(), source=f"{environment_path(self.environment)}/"
                          f"{TEMPLATES_FOLDER}")


def template_parameter_value(spec: Mapping[str, Any], content: str) -> dict[str, Any]:
    """The record's value for a version of a team's own catalog: its spec (`TemplateSpec.to_dict()`,
    compressed: specs run to 4 KB of JSON, SSM's standard limit) and its content hash."""
    packed = zlib.compress(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode(), 9)
    return {
        "name": spec["name"],
        "version": spec["version"],
        "content": content,
        "spec_zlib_base64": base64.b64encode(packed).decode(),
    }


def parameter_values(
    *,
    environment: str,
    region: str,
    account: str,
    job_name_prefix: str,
    enabled_templates: Sequence[str],
    teams: Sequence[Mapping[str, Any]],
    own_templates: Sequence[Mapping[str, Any]] = (),
) -> dict[str, dict[str, Any]]:
    """The record as {parameter name: JSON object}, the layout the stacks write and the CLI reads.

    ``teams`` are `TeamAccess.to_dict()`-shaped (``name``, ``state_machine_arn``,
    ``notification_topic_arn``, ``platform``); ``own_templates`` are `template_parameter_value`s.
    Values may be CDK tokens (the stacks resolve them at deploy time), so nothing is validated here;
    `from_parameters` validates what a deployment wrote.
    """
    root = environment_path(environment)
    values = {
        f"{root}/{ENVIRONMENT_PARAMETER}": {
            "schema_version": SCHEMA_VERSION if any("queues" in team["platform"] for team in teams)
            else SCHEMA_VERSION_WITHOUT_QUEUES,
            "environment": environment,
            "region": region,
            "account": account,
            "job_name_prefix": job_name_prefix,
            "enabled_templates": list(enabled_templates),
        },
    }
    for team in teams:
        values[f"{root}/{TEAMS_FOLDER}/{team['name']}"] = dict(team)
    for template in own_templates:
        values[f"{root}/{TEMPLATES_FOLDER}/{template['name']}/{template['version']}"] = dict(template)
    return values


def from_parameters(environment: str, parameters: Mapping[str, str]) -> DeployedEnvironment:
    """The record from the parameters under `/llmtrain/<environment>/` (name -> JSON string)."""
    root = environment_path(environment)
    decoded = {name: _decode(name, value) for name, value in parameters.items()}
    header = decoded.get(f"{root}/{ENVIRONMENT_PARAMETER}")
    if header is None:
        raise DeployedEnvironmentError(f"{root}/{ENVIRONMENT_PARAMETER} is missing; redeploy the environment")
    version = header.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise DeployedEnvironmentError(
            f"environment {environment!r} was deployed by a newer platform (record schema {version!r}; "
            f"this llmtrain reads schema {SCHEMA_VERSION}): upgrade llmtrain "
            "(pip install -U llm-sagemaker-platform)"
        )
    team_prefix = f"{root}/{TEAMS_FOLDER}/"
    teams = {
        team.name: team
        for team in (
            TeamAccess.from_dict(value, name)
            for name, value in decoded.items()
            if name.startswith(team_prefix)
        )
    }
    values = _fields(
        header,
        f"{root}/{ENVIRONMENT_PARAMETER}",
        ("environment", "region", "account", "job_name_prefix", "enabled_templates"),
    )
    template_prefix = f"{root}/{TEMPLATES_FOLDER}/"
    own = [_own_template(name, value) for name, value in decoded.items() if name.startswith(template_prefix)]
    return DeployedEnvironment(
        **values, teams=teams, schema_version=version, own_templates={spec.ref: spec for spec in own}
    )


def _own_template(name: str, value: Mapping[str, Any]) -> TemplateSpec:
    packed = _fields(value, name, ("name", "version", "content", "spec_zlib_base64"))["spec_zlib_base64"]
    try:
        data = json.loads(zlib.decompress(base64.b64decode(packed)))
        spec = TemplateSpec.from_dict(data, name)
    except (ValueError, zlib.error, TemplateSpecError) as error:
        raise DeployedEnvironmentError(
            f"{name} does not hold a template version this llmtrain reads ({error}); redeploy the "
            "environment, or upgrade llmtrain (pip install -U llm-sagemaker-platform)"
        ) from error
    if (spec.name, spec.version) != (value["name"], value["version"]):
        raise DeployedEnvironmentError(f"{name} holds {spec.ref}; redeploy the environment")
    return spec


def read_deployed_environment(session, environment: str, region: str) -> DeployedEnvironment:
    """Read environment `environment` from SSM Parameter Store in `region` (the caller's account)."""
    if not ENVIRONMENT_NAME_PATTERN.fullmatch(environment):
        raise DeployedEnvironmentError(
            f"--env {environment!r} is not an environment name (lowercase letters, digits and '-', "
            "starting with a letter)"
        )
    root = environment_path(environment)
    ssm = session.client("ssm", region_name=region)
    parameters: dict[str, str] = {}
    try:
        for page in ssm.get_paginator("get_parameters_by_path").paginate(Path=root, Recursive=True):
            parameters.update({p["Name"]: p["Value"] for p in page["Parameters"]})
    except ClientError as error:
        if error.response["Error"]["Code"] in ("AccessDeniedException", "AccessDenied"):
            raise DeployedEnvironmentError(
                f"reading environment {environment!r} ({root}/* in SSM Parameter Store, {region}) was "
                f"denied: {ENGINEER_POLICY_HINT}"
            ) from error
        raise
    if not parameters:
        raise DeployedEnvironmentError(
            f"environment {environment!r} is not deployed in this account's region {region} (nothing "
            f"under {root}/ in SSM Parameter Store): check --env, --region (or AWS_REGION) and your "
            "credentials' account, or deploy it (`npx cdk deploy '<env>/*'`)"
        )
    return from_parameters(environment, parameters)


def _decode(name: str, value: str) -> dict[str, Any]:
    try:
        data = json.loads(value)
    except ValueError as error:
        raise DeployedEnvironmentError(f"{name} is not JSON ({error}); redeploy the environment") from error
    if not isinstance(data, dict):
        raise DeployedEnvironmentError(f"{name} must hold a JSON object; redeploy the environment")
    return data


def _fields(data: Mapping[str, Any], source: str, names: Sequence[str]) -> dict[str, Any]:
    missing = [name for name in names if name not in data]
    if missing:
        raise DeployedEnvironmentError(f"{source} lacks {', '.join(missing)}; redeploy the environment")
    return {name: data[name] for name in names}
