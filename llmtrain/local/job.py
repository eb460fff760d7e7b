"""From a rendered CreateTrainingJob request to what runs on this machine.

The request stays the single source of truth: the local plan copies its hyperparameters, channels,
metric definitions, stopping condition and checkpoint settings, and changes only what this machine
cannot provide (GPUs, many hosts, a model too big for a CPU). Every change is an `Adjustment` that is
printed before the job starts and recorded in summary.json, so nothing is scaled down silently.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmtrain.core.errors import LlmtrainError
from llmtrain.core.instances import INSTANCE_TYPES
from llmtrain.core.user_cache import cached_json, content_key, installed_version
from llmtrain.local.metric_lines import MetricDefinition

# The training toolkit's hyperparameter for processes per host; on a CPU host its default is 1.
PROCESSES_PER_HOST_HP = "sagemaker_mpi_num_of_processes_per_host"
SUBMIT_DIRECTORY_HP = "sagemaker_submit_directory"
CONTAINER_ROOT = "/opt/ml/"
DEFAULT_CHECKPOINT_PATH = "/opt/ml/checkpoints"
DEFAULT_TENSORBOARD_PATH = "/opt/ml/output/tensorboard"  # SageMaker's default LocalPath
DEGREE_HPS = ("replicate_degree", "shard_degree", "tensor_parallel_degree", "pipeline_parallel_degree")

# Model presets that train at a useful speed on a few CPU cores, and what bigger ones become.
LOCAL_PRESETS = frozenset({"llama-tiny", "llama-20m", "gpt2-tiny", "qwen3-moe-tiny", "mixtral-tiny",
                           "deepseek-moe-tiny"})
# A preset's name prefix -> its tiny preset of the same family (a mixture of experts stays one).
PRESET_FAMILY_TINY = {"llama": "llama-tiny", "gpt2": "gpt2-tiny", "qwen3": "qwen3-moe-tiny",
                      "mixtral": "mixtral-tiny", "deepseek": "deepseek-moe-tiny"}
EXPERT_HP = "expert_parallel_degree"
PROGRAM_PRECISION = "bf16"  # training_jobs/contract/hyperparameters.py: mixed_precision's default
# Measured on a 2-core AMD EPYC with AVX2 (torch 2.13): 512x512 matmuls at 1.7 GFLOP/s in bf16, 85 in fp32.
BF16_PROBE = "import torch; print(torch.ops.mkldnn._is_mkldnn_bf16_supported())"
NO_BF16_REASON = ("this CPU has no bf16 matmul instructions (AVX-512 or AMX), so torch runs bf16 matmuls "
                  "about 50x slower than fp32")


class LocalRunError(LlmtrainError):
    """The request cannot run on this machine as asked; the message says what to change."""


@dataclass(frozen=True)
class LocalLimits:
    """How much of the cloud job this machine takes on. Values above these are scaled down."""

    max_hosts: int = 2
    max_processes_per_host: int = 2
    max_seq_len: int = 256
    max_micro_batch_size: int = 4
    max_steps: int = 50
    max_eval_steps: int = 5
    # Whether torch has bf16 matmul kernels on this CPU; None: ask torch (cpu_has_bf16_matmuls).
    bf16_matmuls: bool | None = None


@dataclass(frozen=True)
class Adjustment:
    """One setting that differs from the cloud request, and why."""

    setting: str
    cloud: str
    local: str
    reason: str

    def describe(self) -> str:
        return f"{self.setting}: {self.cloud} -> {self.local} ({self.reason})"

    def to_dict(self) -> dict[str, str]:
        return {"Setting": self.setting, "Cloud": self.cloud, "Local": self.local, "Reason": self.reason}


@dataclass(frozen=True)
class LocalChannel:
    name: str
    # The entry of inputdataconfig.json, as SageMaker writes it from the request's channel.
    config: Mapping[str, str]
    sharded: bool


@dataclass(frozen=True)
class LocalJob:
    job_name: str
    hosts: tuple[str, ...]
    processes_per_host: int
    instance_type: str
    # hyperparameters.json: the request's JSON-encoded strings, with the local adjustments applied.
    hyperparameters: Mapping[str, str]
    channels: tuple[LocalChannel, ...]
    metric_definitions: tuple[MetricDefinition, ...]
    max_runtime_seconds: int | None
    # Where the container's checkpoint folder sits, relative to the job root; None without checkpoints.
    checkpoint_subpath: str | None
    environment: Mapping[str, str]
    adjustments: tuple[Adjustment, ...]
    notes: tuple[str, ...] = field(default=())
    # Where the container's TensorBoard folder sits, relative to the job root; None without
    # TensorBoardOutputConfig.
    tensorboard_subpath: str | None = None

    @property
    def world_size(self) -> int:
        return len(self.hosts) * self.processes_per_host

    def hyperparameter(self, name: str, default: Any = None) -> Any:
        """A hyperparameter's decoded value (the toolkit JSON-decodes them the same way)."""
        raw = self.hyperparameters.get(name)
        return default if raw is None else _decode(raw)


def local_job(
    request: Mapping[str, Any],
    *,
    limits: LocalLimits = LocalLimits(),
    user_settings: frozenset[str] = frozenset(),
) -> LocalJob:
    """The local version of `request`. `user_settings` are hyperparameters the user set on the command
    line: they are kept as given even above the local limits (with a note), never scaled down."""
    hps = {str(k): str(v) for k, v in request.get("HyperParameters", {}).items()}
    adjustments: list[Adjustment] = []
    notes: list[str] = []
    resource = request.get("ResourceConfig", {})
    if "InstanceGroups" in resource:
        raise LocalRunError(
            "ResourceConfig.InstanceGroups (heterogeneous clusters) is not emulated locally; "
            "use a template with one instance type"
        )
    cloud_type = resource["InstanceType"]
    cloud_hosts = int(resource.get("InstanceCount", 1))
    hosts = _plan_hosts(cloud_hosts, limits, adjustments)
    processes, cloud_processes = _plan_processes(cloud_type, hps, limits, adjustments)
    adjustments.insert(0, Adjustment(
        "ResourceConfig.InstanceType", _describe_instance(cloud_type), "local (this machine's CPU, gloo)",
        "local runs train on CPU",
    ))
    _rescale_degrees(hps, processes, len(hosts) * processes, adjustments)
    _rescale_expert_degree(hps, len(hosts) * processes, adjustments)
    cloud_hps = dict(hps)
    _scale_hyperparameters(hps, limits, user_settings, adjustments, notes)
    notes.extend(schedule_notes(cloud_hps, hps, cloud_world=cloud_hosts * cloud_processes,
                                local_world=len(hosts) * processes))
    _check_runnable(request, hps)
    notes.extend(_ignored_settings(request))
    return LocalJob(
        job_name=request["TrainingJobName"],
        hosts=hosts,
        processes_per_host=processes,
        instance_type=cloud_type,
        hyperparameters=hps,
        channels=_plan_channels(request),
        metric_definitions=MetricDefinition.from_request(request),
        max_runtime_seconds=request.get("StoppingCondition", {}).get("MaxRuntimeInSeconds"),
        checkpoint_subpath=_container_subpath(request, "CheckpointConfig", DEFAULT_CHECKPOINT_PATH),
        environment=dict(request.get("Environment", {})),
        adjustments=tuple(adjustments),
        notes=tuple(notes),
        tensorboard_subpath=_container_subpath(request, "TensorBoardOutputConfig",
                                               DEFAULT_TENSORBOARD_PATH),
    )


def _decode(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _set_hp(hps: dict[str, str], name: str, value: Any) -> None:
    hps[name] = json.dumps(value)


def _describe_instance(name: str) -> str:
    known = INSTANCE_TYPES.get(name)
    if known is None or known.gpus == 0:
        return name
    return f"{name} ({known.gpus} GPU{'s' if known.gpus > 1 else ''})"


def _plan_hosts(count: int, limits: LocalLimits, adjustments: list[Adjustment]) -> tuple[str, ...]:
    local = min(count, limits.max_hosts)
    if local != count:
        adjustments.append(Adjustment(
            "ResourceConfig.InstanceCount", str(count), str(local),
            f"at most {limits.max_hosts} emulated hosts run on this machine",
        ))
    # SageMaker names the hosts of a training cluster algo-1, algo-2, ...
    return tuple(f"algo-{i}" for i in range(1, local + 1))


def _plan_processes(
    instance_type: str, hps: dict[str, str], limits: LocalLimits, adjustments: list[Adjustment]
) -> tuple[int, int]:
    """Processes per host here, and in the cloud."""
    explicit = hps.get(PROCESSES_PER_HOST_HP)
    if explicit is not None:
        cloud = int(_decode(explicit))
    elif instance_type in INSTANCE_TYPES:
        cloud = INSTANCE_TYPES[instance_type].processes_per_host
    else:
        cloud = 1
    local = max(1, min(cloud, limits.max_processes_per_host))
    if local != cloud:
        adjustments.append(Adjustment(
            "processes per host", f"{cloud} (one per GPU)", str(local),
            f"at most {limits.max_processes_per_host} CPU processes per emulated host",
        ))
    if local > 1 or explicit is not None:
        # The toolkit starts one process per GPU and 1 on a CPU host unless told otherwise.
        _set_hp(hps, PROCESSES_PER_HOST_HP, local)
    return local, cloud


def _rescale_degrees(hps: dict[str, str], processes: int, world: int, adjustments: list[Adjustment]) -> None:
    """Keep the device-mesh degrees consistent with the smaller local world size."""
    present = {name: int(_decode(hps[name])) for name in DEGREE_HPS if name in hps}
    if not present or _degrees_fit(present, world):
        return
    wanted = dict(present)
    if wanted.get("tensor_parallel_degree", 1) > 1:
        # Tensor parallelism stays within a host.
        wanted["tensor_parallel_degree"] = math.gcd(wanted["tensor_parallel_degree"], processes)
    for name in ("replicate_degree", "shard_degree"):
        if wanted.get(name, 0) > 1:
            wanted[name] = 0  # derived by the training program from the world size and hosts
    if wanted.get("pipeline_parallel_degree", 1) > 1:
        # The scaled-down model is too shallow for the cloud's stages: the local ranks train it
        # without a pipeline (the stages' own runs are in tests/training/test_pipeline.py).
        wanted["pipeline_parallel_degree"] = 1
    for name, value in wanted.items():
        if value != present[name]:
            _set_hp(hps, name, value)
            adjustments.append(Adjustment(
                f"HyperParameters.{name}", str(present[name]), str(value),
                f"the degrees must multiply to the local world size {world} (0 = derived)",
            ))


def _rescale_expert_degree(hps: dict[str, str], world: int, adjustments: list[Adjustment]) -> None:
    """Expert parallel borrows its ranks from the shard ranks: at most the local world size."""
    degree = int(_decode(hps[EXPERT_HP])) if EXPERT_HP in hps else 1
    if degree <= 1 or world % degree == 0:
        return
    local = math.gcd(degree, world)
    _set_hp(hps, EXPERT_HP, local)
    adjustments.append(Adjustment(f"HyperParameters.{EXPERT_HP}", str(degree), str(local),
                                  f"expert parallel splits the local world size {world}'s shard ranks"))


def _degrees_fit(degrees: Mapping[str, int], world: int) -> bool:
    fixed = math.prod(d for d in degrees.values() if d > 0)
    derived = any(d == 0 for d in degrees.values())
    return world % fixed == 0 if derived else fixed == world


def _scale_hyperparameters(
    hps: dict[str, str],
    limits: LocalLimits,
    user_settings: frozenset[str],
    adjustments: list[Adjustment],
    notes: list[str],
) -> None:
    wanted: dict[str, tuple[Any, str]] = {}
    preset = _decode(hps["model_preset"]) if "model_preset" in hps else None
    if isinstance(preset, str) and preset not in LOCAL_PRESETS:
        tiny = PRESET_FAMILY_TINY.get(preset.split("-")[0])
        if tiny:
            wanted["model_preset"] = (tiny, "a model this size does not train on a few CPU cores")
    caps = {
        "seq_len": (limits.max_seq_len, "shorter samples keep CPU steps short"),
        "micro_batch_size": (limits.max_micro_batch_size, "smaller batches keep CPU steps short"),
        "max_steps": (limits.max_steps, "a local run is a short smoke run; --set max_steps=N for more"),
    }
    for name, (cap, reason) in caps.items():
        value = _decode(hps[name]) if name in hps else None
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            wanted[name] = (cap, reason)
    wanted.update(_local_precision(hps, limits))
    if _decode(hps.get("quantization", '""')) == "nf4":
        wanted["quantization"] = ("none", "a local smoke run trains plain LoRA; 4-bit QLoRA quantizes "
                                          "the model channel's checkpoint on bitsandbytes' slow CPU path")
    cloud_max_steps = _int_hp(hps, "max_steps")
    _apply(hps, wanted, user_settings, adjustments, notes)
    local_scaled_steps = "max_steps" in wanted and "max_steps" not in user_settings
    _apply(hps, _fit_schedule(hps, limits, cloud_max_steps, local_scaled_steps), user_settings, adjustments,
           notes)


def _local_precision(hps: dict[str, str], limits: LocalLimits) -> dict[str, tuple[Any, str]]:
    """fp16 needs a GPU; bf16 needs a CPU with bf16 matmul kernels (FP8 runs keep it: they need it)."""
    precision = _decode(hps.get("mixed_precision", json.dumps(PROGRAM_PRECISION)))
    if precision not in ("bf16", "fp16") or _decode(hps.get("fp8", "false")) is True:
        return {}
    native = limits.bf16_matmuls if limits.bf16_matmuls is not None else cpu_has_bf16_matmuls()
    if native and precision == "fp16":
        return {"mixed_precision": ("bf16", "fp16 needs a GPU; CPUs train in bf16")}
    if native:
        return {}
    hps.setdefault("mixed_precision", json.dumps(precision))  # shown as the cloud value
    return {"mixed_precision": ("fp32", NO_BF16_REASON)}


@functools.cache
def cpu_has_bf16_matmuls() -> bool:
    """Whether torch multiplies bf16 matrices with oneDNN's kernels on this CPU (x86: AVX-512 or AMX;
    Arm: its BF16 extension), as it decides itself. Without them it falls back to a scalar loop.
    Asked of the interpreter that runs the local job (llmtrain itself never imports torch), once per
    interpreter, torch version and CPU: the answer is kept in the user's cache (importing torch to
    ask takes seconds)."""
    key = content_key([], os.path.realpath(sys.executable), installed_version("torch"), _cpu_flags())
    return bool(cached_json("machine", f"bf16-matmuls-{key}", _ask_torch_for_bf16_matmuls))


def _ask_torch_for_bf16_matmuls() -> bool:
    try:
        probe = subprocess.run([sys.executable, "-c", BF16_PROBE], capture_output=True, text=True,
                               timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return True
    return probe.stdout.strip() != "False"  # no torch here: the job says so, in the template's precision


def _cpu_flags() -> str:
    """The CPU's model and feature flags (Linux), else what the platform module says."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":", 1)[0].strip() in wanted}))


def _int_hp(hps: Mapping[str, str], name: str) -> int | None:
    value = _decode(hps[name]) if name in hps else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _fit_schedule(hps: Mapping[str, str], limits: LocalLimits, cloud_max_steps: int | None,
                  local_scaled_steps: bool) -> dict[str, tuple[Any, str]]:
    """Step counts sized for a long cloud run, shrunk to the (shorter) local max_steps."""
    max_steps = _int_hp(hps, "max_steps")
    if max_steps is None or max_steps < 1:
        return {}
    caps = {
        "warmup_steps": (max(1, max_steps // 10),
                         "a warm-up longer than the run keeps the learning rate near 0"),
        "log_every_steps": (max(1, max_steps // 20), "log often enough to show a short run's progress"),
        "eval_steps": (limits.max_eval_steps, "a few validation batches keep evaluation short"),
    }
    if local_scaled_steps:  # the user's own max_steps keeps the template's schedule (schedule_notes)
        caps["lr_decay_steps"] = (max_steps, "the learning rate decays over the local run as it would "
                                             "over the cloud run")
    wanted = {name: (cap, reason) for name, (cap, reason) in caps.items()
              if (_int_hp(hps, name) or 0) > cap}
    eval_every = _int_hp(hps, "eval_every_steps") or 0
    if eval_every > max_steps:  # else the local run would never evaluate
        scaled = max(1, min(max_steps, eval_every * max_steps // (cloud_max_steps or max_steps)))
        wanted["eval_every_steps"] = (scaled, "so that the local run evaluates: as often as the cloud run, "
                                              "relative to its length, and at least at its end")
    return wanted


def schedule_notes(cloud_hps: Mapping[str, str], local_hps: Mapping[str, str], *, cloud_world: int,
                   local_world: int) -> list[str]:
    """What the local run's learning rate does differently from the cloud run's, and how to align it."""
    notes = [_global_batch_lr_note(cloud_hps, local_hps, cloud_world, local_world), _decay_note(local_hps)]
    return [note for note in notes if note]


def _decay_note(hps: Mapping[str, str]) -> str | None:
    """A max_steps below lr_decay_steps (a run trained in stages) stops before the decay ends."""
    max_steps, decay = _int_hp(hps, "max_steps"), _int_hp(hps, "lr_decay_steps")
    constant = _decode(hps.get("lr_schedule", '""')) == "constant"
    if not max_steps or not decay or decay <= max_steps or constant:
        return None
    warmup = _int_hp(hps, "warmup_steps") or 0
    progress = max(0.0, min(1.0, (max_steps - warmup) / max(1, decay - warmup)))
    return (f"lr_decay_steps={decay} is longer than max_steps={max_steps}: the run ends "
            f"{100 * progress:.0f}% of the way through the learning-rate decay, far above min_lr; "
            f"--set lr_decay_steps={max_steps} decays it fully within this run")


def _global_batch(hps: Mapping[str, str], world: int) -> int:
    return (_int_hp(hps, "micro_batch_size") or 1) * (_int_hp(hps, "grad_accum_steps") or 1) * world


def _global_batch_lr_note(cloud_hps: Mapping[str, str], local_hps: Mapping[str, str], cloud_world: int,
                          local_world: int) -> str | None:
    """scale_lr_by_global_batch: lr is per 256 samples, so a smaller local batch trains slower."""
    if _decode(local_hps.get("scale_lr_by_global_batch", "false")) is not True or "lr" not in local_hps:
        return None
    lr = float(_decode(local_hps["lr"]))
    cloud_batch, local_batch = _global_batch(cloud_hps, cloud_world), _global_batch(local_hps, local_world)
    if cloud_batch == local_batch:
        return None
    ratio = cloud_batch / local_batch
    return (f"scale_lr_by_global_batch: the peak learning rate is lr x global batch / 256 = "
            f"{lr * cloud_batch / 256:.3g} in the cloud ({cloud_batch} samples per step) but "
            f"{lr * local_batch / 256:.3g} here ({local_batch} samples per step, {ratio:.3g}x fewer), so "
            f"this run learns far slower; --set lr={lr * ratio:.3g} trains at the cloud's peak rate")


def _apply(
    hps: dict[str, str],
    wanted: Mapping[str, tuple[Any, str]],
    user_settings: frozenset[str],
    adjustments: list[Adjustment],
    notes: list[str],
) -> None:
    for name, (value, reason) in wanted.items():
        if name in user_settings:
            notes.append(f"{name}={_decode(hps[name])} is kept as you set it (local runs would use {value})")
            continue
        adjustments.append(Adjustment(f"HyperParameters.{name}", str(_decode(hps[name])), str(value), reason))
        _set_hp(hps, name, value)


def _check_runnable(request: Mapping[str, Any], hps: Mapping[str, str]) -> None:
    if _decode(hps.get("parallelism", '""')) == "smp" or "mp_parameters" in hps:
        raise LocalRunError(
            "this template uses SageMaker model parallelism (SMP v2), which exists only inside the "
            "SMP-enabled SageMaker container; run an fsdp, ddp or deepspeed template locally instead"
        )
    spec = request.get("AlgorithmSpecification", {})
    if spec.get("ContainerEntrypoint"):
        raise LocalRunError(
            "AlgorithmSpecification.ContainerEntrypoint replaces the training toolkit; local runs "
            "emulate the SageMaker PyTorch container, so use a template without it"
        )
    if spec.get("TrainingInputMode", "File") == "Pipe":
        raise LocalRunError("TrainingInputMode Pipe is not emulated locally; use File or FastFile")
    if SUBMIT_DIRECTORY_HP not in hps or "sagemaker_program" not in hps:
        raise LocalRunError(
            "the request lacks sagemaker_program/sagemaker_submit_directory hyperparameters, "
            "so the PyTorch container would not know what to run"
        )


def _plan_channels(request: Mapping[str, Any]) -> tuple[LocalChannel, ...]:
    default_mode = request.get("AlgorithmSpecification", {}).get("TrainingInputMode", "File")
    channels = []
    for item in request.get("InputDataConfig", []):
        s3 = item.get("DataSource", {}).get("S3DataSource", {})
        distribution = s3.get("S3DataDistributionType", "FullyReplicated")
        config = {
            "TrainingInputMode": item.get("InputMode", default_mode),
            "S3DistributionType": distribution,
            "RecordWrapperType": item.get("RecordWrapperType", "None"),
        }
        if "ContentType" in item:
            config["ContentType"] = item["ContentType"]
        channels.append(LocalChannel(item["ChannelName"], config, distribution == "ShardedByS3Key"))
    return tuple(channels)


def _container_subpath(request: Mapping[str, Any], setting: str, default: str) -> str | None:
    """The job-root-relative path of a synced container folder (checkpoints, TensorBoard)."""
    config = request.get(setting)
    if not config:
        return None
    local_path = config.get("LocalPath", default).rstrip("/")
    if not local_path.startswith(CONTAINER_ROOT):
        raise LocalRunError(
            f"{setting}.LocalPath {local_path!r} is outside /opt/ml; local runs can only map "
            "container paths under /opt/ml into the job root"
        )
    return local_path[len(CONTAINER_ROOT):]


def _ignored_settings(request: Mapping[str, Any]) -> list[str]:
    ignored = {
        "EnableManagedSpotTraining": "spot capacity",
        "RetryStrategy": "SageMaker's retries",
        "VpcConfig": "the VPC",
        "EnableInterContainerTrafficEncryption": "inter-container encryption",
    }
    found = [what for key, what in ignored.items() if request.get(key)]
    if request.get("ResourceConfig", {}).get("KeepAlivePeriodInSeconds"):
        found.append("the warm pool")
    if not found:
        return []
    return [f"not emulated locally (cloud only): {', '.join(found)}"]
