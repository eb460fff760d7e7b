"""`llmtrain render`: print the CreateTrainingJob request a run of a template would send.

The platform context (role, buckets, network) comes from the deployed stacks' outputs when given
(`--outputs`, the file `cdk deploy --outputs-file` writes; or `--platform`, a PlatformContext JSON).
Without them the request is a dry run: placeholder ARNs and ids built from `config/<env>.yaml`,
correct in shape and validated, but not launchable; a note on stderr says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path

from llmtrain.catalog import Catalog
from llmtrain.commands._common import (
    add_environment_arguments,
    add_overrides_argument,
    environment_of,
    parse_overrides,
)
from llmtrain.environments import EnvironmentConfig, StackOutput
from llmtrain.errors import LlmtrainError, PlatformContextError
from llmtrain.platform import PlatformContext
from llmtrain.render import RunInput, render


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
    add_environment_arguments(parser)
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
    template = Catalog.load(args.catalog).resolve(args.ref)
    environment = environment_of(args)
    if template.name not in environment.enabled_templates:
        raise LlmtrainError(
            f"template {template.name!r} is not enabled in environment {environment.name!r}; "
            f"add it to job_templates.enabled in {environment.source}"
        )
    platform = _platform(args, environment)
    run = RunInput(
        run_name=args.run_name,
        overrides=parse_overrides(args.overrides),
        attempt=args.attempt,
        instance_type=args.instance_type,
        owner=args.owner,
    )
    request = render(template, run, platform)
    if platform.dry_run:
        print(
            f"llmtrain render: dry run: role, buckets, key and network ids are placeholders built from "
            f"{environment.source}; pass --outputs for a launchable request",
            file=sys.stderr,
        )
    print(json.dumps(request, indent=2))
    return 0


def _platform(args: argparse.Namespace, env: EnvironmentConfig) -> PlatformContext:
    if args.platform:
        return PlatformContext.from_dict(_read_json(args.platform))
    if args.outputs:
        return platform_from_outputs(_read_json(args.outputs), env)
    return PlatformContext.placeholder(
        environment=env.name,
        account=env.account,
        region=env.region,
        resource_prefix=env.job_name_prefix,
        warm_pool_cap_seconds=env.warm_pools.max_keep_alive_seconds,
        **env.platform_features(),
    )


def _read_json(path: Path) -> Mapping:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise PlatformContextError(f"cannot read {path} as JSON: {error}") from error


def platform_from_outputs(outputs: Mapping, env: EnvironmentConfig) -> PlatformContext:
    """Build the context from the outputs of this environment's stacks (environments.StackOutput)."""
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

    return PlatformContext(
        environment=env.name,
        region=env.region,
        account=env.account,
        execution_role_arn=output(StackOutput.EXECUTION_ROLE_ARN),
        datasets_bucket=output(StackOutput.DATASETS_BUCKET),
        checkpoints_bucket=output(StackOutput.CHECKPOINTS_BUCKET),
        artifacts_bucket=output(StackOutput.ARTIFACTS_BUCKET),
        code_bucket=output(StackOutput.CODE_BUCKET),
        kms_key_arn=output(StackOutput.KEY_ARN),
        subnet_ids=tuple(s.strip() for s in output(StackOutput.SUBNET_IDS).split(",") if s.strip()),
        security_group_ids=(output(StackOutput.SECURITY_GROUP_ID),),
        warm_pool_cap_seconds=env.warm_pools.max_keep_alive_seconds,
        job_name_prefix=env.job_name_prefix,
        **env.platform_features(),
    )
