"""The `llmtrain` command line.

Each command group lives in its own module under `llmtrain/commands/` and exposes
`register(subparsers)`, which adds its parser and sets `handler` (a function of the parsed
arguments returning the exit status). Adding a command group is one line in COMMAND_MODULES.
A command that hands its remaining arguments to another program (`data prepare`) sets
`passes_on_arguments`; for every other command an unknown argument is a usage error.

Exit statuses: 0 done; 1 the work failed, or AWS could not be used as asked (the message says
why); 2 bad input (usage, template, override, run), detected before anything was started.
Nothing ends in a traceback: botocore's errors are explained (llmtrain.client.aws).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from importlib import metadata

from botocore.exceptions import BotoCoreError, ClientError

from llmtrain import DISTRIBUTION
from llmtrain.client.aws import AwsAccessError, explain
from llmtrain.core.errors import LlmtrainError

COMMAND_MODULES = (
    "llmtrain.commands.templates",
    "llmtrain.commands.render",
    "llmtrain.commands.run",
    "llmtrain.commands.tune",
    "llmtrain.commands.models",
    "llmtrain.commands.launch",
    "llmtrain.commands.runs",
    "llmtrain.commands.data",
    "llmtrain.commands.quotas",
    "llmtrain.commands.plan",
    "llmtrain.commands.plans",
    "llmtrain.commands.debug",
    "llmtrain.commands.queue",
)
# The packages of the distribution's [cli] extra (pyproject.toml): its core installs without them.
CLI_PACKAGES = ("rich", "psutil", "packaging")
# Commands whose work needs more than the [cli] extra: the extra to name when the console's own
# packages are missing too (each includes [cli]).
COMMAND_EXTRAS = {"data": "data", "run": "local", "tune": "local"}
FAILED = 1
USAGE_ERROR = 2
INTERRUPTED = 130


def version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # running from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmtrain",
        description="Train LLMs on Amazon SageMaker from versioned job templates.",
    )
    parser.add_argument("--version", action="version", version=f"llmtrain {version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ModuleNotFoundError as error:
        if error.name not in CLI_PACKAGES:
            raise
        print(_missing_extra_message(error.name, argv if argv is not None else sys.argv[1:]), file=sys.stderr)
        return USAGE_ERROR
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passes_on_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.passed_on = rest
    try:
        return args.handler(args) or 0
    except AwsAccessError as error:
        return _fail(args, error, FAILED)
    except LlmtrainError as error:
        return _fail(args, error, USAGE_ERROR)
    except (BotoCoreError, ClientError) as error:
        return _fail(args, explain(error), FAILED)
    except KeyboardInterrupt:
        print(f"llmtrain {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`llmtrain runs | head`): not an error; stop writing quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _missing_extra_message(package: str, argv: list[str]) -> str:
    """Name the extra the asked command needs (its packages from the installed distribution's
    metadata): without the console's packages, no command can say so itself."""
    command = next((word for word in argv if not word.startswith("-")), "")
    extra = COMMAND_EXTRAS.get(command, "cli")
    if extra == "cli":
        return (f"llmtrain: the command line needs {package!r}, which comes with the CLI's extra: "
                f"pip install '{DISTRIBUTION}[cli]' (or [data] / [local], which include it)")
    needs = ", ".join([package, *_extra_packages(extra)])
    return (f"llmtrain {command}: needs packages this Python environment lacks ({needs}), which come with "
            f"the [{extra}] extra: pip install '{DISTRIBUTION}[{extra}]'")


def _extra_packages(extra: str) -> list[str]:
    """The package names the installed distribution's `extra` adds, read without `packaging` (one of
    the packages that may be missing)."""
    try:
        declared = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []
    names = []
    for line in declared:
        requirement, _, marker = line.partition(";")
        name = re.match(r"[A-Za-z0-9_.-]+", requirement.strip())
        if name and f'extra == "{extra}"' in marker and name.group(0) != DISTRIBUTION:
            names.append(name.group(0))
    return names


def _fail(args: argparse.Namespace, error: Exception, status: int) -> int:
    print(f"llmtrain {args.command}: error: {error}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
