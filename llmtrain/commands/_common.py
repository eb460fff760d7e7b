"""What several command groups share: the deployed environment of the cloud commands, the
configured environment of `render` and `quotas`, `--set KEY=VALUE` overrides, and plain tables."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import boto3
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from llmtrain import DISTRIBUTION
from llmtrain.client.aws import aws_session, caller_identity, explained, session_region
from llmtrain.core.deployed import (
    DeployedEnvironment,
    TeamAccess,
    read_deployed_environment,
    team_name_problem,
)
from llmtrain.core.environments import EnvironmentConfig, EnvironmentConfigError, load_environment
from llmtrain.core.errors import LlmtrainError
from llmtrain.core.sourcedir import BUNDLE_FOLDER, repository_root

DEFAULT_ENVIRONMENT = "dev"

# -- the deployed environment (cloud commands) ----------------------------------------------------------


def add_cloud_arguments(parser: argparse.ArgumentParser, *, team: bool = True) -> None:
    """--env, --region, --profile (and --team): where a cloud command finds the platform."""
    parser.add_argument(
        "--env",
        default=DEFAULT_ENVIRONMENT,
        help=f"the deployed environment (default: {DEFAULT_ENVIRONMENT})",
    )
    parser.add_argument(
        "--region", default=None, help="the environment's AWS region (default: AWS_REGION or your profile's)"
    )
    parser.add_argument("--profile", default=None, help="the AWS profile to use (default: AWS_PROFILE)")
    if team:
        parser.add_argument(
            "--team", default=None, help="your team (required where the environment has several teams)"
        )


@dataclass(frozen=True)
class Cloud:
    """A cloud command's view of AWS: the session, who is calling, the environment and team."""

    session: boto3.Session
    identity: dict[str, Any]
    deployed: DeployedEnvironment
    team: TeamAccess


def connect(args: argparse.Namespace) -> Cloud:
    """Check the credentials, then read the environment `--env` from AWS (llmtrain.core.deployed) and pick
    the team: `--team`, or the environment's only team."""
    session, identity, deployed = connect_environment(args)
    return Cloud(session=session, identity=identity, deployed=deployed,
                 team=deployed.team(getattr(args, "team", None)))


def connect_environment(
    args: argparse.Namespace,
) -> tuple[boto3.Session, dict[str, Any], DeployedEnvironment]:
    """The credentials checked and the environment `--env` read, for a command about the whole
    environment (`--team`, when given, is checked for its form only)."""
    team = getattr(args, "team", None)
    problem = team_name_problem(team) if team is not None else None
    if problem:  # before any AWS call
        raise LlmtrainError(problem)
    session = aws_session(args.profile)
    region = session_region(session, args.region)
    identity = caller_identity(session, region)
    with explained(f"reading environment {args.env!r} from SSM Parameter Store in {region}"):
        deployed = read_deployed_environment(session, args.env, region)
    return session, identity, deployed


def follow_up_options(args: argparse.Namespace, cloud: Cloud) -> str:
    """The options that point a follow-up command at the same environment and team."""
    parts = [f" --env {cloud.deployed.environment}"]
    if getattr(args, "region", None):
        parts.append(f" --region {args.region}")
    if getattr(args, "profile", None):
        parts.append(f" --profile {args.profile}")
    if getattr(args, "team", None):
        parts.append(f" --team {args.team}")
    return "".join(parts)


# -- the configured environment (render, quotas) ---------------------------------------------------------


def add_environment_arguments(
    parser: argparse.ArgumentParser, *, default: str | None = DEFAULT_ENVIRONMENT
) -> None:
    parser.add_argument(
        "--env",
        default=default,
        help=f"environment: <ENV>.yaml of the environments folder (default: {default or 'none'})",
    )
    parser.add_argument(
        "--config-dir",
        type=Path,
        default=None,
        help="folder of environment files (default: ./config of the working folder)",
    )


def config_folder(args: argparse.Namespace) -> Path | None:
    """Where environment files are read: --config-dir, else ./config of the working folder, else, in a
    checkout of the platform's repository, its config/. None where there is none (llmtrain installed
    from its wheel, run outside such a folder): the wheel ships no environment files."""
    if args.config_dir is not None:
        return args.config_dir
    for folder in (Path("config"), _checkout_config()):
        if folder is not None and folder.is_dir():
            return folder
    return None


def _checkout_config() -> Path | None:
    root = repository_root()
    return None if root.name == BUNDLE_FOLDER else root / "config"


def account_session(environment: EnvironmentConfig, profile: str | None = None) -> boto3.Session:
    """A session (`profile`, else the usual chain) whose credentials are checked to be for the
    configured environment's account."""
    session = aws_session(profile)
    identity = caller_identity(session, environment.region)
    if identity["Account"] != environment.account:
        raise LlmtrainError(
            f"your AWS credentials are for account {identity['Account']} but environment "
            f"{environment.name!r} is in account {environment.account}: use credentials for that account "
            "(--profile or AWS_PROFILE)"
        )
    return session


def environment_of(args: argparse.Namespace) -> EnvironmentConfig:
    """The environment named by `--env` (and `--config-dir`), or an error listing the known ones."""
    folder = config_folder(args)
    name = args.env or DEFAULT_ENVIRONMENT
    if folder is None:
        raise LlmtrainError(
            f"--env {name}: no environment files here (no ./config folder): run from the folder that "
            f"holds config/{name}.yaml (the platform's repository), or pass --config-dir DIR"
        )
    path = folder / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in folder.glob("*.yaml"))) or "none"
        raise LlmtrainError(
            f"--env {name}: no {path}; environments there: {known} (pass --config-dir for another folder)"
        )
    try:
        return load_environment(path)
    except EnvironmentConfigError as error:
        raise LlmtrainError(str(error)) from error


# -- folders a command writes ----------------------------------------------------------------------------


def writable_folder(folder: Path, option: str) -> Path:
    """`folder`, created if missing, once a file could be written in it; otherwise a one-line error
    naming `option` and the path. Every command that writes calls it before any work, so an unusable
    --workdir or --output is refused at once, not by a traceback after the work."""
    if folder.exists() and not folder.is_dir():
        raise LlmtrainError(f"{option} {folder}: is a file, not a folder: name a folder (new or existing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise LlmtrainError(
            f"{option} {folder}: cannot write there ({reason}): name a folder you can create and write to"
        ) from None
    return folder


# -- actions ---------------------------------------------------------------------------------------------

# The verbs people type by habit for an action (`ls` after `kubectl`, `list` after `aws`), accepted
# by every command group that has the action.
HABIT_ALIASES: dict[str, tuple[str, ...]] = {"ls": ("list",), "show": ("describe",)}


def add_action(actions: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A group's action `name`, also reachable by its habitual aliases (HABIT_ALIASES)."""
    return actions.add_parser(name, aliases=list(HABIT_ALIASES.get(name, ())), **kwargs)


# -- overrides ------------------------------------------------------------------------------------------


class _OverrideAction(argparse.Action):
    """Collects `--set KEY=VALUE`; `--set KEY VALUE` (a space for the '=') is a usage error at once."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        key, sep, _ = value.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentError(
                self,
                f"{value!r} is not KEY=VALUE: write the setting and its value with '=' and no spaces, "
                f"e.g. --set {key.strip() or 'max_steps'}=100",
            )
        items = list(getattr(namespace, self.dest, None) or [])
        given = [item for item in items if item.partition("=")[0].strip() == key.strip()]
        if given:
            raise argparse.ArgumentError(
                self,
                f"{key.strip()!r} is set twice ({given[0]!r} and {value!r}): give each setting once",
            )
        items.append(value)
        setattr(namespace, self.dest, items)


def add_overrides_argument(parser: argparse.ArgumentParser, *, dest: str = "overrides") -> None:
    parser.add_argument(
        "--set",
        dest=dest,
        action=_OverrideAction,
        default=[],
        metavar="KEY=VALUE",
        help="override a setting the template allows (repeatable)",
    )


def parse_overrides(items: list[str]) -> dict[str, str]:
    overrides = {}
    for item in items:
        key, _, value = item.partition("=")
        overrides[key.strip()] = value
    return overrides


# -- output ---------------------------------------------------------------------------------------------


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Columns padded to their widest cell, as plain text (readable in a pipe or a log)."""
    widths = [max(len(row[i]) for row in (headers, *rows)) for i in range(len(headers))]
    for row in (headers, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


# -- installed packages -----------------------------------------------------------------------------


def unmet_requirement(line: str) -> str | None:
    """Why this environment does not satisfy the requirement line (not installed, another version),
    or None (also for a line that is no requirement, such as a pip option)."""
    try:
        requirement = Requirement(line)
    except InvalidRequirement:
        return None  # pip options and the like: the toolkit's pip reads them, not us
    if requirement.marker is not None and not requirement.marker.evaluate():
        return None
    try:
        installed = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        return f"{requirement} (not installed)"
    if requirement.specifier and not requirement.specifier.contains(installed, prereleases=True):
        return f"{requirement} (have {installed})"
    return None



def extra_requirements(extra: str) -> list[str]:
    """What the installed distribution's `extra` adds (its own metadata: pyproject.toml's
    optional-dependencies), as requirement lines; none when llmtrain runs from a checkout that was
    never installed."""
    try:
        declared = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []
    found = []
    for requirement in map(Requirement, declared):
        in_extra = requirement.marker is not None and requirement.marker.evaluate({"extra": extra})
        if in_extra and canonicalize_name(requirement.name) != DISTRIBUTION:
            found.append(f"{requirement.name}{requirement.specifier}")
    return found


def require_extra(extra: str, command: str) -> None:
    """Refuse, naming the install command, when this environment lacks what `extra` adds."""
    missing = [problem for problem in map(unmet_requirement, extra_requirements(extra)) if problem]
    if missing:
        raise LlmtrainError(
            f"{command} needs packages this Python environment lacks: {', '.join(missing)}. Install "
            f"them with: pip install '{DISTRIBUTION}[{extra}]'"
        )
