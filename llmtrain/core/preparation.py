"""A data preparation on SageMaker Processing (`llmtrain data prepare --cloud`): what it is, the checks
that need no AWS call, and its two CreateProcessingJob requests.

1. The shards job: N instances run the training program's `prepare_data --host-config`: the code
   installed with llmtrain, the one `llmtrain data prepare` runs locally, uploaded beside the dataset
   (`DATASET/.preparation-code/`), so the dataset is the one made locally from the same files; the
   image of the template version whose runs will read it. Every instance is given the whole input
   (FullyReplicated: SageMaker's ShardedByS3Key gives each instance files of its choosing, and a
   work unit may group several files) and tokenizes the work units assigned to it (unit k on
   instance k mod N). Its shards go to the dataset's prefix, its `plan.json` and units' manifests to
   `DATASET/.preparation/`, uploaded as they are written, so a failed or stopped job leaves its
   complete units and a rerun (`--previous`: that state plus `sizes.json`, the listing of the
   prefix, written by the state machine) redoes only the others.
2. The merge job: one instance runs `prepare_data --merge-only` over `DATASET/.preparation/` (small
   files only: the shards are checked against `sizes.json`) and writes the split manifests,
   `preparation.json` and the tokenizer. Before it the prefix holds no manifest: nothing
   half-written is a dataset.

With `--dedup`, the instances cannot see each other's documents: each writes its units' signatures
and every document the filters kept (to `DATASET/.dedup/`, beside its shards), and the merge job is
also given the dataset's prefix (its shards and `.dedup/`), finds the duplicates across every unit
and rewrites the units that lose documents, so the dataset is still the local `--dedup` one. The
marker step then removes the shards the merge replaced and `.dedup/`
(llmtrain.lifecycle.preparation_steps.remove_unused_files).

Both jobs are started and followed by the team's preparation state machine
(training_constructs.preparation_launcher), whose input is `PreparationInput`: the CLI builds it after
its own checks, the state machine's Validate step (llmtrain.lifecycle.preparation_steps) checks it
again, lists the input itself and renders the requests here. Pure functions; the S3 checks (the
input's files, the output's state, the tokenizer) are llmtrain.lifecycle.preparation_steps and
llmtrain.client.preparations.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from llmtrain.core.errors import LlmtrainError
from llmtrain.core.instances import INSTANCE_TYPES
from llmtrain.core.platform import PlatformContext
from llmtrain.core.render import TAG_PREFIX, image_uri
from llmtrain.core.s3_uris import S3UriError, parse_s3_uri
from llmtrain.core.sourcedir import SOURCEDIR_NAME
from llmtrain.core.spec import TemplateSpec
from llmtrain.core.validate import input_problems

DATASET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
PROCESSING = "/opt/ml/processing"
CODE_PATH = f"{PROCESSING}/input/code"
INPUT_PATH = f"{PROCESSING}/input/data"
TOKENIZER_PATH = f"{PROCESSING}/input/tokenizer"
PREVIOUS_PATH = f"{PROCESSING}/input/previous"
SHARDS_PATH = f"{PROCESSING}/input/shards"  # with --dedup, the merge's copy of the dataset's prefix
DATASET_PATH = f"{PROCESSING}/output/dataset"
STATE_PATH = f"{PROCESSING}/output/state"
STATE_FOLDER = ".preparation"  # DATASET/.preparation/: plan.json, units/, and the launcher's sizes.json
CODE_FOLDER = ".preparation-code"  # DATASET/.preparation-code/sourcedir.tar.gz: the program's code
SIZES_FILE = "sizes.json"
# DATASET/.dedup/: with --dedup, the instances' signatures and documents (the program's
# data_pipeline.units.DEDUP_FOLDER), removed once the merge used them.
DEDUP_FOLDER = ".dedup"
SHARD_PREFIX = "shard_"  # the program's shard files (and their masks) begin so
PROGRAM_FOLDER = "/opt/ml/code"
# In the code archive: the quality steps' library (datatrove), which the program's requirements.txt
# leaves out (training jobs never use it) and both jobs install (--filter in the shards job, --dedup in
# both).
QUALITY_REQUIREMENTS = "training_jobs/data_pipeline/requirements.txt"
# prepare_data's options the platform sets for each job; a user's are refused.
PLATFORM_OPTIONS = (
    "--input",
    "--output",
    "--tokenizer",
    "--workers",
    "--host-config",
    "--previous",
    "--state",
    "--merge-only",
    "--shards",
)
CLOUD_REFUSED = {
    "--preference": "preference pairs are prepared by one process: prepare them locally",
    "--prompts": "prompt datasets are prepared by one process: prepare them locally",
}
DEDUP_OPTION = "--dedup"  # gives the merge job the dataset's prefix to rewrite (see above)
# prepare_data's parser takes an abbreviated option (`--ded` for `--dedup`); the ones the platform reads
# must be written in full.
READ_BY_PLATFORM = (*PLATFORM_OPTIONS, *CLOUD_REFUSED, DEDUP_OPTION)
MAX_VOLUME_GB = 16384  # botocore: ProcessingClusterConfig.VolumeSizeInGB
VOLUME_MARGIN_GB = 10  # the image's pip installs, the tokenizer, logs
MAX_RUNTIME_SECONDS = 5 * 86400  # botocore: ProcessingStoppingCondition.MaxRuntimeInSeconds
JOB_NAME_MAX = 63
DATASET_MANIFEST = "llmtrain-dataset.json"  # the marker that makes a dataset's folder complete
STAMP = re.compile(r"\d{14}")
# Every CPU type the platform knows: a preparation tokenizes on CPUs.
CPU_INSTANCE_TYPES = tuple(sorted(name for name, spec in INSTANCE_TYPES.items() if not spec.gpus))


class PreparationError(LlmtrainError):
    """A cloud preparation that must not start; the message says what to change."""


@dataclass(frozen=True)
class Preparation:
    """One cloud preparation, as the user asked for it and the S3 checks found it."""

    name: str  # the dataset's name in the team's datasets
    input_uri: str  # a prefix under the team's datasets prefix
    tokenizer_uri: str  # an HF tokenizer folder under the team's datasets prefix
    instance_type: str
    instance_count: int
    options: tuple[str, ...]  # prepare_data's options that shape the dataset (fields, splits, shards)
    owner: str
    input_bytes: int
    stamp: str  # UTC time of the start, YYYYMMDDHHMMSS: each attempt's jobs have their own names
    rerun: bool = False  # the prefix holds an earlier attempt's state: its complete units are kept
    max_runtime_seconds: int = 5 * 86400

    def dataset_uri(self, platform: PlatformContext) -> str:
        return f"{platform.datasets_uri}{self.name}/"

    def state_uri(self, platform: PlatformContext) -> str:
        return f"{self.dataset_uri(platform)}{STATE_FOLDER}/"

    def code_uri(self, platform: PlatformContext) -> str:
        return f"{self.dataset_uri(platform)}{CODE_FOLDER}/{SOURCEDIR_NAME}"

    @property
    def deduplicates(self) -> bool:
        return any(option.split("=", 1)[0] == DEDUP_OPTION for option in self.options)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    @classmethod
    def from_dict(cls, data: object) -> Preparation:
        """The record from its JSON form; PreparationError naming each field that is missing or of the
        wrong type (the launcher's Validate step reads what a client sent)."""
        if not isinstance(data, Mapping):
            raise PreparationError(f"'preparation' must be a JSON object, got {type(data).__name__}")
        problems = [f"'{name}' is not a field of a preparation" for name in sorted(set(data) - set(_TYPES))]
        values: dict[str, Any] = {}
        for name, kind in _TYPES.items():
            if name not in data:
                if name not in _OPTIONAL:
                    problems.append(f"'{name}' is missing")
                continue
            value = data[name]
            if kind is tuple:
                if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
                    problems.append(f"'{name}' must be a list of strings")
                    continue
                value = tuple(value)
            elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                problems.append(f"'{name}' must be {_KIND_WORDS[kind]}, got {json_type(value)}")
                continue
            values[name] = value
        if problems:
            raise PreparationError("the preparation's input: " + "; ".join(problems))
        return cls(**values)


_TYPES: dict[str, type] = {
    "name": str, "input_uri": str, "tokenizer_uri": str, "instance_type": str, "instance_count": int,
    "options": tuple, "owner": str, "input_bytes": int, "stamp": str, "rerun": bool,
    "max_runtime_seconds": int,
}
_OPTIONAL = ("rerun", "max_runtime_seconds", "input_bytes")
_KIND_WORDS = {str: "a string", int: "a whole number", bool: "true or false"}


def json_type(value: object) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


@dataclass(frozen=True)
class PreparationInput:
    """The input of a team's preparation state machine (`TrainingPreparations`): built by the CLI
    (`llmtrain data prepare --cloud`), read by the state machine's Validate step, which checks it
    again and lists the input itself before any job."""

    preparation: Preparation
    template: str  # `name@version`: the version whose image runs the preparation

    def to_dict(self) -> dict[str, Any]:
        return {"template": self.template, "preparation": self.preparation.to_dict()}

    @classmethod
    def from_dict(cls, data: object) -> PreparationInput:
        if not isinstance(data, Mapping):
            raise PreparationError(
                f"the execution input must be a JSON object with 'template' and 'preparation', got "
                f"{json_type(data)}: start preparations with `llmtrain data prepare --cloud`"
            )
        unknown = sorted(set(data) - {"template", "preparation"})
        if unknown:
            raise PreparationError(f"the execution input has unknown fields {unknown}: 'template' and "
                                   "'preparation' only")
        template = data.get("template")
        if not isinstance(template, str) or "@" not in template:
            raise PreparationError(
                f"the execution input's 'template' must be 'name@version', got {template!r}"
            )
        return cls(Preparation.from_dict(data.get("preparation")), template)


def preparation_instance_types(team_types: Sequence[str]) -> tuple[str, ...]:
    """The instance types a team's preparations may run on: the CPU types among the team's instance
    types, or, where it lists none (a team's types are its training's GPUs), every CPU type the
    platform knows. The launcher's role has them as its `sagemaker:InstanceTypes` condition."""
    return tuple(t for t in team_types if t in CPU_INSTANCE_TYPES) or CPU_INSTANCE_TYPES


def execution_name(platform: PlatformContext, preparation: Preparation) -> str:
    """The preparation state machine's execution of one attempt: `<job name stem>-<stamp>`."""
    return f"{job_name_stem(platform, preparation.name)}-{preparation.stamp}"


def check_preparation(preparation: Preparation, platform: PlatformContext) -> None:
    """Every check that needs no AWS call; PreparationError naming each problem."""
    if not DATASET_NAME.fullmatch(preparation.name):
        raise PreparationError(
            f"--name {preparation.name!r}: a dataset name is 1-128 letters, digits, '.', "
            "'_' or '-', starting with a letter or digit"
        )
    if not STAMP.fullmatch(preparation.stamp):
        raise PreparationError(f"the preparation's stamp {preparation.stamp!r} must be YYYYMMDDHHMMSS (UTC)")
    problems = [
        *_location_problems(preparation, platform),
        *_instance_problems(preparation, platform),
        *option_problems(preparation.options),
    ]
    if problems:
        raise PreparationError("; ".join(problems))


def _location_problems(preparation: Preparation, platform: PlatformContext) -> list[str]:
    datasets = parse_s3_uri(platform.datasets_uri)
    problems = []
    for option, uri in (("--input", preparation.input_uri), ("--tokenizer", preparation.tokenizer_uri)):
        try:
            location = parse_s3_uri(uri)
        except S3UriError as error:
            problems.append(f"{option}: {error}")
            continue
        if not location.within(datasets):
            problems.append(
                f"{option} {uri!r} is outside team {platform.team!r}'s datasets prefix; a "
                f"preparation reads only under {datasets.uri}"
            )
        elif location.key.startswith(f"{datasets.key}{preparation.name}/"):
            problems.append(
                f"{option} {uri!r} lies inside the dataset being prepared ({preparation.name}): "
                "give another --name"
            )
    return problems


def _instance_problems(preparation: Preparation, platform: PlatformContext) -> list[str]:
    kind, count = preparation.instance_type, preparation.instance_count
    problems = []
    allowed = preparation_instance_types(platform.allowed_instance_types)
    if kind not in CPU_INSTANCE_TYPES:
        problems.append(
            f"--instance-type {kind!r}: a preparation tokenizes on CPUs; use one of {', '.join(allowed)}"
        )
    elif kind not in allowed:
        problems.append(
            f"--instance-type {kind!r} is not allowed for team {platform.team!r} (its preparations run on "
            f"{', '.join(allowed)})"
        )
    if preparation.max_runtime_seconds < 60 or preparation.max_runtime_seconds > MAX_RUNTIME_SECONDS:
        problems.append(f"--max-runtime-hours: {preparation.max_runtime_seconds} s is not within 60 s and "
                        f"{MAX_RUNTIME_SECONDS // 3600} h (SageMaker's limit)")
    if count < 1:
        problems.append(f"--instance-count {count}: at least 1")
    elif platform.max_instance_count is not None and count > platform.max_instance_count:
        problems.append(
            f"--instance-count {count} is above team {platform.team!r}'s cap of "
            f"{platform.max_instance_count} instances per job"
        )
    return problems


def option_problems(options: tuple[str, ...]) -> list[str]:
    problems = []
    for option in options:
        name = option.split("=", 1)[0]
        if name in PLATFORM_OPTIONS:
            problems.append(f"{name}: the platform sets it for each job of a cloud preparation; leave it out")
        elif name in CLOUD_REFUSED:
            problems.append(f"{name} is not offered with --cloud: {CLOUD_REFUSED[name]}")
        elif _abbreviated(name):
            problems.append(f"{name}: write the option in full ({' or '.join(_abbreviated(name))}): the "
                            "platform reads it")
    return problems


def _abbreviated(name: str) -> list[str]:
    """The options the platform reads that `name` abbreviates (none: `name` is not an abbreviation)."""
    if not name.startswith("--") or name in READ_BY_PLATFORM:
        return []
    return [option for option in READ_BY_PLATFORM if option.startswith(name)]


def input_files_problem(files: int, instance_count: int, input_uri: str) -> str | None:
    """Every instance reads the whole input but must have work: the input's work units are at least
    its files, so no more instances than files."""
    if files == 0:
        return f"--input {input_uri}: no files there (`llmtrain data ls` lists your team's datasets)"
    if instance_count > files:
        return (
            f"--instance-count {instance_count} is more than the {files} input file(s) in {input_uri}: "
            f"some instances would have nothing to do; use at most {files}"
        )
    return None


def volume_size_gb(input_bytes: int, instance_count: int, deduplicates: bool = False) -> int:
    """Each instance holds the whole input and its share of the shards (token ids of 2 or 4 bytes, about
    as many bytes as the text they encode), plus a margin. With --dedup, also its share of the
    signatures, about as many bytes again for documents of 1 KB or more (MinHash keeps 112 hashes of 8
    bytes per document); the merge (one instance) then holds every shard and signature and the
    shards it rewrites: the same sum for N = 1."""
    shares = 2 if deduplicates else 1
    needed = input_bytes * (1 + shares / instance_count) / 1e9
    return min(MAX_VOLUME_GB, math.ceil(needed * 1.1) + VOLUME_MARGIN_GB)


# The top-level fields of both requests but RoleArn: the preparation state machine passes each of them
# from the rendered request and fixes the role itself (training_constructs.preparation_launcher).
PROCESSING_REQUEST_FIELDS = (
    "ProcessingJobName",
    "AppSpecification",
    "ProcessingInputs",
    "ProcessingOutputConfig",
    "ProcessingResources",
    "StoppingCondition",
    "NetworkConfig",
    "Environment",
    "Tags",
)
STAGES = ("shard", "merge")  # of equal length, so both jobs' names share their stem
STAMP_LENGTH = len("YYYYMMDDHHMMSS")


def job_name_stem(platform: PlatformContext, name: str) -> str:
    """`<team prefix>-<dataset>-<hash>`, every job of the dataset's preparations starts with it: the team's
    prefix (IAM scopes its jobs by it), the dataset's name cut to leave room for `-<stage>-<stamp>` (with a
    hash of the whole, so two names never share a stem)."""
    digest = hashlib.sha256(name.encode()).hexdigest()[:6]
    room = JOB_NAME_MAX - len(platform.job_name_prefix) - len(f"--{digest}-{STAGES[0]}-") - STAMP_LENGTH
    slug = re.sub(r"[^a-zA-Z0-9]+", "-", name).strip("-")[: max(room, 0)].rstrip("-")
    return f"{platform.job_name_prefix}-{slug}-{digest}" if slug else f"{platform.job_name_prefix}-{digest}"


def job_name(platform: PlatformContext, preparation: Preparation, stage: str) -> str:
    return f"{job_name_stem(platform, preparation.name)}-{stage}-{preparation.stamp}"


def shards_request(preparation: Preparation, platform: PlatformContext, template: TemplateSpec) -> dict:
    """The shards job: N instances, each its share of the work units."""
    arguments = [
        "--input",
        INPUT_PATH,
        "--tokenizer",
        TOKENIZER_PATH,
        "--output",
        DATASET_PATH,
        "--state",
        STATE_PATH,
        "--host-config",
        *preparation.options,
    ]
    inputs = [
        _input("code", preparation.code_uri(platform), CODE_PATH),
        _input("data", preparation.input_uri, INPUT_PATH),
        _input("tokenizer", preparation.tokenizer_uri, TOKENIZER_PATH),
    ]
    if preparation.rerun:
        arguments += ["--previous", PREVIOUS_PATH]
        inputs.append(_input("previous", preparation.state_uri(platform), PREVIOUS_PATH))
    outputs = [
        _output("dataset", DATASET_PATH, preparation.dataset_uri(platform)),
        _output("state", STATE_PATH, preparation.state_uri(platform)),
    ]
    return _request(
        preparation, platform, template, "shard", preparation.instance_count, inputs, outputs, arguments
    )


def merge_request(preparation: Preparation, platform: PlatformContext, template: TemplateSpec) -> dict:
    """The merge job: one instance, the units' manifests and sizes.json in, the dataset's manifests out;
    with --dedup also the dataset's prefix in (the shards and signatures), and the rewritten shards out."""
    arguments = [
        "--merge-only",
        "--input",
        PREVIOUS_PATH,
        "--tokenizer",
        TOKENIZER_PATH,
        "--output",
        DATASET_PATH,
    ]
    inputs = [
        _input("code", preparation.code_uri(platform), CODE_PATH),
        _input("tokenizer", preparation.tokenizer_uri, TOKENIZER_PATH),
        _input("state", preparation.state_uri(platform), PREVIOUS_PATH),
    ]
    if preparation.deduplicates:
        arguments += ["--shards", SHARDS_PATH]
        inputs.append(_input("shards", preparation.dataset_uri(platform), SHARDS_PATH))
    outputs = [_output("dataset", DATASET_PATH, preparation.dataset_uri(platform), mode="EndOfJob")]
    return _request(preparation, platform, template, "merge", 1, inputs, outputs, arguments)


def _request(
    preparation: Preparation,
    platform: PlatformContext,
    template: TemplateSpec,
    stage: str,
    count: int,
    inputs: list[dict],
    outputs: list[dict],
    arguments: list[str],
) -> dict:
    request = {
        "ProcessingJobName": job_name(platform, preparation, stage),
        "RoleArn": platform.execution_role_arn,
        "AppSpecification": {
            "ImageUri": image_uri(template, preparation.instance_type, platform.region),
            "ContainerEntrypoint": ["/bin/bash", "-c", _entry_script(), "prepare_data"],
            "ContainerArguments": arguments,
        },
        "ProcessingInputs": inputs,
        "ProcessingOutputConfig": {"Outputs": outputs, "KmsKeyId": platform.kms_key_arn},
        "ProcessingResources": {
            "ClusterConfig": {
                "InstanceCount": count,
                "InstanceType": preparation.instance_type,
                "VolumeSizeInGB": volume_size_gb(preparation.input_bytes, count, preparation.deduplicates),
                "VolumeKmsKeyId": platform.kms_key_arn,
            }
        },
        "StoppingCondition": {"MaxRuntimeInSeconds": preparation.max_runtime_seconds},
        "NetworkConfig": {
            "EnableInterContainerTrafficEncryption": platform.inter_container_traffic_encryption,
            "EnableNetworkIsolation": False,  # pip installs the program's requirements
            "VpcConfig": {
                "SecurityGroupIds": list(platform.security_group_ids),
                "Subnets": list(platform.subnet_ids),
            },
        },
        "Environment": {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"},
        "Tags": _tags(preparation, platform, template, stage),
    }
    problems = input_problems("sagemaker", "CreateProcessingJob", request)
    if problems:
        raise PreparationError(f"the {stage} job's request is not valid: " + "; ".join(problems))
    return request


def _entry_script() -> str:
    """Unpack the program's code (a sourcedir, as a training job's toolkit does), install its
    requirements and the quality steps', and run prepare_data with the job's arguments."""
    return (
        f"set -e; mkdir -p {PROGRAM_FOLDER}; tar -xzf {CODE_PATH}/*.tar.gz -C {PROGRAM_FOLDER}; "
        f"cd {PROGRAM_FOLDER}; python -m pip install -q -r requirements.txt -r {QUALITY_REQUIREMENTS}; "
        'exec python -m training_jobs.prepare_data "$@"'
    )


def _input(name: str, uri: str, local_path: str) -> dict[str, Any]:
    return {
        "InputName": name,
        "AppManaged": False,
        "S3Input": {
            "S3Uri": uri,
            "LocalPath": local_path,
            "S3DataType": "S3Prefix",
            "S3InputMode": "File",
            # Every instance gets the whole input: it runs the plan's units of its number, which may
            # group several files; SageMaker's ShardedByS3Key would choose the files itself.
            "S3DataDistributionType": "FullyReplicated",
            "S3CompressionType": "None",
        },
    }


def _output(name: str, local_path: str, uri: str, mode: str = "Continuous") -> dict[str, Any]:
    # Continuous: a unit's files reach S3 as they are written, so a failed job leaves its complete units.
    return {
        "OutputName": name,
        "AppManaged": False,
        "S3Output": {"S3Uri": uri, "LocalPath": local_path, "S3UploadMode": mode},
    }


def _tags(
    preparation: Preparation, platform: PlatformContext, template: TemplateSpec, stage: str
) -> list[dict[str, str]]:
    values = {
        "dataset": preparation.name,
        "stage": stage,
        "template": template.name,
        "template-version": template.version,
        "owner": preparation.owner,
        "environment": platform.environment,
        "team": platform.team,
    }
    return [{"Key": TAG_PREFIX + key, "Value": value} for key, value in values.items()]
