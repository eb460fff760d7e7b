"""`llmtrain tune NAME[@VERSION] --run-name R --param NAME=RANGE ... [--objective METRIC] [--local]`

Search some of a template's hyperparameters for the best value of one of its metrics, with the
same template, overrides and guard rails as `llmtrain start` / `llmtrain run --local`:

    llmtrain tune llama-finetune-lora --run-name lr-1 --param lr=1e-5..1e-3:log --objective eval:loss \\
        --trials 20 --parallel 4 --set channels.validation=s3://... --env dev --team nlp
    llmtrain tune --local llama-pretrain-fsdp --run-name lr-local --param lr=1e-4..1e-2:log --trials 8

Locally, Optuna runs the trials as `llmtrain run --local` runs (llmtrain.local.trials); in the cloud,
a SageMaker Automatic Model Tuning job runs them, started through the team's launcher
(llmtrain.lifecycle.tuning_jobs plans it as the launcher does; `--dry-run --json` prints its
CreateHyperParameterTuningJob request). Either way the ranges are checked against the template's
bounds and the training program's contract of the code the version runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import util as import_util
from pathlib import Path

from rich.console import Console

from llmtrain.commands._common import (
    add_cloud_arguments,
    add_overrides_argument,
    follow_up_options,
    parse_overrides,
    print_table,
    writable_folder,
)
from llmtrain.core.catalog import Catalog
from llmtrain.core.errors import LlmtrainError
from llmtrain.core.program_contract import ProgramContract
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.spec import TemplateSpec
from llmtrain.core.tuning import (
    DEFAULT_STRATEGY,
    SEARCH_STRATEGIES,
    ParamRange,
    Trial,
    TuneError,
    TuneSpec,
    check_tune,
    check_tune_program,
    full_run_command,
)
from llmtrain.local.data import parse_data_option

INTERRUPTED = 130


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tune",
        help="search a template's hyperparameters (locally with Optuna, or a SageMaker tuning job)",
        description=(
            "Tune hyperparameters of a template: each --param names a setting the template lets a run "
            "override and a range within its bounds; the objective is one of the template's metrics. "
            "With --local, Optuna runs the trials on this machine as `llmtrain run --local` runs; "
            "without it, a SageMaker Automatic Model Tuning job runs them, started through your team's "
            "launcher. See docs/launcher.md (cloud) and docs/local.md (local)."
        ),
    )
    parser.add_argument("ref", metavar="NAME[@VERSION]", help="the template version to tune")
    parser.add_argument(
        "--run-name", required=True, help="names the tune; the same name again continues a local tune"
    )
    parser.add_argument(
        "--param",
        dest="params",
        action="append",
        default=[],
        metavar="NAME=RANGE",
        help="a hyperparameter and its range: LOW..HIGH (add :log for a log scale, :int for "
        "integers) or a list A,B,C (repeatable)",
    )
    parser.add_argument(
        "--objective",
        default=None,
        metavar="METRIC",
        help="the template metric to optimize (default: its evaluation loss, e.g. eval:loss)",
    )
    parser.add_argument("--maximize", action="store_true", help="maximize the objective (default: minimize)")
    parser.add_argument(
        "--trials", type=int, default=8, help="how many trials (training jobs) in all (default 8)"
    )
    parser.add_argument("--parallel", type=int, default=1, help="how many trials run at once (default 1)")
    parser.add_argument(
        "--strategy",
        choices=sorted(SEARCH_STRATEGIES),
        default=DEFAULT_STRATEGY,
        help=f"how values are chosen (default {DEFAULT_STRATEGY})",
    )
    parser.add_argument(
        "--no-early-stopping",
        dest="early_stopping",
        action="store_false",
        help="run every trial to its end (default: poor trials are stopped early)",
    )
    parser.add_argument(
        "--warm-start",
        dest="warm_start",
        action="append",
        default=[],
        metavar="TUNE",
        help="start from the trials of an earlier tune (its run name; repeatable)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the search (repeatable searches)")
    add_overrides_argument(parser, dest="settings")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print JSON: the result of a local tune, or the request of a --dry-run",
    )
    parser.add_argument("--local", action="store_true", help="run the trials on this machine")
    parser.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="[CHANNEL=]DIR",
        help="(--local) a local folder for a channel, as for `llmtrain run --local`",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path("runs"),
        help="(--local) where tunes and run folders live (default: ./runs)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="(cloud) check everything and print the tuning request; start nothing",
    )
    add_cloud_arguments(parser)
    parser.set_defaults(handler=tune_command)


def tune_command(args: argparse.Namespace) -> int:
    settings = parse_overrides(args.settings)
    if args.local:
        writable_folder(args.workdir, "--workdir")
        catalog = Catalog.load()
        template = catalog.resolve(args.ref)
        tune = tune_spec(args, template)
        check_tune(template, tune, settings)
        return _local(args, catalog, template, tune, settings)
    return _cloud(args, settings)


def tune_spec(args: argparse.Namespace, template: TemplateSpec) -> TuneSpec:
    objective = args.objective or _default_objective(template)
    return TuneSpec(
        params=tuple(ParamRange.parse(text) for text in args.params),
        objective=objective,
        maximize=args.maximize,
        trials=args.trials,
        parallel=args.parallel,
        strategy=args.strategy,
        early_stopping=args.early_stopping,
        warm_start_from=tuple(args.warm_start),
        seed=args.seed,
    )


def _default_objective(template: TemplateSpec) -> str:
    from llmtrain.local.metric_lines import eval_loss_metric

    found = eval_loss_metric([m.name for m in template.metrics])
    if found is None:
        names = ", ".join(m.name for m in template.metrics) or "none"
        raise TuneError(
            f"{template.ref} has no evaluation loss metric to tune for: name one with "
            f"--objective (its metrics: {names})"
        )
    return found


# -- local ----------------------------------------------------------------------------------------------


def _local(
    args: argparse.Namespace,
    catalog: Catalog,
    template: TemplateSpec,
    tune: TuneSpec,
    settings: dict[str, str],
) -> int:
    from llmtrain.commands.run import require_local_run_packages
    from llmtrain.core.team_context import local_context
    from llmtrain.local.trials import LocalTuneOptions, TuneInterrupted, run_local_tune

    program = catalog.program_contract(template)
    # Checked before anything runs: the ranges with the program's rules, and the first trial's
    # request (each trial renders its own).
    check_tune_program(template, tune, RunInput(run_name="t0", overrides=settings, owner="local"),
                       local_context(), program)
    lows = {p.name: str(p.values[0] if p.kind == "categorical" else p.low) for p in tune.params}
    render(
        template,
        RunInput(run_name="t0", overrides={**settings, **lows}, owner="local"),
        local_context(),
        program,
    )
    require_local_run_packages()
    if import_util.find_spec("optuna") is None:
        raise LlmtrainError("llmtrain tune --local needs Optuna: pip install 'llm-sagemaker-platform[local]'")
    console = Console(soft_wrap=True, stderr=args.json)
    data = parse_data_option(args.data)
    options = LocalTuneOptions(run_name=args.run_name, workdir=args.workdir, data=data.channels,
                               optional_data=data.optional, settings=settings)
    try:
        result = run_local_tune(
            template, catalog.sourcedir(template), tune, options, local_context(), program=program,
            console=console,
        )
    except (TuneInterrupted, KeyboardInterrupt) as stop:
        console.print(
            f"[yellow]llmtrain[/] tune {args.run_name!r} {stop or 'interrupted'}; continue it with the "
            "same command (its study is kept)"
        )
        return INTERRUPTED
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0 if result.best else 1
    print_trials(result.trials, tune.objective)
    if result.plot:
        print(f"plot: {result.plot}")
    best = result.best
    if best is None:
        print(f"no trial reported {tune.objective}: see the trials' logs in {result.folder}/trials/")
        return 1
    print(
        f"best: trial {best.number}, {tune.objective}={best.objective:g} with "
        + ", ".join(f"{k}={v}" for k, v in best.params.items())
    )
    command, dropped = full_run_command(template.ref, f"{args.run_name}-best", settings, best.params)
    print("run it in full: " + command)
    if dropped:
        print("  (without the trials' " + " ".join(f"--set {k}={v}" for k, v in dropped.items())
              + ": the full run takes the template's values; add them back to change them)")
    return 0


def print_trials(trials: tuple[Trial, ...] | list[Trial], objective: str) -> None:
    names = list(dict.fromkeys(name for trial in trials for name in trial.params))
    rows = [
        [
            str(t.number),
            t.status,
            "-" if t.objective is None else f"{t.objective:g}",
            *(_cell(t.params.get(name)) for name in names),
            t.detail[:60],
        ]
        for t in trials
    ]
    print_table(["trial", "status", objective, *names, "detail"], rows)


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# -- cloud ----------------------------------------------------------------------------------------------


def _cloud(args: argparse.Namespace, settings: dict[str, str]) -> int:
    from llmtrain.client.launcher import LauncherClient, owner_from_identity
    from llmtrain.commands.launch import checked_template

    if args.data or args.workdir != Path("runs"):
        raise TuneError("--data and --workdir are for a local tune (--local)")
    catalog, template, cloud = checked_template(
        args, settings, check=lambda template: check_tune(template, tune_spec(args, template), settings)
    )
    tune = tune_spec(args, template)
    request, plan = check_tune_in_environment(
        cloud, template, args.run_name, settings, tune, program=catalog.program_contract(template)
    )
    print(plan.get("summary") or f"plan: not available: {plan.get('unavailable')}", file=sys.stderr)
    if args.dry_run:
        print(json.dumps(request, indent=2) if args.json else json.dumps(request))
        print(
            f"llmtrain tune: dry run: {template.ref} tune {args.run_name!r} passed every check; nothing "
            "started",
            file=sys.stderr,
        )
        return 0
    client = LauncherClient.for_team(
        cloud.deployed, cloud.team, session=cloud.session, identity=cloud.identity
    )
    execution, _ = client.start(
        template_ref=template.ref,
        run_name=args.run_name,
        overrides=settings,
        owner=owner_from_identity(cloud.identity),
        tune=tune.to_dict(),
    )
    where = follow_up_options(args, cloud)
    print(
        f"started tune {args.run_name} ({template.ref}, {tune.trials} trials): execution "
        f"{execution['executionArn']}"
    )
    print(f"follow it with `llmtrain status {args.run_name}{where}`")
    return 0


def check_tune_in_environment(
    cloud, template: TemplateSpec, run_name: str, settings: dict[str, str], tune: TuneSpec, *,
    program: ProgramContract | None = None,
) -> tuple[dict, dict]:
    """What `llmtrain start` checks against the deployed environment (the template enabled, the run
    rendered with the team's context, its channels holding data, its plan), then the tune's own
    checks as the launcher's Resolve runs them (an environment without queues, the ranges with the
    program's rules, its trials together within the team's budget, the earlier tunes it warm-starts
    from); returns the CreateHyperParameterTuningJob request and the plan, as the launcher will build
    them. `program`: the training program's contract of the code the version runs."""
    from llmtrain.client.launcher import owner_from_identity
    from llmtrain.commands.launch import check_in_environment
    from llmtrain.core.jumpstart import resolve_base_model
    from llmtrain.core.runs import DEFAULT_OWNER
    from llmtrain.lifecycle.tuning_jobs import check_tune_environment, parent_tuning_jobs, render_tune

    platform, region = cloud.team.platform, cloud.deployed.region
    check_tune_environment(platform)
    check_in_environment(cloud, template, run_name, settings, program=program)
    sagemaker = cloud.session.client("sagemaker", region_name=region)
    parents = parent_tuning_jobs(sagemaker, platform, tune.warm_start_from)
    base_model = resolve_base_model(settings, cloud.session.client("s3", region_name=region), region)
    owner = owner_from_identity(cloud.identity) or DEFAULT_OWNER
    run = RunInput(run_name=run_name, overrides=settings, owner=owner, base_model=base_model)
    return render_tune(template, run, tune, platform, program, parents=parents)
