"""`llmtrain render`: print the CreateTrainingJob request a run of a template would send.

It renders as one team of the environment (`--team`, or the environment's only team): with the
team's job-name prefix, limits (templates, instance types and count, warm-pool cap) and data under
`teams/<team>/`, where a template's default channels resolve. The platform context (role, buckets,
network) comes from the deployed stacks' outputs when given (`--outputs`, the file
`cdk deploy --outputs-file` writes; or `--platform`, a PlatformContext JSON, whose team it is).
Without them the request is a dry run: placeholder ARNs and ids built from `<env>.yaml` of the
environments folder (--config-dir, ./config, a checkout's config/) or, where there is none (the wheel
ships no environment files), from a stand-in environment of that name; correct in shape and
validated, but not launchable; a note on stderr says which. `llmtrain start --dry-run` renders
against a deployed environment instead. The run's plan (llmtrain.planner: fits, speed, hours,
cost) follows on stderr in one line.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path

from llmtrain.commands._common import (
    DEFAULT_ENVIRONMENT,
    add_environment_arguments,
    add_overrides_argument,
    config_folder,
    environment_of,
    parse_overrides,
)
from llmtrain.core.catalog import Catalog
from llmtrain.core.deployed import team_name_problem
from llmtrain.core.environments import EnvironmentConfig, EnvironmentConfigError, StackOutput, TeamConfig
from llmtrain.core.errors import LlmtrainError, PlatformContextError
from llmtrain.core.platform import DEFAULT_TEAM, MAX_KEEP_ALIVE_SECONDS, PlatformContext
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.team_context import PlatformResources, configured_team_context, placeholder_context
from llmtrain.planner.checks import plan_summary

# The name of a stand-in environment (it names placeholder resources): as config/<env>.yaml's files are.
STAND_IN_NAME = re.compile(r"[a-z][a-z0-9-]{0,30}")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "render",
        help="print the CreateTrainingJob request of a run as JSON",
        description="Render a template version and a run's overrides into the complete CreateTrainingJob "
        "request, validated against SageMaker's API model and the platform's rules.",
    )
    parser.add_argument("ref", metavar="NAME[@VERSION]", help="template name, optionally @VERSION or @latest")
    parser.add_argument("--run-name", required=True, help="the run's name (part of the job name)")
    add_overrides_argument(parser)
    add_environment_arguments(parser, default=None)
    parser.add_argument(
        "--team", default=None, help="render as this team (default: the environment's only team)"
    )
    parser.add_argument("--catalog", type=Path, default=None, help="catalog folder (default: templates/)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--outputs", type=Path, help="stack outputs JSON from `cdk deploy --outputs-file`")
    source.add_argument("--platform", type=Path, help="a PlatformContext JSON file")
    parser.add_argument("--attempt", type=int, default=1, help="attempt number of the run (default: 1)")
    parser.add_argument(
        "--instance-type", default=None, help="capacity fallback instance type of the template"
    )
    parser.add_argument("--owner", default="unknown", help="value of the owner tag")
    parser.set_defaults(handler=render_command)


def render_command(args: argparse.Namespace) -> int:
    if args.team is not None and team_name_problem(args.team):
        raise LlmtrainError(team_name_problem(args.team))
    catalog = Catalog.load(args.catalog)
    template = catalog.resolve(args.ref)
    environment = _configured_environment(args)
    if environment is None:
        platform = _platform_without_configuration(args)
    else:
        if template.name not in environment.enabled_templates:
            raise LlmtrainError(
                f"template {template.name!r} is not enabled in environment {environment.name!r}; "
                f"add it to job_templates.enabled in {environment.source}"
            )
        platform = _platform(args, environment, configured_team(environment, args.team))
    run = RunInput(
        run_name=args.run_name,
        overrides=parse_overrides(args.overrides),
        attempt=args.attempt,
        instance_type=args.instance_type,
        owner=args.owner,
    )
    program = catalog.program_contract(template)
    request = render(template, run, platform, program)
    if platform.dry_run:
        source = environment.source if environment else (
            f"a stand-in environment {platform.environment!r} (team {platform.team!r}; no ./config folder "
            "here, so none of your environment's limits: run where config/ is, or pass --config-dir)"
        )
        print(
            f"llmtrain render: dry run: role, buckets, key and network ids are placeholders built from "
            f"{source}; pass --outputs or --platform, or use `llmtrain start --dry-run`, for a launchable "
            "request",
            file=sys.stderr,
        )
    print(json.dumps(request, indent=2))
    print(plan_summary(template, request, program), file=sys.stderr)
    return 0


def _configured_environment(args: argparse.Namespace) -> EnvironmentConfig | None:
    """<env>.yaml of the environments folder (--config-dir, ./config, a checkout's config/), or None
    where there is none: then a stand-in environment is rendered (docs/templates.md)."""
    if config_folder(args) is None:
        return None
    return environment_of(args)


def configured_team(environment: EnvironmentConfig, name: str | None) -> TeamConfig:
    """The team `name` of the environment file, or its only team."""
    if name is None:
        if len(environment.teams) == 1:
            return environment.teams[0]
        raise LlmtrainError(
            f"environment {environment.name!r} has several teams "
            f"({', '.join(t.name for t in environment.teams)}): choose one with --team"
        )
    try:
        return environment.team(name)
    except EnvironmentConfigError as error:
        raise LlmtrainError(str(error)) from error


def _platform_without_configuration(args: argparse.Namespace) -> PlatformContext:
    if args.platform:
        return _given_platform(args)
    if args.outputs:
        raise LlmtrainError("--outputs needs the environment's file: pass --env and --config-dir")
    name = args.env or DEFAULT_ENVIRONMENT
    if not STAND_IN_NAME.fullmatch(name):
        raise LlmtrainError(
            f"--env {name!r} is not an environment name: lowercase letters, digits and hyphens, starting "
            "with a letter"
        )
    return placeholder_context(
        environment=name,
        account="111111111111",
        region="us-east-1",
        resource_prefix=f"llmtrain-{name}",
        warm_pool_cap_seconds=MAX_KEEP_ALIVE_SECONDS,
        team=args.team or DEFAULT_TEAM,
    )


def _platform(args: argparse.Namespace, env: EnvironmentConfig, team: TeamConfig) -> PlatformContext:
    if args.platform:
        return _given_platform(args)
    if args.outputs:
        return platform_from_outputs(_read_json(args.outputs), env, team)
    return configured_team_context(env, team)


def _given_platform(args: argparse.Namespace) -> PlatformContext:
    platform = PlatformContext.from_dict(_read_json(args.platform))
    if args.team is not None and args.team != platform.team:
        raise LlmtrainError(
            f"--team {args.team}: {args.platform} is the platform context of team {platform.team!r}"
        )
    return platform


def _read_json(path: Path) -> Mapping:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise PlatformContextError(f"cannot read {path} as JSON: {error}") from error


def platform_from_outputs(outputs: Mapping, env: EnvironmentConfig, team: TeamConfig) -> PlatformContext:
    """Build the team's context from the outputs of this environment's stacks (environments.StackOutput)."""
    merged: dict[str, str] = {}
    for stack, values in outputs.items():
        if isinstance(values, Mapping) and stack.startswith(env.stack_name("")):
            merged.update(values)

    def output(name: str) -> str:
        if name not in merged:
            raise PlatformContextError(
                f"the stack outputs lack {name!r} for environment {env.name!r} (stacks "
                f"{env.stack_name('*')}); deploy with `cdk deploy --outputs-file` and pass that file"
            )
        return merged[name]

    # The team's own key; an environment of one team publishes the bare key too (as before teams).
    role_key = StackOutput.team_output(team.name, StackOutput.EXECUTION_ROLE_ARN)
    if role_key not in merged and len(env.teams) == 1:
        role_key = StackOutput.EXECUTION_ROLE_ARN
    return configured_team_context(env, team, PlatformResources(
        execution_role_arn=output(role_key),
        datasets_bucket=output(StackOutput.DATASETS_BUCKET),
        checkpoints_bucket=output(StackOutput.CHECKPOINTS_BUCKET),
        artifacts_bucket=output(StackOutput.ARTIFACTS_BUCKET),
        code_bucket=output(StackOutput.CODE_BUCKET),
        kms_key_arn=output(StackOutput.KEY_ARN),
        subnet_ids=tuple(s.strip() for s in output(StackOutput.SUBNET_IDS).split(",") if s.strip()),
        security_group_ids=(output(StackOutput.SECURITY_GROUP_ID),),
    ))
