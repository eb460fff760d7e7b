"""`llmtrain data prepare | upload | ls`: from text files to a dataset a cloud run can read.

    llmtrain data prepare --input FILES_OR_DIRS... --output DIR [--tokenizer DIR] [prepare_data options]
    llmtrain data prepare --cloud --name NAME --input S3_PREFIX --tokenizer S3_FOLDER --template REF [...]
    llmtrain data status NAME [--env ENV] [--team T]
    llmtrain data upload DIR --name NAME [--env ENV] [--team T] [--overwrite]
    llmtrain data ls [--env ENV] [--team T] [--json]

`prepare` runs the training program's own `prepare_data` (the one the platform's jobs read the
shards of) from the files shipped with llmtrain, in this Python environment, with its progress
bar; every option after `prepare` is passed on to it. With `--cloud` it runs on SageMaker Processing
instead (llmtrain.commands.data_cloud), and `status` follows it. `upload` and `ls` use the team's prefix of
the environment's datasets bucket (llmtrain.client.datasets).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from boto3.s3.transfer import TransferConfig
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from llmtrain.client.datasets import (
    channel_suggestions,
    check_dataset_name,
    list_datasets,
    local_files,
    upload_dataset,
)
from llmtrain.client.launcher import owner_from_identity
from llmtrain.commands._common import (
    add_action,
    add_cloud_arguments,
    connect,
    follow_up_options,
    print_table,
    require_extra,
    writable_folder,
)
from llmtrain.commands.data_cloud import (
    cloud_help,
    preparation_progress,
    prepare_cloud_command,
    progress_state,
    register_status,
)
from llmtrain.core.errors import LlmtrainError
from llmtrain.core.sourcedir import program_environment, repository_root
from llmtrain.local.data import PREPARE_MODULE, TINY_TOKENIZER

MIB = 1 << 20
DEFAULT_PART_MIB = 64
MIN_PART_MIB = 5  # S3's smallest multipart part


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "data",
        help="prepare, upload and list datasets",
        description="From text files to a dataset a cloud run reads: prepare token shards, upload them to "
        "your team's datasets, list them.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    prepare = actions.add_parser(
        "prepare",
        help="tokenize text, JSONL or CSV files into training shards",
        add_help=False,
        allow_abbrev=False,
        usage="llmtrain data prepare --input FILES_OR_DIRS... --output DIR [--tokenizer DIR] [options]",
    )
    prepare.add_argument("-h", "--help", action=_PrepareHelp, nargs=0, help="show the options and exit")
    prepare.add_argument("--tokenizer", default=None)
    prepare.set_defaults(handler=prepare_command, passes_on_arguments=True)

    upload = actions.add_parser(
        "upload",
        help="upload a prepared dataset to your team's datasets",
        description="Upload a folder (what `llmtrain data prepare` wrote) to s3://<datasets bucket>/teams/"
        "<team>/<NAME>/: multipart, every file checked against its SHA-256 once uploaded. Prints the "
        "--set channels.<channel>=... that runs use. An existing dataset name is refused unless --overwrite.",
    )
    upload.add_argument("folder", type=Path, metavar="DIR")
    upload.add_argument("--name", required=True, help="the dataset's name in your team's datasets")
    upload.add_argument("--overwrite", action="store_true", help="replace the files of an existing dataset")
    upload.add_argument(
        "--part-size-mib",
        type=int,
        default=DEFAULT_PART_MIB,
        help=f"multipart part size and threshold in MiB (default {DEFAULT_PART_MIB}, "
        f"at least {MIN_PART_MIB})",
    )
    add_cloud_arguments(upload)
    upload.set_defaults(handler=upload_command)

    register_status(actions)

    listing = add_action(
        actions, "ls", help="list your team's datasets", description="List your team's datasets."
    )
    listing.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    add_cloud_arguments(listing)
    listing.set_defaults(handler=ls_command)


# -- prepare --------------------------------------------------------------------------------------------


class _PrepareHelp(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(parser.format_usage())
        try:
            require_extra("data", "llmtrain data prepare")
        except LlmtrainError as error:
            parser.exit(2, f"llmtrain data prepare: error: {error}\n")
        print(
            f"Runs the training program's prepare_data; --tokenizer defaults to the platform's tiny demo "
            f"tokenizer ({TINY_TOKENIZER}). Its options:\n",
            flush=True,
        )
        subprocess.run(
            [sys.executable, "-m", PREPARE_MODULE, "--help"], env=program_environment(), check=False
        )
        print(
            "\nWith --cloud, on SageMaker Processing (--input and --tokenizer in S3; the other options "
            "above are passed on):\n"
        )
        print(cloud_help())
        parser.exit()


def prepare_command(args: argparse.Namespace) -> int:
    require_extra("data", "llmtrain data prepare")
    if "--cloud" in args.passed_on:
        return prepare_cloud_command(args)
    output = _output_of(args.passed_on)
    if output:  # prepare_data writes beside it (OUTPUT.partial), then renames: its folder must take files
        writable_folder(Path(output).absolute().parent, f"--output {output}: its folder")
    tokenizer = args.tokenizer
    if tokenizer is None:
        tokenizer = str(repository_root() / TINY_TOKENIZER)
        print(
            f"llmtrain data prepare: no --tokenizer: using the platform's tiny demo tokenizer ({tokenizer}); "
            "pass the tokenizer folder of the model you train for real data",
            file=sys.stderr,
        )
    command = [sys.executable, "-m", PREPARE_MODULE, *args.passed_on, "--tokenizer", tokenizer]
    status = subprocess.run(command, env=program_environment(), check=False).returncode
    if status == 0 and output:
        print(
            f"next: try it here, `llmtrain run --local TEMPLATE --run-name RUN --data {output}`; then "
            f"`llmtrain data upload {output} --name NAME --env ENV` for a cloud run"
        )
    return status


def _output_of(passed_on: list[str]) -> str | None:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--output")
    return parser.parse_known_args(passed_on)[0].output


# -- upload ---------------------------------------------------------------------------------------------


def upload_command(args: argparse.Namespace) -> int:
    check_dataset_name(args.name)
    if args.part_size_mib < MIN_PART_MIB:
        raise LlmtrainError(
            f"--part-size-mib {args.part_size_mib}: S3's parts are at least {MIN_PART_MIB} MiB"
        )
    part = args.part_size_mib * MIB
    config = TransferConfig(multipart_threshold=part, multipart_chunksize=part)
    files = local_files(args.folder, config)  # before any AWS call: a wrong folder needs no credentials
    cloud = connect(args)
    bucket = cloud.team.datasets_bucket
    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("uploading", total=sum(f.size for f in files))
        uri = upload_dataset(
            cloud.session.client("s3", region_name=cloud.deployed.region),
            bucket=bucket,
            team=cloud.team,
            name=args.name,
            files=files,
            config=config,
            overwrite=args.overwrite,
            uploaded_by=owner_from_identity(cloud.identity),
            on_bytes=lambda count: progress.update(task, advance=count),
            on_file=lambda file: progress.update(task, description=file.relative),
        )
    total = sum(f.size for f in files)
    print(f"uploaded {len(files)} files ({total / MIB:.1f} MiB) to {uri}, each verified against its SHA-256")
    channels = channel_suggestions(args.folder, uri)
    if channels:
        sets = " ".join(f"--set channels.{name}={channel_uri}" for name, channel_uri in channels.items())
        print(
            "use it in a run:\n"
            f"  llmtrain start TEMPLATE --run-name RUN{follow_up_options(args, cloud)} {sets}"
        )
    else:
        print(
            f"use it as a channel of a run: --set channels.<CHANNEL>={uri} "
            "(e.g. channels.model, channels.tokenizer)"
        )
    return 0


# -- ls -------------------------------------------------------------------------------------------------


def ls_command(args: argparse.Namespace) -> int:
    cloud = connect(args)
    s3 = cloud.session.client("s3", region_name=cloud.deployed.region)
    datasets = list_datasets(s3, cloud.team.datasets_bucket, cloud.team)
    # An incomplete dataset may be a cloud preparation under way (or stopped): its state says how far.
    preparing = {
        d.name: done
        for d in datasets
        if not d.complete and (done := preparation_progress(s3, cloud.team.platform, d.name)) is not None
    }
    if args.json:
        print(json.dumps([_listed(d.to_dict(), preparing.get(d.name)) for d in datasets], indent=2))
        return 0
    where = f"{cloud.team.datasets_uri} (team {cloud.team.name})"
    if not datasets:
        print(f"no datasets in {where}; upload one with `llmtrain data upload DIR --name NAME`")
        return 0
    print(f"datasets in {where}:")
    rows = [
        (
            d.name,
            str(d.files),
            f"{d.bytes / MIB:.1f} MiB",
            d.last_modified.strftime("%Y-%m-%d %H:%M") if d.last_modified else "-",
            d.uri,
            "complete" if d.complete
            else progress_state(preparing[d.name], d.name) if d.name in preparing
            else "incomplete (interrupted, or not uploaded by llmtrain)",
        )
        for d in datasets
    ]
    print_table(("NAME", "FILES", "SIZE", "MODIFIED", "URI", "STATE"), rows)
    return 0


def _listed(dataset: dict, preparation: dict | None) -> dict:
    if preparation is None:
        return dataset
    return {**dataset, "preparation": {key: preparation[key] for key in ("units", "units_done", "tokens")}}
