"""The `llmtrain` command line.

Each command group lives in its own module under `llmtrain/commands/` and exposes
`register(subparsers)`, which adds its parser and sets `handler` (a function of the parsed
arguments returning the exit status). Adding a command group is one line in COMMAND_MODULES.
Bad input exits with status 2 and a message that says what to fix.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from llmtrain.errors import LlmtrainError

COMMAND_MODULES = (
    "llmtrain.commands.templates",
    "llmtrain.commands.render",
    "llmtrain.commands.run",
    "llmtrain.commands.launch",
    "llmtrain.commands.quotas",
    "llmtrain.commands.plans",
    "llmtrain.commands.debug",
)
USAGE_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmtrain",
        description="Train LLMs on Amazon SageMaker from versioned job templates.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args) or 0
    except LlmtrainError as error:
        print(f"llmtrain {args.command}: error: {error}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
