"""Arguments several command groups share: the environment, and `--set KEY=VALUE` overrides."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmtrain.environments import EnvironmentConfig, EnvironmentConfigError, load_environment
from llmtrain.errors import LlmtrainError, OverrideError
from llmtrain.sourcedir import repository_root


def add_environment_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env", default="dev", help="environment: config/<ENV>.yaml (default: dev)")
    parser.add_argument(
        "--config-dir", type=Path, default=None, help="folder of environment files (default: config/)"
    )


def environment_of(args: argparse.Namespace) -> EnvironmentConfig:
    """The environment named by `--env` (and `--config-dir`), or an error listing the known ones."""
    folder = args.config_dir or repository_root() / "config"
    path = folder / f"{args.env}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in folder.glob("*.yaml"))) or "none"
        raise LlmtrainError(f"--env {args.env}: no {path}; environments: {known}")
    try:
        return load_environment(path)
    except EnvironmentConfigError as error:
        raise LlmtrainError(str(error)) from error


def add_overrides_argument(parser: argparse.ArgumentParser, *, dest: str = "overrides") -> None:
    parser.add_argument(
        "--set",
        dest=dest,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a setting the template allows (repeatable)",
    )


def parse_overrides(items: list[str]) -> dict[str, str]:
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise OverrideError(item, "write overrides as --set KEY=VALUE, e.g. --set max_steps=100")
        overrides[key.strip()] = value
    return overrides
