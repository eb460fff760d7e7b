"""Validation of a CreateTrainingJob request: SageMaker's rules and the platform's.

1. botocore's own input shape for CreateTrainingJob, through `ParamValidator` (types, required
   members, minimums), plus the `max`/`pattern`/`enum` metadata and map sizes that `ParamValidator`
   skips but the SageMaker API enforces (the same patterns, matched against the whole value).
2. The platform's rules: more than one node needs an EFA-capable instance type, a template's own
   script gets parallel degrees that divide the world size (the platform's training program checks
   its own: llmtrain.core.render.check_program), SMDDP runs only where it is supported, QLoRA only with
   the parallelisms the program quantizes with, the warm pool stays within the environment's cap
   (and off with spot), job names fit SageMaker's pattern and carry the environment's prefix,
   storage fits instance storage.

Pure functions (no AWS calls): the launcher's Lambda, the CLI and the construct all call them.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from math import prod
from typing import TYPE_CHECKING, Any

import botocore.session
import regex
from botocore.model import Shape
from botocore.validate import ParamValidator

from llmtrain.core.errors import RequestValidationError
from llmtrain.core.instances import EFA_INSTANCE_TYPES, INSTANCE_TYPES, fp8_instance_types
from llmtrain.core.platform import PlatformContext
from training_jobs.contract.hyperparameters import QUANTIZED_PARALLELISMS
from training_jobs.contract.parallel_dims import reshards_checkpoints
from training_jobs.contract.torch_versions import torch_release

if TYPE_CHECKING:
    from llmtrain.core.jumpstart import BaseModel

JOB_NAME_PATTERN = regex.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")
JOB_NAME_MAX = 63


@cache
def input_shape(service: str, operation: str) -> Shape:
    """botocore's input shape of one operation (from the installed service model)."""
    model = botocore.session.get_session().get_service_model(service)
    return model.operation_model(operation).input_shape


def create_training_job_shape() -> Shape:
    """botocore's input shape of sagemaker:CreateTrainingJob."""
    return input_shape("sagemaker", "CreateTrainingJob")


@cache
def _compiled(pattern: str) -> regex.Pattern:
    # AWS patterns are Java regexes (\p{L}, \p{Alnum}, lookbehinds): the `regex` module reads them.
    return regex.compile(pattern)


def shape_problems(request: Mapping[str, Any]) -> list[str]:
    """Everything botocore's validator reports on a CreateTrainingJob request, then the constraints
    it does not check."""
    return input_problems("sagemaker", "CreateTrainingJob", request)


def input_problems(service: str, operation: str, params: Mapping[str, Any]) -> list[str]:
    """botocore's validator on one operation's input, then its max/pattern/enum constraints."""
    shape = input_shape(service, operation)
    report = ParamValidator().validate(params, shape)
    problems = report.generate_report().splitlines() if report.has_errors() else []
    problems.extend(constraint_problems(params, shape, operation))
    return problems


def constraint_problems(value: Any, shape: Shape, path: str) -> list[str]:
    """max / pattern / enum (and map sizes) of botocore's metadata, recursively."""
    kind = shape.type_name
    if kind == "structure" and isinstance(value, Mapping):
        problems = []
        for key, member in value.items():
            if key in shape.members:
                problems += constraint_problems(member, shape.members[key], f"{path}.{key}")
        return problems
    if kind == "list" and isinstance(value, list | tuple):
        problems = _size_problems(len(value), shape, path, "items", check_min=False)
        for index, item in enumerate(value):
            problems += constraint_problems(item, shape.member, f"{path}[{index}]")
        return problems
    if kind == "map" and isinstance(value, Mapping):
        problems = _size_problems(len(value), shape, path, "entries", check_min=True)
        for key, item in value.items():
            problems += constraint_problems(key, shape.key, f"{path} key {key!r}")
            problems += constraint_problems(item, shape.value, f"{path}[{key!r}]")
        return problems
    if kind == "string" and isinstance(value, str):
        return _string_problems(value, shape, path)
    if (
        kind in ("integer", "long", "float", "double")
        and isinstance(value, int | float)
        and not isinstance(value, bool)
    ):
        return _number_problems(value, shape, path)
    return []


def _size_problems(size: int, shape: Shape, path: str, unit: str, *, check_min: bool) -> list[str]:
    meta = shape.metadata
    if "max" in meta and size > meta["max"]:
        return [f"{path} holds {size} {unit}; SageMaker allows at most {meta['max']}"]
    if check_min and "min" in meta and size < meta["min"]:
        return [f"{path} holds {size} {unit}; SageMaker needs at least {meta['min']}"]
    return []


def _string_problems(value: str, shape: Shape, path: str) -> list[str]:
    meta = shape.metadata
    problems = []
    if "max" in meta and len(value) > meta["max"]:
        problems.append(f"{path} is {len(value)} characters long; SageMaker allows at most {meta['max']}")
    if "pattern" in meta and not _compiled(meta["pattern"]).fullmatch(value):
        problems.append(f"{path} {value!r} does not match SageMaker's pattern {meta['pattern']}")
    enum = shape.enum
    if enum and value not in enum:
        shown = ", ".join(enum[:12]) + (", ..." if len(enum) > 12 else "")
        problems.append(f"{path} {value!r} is not one of SageMaker's values ({shown})")
    return problems


def _number_problems(value: float, shape: Shape, path: str) -> list[str]:
    meta = shape.metadata
    if "max" in meta and value > meta["max"]:
        return [f"{path} is {value}; SageMaker allows at most {meta['max']}"]
    return []


# --- the platform's rules -------------------------------------------------------------------------


def job_name_problems(job_name: str, prefix: str) -> list[str]:
    problems = []
    if len(job_name) > JOB_NAME_MAX:
        problems.append(
            f"training job name {job_name!r} is {len(job_name)} characters; SageMaker allows {JOB_NAME_MAX}: "
            "shorten the run name"
        )
    if not JOB_NAME_PATTERN.fullmatch(job_name):
        problems.append(
            f"training job name {job_name!r} must be letters, digits and dashes, starting and ending with a "
            "letter or digit"
        )
    if not job_name.startswith(prefix + "-"):
        problems.append(
            f"training job name {job_name!r} must start with the environment's prefix '{prefix}-'"
        )
    return problems


def efa_problems(instance_type: str, instance_count: int) -> list[str]:
    if instance_count > 1 and instance_type not in EFA_INSTANCE_TYPES:
        return [
            f"instance_count {instance_count} on {instance_type}: more than one node needs an EFA-capable "
            f"instance type ({', '.join(sorted(EFA_INSTANCE_TYPES))}); use one or run on a single node"
        ]
    return []


def degree_problems(degrees: Mapping[str, int], world_size: int) -> list[str]:
    """Degrees of 0 are derived; the others must multiply to a divisor of the world size, and to
    the world size itself when none is derived."""
    fixed = {name: d for name, d in degrees.items() if d}
    product = prod(fixed.values())
    shown = ", ".join(f"{name}={d}" for name, d in degrees.items())
    if world_size % product:
        return [
            f"parallel degrees ({shown}) multiply to {product}, which does not divide the world size "
            f"{world_size} (instance_count x GPUs per instance); pick degrees whose product divides it"
        ]
    if len(fixed) == len(degrees) and product != world_size:
        return [
            f"parallel degrees ({shown}) multiply to {product} but the world size is {world_size}; "
            "set one degree to 0 to derive it, or make the product equal the world size"
        ]
    return []


def _world_size(request: Mapping[str, Any]) -> int:
    resources = request["ResourceConfig"]
    return resources["InstanceCount"] * INSTANCE_TYPES[resources["InstanceType"]].processes_per_host


def reshape_problems(strategy: str, first: Mapping[str, Any], other: Mapping[str, Any]) -> list[str]:
    """Another attempt of a run (`other`, e.g. on a fallback type with another number of GPUs)
    with another world size than its `first`: fine where the checkpoints reshard, not otherwise."""
    before, after = _world_size(first), _world_size(other)
    if before == after or reshards_checkpoints(strategy):
        return []
    return [
        f"{other['ResourceConfig']['InstanceType']} runs {after} processes where the run's "
        f"{first['ResourceConfig']['InstanceType']} runs {before}, and {strategy} checkpoints do not "
        "reshard to another number of GPUs: choose fallback types with the same GPUs per instance"
    ]


# The instance types SageMaker's distributed data parallel library (SMDDP) runs on: the SageMaker
# Python SDK's own list (sagemaker.fw_utils.SM_DATAPARALLEL_SUPPORTED_INSTANCE_TYPES, which
# tests/llmtrain/test_render.py keeps equal).
SMDDP_INSTANCE_TYPES = ("ml.p3.16xlarge", "ml.p3dn.24xlarge", "ml.p4d.24xlarge", "ml.p4de.24xlarge")


def smddp_problems(smddp: bool, instance_type: str) -> list[str]:
    """SMDDP on an instance type it does not support (a capacity fallback included)."""
    if not smddp or instance_type in SMDDP_INSTANCE_TYPES:
        return []
    return [
        f"distribution.smddp runs on {', '.join(SMDDP_INSTANCE_TYPES)}, not {instance_type}: pick one of "
        "those instance types or a template version without smddp"
    ]


def quantization_problems(strategy: str, hyperparameters: Mapping[str, Any], template: str) -> list[str]:
    """A quantized base (QLoRA) under a strategy the training program refuses it with (the program
    checks it when it loads the model; code frozen before its contract does not say so up front)."""
    if hyperparameters.get("quantization", "none") == "none" or strategy in QUANTIZED_PARALLELISMS:
        return []
    return [
        f"quantization={hyperparameters['quantization']} (QLoRA) trains with strategy "
        f"{' or '.join(QUANTIZED_PARALLELISMS)}, and {template} uses {strategy}: set quantization=none "
        "(LoRA on the sharded base) or use a QLoRA template (llama-finetune-qlora)"
    ]


def fp8_problems(template: str, instance_type: str, hyperparameters: Mapping[str, Any],
                 capabilities: Mapping[str, object], framework_version: str | None) -> list[str]:
    """`fp8: true` where it cannot run: on a GPU without FP8 tensor cores (compute capability below
    8.9: torchao's float8 matmuls need them; the program would stop at start-up), with code that
    ships no torchao (its contract's capability `fp8`: None for code frozen before FP8), or on an
    image whose PyTorch is older than that torchao supports (`fp8_min_torch`)."""
    if not hyperparameters.get("fp8"):
        return []
    problems = []
    kind = INSTANCE_TYPES.get(instance_type)
    gpu = kind.gpu_model if kind else None
    if gpu is None or not gpu.has_fp8:
        if gpu:
            major, minor = gpu.compute_capability
            what = f"its {gpu.name} GPUs (compute capability {major}.{minor})"
        else:
            what = "it has no GPU"
        problems.append(
            f"fp8=true needs GPUs with FP8 tensor cores (compute capability 8.9+), and {instance_type} has "
            f"none: {what}; set fp8=false, or use one of {', '.join(fp8_instance_types())}"
        )
    requirement, minimum = capabilities.get("fp8"), capabilities.get("fp8_min_torch")
    if not requirement:
        problems.append(
            f"fp8=true: {template}'s training program ships no torchao (its code predates FP8): set "
            "fp8=false or use a template version whose program trains in FP8"
        )
    elif minimum and framework_version and torch_release(framework_version) < torch_release(str(minimum)):
        problems.append(
            f"fp8=true: {template}'s program installs {requirement}, which needs PyTorch {minimum} or newer, "
            f"and its image runs PyTorch {framework_version}: set fp8=false"
        )
    return problems


def model_archive_problems(template: str, base_model: BaseModel | None,
                           capabilities: Mapping[str, object]) -> list[str]:
    """A JumpStart base model whose weights are one .tar.gz, for code that reads only a folder from
    the model channel (its contract's capability `model_archive`: False for code frozen before it)."""
    if base_model is None or not base_model.is_archive or capabilities.get("model_archive"):
        return []
    return [f"base_model={base_model.reference}: its training weights are one archive "
            f"({base_model.uri}), which {template}'s training program cannot unpack (its code predates "
            "JumpStart base models); use a newer version of the template"]


def warm_pool_problems(keep_alive_seconds: int, cap_seconds: int, spot: bool) -> list[str]:
    problems = []
    if keep_alive_seconds > cap_seconds:
        problems.append(
            f"keep_alive_seconds {keep_alive_seconds} exceeds this environment's warm-pool cap of "
            f"{cap_seconds} seconds; lower it to at most {cap_seconds}"
        )
    if spot and keep_alive_seconds:
        problems.append(
            "warm pools do not work with managed spot training: set keep_alive_seconds to 0 or spot off"
        )
    return problems


def storage_problems(instance_type: str, volume_size_gb: int, volume_kms_key: bool) -> list[str]:
    local = INSTANCE_TYPES[instance_type].local_storage_gb if instance_type in INSTANCE_TYPES else None
    if local is None:
        return []
    problems = []
    if volume_size_gb > local:
        problems.append(
            f"volume_size_gb {volume_size_gb} exceeds the {local} GB of instance storage of {instance_type}, "
            "which SageMaker mounts instead of an EBS volume"
        )
    if volume_kms_key:
        problems.append(f"{instance_type} has instance storage: SageMaker rejects a VolumeKmsKeyId for it")
    return problems


def spot_problems(stopping: Mapping[str, int], spot: bool) -> list[str]:
    max_runtime = stopping.get("MaxRuntimeInSeconds", 0)
    max_wait = stopping.get("MaxWaitTimeInSeconds")
    if spot and (max_wait is None or max_wait < max_runtime):
        return ["managed spot training needs max_wait_seconds >= max_runtime_seconds"]
    if not spot and max_wait is not None:
        return ["max_wait_seconds only applies to managed spot training"]
    return []


def platform_problems(request: Mapping[str, Any], platform: PlatformContext) -> list[str]:
    """The platform's rules that can be read off a request alone."""
    resources = request.get("ResourceConfig", {})
    instance_type = resources.get("InstanceType", "")
    spot = bool(request.get("EnableManagedSpotTraining"))
    return [
        *job_name_problems(request.get("TrainingJobName", ""), platform.job_name_prefix),
        *efa_problems(instance_type, resources.get("InstanceCount", 1)),
        *warm_pool_problems(
            resources.get("KeepAlivePeriodInSeconds", 0), platform.warm_pool_cap_seconds, spot
        ),
        *storage_problems(instance_type, resources.get("VolumeSizeInGB", 0), "VolumeKmsKeyId" in resources),
        *spot_problems(request.get("StoppingCondition", {}), spot),
    ]


def validate_request(request: Mapping[str, Any], platform: PlatformContext) -> None:
    """Raise RequestValidationError listing every problem of the request, SageMaker's and ours."""
    problems = shape_problems(request) + platform_problems(request, platform)
    if problems:
        raise RequestValidationError(problems)
