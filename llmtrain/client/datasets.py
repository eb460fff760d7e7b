"""Datasets in a team's prefix of the datasets bucket: upload them, list them, check a run's channels.

A dataset is a folder uploaded under `s3://<datasets bucket>/teams/<team>/<name>/`, usually the
output of `llmtrain data prepare` (token shards with their `manifest.json`, or `train/` and
`validation/` folders of them). `upload_dataset` sends every file with S3's transfer manager
(multipart above `TransferConfig.multipart_threshold`), asks S3 to verify a SHA-256 checksum of
every request, then compares the checksum S3 stored for each object with the one computed here
(for a multipart object, S3's checksum of the parts' checksums) and its size. It writes
`llmtrain-dataset.json` (the files, their sizes and SHA-256) last, so a dataset with that file
is complete; an interrupted upload has none. An existing dataset name is refused unless the
caller asks to overwrite it, and nothing is ever deleted but that marker.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from boto3.s3.transfer import TransferConfig
from s3transfer.utils import ChunksizeAdjuster

from llmtrain.client.aws import explained
from llmtrain.core.deployed import TeamAccess
from llmtrain.core.errors import LlmtrainError, did_you_mean
from llmtrain.core.instances import instance_type
from llmtrain.core.preparation import DATASET_MANIFEST, DATASET_NAME
from llmtrain.core.s3_uris import parse_s3_uri
from llmtrain.core.token_data import (
    PREPARE_HINT,
    TOKENIZER_FILES,
    RunShape,
    ShardsManifest,
    TokenDataError,
    TokenizerFacts,
    data_problems,
    file_problems,
    has_tokenizer,
    parse_manifest,
    shipped_tokenizer_facts,
    split_folders_hint,
)
from training_jobs.contract.token_data import MANIFEST as SHARDS_MANIFEST
from training_jobs.contract.token_data import SPLITS, TOKENIZER_FOLDER

CHECKSUM_ALGORITHM = "SHA256"
_READ_BLOCK = 1 << 20


class DatasetError(LlmtrainError):
    """A dataset cannot be uploaded or used as asked; the message says what to do."""


@dataclass(frozen=True)
class LocalFile:
    """One file of a dataset folder and the checksums S3 must end up with."""

    relative: str
    path: Path
    size: int
    sha256: str  # hex, of the whole file
    s3_checksum: str  # base64, as S3 reports ChecksumSHA256 (of the parts' checksums when multipart)


@dataclass(frozen=True)
class DatasetListing:
    """One dataset of a team, as `llmtrain data ls` shows it."""

    name: str
    uri: str
    files: int
    bytes: int
    last_modified: datetime | None
    complete: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "uri": self.uri,
            "files": self.files,
            "bytes": self.bytes,
            "last_modified": self.last_modified.isoformat(timespec="seconds") if self.last_modified else None,
            "complete": self.complete,
        }


def check_dataset_name(name: str) -> None:
    if not DATASET_NAME.fullmatch(name):
        raise DatasetError(
            f"--name {name!r}: a dataset name is 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )


# -- the folder -----------------------------------------------------------------------------------------


def local_files(folder: Path, config: TransferConfig) -> list[LocalFile]:
    """The files under `folder` (recursively, sorted), with their checksums."""
    if not folder.is_dir():
        raise DatasetError(f"{folder} is not a folder: upload the folder `llmtrain data prepare` wrote")
    paths = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != DATASET_MANIFEST)
    if not paths:
        raise DatasetError(f"{folder} holds no files; prepare a dataset with `llmtrain data prepare` first")
    return [_local_file(folder, path, config) for path in paths]


def _local_file(folder: Path, path: Path, config: TransferConfig) -> LocalFile:
    size = path.stat().st_size
    whole = hashlib.sha256()
    multipart = size >= config.multipart_threshold
    part_size = ChunksizeAdjuster().adjust_chunksize(config.multipart_chunksize, size) if multipart else 0
    parts: list[bytes] = []
    part = hashlib.sha256()
    filled = 0
    with path.open("rb") as stream:
        while block := stream.read(min(_READ_BLOCK, part_size - filled) if multipart else _READ_BLOCK):
            whole.update(block)
            if multipart:
                part.update(block)
                filled += len(block)
                if filled == part_size:
                    parts.append(part.digest())
                    part, filled = hashlib.sha256(), 0
    if multipart:
        if filled:
            parts.append(part.digest())
        s3_checksum = base64.b64encode(hashlib.sha256(b"".join(parts)).digest()).decode()
    else:
        s3_checksum = base64.b64encode(whole.digest()).decode()
    return LocalFile(path.relative_to(folder).as_posix(), path, size, whole.hexdigest(), s3_checksum)


def channel_suggestions(folder: Path, uri: str) -> dict[str, str]:
    """Which channel each part of an uploaded folder is: prepare_data's train/ and validation/
    folders (or any subfolder of shards) by their names, a folder of shards as `train`, and the
    tokenizer/ it writes beside them as `tokenizer`."""
    if (folder / SHARDS_MANIFEST).is_file():
        found = {"train": uri}
    else:
        found = {
            sub.name: f"{uri}{sub.name}/"
            for sub in sorted(folder.iterdir())
            if sub.is_dir() and (sub / SHARDS_MANIFEST).is_file()
        }
    if found and has_tokenizer(folder / TOKENIZER_FOLDER):
        found[TOKENIZER_FOLDER] = f"{uri}{TOKENIZER_FOLDER}/"
    return found


# -- S3 -------------------------------------------------------------------------------------------------


def upload_dataset(
    s3,
    *,
    bucket: str,
    team: TeamAccess,
    name: str,
    files: Sequence[LocalFile],
    config: TransferConfig,
    overwrite: bool = False,
    uploaded_by: str | None = None,
    on_bytes: Callable[[int], None] = lambda count: None,
    on_file: Callable[[LocalFile], None] = lambda file: None,
) -> str:
    """Upload `files` as dataset `name` of `team`, verified; returns the dataset's S3 URI."""
    check_dataset_name(name)
    prefix = f"{team.datasets_prefix}{name}/"
    uri = f"s3://{bucket}/{prefix}"
    with explained(f"reading {uri}"):
        existing = _object_keys(s3, bucket, prefix)
    _refuse_to_replace(uri, prefix, existing, files, overwrite)
    with explained(f"uploading to {uri}"):
        if f"{prefix}{DATASET_MANIFEST}" in existing:
            # While its files are replaced the dataset is not complete (the only object removed).
            s3.delete_object(Bucket=bucket, Key=f"{prefix}{DATASET_MANIFEST}")
        for file in files:
            on_file(file)
            s3.upload_file(
                str(file.path),
                bucket,
                f"{prefix}{file.relative}",
                ExtraArgs={"ChecksumAlgorithm": CHECKSUM_ALGORITHM, "Metadata": {"sha256": file.sha256}},
                Config=config,
                Callback=on_bytes,
            )
            _verify(s3, bucket, f"{prefix}{file.relative}", file)
        manifest = {
            "format": 1,
            "name": name,
            "team": team.name,
            "uploaded_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "uploaded_by": uploaded_by,
            "bytes": sum(file.size for file in files),
            "files": [{"path": f.relative, "size": f.size, "sha256": f.sha256} for f in files],
        }
        s3.put_object(
            Bucket=bucket,
            Key=f"{prefix}{DATASET_MANIFEST}",
            Body=json.dumps(manifest, indent=2).encode(),
            ContentType="application/json",
            ChecksumAlgorithm=CHECKSUM_ALGORITHM,
        )
    return uri


def _refuse_to_replace(
    uri: str, prefix: str, existing: Mapping[str, int], files: Sequence[LocalFile], overwrite: bool
) -> None:
    data_keys = {key for key in existing if key != f"{prefix}{DATASET_MANIFEST}"}
    if not data_keys:
        return
    if not overwrite:
        raise DatasetError(
            f"dataset {uri} already exists ({len(data_keys)} files): choose another --name, or pass "
            "--overwrite to replace its files"
        )
    left_over = sorted(data_keys - {f"{prefix}{file.relative}" for file in files})
    if left_over:
        shown = ", ".join(key[len(prefix) :] for key in left_over[:5]) + (
            " ..." if len(left_over) > 5 else ""
        )
        raise DatasetError(
            f"--overwrite would leave {len(left_over)} files of the old dataset in {uri} that this folder "
            f"lacks ({shown}), and llmtrain deletes no data: remove them yourself "
            f"(`aws s3 rm --recursive {uri}`) or choose another --name"
        )


def _verify(s3, bucket: str, key: str, file: LocalFile) -> None:
    head = s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    stored = (head.get("ChecksumSHA256") or "").split("-", 1)[0]
    if head.get("ContentLength") != file.size or stored != file.s3_checksum:
        raise DatasetError(
            f"s3://{bucket}/{key} does not match {file.path} after the upload "
            f"(size {head.get('ContentLength')} "
            f"vs {file.size}, SHA-256 {stored or 'missing'} vs {file.s3_checksum}): upload again with "
            "--overwrite"
        )


def list_datasets(s3, bucket: str, team: TeamAccess) -> list[DatasetListing]:
    """The team's datasets: each folder directly under its datasets prefix."""
    with explained(f"listing s3://{bucket}/{team.datasets_prefix}"):
        pages = s3.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=team.datasets_prefix, Delimiter="/"
        )
        folders = [common["Prefix"] for page in pages for common in page.get("CommonPrefixes", [])]
        return [_listing(s3, bucket, folder, team) for folder in folders]


def _listing(s3, bucket: str, folder: str, team: TeamAccess) -> DatasetListing:
    objects = list(_objects(s3, bucket, folder))
    data = [o for o in objects if o["Key"] != f"{folder}{DATASET_MANIFEST}"]
    return DatasetListing(
        name=folder[len(team.datasets_prefix) :].rstrip("/"),
        uri=f"s3://{bucket}/{folder}",
        files=len(data),
        bytes=sum(o["Size"] for o in data),
        last_modified=max((o["LastModified"] for o in objects), default=None),
        complete=len(data) < len(objects),
    )


def channel_problems(
    s3, team: TeamAccess, request: Mapping[str, Any], *, token_channels: bool = False,
    manifest_versions: tuple[int, ...] = (1, 2),
) -> list[str]:
    """The request's channels that hold no data. Rendering with the team's platform context has
    already refused a channel outside the team's datasets prefix.

    With `token_channels` (a template of the platform's training program) the train and validation
    channels are also checked as the job will load them (llmtrain.core.token_data): their manifests are
    read, the shards' sizes taken from the listing (no shard is read), and a tokenizer channel must
    hold a tokenizer. `manifest_versions`: the manifest versions the code the template version runs
    reads (ProgramContract.manifest_versions)."""
    bucket = team.datasets_bucket
    problems: list[str] = []
    manifests: dict[str, ShardsManifest] = {}
    channels = {
        c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in request.get("InputDataConfig", [])
    }
    for name, uri in channels.items():
        key = parse_s3_uri(uri).key
        checked = token_channels and (name in SPLITS or name == TOKENIZER_FOLDER)
        with explained(f"checking channel {name} ({uri})"):
            sizes = _relative_sizes(s3, bucket, key) if checked else None
            present = bool(sizes) if checked else (
                s3.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1).get("KeyCount", 0) > 0
            )
            if not present:
                problems.append(_nothing_at(s3, team, name, uri, key))
            elif checked and name == TOKENIZER_FOLDER:
                problems += _tokenizer_channel_problems(uri, sizes)
            elif checked:
                try:
                    manifests[name] = _s3_manifest(s3, bucket, key, uri, name, sizes)
                except TokenDataError as problem:
                    problems.append(str(problem))
    if manifests and not problems:
        problems = data_problems(manifests, _cloud_shape(request), _cloud_tokenizer(channels),
                                 manifest_versions)
    return problems


def _nothing_at(s3, team: TeamAccess, name: str, uri: str, key: str) -> str:
    names = [d.name for d in list_datasets(s3, team.datasets_bucket, team)]
    wanted = key[len(team.datasets_prefix) :].split("/", 1)[0]
    return (
        f"channel {name}: nothing at {uri}{did_you_mean(wanted, names)}; `llmtrain data ls "
        f"--env {team.platform.environment} --team {team.name}` lists your team's datasets, "
        f"`llmtrain data upload DIR --name NAME` uploads one and prints the --set "
        f"channels.{name}=... to use"
    )


def _relative_sizes(s3, bucket: str, key: str) -> dict[str, int]:
    """Every object under the channel's prefix, by its name relative to it, with its size."""
    return {o["Key"][len(key) :].lstrip("/"): o["Size"] for o in _objects(s3, bucket, key)}


def _s3_manifest(s3, bucket: str, key: str, uri: str, name: str, sizes: Mapping[str, int]) -> ShardsManifest:
    where = uri if uri.endswith("/") else f"{uri}/"
    if SHARDS_MANIFEST not in sizes:
        splits = [split for split in SPLITS if f"{split}/{SHARDS_MANIFEST}" in sizes]
        if splits:
            raise TokenDataError(split_folders_hint(name, where, splits) + " (--set channels.NAME=...)")
        raise TokenDataError(f"channel {name}: no {SHARDS_MANIFEST} at {where}: {PREPARE_HINT}, then "
                             "`llmtrain data upload DIR --name NAME` (it prints the channels to use)")
    body = s3.get_object(Bucket=bucket, Key=f"{key.rstrip('/')}/{SHARDS_MANIFEST}")["Body"].read()
    manifest = parse_manifest(body, where)
    problems = file_problems(manifest, sizes)
    if problems:
        raise TokenDataError(f"channel {name}: " + "; ".join(problems) + "; upload the dataset again")
    return manifest


def _tokenizer_channel_problems(uri: str, sizes: Mapping[str, int]) -> list[str]:
    if any(name in sizes for name in TOKENIZER_FILES):
        return []
    return [f"channel {TOKENIZER_FOLDER}: {uri} holds no tokenizer ({', '.join(TOKENIZER_FILES)} at its "
            f"top): give the folder `llmtrain data prepare` wrote as {TOKENIZER_FOLDER}/ beside the splits"]


def _cloud_shape(request: Mapping[str, Any]) -> RunShape:
    resources = request["ResourceConfig"]
    return RunShape.of(request["HyperParameters"], hosts=int(resources["InstanceCount"]),
                       processes_per_host=instance_type(resources["InstanceType"]).processes_per_host)


def _cloud_tokenizer(channels: Mapping[str, str]) -> TokenizerFacts | None:
    """The shipped tokenizer, when the job reads its data with it (no tokenizer or model channel);
    another tokenizer is in S3, where only the job reads it (and checks it against the data)."""
    return None if TOKENIZER_FOLDER in channels or "model" in channels else shipped_tokenizer_facts()


def _object_keys(s3, bucket: str, prefix: str) -> dict[str, int]:
    return {o["Key"]: o["Size"] for o in _objects(s3, bucket, prefix)}


def _objects(s3, bucket: str, prefix: str) -> Iterable[Mapping[str, Any]]:
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        yield from page.get("Contents", [])
