"""A cloud data preparation's checks in S3 from the CLI, with the engineer's credentials (the requests
and the checks that need no AWS call are llmtrain.core.preparation; what the team's preparation state
machine reads and writes, llmtrain.lifecycle.preparation_steps, which these call with AWS's failures
explained).

Before the preparation starts: the input prefix's files (none, a binary format by name, text that is
not UTF-8 in the first 64 KiB of the first `UTF8_CHECKED_FILES` files, all empty), the output's state
(a dataset there is refused; an earlier attempt's state makes this a rerun; anything else is
refused), the tokenizer folder (downloaded and loaded with the program's own loader, with the
prepare_data options parsed by the program's parser), and the code upload. While and after it runs:
its progress (`progress`), what each quality step removed (`step_removals`, `removal_line`) and
whether the dataset is complete (`is_complete`).
"""

from __future__ import annotations

import codecs
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from llmtrain.client.aws import explained
from llmtrain.core.platform import PlatformContext
from llmtrain.core.preparation import Preparation, PreparationError, input_files_problem
from llmtrain.core.s3_uris import parse_s3_uri
from llmtrain.core.sourcedir import package_code, program_environment
from llmtrain.core.spec import PLATFORM_CODE, PLATFORM_ENTRY_POINT, CodeSpec
from llmtrain.core.token_data import TOKENIZER_FILES
from llmtrain.lifecycle import preparation_steps as steps
from llmtrain.lifecycle.preparation_steps import InputFile
from training_jobs.contract.token_data import BINARY_SUFFIXES

UTF8_CHECK_BYTES = 1 << 16
UTF8_CHECKED_FILES = 100  # ranged reads before the job; the job's instances check every file
MAX_TOKENIZER_BYTES = 200 << 20
# Run by the program's interpreter: the options parsed by prepare_data's parser (placeholders for the
# paths the platform sets), then the tokenizer loaded as prepare_data loads it.
_CHECK_PROGRAM = """
import sys
from training_jobs.prepare_data import parse_args
from training_jobs.data_pipeline.pipeline import load_tokenizer
from training_jobs.trainer.errors import DataError
parse_args(["--input", "INPUT", "--output", "OUTPUT", "--tokenizer", sys.argv[1], "--workers", "1",
            "--host-config", *sys.argv[2:]])
try:
    load_tokenizer(sys.argv[1])
except DataError as error:
    sys.exit(f"error: {error}")
"""


def input_files(s3, uri: str) -> list[InputFile]:
    """The files the instances will read, as prepare_data finds them (hidden names left out)."""
    with explained(f"listing {uri}"):
        return steps.input_files(s3, uri)


def check_inputs(s3, uri: str, files: list[InputFile], instance_count: int) -> None:
    problem = input_files_problem(len(files), instance_count, uri)
    if problem:
        raise PreparationError(problem)
    bucket = parse_s3_uri(uri).bucket
    for file in files:
        suffix = PurePosixPath(file.key).suffix.lower()
        if suffix in BINARY_SUFFIXES:
            raise PreparationError(
                f"s3://{bucket}/{file.key}: a {suffix} file is not text; convert it to "
                "JSONL, CSV or UTF-8 text first"
            )
    for file in [f for f in files if f.size][:UTF8_CHECKED_FILES]:
        with explained(f"reading s3://{bucket}/{file.key}"):
            head = s3.get_object(Bucket=bucket, Key=file.key, Range=f"bytes=0-{UTF8_CHECK_BYTES - 1}")[
                "Body"
            ].read()
        try:
            codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        except UnicodeDecodeError as error:
            raise PreparationError(
                f"s3://{bucket}/{file.key}: not UTF-8 text (byte {error.start}); convert it to UTF-8 first"
            ) from error
    if all(file.size == 0 for file in files):
        raise PreparationError(f"--input {uri}: every file there is empty; there is no text to prepare")


def output_is_rerun(s3, preparation: Preparation, platform: PlatformContext) -> bool:
    """Whether the dataset's prefix holds an earlier attempt of this preparation (resumed); refused
    when it holds a dataset or other files."""
    with explained(f"listing {preparation.dataset_uri(platform)}"):
        return steps.output_is_rerun(s3, preparation, platform)


def check_tokenizer_and_options(s3, uri: str, options: Iterable[str]) -> None:
    """The tokenizer folder loads with the program's loader, and prepare_data's parser takes the
    options; before any job, so a typo costs no instance time."""
    location = parse_s3_uri(uri)
    prefix = location.key if location.key.endswith("/") else f"{location.key}/"
    with explained(f"listing {uri}"):
        objects = [o for o in _objects(s3, location.bucket, prefix) if "/" not in o["Key"][len(prefix) :]]
    names = {o["Key"][len(prefix) :] for o in objects}
    if not names & set(TOKENIZER_FILES):
        raise PreparationError(
            f"--tokenizer {uri}: no tokenizer there ({', '.join(TOKENIZER_FILES)}); give the "
            "S3 folder of an HF tokenizer, e.g. a prepared dataset's tokenizer/"
        )
    if sum(o["Size"] for o in objects) > MAX_TOKENIZER_BYTES:
        raise PreparationError(
            f"--tokenizer {uri}: more than {MAX_TOKENIZER_BYTES >> 20} MiB at its top; give "
            "a tokenizer's folder, not a model's"
        )
    with tempfile.TemporaryDirectory(prefix="llmtrain-tokenizer-") as folder:
        for obj in objects:
            with explained(f"downloading s3://{location.bucket}/{obj['Key']}"):
                s3.download_file(location.bucket, obj["Key"], str(Path(folder) / obj["Key"][len(prefix) :]))
        checked = subprocess.run(
            [sys.executable, "-c", _CHECK_PROGRAM, folder, *options],
            env=program_environment(),
            capture_output=True,
            text=True,
            check=False,
        )
    if checked.returncode != 0:
        lines = [line for line in checked.stderr.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit status {checked.returncode}"
        raise PreparationError(f"{reason.replace(folder, uri)} (checked before any job)")


def upload_code(s3, preparation: Preparation, platform: PlatformContext) -> str:
    """The program's code installed with llmtrain, as the sourcedir archive the instances unpack."""
    uri = preparation.code_uri(platform)
    location = parse_s3_uri(uri)
    with explained(f"uploading the program's code to {uri}"):
        s3.put_object(
            Bucket=location.bucket,
            Key=location.key,
            Body=package_code(CodeSpec(PLATFORM_CODE, PLATFORM_ENTRY_POINT)),
        )
    return uri


def progress(s3, preparation: Preparation, platform: PlatformContext) -> dict[str, Any]:
    """Units done of the plan's units, the tokens they wrote and what the units' quality steps removed,
    from the state folder (llmtrain.lifecycle.preparation_steps.progress)."""
    with explained(f"reading {preparation.state_uri(platform)}"):
        return steps.progress(s3, preparation, platform)


def is_complete(s3, platform: PlatformContext, name: str) -> bool:
    with explained(f"reading {platform.datasets_uri}{name}/"):
        return steps.is_complete(s3, platform, name)


def step_removals(s3, platform: PlatformContext, name: str) -> list[dict[str, Any]] | None:
    """What each quality step removed, from the merge's report; None before the merge wrote it."""
    with explained(f"reading {platform.datasets_uri}{name}/{steps.REPORT_FILE}"):
        return steps.step_removals(s3, platform, name)


removal_line = steps.removal_line


def _objects(s3, bucket: str, prefix: str) -> Iterable[Mapping[str, Any]]:
    return steps.objects(s3, bucket, prefix)
