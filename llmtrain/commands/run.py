"""`llmtrain run --local NAME[@VERSION] --run-name R [--set k=v ...] [--data [CHANNEL=]DIR] [--workdir DIR]`

Renders the same CreateTrainingJob request the launcher would (same template, same overrides, a
local platform context), then runs it on this machine the way the SageMaker container does
(llmtrain.local). Cloud runs go through the launcher: `llmtrain start`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.text import Text

from llmtrain.commands._common import (
    add_overrides_argument,
    parse_overrides,
    unmet_requirement,
    writable_folder,
)
from llmtrain.core.catalog import DEFAULT_TEMPLATE, Catalog
from llmtrain.core.errors import LlmtrainError
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.sourcedir import PLATFORM_PACKAGE, REQUIREMENTS, repository_root
from llmtrain.core.spec import TemplateSpec
from llmtrain.core.team_context import local_context
from llmtrain.local import EXIT_CODES, LocalRunOptions, RunAlreadyTrained, next_attempt, run_local
from llmtrain.local.data import parse_data_option
from llmtrain.local.runner import run_owner
from llmtrain.planner.checks import plan_summary

# What a local run needs besides the training program's requirements.txt: the toolkit of the
# SageMaker PyTorch container (the `local` extra) and torch, which the container brings.
# The [local] extra's, and torch: the toolkit, and the full mlflow for the run's SQLite tracking store
# (the training program's own mlflow-skinny has no database store).
# What the [local] extra and the CPU torch add (the training program's pins are checked too).
LOCAL_RUN_PACKAGES = ("torch", "sagemaker-training", "sagemaker-pytorch-training", "mlflow", "matplotlib")
TORCH_CPU_INSTALL = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"

def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a job template on this machine as SageMaker would (--local)",
        description=(
            "Render the CreateTrainingJob request of a template and run it on this machine with the "
            "SageMaker PyTorch training toolkit: a job root laid out like /opt/ml, torchrun on CPU with "
            "gloo, several emulated hosts for instance_count > 1. Resources too big for this machine "
            "are scaled down, and every change is printed. Running again with the same --run-name "
            "resumes from the run's latest checkpoint. See docs/local.md."
        ),
    )
    parser.add_argument("template", nargs="?", default=DEFAULT_TEMPLATE, metavar="NAME[@VERSION]",
                        help=f"the template version to run (default: {DEFAULT_TEMPLATE}, latest version)")
    parser.add_argument("--local", action="store_true",
                        help="run on this machine (cloud runs are started with `llmtrain start`)")
    parser.add_argument("--run-name", required=True,
                        help="names the run folder; the same name again resumes from its checkpoints")
    add_overrides_argument(parser, dest="settings")
    parser.add_argument("--data", action="append", default=[], metavar="[CHANNEL=]DIR",
                        help="a local folder for a channel (a bare DIR is the train channel; repeatable); "
                             "default: the shipped tiny corpus for train and validation")
    parser.add_argument("--workdir", type=Path, default=Path("runs"),
                        help="where run folders live (default: ./runs)")
    parser.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    console = Console(soft_wrap=True)
    if not args.local:
        console.print(
            "[red]llmtrain run[/] runs a template on this machine: add --local. "
            "Cloud runs are started through the launcher with `llmtrain start`."
        )
        return 2
    writable_folder(args.workdir, "--workdir")
    settings = parse_overrides(args.settings)
    data = parse_data_option(args.data)
    options = LocalRunOptions(
        run_name=args.run_name,
        workdir=args.workdir,
        data=data.channels,
        optional_data=data.optional,
        user_settings=frozenset(settings),
    )
    catalog = Catalog.load()
    template = catalog.resolve(args.template)
    _check_run_owner(options, template, explicit_version="@" in args.template)
    run_input = RunInput(run_name=args.run_name, overrides=settings, attempt=next_attempt(options),
                         owner="local")
    program = catalog.program_contract(template)
    request = render(template, run_input, local_context(), program)
    console.print(f"[bold cyan]llmtrain[/] rendered {template.ref} for run {args.run_name!r} "
                  f"(the request the launcher would send)")
    console.print(f"[bold cyan]llmtrain[/] {plan_summary(template, request, program)} [dim](for the cloud "
                  "request; this machine runs it scaled down)[/]", markup=True, highlight=False)
    require_local_run_packages()
    try:
        summary = run_local(request, catalog.sourcedir(template), options,
                            template_channels=template.inputs.channels, console=console,
                            token_channels=template.code.is_platform)
    except RunAlreadyTrained as done:
        console.print(Text(f"llmtrain {done}"))
        return 0
    except KeyboardInterrupt:
        # Only before the job starts: once it runs, Ctrl-C stops it like StopTrainingJob.
        console.print("[yellow]llmtrain[/] interrupted before the job started; nothing ran")
        return EXIT_CODES["Stopped"]
    return EXIT_CODES[summary["TrainingJobStatus"]]


def _check_run_owner(options: LocalRunOptions, template: TemplateSpec, *, explicit_version: bool) -> None:
    """A run keeps its template for life: its checkpoints belong to that program and model (as the
    launcher's Resolve keeps a cloud run's)."""
    owner = run_owner(options)
    if owner is None:
        return
    name, version = owner
    if name != template.name or (explicit_version and version != template.version):
        raise LlmtrainError(
            f"run {options.run_name!r} in {options.workdir} belongs to {name}@{version} (its earlier jobs "
            f"and checkpoints), not {template.ref}: continue it with {name}@{version}, or start fresh "
            f"with another --run-name")


def require_local_run_packages() -> None:
    """Refuse, naming the install commands, when this environment cannot run the job as the container
    would: the toolkit runs `pip install -r requirements.txt` without an index, so every pin of the
    training program must already be installed, and torch with it."""
    requirements_file = repository_root() / PLATFORM_PACKAGE / REQUIREMENTS
    wanted = [*LOCAL_RUN_PACKAGES, *_requirement_lines(requirements_file)]
    missing = [problem for problem in map(unmet_requirement, wanted) if problem]
    if missing:
        raise LlmtrainError(
            "llmtrain run --local needs packages this Python environment lacks: " + ", ".join(missing) +
            ".\nInstall torch first, its CPU build (an unpinned torch pulls a multi-GB CUDA build), then "
            f"the rest:\n  {TORCH_CPU_INSTALL}\n  pip install 'llm-sagemaker-platform[local]'\n"
            f"  DS_BUILD_OPS=0 pip install -r {requirements_file}"
        )


def _requirement_lines(path: Path) -> list[str]:
    lines = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    return [line for line in lines if line]
