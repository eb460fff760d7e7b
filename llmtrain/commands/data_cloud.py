"""`llmtrain data prepare --cloud` and `llmtrain data status NAME`: a data preparation on SageMaker
Processing (llmtrain.core.preparation), checked and estimated before anything starts, then started
through the team's preparation state machine and followed (llmtrain.client.preparation_jobs).

    llmtrain data prepare --cloud --name NAME --input S3_PREFIX --tokenizer S3_FOLDER --template REF
        [--instance-type ml.c5.4xlarge] [--instance-count N] [--max-runtime-hours H] [--dry-run]
        [--no-wait] [--env ENV] [--team T] [prepare_data options]

`--input` and `--tokenizer` are S3 URIs under the team's datasets prefix, or paths relative to it.
Every other option is passed on to the program's prepare_data, as a local preparation passes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from datetime import UTC, datetime

from llmtrain.client.launcher import owner_from_identity
from llmtrain.client.preparation_jobs import (
    PreparationFailed,
    preparation_executions,
    preparation_jobs,
    preparation_state_machine,
    start_preparation,
)
from llmtrain.client.preparations import (
    check_inputs,
    check_tokenizer_and_options,
    input_files,
    is_complete,
    output_is_rerun,
    progress,
    removal_line,
    step_removals,
)
from llmtrain.commands._common import add_cloud_arguments, connect
from llmtrain.core.catalog import Catalog
from llmtrain.core.errors import LlmtrainError
from llmtrain.core.platform import PlatformContext
from llmtrain.core.preparation import (
    Preparation,
    PreparationError,
    check_preparation,
    merge_request,
    shards_request,
)
from llmtrain.core.s3_uris import S3_SCHEME
from llmtrain.planner.preparation_cost import check_budget, estimate

DEFAULT_INSTANCE_TYPE = "ml.c5.4xlarge"


def _cloud_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmtrain data prepare --cloud", add_help=False, allow_abbrev=False)
    parser.add_argument("--cloud", action="store_true", help="prepare on SageMaker Processing")
    parser.add_argument("--name", required=True, help="the dataset's name in your team's datasets")
    parser.add_argument("--input", required=True, help="the S3 prefix of the input files")
    parser.add_argument(
        "--template",
        required=True,
        help="the template whose runs read the dataset: its image runs the preparation",
    )
    parser.add_argument(
        "--instance-type",
        default=DEFAULT_INSTANCE_TYPE,
        help=f"a CPU instance type (default {DEFAULT_INSTANCE_TYPE})",
    )
    parser.add_argument(
        "--instance-count",
        type=int,
        default=1,
        help="instances of the shards job, at most the input's files (default 1)",
    )
    parser.add_argument(
        "--max-runtime-hours",
        type=float,
        default=120.0,
        help="each job's MaxRuntimeInSeconds, in hours (default 120)",
    )
    parser.add_argument("--dry-run", action="store_true", help="check, estimate and print the requests only")
    parser.add_argument("--no-wait", action="store_true", help="start the preparation and return")
    add_cloud_arguments(parser)
    return parser


def cloud_help() -> str:
    return _cloud_parser().format_help()


def prepare_cloud_command(args: argparse.Namespace) -> int:
    options, passed_on = _cloud_parser().parse_known_args(args.passed_on)
    if args.tokenizer is None:
        raise LlmtrainError(
            "--cloud needs --tokenizer: the S3 folder of an HF tokenizer in your team's "
            "datasets (e.g. a prepared dataset's tokenizer/)"
        )
    template = Catalog.load().resolve(options.template)
    cloud = connect(options)
    platform = cloud.team.platform
    machine = None if options.dry_run else preparation_state_machine(cloud.team)  # before any check
    if platform.allowed_templates and template.name not in platform.allowed_templates:
        raise PreparationError(f"--template {template.name} is not allowed for team {platform.team!r}")
    draft = Preparation(
        name=options.name,
        input_uri=_in_team(options.input, platform),
        tokenizer_uri=_in_team(args.tokenizer, platform),
        instance_type=options.instance_type,
        instance_count=options.instance_count,
        options=tuple(passed_on),
        owner=owner_from_identity(cloud.identity) or "unknown",
        input_bytes=0,
        stamp=datetime.now(UTC).strftime("%Y%m%d%H%M%S"),
        max_runtime_seconds=max(60, int(options.max_runtime_hours * 3600)),
    )
    check_preparation(draft, platform)  # before any S3 call
    s3 = cloud.session.client("s3", region_name=cloud.deployed.region)
    files = input_files(s3, draft.input_uri)
    check_inputs(s3, draft.input_uri, files, draft.instance_count)
    rerun = output_is_rerun(s3, draft, platform)
    check_tokenizer_and_options(s3, draft.tokenizer_uri, passed_on)
    preparation = dataclasses.replace(draft, input_bytes=sum(f.size for f in files), rerun=rerun)
    plan = estimate(preparation.input_bytes, preparation.instance_type, preparation.instance_count)
    print(f"{len(files)} input file(s), {preparation.input_bytes / 1e9:.2f} GB; {plan.summary_line()}")
    check_budget(plan, platform.run_budget_usd, platform.team)
    if options.dry_run:
        requests = [
            shards_request(preparation, platform, template),
            merge_request(preparation, platform, template),
        ]
        print(json.dumps(requests, indent=2))
        return 0
    sfn = cloud.session.client("stepfunctions", region_name=cloud.deployed.region)
    try:
        summary = start_preparation(
            sfn, s3, machine, preparation, platform, template, wait=not options.no_wait
        )
    except PreparationFailed as failed:  # it ran: not a usage error
        print(f"llmtrain data: error: {failed}", file=sys.stderr)
        return 1
    if summary is not None:
        print(summary.get("message") or f"dataset {preparation.dataset_uri(platform)} is complete")
    return 0


def _in_team(value: str, platform: PlatformContext) -> str:
    """An S3 URI as given, or a path relative to the team's datasets prefix (as channels are)."""
    return value if value.startswith(S3_SCHEME) else platform.datasets_uri + value.lstrip("/")


def register_status(actions) -> None:
    status = actions.add_parser(
        "status",
        help="a cloud preparation's progress and cost",
        description="The processing jobs of a `data prepare --cloud`, their state and cost, the work units "
        "done and the tokens written.",
    )
    status.add_argument("name", metavar="NAME", help="the dataset's name")
    add_cloud_arguments(status)
    status.set_defaults(handler=status_command)


def status_command(args: argparse.Namespace) -> int:
    cloud = connect(args)
    s3 = cloud.session.client("s3", region_name=cloud.deployed.region)
    sagemaker = cloud.session.client("sagemaker", region_name=cloud.deployed.region)
    sfn = cloud.session.client("stepfunctions", region_name=cloud.deployed.region)
    machine = preparation_state_machine(cloud.team)
    lines = status_lines(sagemaker, s3, cloud.team.platform, args.name, sfn=sfn, state_machine_arn=machine)
    if not lines:
        print(f"no preparation jobs of {args.name} in team {cloud.team.platform.team!r}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


def status_lines(
    sagemaker, s3, platform: PlatformContext, name: str, *, sfn=None, state_machine_arn: str | None = None
) -> list[str]:
    """The preparation's attempts (the state machine's executions) and jobs, the work units written and
    their tokens, the cost, what each quality step removed, the dataset's state."""
    executions = preparation_executions(sfn, state_machine_arn, platform, name) if sfn is not None else []
    jobs = preparation_jobs(sagemaker, platform, name)
    if not jobs and not executions:
        return []
    costs = [job.usd for job in jobs if job.usd is not None]
    done = progress(s3, Preparation(name, "", "", "", 1, (), "", 0, ""), platform)
    units = done["units"] if done["units"] is not None else "?"
    return [
        *(execution.line() for execution in executions),
        *(job.line() for job in jobs),
        f"work units: {done['units_done']} of {units} written; {done['tokens']:,} tokens; cost so far: "
        f"${sum(costs):,.2f} (ended jobs: duration x instances x on-demand price)",
        *_removal_lines(s3, platform, name, done),
        "dataset: complete" if is_complete(s3, platform, name) else "dataset: not complete yet",
    ]


def preparation_progress(s3, platform: PlatformContext, name: str) -> dict | None:
    """A cloud preparation's units and tokens so far, where `name`'s folder holds one's state."""
    done = progress(s3, Preparation(name, "", "", "", 1, (), "", 0, ""), platform)
    return done if done["units"] is not None else None


def progress_state(done: dict, name: str) -> str:
    """`data ls`'s state of a dataset a cloud preparation is writing."""
    return (
        f"preparing: {done['units_done']} of {done['units']} work units, {done['tokens']:,} tokens "
        f"(`llmtrain data status {name}`: jobs and cost)"
    )


def _removal_lines(s3, platform: PlatformContext, name: str, done: dict) -> list[str]:
    """Each quality step's removals: the merge's report once it is written, else the units' so far (the
    deduplication of a cloud preparation is decided by its merge job)."""
    steps = step_removals(s3, platform, name)
    if steps is not None:
        return [removal_line(s["step"], s["removed_documents"], s["removed_tokens"]) for s in steps]
    lines = [
        removal_line(step, counts["documents"], counts["tokens"]) + " so far"
        for step, counts in done["removed"].items()
    ]
    if done["dedup"]:
        lines.append(f"dedup-{done['dedup']}: the merge job finds the duplicates across every work unit")
    return lines
