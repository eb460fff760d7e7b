"""A cloud data preparation's steps that read or write S3 and SageMaker (the requests and the checks
that need no AWS call are llmtrain.core.preparation).

Before any job: the input prefix's files (none, a binary format by name, text that is not UTF-8 in
the first 64 KiB of the first `UTF8_CHECKED_FILES` files, all empty), the output's state (a dataset
there is refused; an earlier attempt's state makes this a rerun; anything else is refused), the
tokenizer folder (downloaded and loaded with the program's own loader, with the prepare_data options
parsed by the program's parser). Then the code upload, the shards job, `sizes.json` (the listing
the merge and a rerun read) and the merge job, and last the `llmtrain-dataset.json` marker that
makes the folder a complete dataset in `llmtrain data ls`, once the files the dataset does not use
are removed (the shards a deduplicating merge replaced, `.dedup/`, temporaries).
"""

from __future__ import annotations

import codecs
import json
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from llmtrain.client.aws import explained
from llmtrain.client.datasets import DATASET_MANIFEST
from llmtrain.core.platform import PlatformContext
from llmtrain.core.preparation import (
    CODE_FOLDER,
    DEDUP_FOLDER,
    SIZES_FILE,
    STATE_FOLDER,
    Preparation,
    PreparationError,
    input_files_problem,
)
from llmtrain.core.s3_uris import parse_s3_uri
from llmtrain.core.sourcedir import package_code, program_environment
from llmtrain.core.spec import PLATFORM_CODE, PLATFORM_ENTRY_POINT, CodeSpec
from llmtrain.core.token_data import TOKENIZER_FILES
from training_jobs.contract.token_data import BINARY_SUFFIXES, MANIFEST, SPLITS

UTF8_CHECK_BYTES = 1 << 16
UTF8_CHECKED_FILES = 100  # ranged reads before the job; the job's instances check every file
MAX_TOKENIZER_BYTES = 200 << 20
PLAN_FILE = "plan.json"
REPORT_FILE = "preparation.json"  # the merge's report: the plan, each split's totals, each step's removals
SHARD_PREFIX = "shard_"  # the program's shard files (and their masks) begin so
DELETE_BATCH = 1000  # S3 DeleteObjects' most keys per call
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


@dataclass(frozen=True)
class InputFile:
    key: str
    size: int


def input_files(s3, uri: str) -> list[InputFile]:
    """The files the instances will read, as prepare_data finds them (hidden names left out)."""
    location = parse_s3_uri(uri)
    prefix = location.key if location.key.endswith("/") or not location.key else f"{location.key}/"
    with explained(f"listing {uri}"):
        objects = list(_objects(s3, location.bucket, prefix))
    return [
        InputFile(o["Key"], o["Size"])
        for o in objects
        if not o["Key"].endswith("/")
        and not any(part.startswith(".") for part in o["Key"][len(prefix) :].split("/"))
    ]


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
    bucket, prefix = platform.datasets_bucket, parse_s3_uri(preparation.dataset_uri(platform)).key
    with explained(f"listing {preparation.dataset_uri(platform)}"):
        keys = {o["Key"][len(prefix) :] for o in _objects(s3, bucket, prefix)}
    datasets = {DATASET_MANIFEST, MANIFEST, *(f"{split}/{MANIFEST}" for split in SPLITS)}
    if keys & datasets:
        raise PreparationError(
            f"{preparation.dataset_uri(platform)} already holds a dataset "
            f"({', '.join(sorted(keys & datasets))}): choose another --name"
        )
    if f"{STATE_FOLDER}/{PLAN_FILE}" in keys:
        return True
    others = sorted(key for key in keys if not key.startswith((f"{STATE_FOLDER}/", f"{CODE_FOLDER}/")))
    if others:
        raise PreparationError(
            f"{preparation.dataset_uri(platform)} holds {len(others)} file(s) (e.g. "
            f"{others[0]}) but no preparation: choose another --name"
        )
    return False


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


def write_sizes(s3, preparation: Preparation, platform: PlatformContext) -> dict[str, int]:
    """`sizes.json` in the state folder: every object of the dataset's prefix by relative key (the
    state and the code left out), what a rerun and the merge check the units' shards against."""
    bucket, prefix = platform.datasets_bucket, parse_s3_uri(preparation.dataset_uri(platform)).key
    with explained(f"listing {preparation.dataset_uri(platform)}"):
        sizes = {
            o["Key"][len(prefix) :]: o["Size"]
            for o in _objects(s3, bucket, prefix)
            if not o["Key"][len(prefix) :].startswith((f"{STATE_FOLDER}/", f"{CODE_FOLDER}/"))
        }
    with explained(f"writing {preparation.state_uri(platform)}{SIZES_FILE}"):
        s3.put_object(
            Bucket=bucket,
            Key=f"{prefix}{STATE_FOLDER}/{SIZES_FILE}",
            Body=json.dumps(sizes, sort_keys=True).encode(),
            ContentType="application/json",
        )
    return sizes


def write_marker(s3, preparation: Preparation, platform: PlatformContext) -> None:
    """`llmtrain-dataset.json`, last, once the merge wrote the manifests: the dataset is complete. The
    files it does not use are removed first (`remove_unused_files`), so the marker lists what is there."""
    bucket, prefix = platform.datasets_bucket, parse_s3_uri(preparation.dataset_uri(platform)).key
    sizes = {o["Key"][len(prefix) :]: o["Size"] for o in _objects(s3, bucket, prefix)}
    if not set(sizes) & {MANIFEST, *(f"{s}/{MANIFEST}" for s in SPLITS)}:
        raise PreparationError(
            f"{preparation.dataset_uri(platform)} has no {MANIFEST}: the merge job has not "
            "written the dataset"
        )
    removed = remove_unused_files(s3, bucket, prefix, sizes)
    files = [
        {"path": path, "size": size}
        for path, size in sizes.items()
        if path != DATASET_MANIFEST and path not in removed
    ]
    marker = {
        "format": 1,
        "name": preparation.name,
        "team": platform.team,
        "uploaded_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "uploaded_by": preparation.owner,
        "prepared_by": "llmtrain data prepare --cloud",
        "bytes": sum(f["size"] for f in files),
        "files": files,
    }
    s3.put_object(
        Bucket=bucket,
        Key=f"{prefix}{DATASET_MANIFEST}",
        Body=json.dumps(marker, indent=2).encode(),
        ContentType="application/json",
    )


def remove_unused_files(s3, bucket: str, prefix: str, sizes: Mapping[str, int]) -> set[str]:
    """The preparation's files under the dataset's prefix that the finished dataset does not use: the
    shard files no split manifest lists (the instances' shards that a deduplicating merge rewrote, and
    temporaries the Continuous upload caught) and `.dedup/` (the signatures, used). The prefix held no
    other files when the preparation started (output_is_rerun), so none of them is anyone else's.
    Returns their keys relative to the prefix."""
    listed: set[str] = set()
    for folder in ("", *(f"{split}/" for split in SPLITS)):
        if f"{folder}{MANIFEST}" in sizes:
            names = _listed_files(s3, bucket, f"{prefix}{folder}{MANIFEST}")
            listed.update(f"{folder}{name}" for name in names)
    unused = sorted(
        path
        for path in sizes
        if path.startswith(f"{DEDUP_FOLDER}/") or (_is_shard_file(path) and path not in listed)
    )
    for start in range(0, len(unused), DELETE_BATCH):
        batch = unused[start : start + DELETE_BATCH]
        with explained(f"removing {len(batch)} unused file(s) of {prefix}"):
            answer = s3.delete_objects(
                Bucket=bucket, Delete={"Objects": [{"Key": prefix + path} for path in batch], "Quiet": True}
            )
        if answer.get("Errors"):
            error = answer["Errors"][0]
            raise PreparationError(f"could not remove s3://{bucket}/{error['Key']}: {error.get('Message')}")
    return set(unused)


def _listed_files(s3, bucket: str, key: str) -> set[str]:
    """The shard and mask files a split's manifest lists; a manifest that lists none is refused before
    anything is removed."""
    with explained(f"reading s3://{bucket}/{key}"):
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    try:
        entries = json.loads(body)["shards"]
        return {entry[name] for entry in entries for name in ("path", "mask") if name in entry}
    except (ValueError, KeyError, TypeError) as error:
        raise PreparationError(
            f"s3://{bucket}/{key} is not the manifest of a dataset ({type(error).__name__}: {error}); "
            "nothing was removed and the dataset is not marked complete"
        ) from error


def _is_shard_file(path: str) -> bool:
    folder, _, name = path.rpartition("/")
    return folder in ("", *SPLITS) and name.startswith(SHARD_PREFIX)


def step_removals(s3, platform: PlatformContext, name: str) -> list[dict[str, Any]] | None:
    """What each quality step removed, from the merge's report (`preparation.json`); None before the
    merge wrote it."""
    key = f"{parse_s3_uri(platform.datasets_uri).key}{name}/{REPORT_FILE}"
    try:
        report = json.loads(s3.get_object(Bucket=platform.datasets_bucket, Key=key)["Body"].read())
    except s3.exceptions.NoSuchKey:
        return None
    return report.get("steps", [])


def removal_line(step: str, documents: int, tokens: int) -> str:
    """A step's removals, as prepare_data prints them locally."""
    return f"{step} removed {documents:,} document(s) ({tokens:,} tokens)"


def progress(s3, preparation: Preparation, platform: PlatformContext) -> dict[str, Any]:
    """Units done of the plan's units, the tokens they wrote and what the units' quality steps removed
    (the filters': a distributed job's deduplication is its merge's), from the state folder."""
    bucket, prefix = platform.datasets_bucket, parse_s3_uri(preparation.state_uri(platform)).key
    try:
        plan = json.loads(s3.get_object(Bucket=bucket, Key=f"{prefix}{PLAN_FILE}")["Body"].read())
    except s3.exceptions.NoSuchKey:
        return {"units": None, "units_done": 0, "tokens": 0, "removed": {}, "dedup": None}
    tokens = 0
    removed: dict[str, Counter] = {}
    keys = [o["Key"] for o in _objects(s3, bucket, f"{prefix}units/")]
    for key in keys:
        manifest = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        tokens += sum(body["tokens"] for body in manifest["splits"].values())
        for step, counts in manifest.get("removed", {}).items():
            removed.setdefault(step, Counter()).update(counts)
    return {
        "units": len(plan["units"]),
        "units_done": len(keys),
        "tokens": tokens,
        "removed": removed,
        "dedup": plan.get("settings", {}).get("quality", {}).get("dedup"),
    }


def _objects(s3, bucket: str, prefix: str) -> Iterable[Mapping[str, Any]]:
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        yield from page.get("Contents", [])
