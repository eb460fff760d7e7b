#!/usr/bin/env python3
"""The CDK app: one PlatformStage per environment file in config/.

This is the only place that reads the process environment or CDK context:
  -c config_dir=PATH        where the environment files are (default: config/ next to this file)
  -c environments=dev,prod  build only these environments (default: every file)
cdk-nag (AwsSolutions) checks every stack at synth; an unacknowledged finding fails the synth.
An invalid environment file (or construct props) ends the synth with its message and exit status
1, not a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks

from llmtrain.core.environments import EnvironmentConfig, EnvironmentConfigError, load_environments
from llmtrain.core.errors import LlmtrainError
from stacks import add_platform_stages
from training_constructs import PropsError

ROOT = Path(__file__).resolve().parent


def select_environments(
    environments: dict[str, EnvironmentConfig], selection: str | None
) -> list[EnvironmentConfig]:
    """The environments named in ``selection`` (comma-separated), or all of them when it is empty."""
    names = [name.strip() for name in (selection or "").split(",") if name.strip()]
    if not names:
        return list(environments.values())
    unknown = sorted(set(names) - set(environments))
    if unknown:
        raise EnvironmentConfigError(
            f"-c environments={selection}: no environment file for "
            f"{', '.join(unknown)} (have: {', '.join(environments)})"
        )
    return [environments[name] for name in dict.fromkeys(names)]


def main() -> None:
    app = cdk.App()
    config_dir = Path(app.node.try_get_context("config_dir") or ROOT / "config")
    selection = app.node.try_get_context("environments")
    add_platform_stages(app, select_environments(load_environments(config_dir), selection))
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    app.synth()


def run() -> int:
    """`main`, with the platform's own errors as one message on stderr (what to fix, where)."""
    try:
        main()
    except (EnvironmentConfigError, PropsError, LlmtrainError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run())
