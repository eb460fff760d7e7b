"""Render a template version and a run's input into a complete CreateTrainingJob request.

`render(template, run_input, platform)` is one pure function (no AWS calls, no clock, no randomness):
the launcher's Lambda, `llmtrain render` and the local runner get the same dict for the same input.
It applies the run's overrides within the template's bounds, sets the framework hyperparameters
the SageMaker PyTorch container reads exactly as the SageMaker Python SDK 2.x does for the same job
(tests/llmtrain/test_sdk_equivalence.py compares them), and validates the result: SageMaker's rules,
the platform's, and, for the platform's training program, the program's own (its contract: every
hyperparameter's name, type and bounds, their combinations, the degrees and the global batch on the
cluster), so a run the program would refuse fails here, before any job exists.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmtrain.errors import (
    OverrideError,
    RequestValidationError,
    RunInputError,
    TeamLimitError,
    shown_value,
    where_set,
)
from llmtrain.images import image_torch_problems, training_image_uri
from llmtrain.instances import instance_type as lookup_instance_type
from llmtrain.jumpstart import (
    BaseModel,
    content_bucket,
    gated_content_bucket,
    is_jumpstart_reference,
    parse_reference,
)
from llmtrain.platform import PlatformContext
from llmtrain.program_contract import ProgramContract, installed_contract
from llmtrain.s3_uris import S3_SCHEME, S3Location, S3UriError, parse_s3_uri
from llmtrain.sourcedir import SOURCEDIR_NAME
from llmtrain.spec import (
    CHANNEL_SETTING_PREFIX,
    DEGREE_NAMES,
    PLATFORM_RUN_OPTIONS,
    RESOURCE_SETTINGS,
    OverrideRule,
    TemplateSpec,
)
from llmtrain.validate import (
    JOB_NAME_MAX,
    degree_problems,
    fp8_problems,
    model_archive_problems,
    quantization_problems,
    smddp_problems,
    validate_request,
)

CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"
# Where the training program writes TensorBoard events with tensorboard=true: SM_OUTPUT_DATA_DIR
# (/opt/ml/output/data in the container) + "/tensorboard" (training_jobs/trainer/metrics.py).
TENSORBOARD_LOCAL_PATH = "/opt/ml/output/data/tensorboard"
CONTAINER_LOG_LEVEL = 20  # logging.INFO: the SDK's default container_log_level
MAX_ATTEMPTS = 99
RUN_NAME_PATTERN = re.compile(r"[a-zA-Z0-9](-?[a-zA-Z0-9])*")
_TAG_VALUE = re.compile(r"[\w .:/=+\-@]{1,256}")
TAG_PREFIX = "llmtrain:"
# The training toolkit installs requirements.txt from this CodeArtifact repository when the variable
# is set (sagemaker_training.modules: CA_REPOSITORY_ARN).
CODEARTIFACT_ENV = "CA_REPOSITORY_ARN"
# Where the training program logs to MLflow (training_jobs/trainer/tracking.py reads the same names;
# the sagemaker-mlflow plugin resolves a tracking server ARN as the tracking URI).
MLFLOW_TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
MLFLOW_EXPERIMENT_ENV = "MLFLOW_EXPERIMENT_NAME"
MODEL_ARTIFACT_ENV = "LLMTRAIN_MODEL_ARTIFACT_URI"
# Where a construct-library deployment sets the environment's features (training plans, debugging).
_FEATURES_PROP = "TrainingLauncherProps.platform_features"
# How long a job may wait for its training plan's capacity when the run does not say.
DEFAULT_MAX_PENDING_SECONDS = 24 * 3600


@dataclass(frozen=True)
class RunInput:
    """One run of a template: its name, overrides, and which attempt of the run this is.

    `attempt` makes every attempt's job name unique; all attempts share the run's checkpoint
    prefix, so a retry resumes. `instance_type` is the launcher's capacity fallback choice.
    """

    run_name: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    attempt: int = 1
    instance_type: str | None = None
    owner: str = "unknown"
    # The run's JumpStart base model (`base_model=<model id>[@version]`), resolved in the
    # environment's region when the run starts (llmtrain.jumpstart): render reads no AWS.
    base_model: BaseModel | None = None

    def __post_init__(self) -> None:
        if isinstance(self.base_model, Mapping):
            object.__setattr__(self, "base_model", BaseModel.from_dict(self.base_model))
        if not isinstance(self.run_name, str) or not RUN_NAME_PATTERN.fullmatch(self.run_name):
            raise RunInputError(
                "run_name",
                f"{self.run_name!r} must be letters, digits and single dashes, "
                "starting and ending with a letter or digit",
            )
        if (
            isinstance(self.attempt, bool)
            or not isinstance(self.attempt, int)
            or not 1 <= self.attempt <= MAX_ATTEMPTS
        ):
            raise RunInputError("attempt", f"{self.attempt!r} must be an integer in 1..{MAX_ATTEMPTS}")
        if not isinstance(self.owner, str) or not _TAG_VALUE.fullmatch(self.owner):
            raise RunInputError(
                "owner", f"{self.owner!r} must be 1-256 letters, digits, spaces or _ . : / = + - @"
            )
        if not isinstance(self.overrides, Mapping):
            raise RunInputError("overrides", "must be a mapping of setting name to value")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunInput:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise RunInputError(unknown[0], f"is not a run input field; use {', '.join(sorted(names))}")
        if "run_name" not in data:
            raise RunInputError("run_name", "is required")
        return cls(**data)


@dataclass(frozen=True)
class JobSettings:
    """The template's settings after the run's overrides."""

    instance_type: str
    instance_count: int
    volume_size_gb: int
    max_runtime_seconds: int
    spot: bool
    max_wait_seconds: int | None
    keep_alive_seconds: int
    degrees: Mapping[str, int]
    hyperparameters: Mapping[str, Any]
    channels: Mapping[str, str]
    # Platform run options (spec.PLATFORM_RUN_OPTIONS).
    training_plan_arn: str | None = None
    max_pending_seconds: int | None = None
    remote_debug: bool = False
    # A JumpStart base model in the model channel, and whether the run accepts its EULA.
    base_model: BaseModel | None = None
    accept_eula: bool = False

    @property
    def world_size(self) -> int:
        return self.instance_count * lookup_instance_type(self.instance_type).processes_per_host


def code_key(template: TemplateSpec) -> str:
    """Where the JobTemplate construct uploads the template's code in the code bucket."""
    return f"templates/{template.name}/{template.version}/{SOURCEDIR_NAME}"


def code_uri(template: TemplateSpec, platform: PlatformContext) -> str:
    return f"s3://{platform.code_bucket}/{code_key(template)}"


def job_name(platform: PlatformContext, run: RunInput) -> str:
    return f"{platform.job_name_prefix}-{run.run_name}-a{run.attempt}"


def max_run_name_length(platform: PlatformContext) -> int:
    return JOB_NAME_MAX - len(f"{platform.job_name_prefix}--a{MAX_ATTEMPTS}")


def render(
    template: TemplateSpec,
    run_input: RunInput | Mapping[str, Any],
    platform: PlatformContext,
    program: ProgramContract | None = None,
) -> dict:
    """The complete CreateTrainingJob request; raises OverrideError, ProgramSettingError or
    RequestValidationError.

    `program` is the training program's contract of the code the version runs
    (`Catalog.program_contract`: a published version's frozen code has its own); None means the
    program installed beside llmtrain, right for a version whose code is not frozen."""
    run = run_input if isinstance(run_input, RunInput) else RunInput.from_dict(run_input)
    _check_run_name(run, platform)
    check_team_template(template.name, platform)
    settings = resolve_settings(template, run, platform)
    check_team_limits(settings, platform)
    problems = (
        quantization_problems(template.distribution.strategy, settings.hyperparameters, template.ref)
        + smddp_problems(template.distribution.smddp, settings.instance_type)
        + image_torch_problems(template)
    )
    if template.code.is_platform:
        problems += capability_problems(template, settings, program)
    else:
        # The platform's program checks its own degrees (check_program); a template's own script
        # gets the distribution only through SMP's mp_parameters.
        problems += degree_problems(settings.degrees, settings.world_size)
    if problems:
        raise RequestValidationError(problems)
    check_program(template, settings, program)
    request = build_request(template, settings, run, platform)
    validate_request(request, platform)
    return request


def capability_problems(
    template: TemplateSpec, settings: JobSettings, program: ProgramContract | None = None
) -> list[str]:
    """What the run asks of the training program that its code (`program`'s capability table) or
    its instances cannot do: FP8 on GPUs without it or without torchao, a JumpStart archive for code
    that reads only a folder. Nothing for a template that runs its own code."""
    if not template.code.is_platform:
        return []
    capabilities = (program or installed_contract()).capabilities
    return (fp8_problems(template.ref, settings.instance_type, settings.hyperparameters, capabilities,
                         template.image.framework_version)
            + model_archive_problems(template.ref, settings.base_model, capabilities))


def check_program(
    template: TemplateSpec, settings: JobSettings, program: ProgramContract | None = None
) -> None:
    """The training program's own rules on what the run sends it (ProgramSettingError with the
    program's message); nothing for a template that runs its own code."""
    if not template.code.is_platform:
        return
    values = program_hyperparameters(template, settings)
    if template.distribution.strategy == "smp":
        values["mp_parameters"] = smp_parameters(template, settings)
    # As SM_HPS holds them: the training toolkit decodes the JSON render encodes.
    decoded = {name: json.loads(json.dumps(value)) for name, value in values.items()}
    (program or installed_contract()).check(
        decoded, world_size=settings.world_size, num_hosts=settings.instance_count
    )


def _check_run_name(run: RunInput, platform: PlatformContext) -> None:
    longest = max_run_name_length(platform)
    if len(run.run_name) > longest:
        raise RunInputError(
            "run_name",
            f"{run.run_name!r} is {len(run.run_name)} characters; with the job-name prefix "
            f"'{platform.job_name_prefix}' and the attempt suffix it may be at most {longest}",
        )


def check_team_template(name: str, platform: PlatformContext) -> None:
    """Refuse a template the team may not run, naming the team's list."""
    if platform.allowed_templates and name not in platform.allowed_templates:
        raise TeamLimitError(
            platform.team,
            "templates",
            f"template {name!r} is not one of its templates "
            f"({', '.join(platform.allowed_templates)})",
        )


def check_team_limits(settings: JobSettings, platform: PlatformContext) -> None:
    """Refuse an instance type or count beyond the team's limits, naming the limit."""
    allowed = platform.allowed_instance_types
    if allowed and settings.instance_type not in allowed:
        raise TeamLimitError(
            platform.team,
            "instance_types",
            f"instance type {settings.instance_type} is not one of its instance types ({', '.join(allowed)})",
        )
    cap = platform.max_instance_count
    if cap is not None and settings.instance_count > cap:
        raise TeamLimitError(
            platform.team,
            "max_instance_count",
            f"instance_count {settings.instance_count} is above its cap of {cap} instances per job",
        )


# --- overrides ------------------------------------------------------------------------------------


def resolve_settings(template: TemplateSpec, run: RunInput, platform: PlatformContext) -> JobSettings:
    compute = template.compute
    values: dict[str, Any] = {
        "instance_type": compute.instance_type,
        "instance_count": compute.instance_count,
        "volume_size_gb": compute.volume_size_gb,
        "max_runtime_seconds": template.max_runtime_seconds,
        "spot": template.spot.enabled,
        "max_wait_seconds": template.spot.max_wait_seconds,
        "keep_alive_seconds": template.keep_alive_seconds,
    }
    degrees = {name: getattr(template.distribution, name) for name in DEGREE_NAMES}
    hyperparameters = dict(template.hyperparameters)
    channels = {name: prefix for name, prefix in template.inputs.channels.items()}
    options: dict[str, Any] = {}
    for setting, raw in run.overrides.items():
        value = coerce_override(template, setting, raw)
        if setting in PLATFORM_RUN_OPTIONS:
            options[setting] = value
        elif setting in RESOURCE_SETTINGS:
            values[setting] = value
        elif setting in DEGREE_NAMES:
            degrees[setting] = value
        elif setting.startswith(CHANNEL_SETTING_PREFIX):
            channels[setting[len(CHANNEL_SETTING_PREFIX) :]] = value
        else:
            hyperparameters[setting] = value
    if run.instance_type is not None:
        values["instance_type"] = _fallback_instance_type(template, run.instance_type)
    if not values["spot"]:
        if "max_wait_seconds" in run.overrides:
            raise OverrideError(
                "max_wait_seconds", "only applies to managed spot training; also set spot=true"
            )
        values["max_wait_seconds"] = None
    channels, base_model, accept_eula = _base_model_settings(template, run, options, channels, platform)
    uris = _channel_uris(channels, platform)
    if base_model is not None:
        uris["model"] = base_model.uri
    return JobSettings(
        **values,
        degrees=degrees,
        hyperparameters=hyperparameters,
        channels=uris,
        base_model=base_model,
        accept_eula=accept_eula,
        **_run_options(options, spot=values["spot"], platform=platform),
    )


def _base_model_settings(
    template: TemplateSpec, run: RunInput, options: Mapping[str, Any], channels: dict[str, str | None],
    platform: PlatformContext,
) -> tuple[dict[str, str | None], BaseModel | None, bool]:
    """The model channel a run's `base_model` gives: a folder in the team's datasets prefix as it is,
    or a JumpStart model's training weights (resolved at start), with its EULA accepted where it has
    one (`accept_eula=true`)."""
    value, accept = options.get("base_model"), bool(options.get("accept_eula", False))
    if value is None:
        if "accept_eula" in options:
            raise OverrideError("accept_eula", "applies to a JumpStart base model: also set "
                                               "base_model=<JumpStart model id>")
        return channels, None, False
    if "model" not in template.inputs.channels:
        raise OverrideError("base_model", f"{template.ref} trains from scratch: it has no model channel to "
                                          "start from (a fine-tuning template, such as llama-finetune-lora, "
                                          "has one)")
    if f"{CHANNEL_SETTING_PREFIX}model" in run.overrides:
        raise OverrideError("base_model", "and channels.model both name the model channel: set one of them")
    if not is_jumpstart_reference(value):
        if accept:
            raise OverrideError("accept_eula", "applies to a JumpStart base model, not to a folder of your "
                                               "own")
        return {**channels, "model": value}, None, False
    model_id, version = parse_reference(value)
    base = run.base_model
    if base is None or base.model_id != model_id or version not in (None, base.version):
        raise OverrideError("base_model", f"JumpStart model {value!r} is resolved in the environment's "
                                          "region when the run starts (`llmtrain start`, `llmtrain tune` and "
                                          "the launcher do it); to see its request, use "
                                          "`llmtrain start --dry-run`")
    buckets = (content_bucket(platform.region), gated_content_bucket(platform.region))
    if not any(base.uri.startswith(f"s3://{bucket}/") for bucket in buckets):
        raise OverrideError("base_model", f"{base.uri} is not in JumpStart's buckets of {platform.region}")
    if base.gated and not accept:
        raise OverrideError("accept_eula", f"{base.reference} is a gated model: read its end-user "
                                           f"license agreement at {base.eula_url} and set accept_eula=true "
                                           "to accept it")
    return channels, base, accept


def _run_options(options: Mapping[str, Any], *, spot: bool, platform: PlatformContext) -> dict[str, Any]:
    """The platform run options, checked against what the environment offers."""
    plan = options.get("training_plan")
    arn = None
    if plan is not None:
        arn = platform.training_plans.get(plan)
        if arn is None:
            lists = where_set(props=f"{_FEATURES_PROP}['training_plans']", config="training_plans")
            known = ", ".join(sorted(platform.training_plans)) or f"none (listed as {lists})"
            raise OverrideError(
                "training_plan", f"{plan!r} is not a training plan of environment "
                f"{platform.environment}; its plans: {known} (llmtrain plans --env ENV lists them)"
            )
        if spot:
            raise OverrideError("training_plan", "a training plan's capacity is reserved on-demand "
                                "capacity: turn spot off (spot=false) to run in a plan")
    pending = options.get("max_pending_seconds")
    if pending is not None and arn is None:
        raise OverrideError("max_pending_seconds", "only applies to a run in a training plan; also set "
                            "training_plan=NAME")
    remote_debug = bool(options.get("remote_debug", False))
    if remote_debug and not platform.remote_debug:
        allows = where_set(props=f"{_FEATURES_PROP}['remote_debug']", config="remote_debug.enabled")
        raise OverrideError(
            "remote_debug", f"environment {platform.environment} does not allow remote debugging: "
            f"its platform team turns it on ({allows}) and deploys"
        )
    return {
        "training_plan_arn": arn,
        "max_pending_seconds": (pending or DEFAULT_MAX_PENDING_SECONDS) if arn else None,
        "remote_debug": remote_debug,
    }


def coerce_override(template: TemplateSpec, setting: str, raw: Any) -> Any:
    """The override's value in its declared type and bounds (strings from the CLI are parsed)."""
    rule = template.overridable.get(setting) or PLATFORM_RUN_OPTIONS.get(setting)
    if rule is None:
        allowed = ", ".join(sorted([*template.overridable, *PLATFORM_RUN_OPTIONS]))
        raise OverrideError(setting, f"{template.ref} does not allow overriding it; it allows: {allowed}")
    value = _parse_typed(setting, raw, rule)
    _check_bounds(setting, value, rule)
    return value


def _parse_typed(setting: str, raw: Any, rule: OverrideRule) -> Any:
    kind = rule.type
    try:
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.lower() in ("true", "false"):
                return raw.lower() == "true"
        elif kind == "int" and not isinstance(raw, bool):
            if isinstance(raw, int) or (isinstance(raw, str) and re.fullmatch(r"[+-]?\d+", raw.strip())):
                return int(raw)
        elif kind == "float" and not isinstance(raw, bool):
            if isinstance(raw, int | float | str) and math.isfinite(float(raw)):
                return float(raw)
        elif isinstance(raw, str):
            if kind == "s3_uri":
                _s3_uri(setting, raw)
            return raw
    except (ValueError, OverflowError):  # OverflowError: an integer too large for a float
        pass
    raise OverrideError(setting, f"{shown_value(raw)} is not a valid {kind}; expected {rule.describe()}")


def _check_bounds(setting: str, value: Any, rule: OverrideRule) -> None:
    shown, allowed = shown_value(value), f"allowed: {rule.describe()}"
    if rule.min is not None and value < rule.min:
        raise OverrideError(setting, f"{shown} is below the minimum {rule.shown(rule.min)}; {allowed}")
    if rule.max is not None and value > rule.max:
        raise OverrideError(setting, f"{shown} is above the maximum {rule.shown(rule.max)}; {allowed}")
    if rule.choices is not None and value not in rule.choices:
        raise OverrideError(setting, f"{shown} is not allowed; {allowed}")


def _fallback_instance_type(template: TemplateSpec, chosen: str) -> str:
    allowed = (template.compute.instance_type, *template.retry.fallback_instance_types)
    if chosen not in allowed:
        raise OverrideError(
            "instance_type",
            f"capacity fallback {chosen!r} is not one of {template.ref}'s instance types: "
            f"{', '.join(allowed)}",
        )
    return chosen


def _channel_uris(channels: Mapping[str, str | None], platform: PlatformContext) -> dict[str, str]:
    """A template's prefixes resolve under the team's datasets prefix; a run's S3 URIs must lie inside
    it (the team's execution role reads nothing else); channels without a source are left out. Every
    URI is parsed (llmtrain.s3_uris): one whose key could mean another prefix is refused."""
    datasets = parse_s3_uri(platform.datasets_uri)
    uris = {}
    for name, source in channels.items():
        if source is None:
            continue
        setting = f"{CHANNEL_SETTING_PREFIX}{name}"
        location = _s3_uri(setting, source if source.startswith(S3_SCHEME) else datasets.uri + source)
        if not location.within(datasets):
            raise OverrideError(
                setting,
                f"{location.uri!r} is outside team {platform.team!r}'s datasets prefix; "
                f"its channels may read only under {datasets.uri}",
            )
        uris[name] = location.uri
    return uris


def _s3_uri(setting: str, text: str) -> S3Location:
    try:
        return parse_s3_uri(text)
    except S3UriError as error:
        raise OverrideError(setting, str(error)) from None


# --- the request ----------------------------------------------------------------------------------


def build_request(
    template: TemplateSpec, settings: JobSettings, run: RunInput, platform: PlatformContext
) -> dict:
    name = job_name(platform, run)
    request: dict[str, Any] = {
        "TrainingJobName": name,
        "RoleArn": platform.execution_role_arn,
        "AlgorithmSpecification": {
            "TrainingImage": image_uri(template, settings.instance_type, platform.region),
            "TrainingInputMode": template.inputs.mode,
            "MetricDefinitions": [{"Name": m.name, "Regex": m.regex} for m in template.metrics],
            "EnableSageMakerMetricsTimeSeries": True,
        },
        "HyperParameters": hyperparameters(template, settings, name, platform),
        "InputDataConfig": [
            _channel(channel, uri, template.inputs.mode,
                     accept_eula=settings.accept_eula and channel == "model")
            for channel, uri in settings.channels.items()
        ],
        "OutputDataConfig": {
            "S3OutputPath": run_prefix_uri(platform.artifacts_bucket, template, run, platform),
            "KmsKeyId": platform.kms_key_arn,
        },
        "ResourceConfig": _resource_config(settings, platform),
        "VpcConfig": {
            "SecurityGroupIds": list(platform.security_group_ids),
            "Subnets": list(platform.subnet_ids),
        },
        "StoppingCondition": _stopping_condition(settings),
        "EnableNetworkIsolation": False,
        # An environment that asks for it encrypts every job's inter-node traffic, whatever the template says.
        "EnableInterContainerTrafficEncryption": (
            template.inter_container_encryption or platform.inter_container_traffic_encryption
        ),
        "EnableManagedSpotTraining": settings.spot,
        "RetryStrategy": {"MaximumRetryAttempts": template.retry.internal_error_attempts},
        # SageMaker Debugger's system profiler stays off: the training program profiles itself.
        "ProfilerConfig": {"DisableProfiler": True},
        # Always present (also when off), so a run's choice never changes the request's layout.
        "RemoteDebugConfig": {"EnableRemoteDebug": settings.remote_debug},
        "Environment": container_environment(template, run, platform),
        "Tags": _tags(template, run, platform),
    }
    if template.infra_check:
        request["InfraCheckConfig"] = {"EnableInfraCheck": True}
    if platform.mlflow_tracking_server_arn is not None:
        request["MlflowConfig"] = {
            "MlflowResourceArn": platform.mlflow_tracking_server_arn,
            "MlflowExperimentName": mlflow_experiment_name(template.name, platform.team),
            "MlflowRunName": name,
        }
    if settings.hyperparameters.get("tensorboard") is True:
        # SageMaker uploads the events while the job runs, so TensorBoard follows it live; every
        # attempt of a run writes to the same prefix, so a resumed run continues the same curves.
        request["TensorBoardOutputConfig"] = {
            "LocalPath": TENSORBOARD_LOCAL_PATH,
            "S3OutputPath": tensorboard_uri(template, run, platform),
        }
    if template.checkpoints:
        request["CheckpointConfig"] = {
            # One prefix per run, shared by all its attempts, so a retried job resumes.
            "S3Uri": run_prefix_uri(platform.checkpoints_bucket, template, run, platform),
            "LocalPath": CHECKPOINT_LOCAL_PATH,
        }
    return request


def run_prefix_uri(bucket: str, template: TemplateSpec, run: RunInput, platform: PlatformContext) -> str:
    """A run's prefix in one of the team's buckets: `s3://<bucket>/teams/<team>/<template>/<run>/`,
    shared by every attempt of the run (checkpoints resume, artifacts and events sit together)."""
    return f"s3://{bucket}/{platform.data_prefix}{template.name}/{run.run_name}/"


def container_environment(template: TemplateSpec, run: RunInput, platform: PlatformContext) -> dict[str, str]:
    """The container's environment: where pip finds packages, and where the program logs to MLflow
    (with where SageMaker will put the job's model.tar.gz, which the program records there)."""
    environment = {}
    if platform.package_repository_arn is not None:
        environment[CODEARTIFACT_ENV] = platform.package_repository_arn
    if platform.mlflow_tracking_server_arn is not None:
        environment[MLFLOW_TRACKING_URI_ENV] = platform.mlflow_tracking_server_arn
        environment[MLFLOW_EXPERIMENT_ENV] = mlflow_experiment_name(template.name, platform.team)
        environment[MODEL_ARTIFACT_ENV] = model_artifact_uri(template, run, platform)
    return environment


def mlflow_experiment_name(template_name: str, team: str) -> str:
    """One MLflow experiment per team and template (`<team>-<template>`), on the environment's one
    tracking server: a team's runs of a template sit together, apart from other teams' runs."""
    return f"{team}-{template_name}"


def model_artifact_uri(template: TemplateSpec, run: RunInput, platform: PlatformContext) -> str:
    """Where SageMaker uploads the job's model.tar.gz: `<S3OutputPath><job name>/output/model.tar.gz`."""
    output = run_prefix_uri(platform.artifacts_bucket, template, run, platform)
    return f"{output}{job_name(platform, run)}/output/model.tar.gz"


def tensorboard_uri(template: TemplateSpec, run: RunInput, platform: PlatformContext) -> str:
    """Where a run's TensorBoard events are synced (beside its model artifacts)."""
    return run_prefix_uri(platform.artifacts_bucket, template, run, platform) + "tensorboard/"


def image_uri(template: TemplateSpec, instance_type_name: str, region: str) -> str:
    if template.image.uri is not None:
        return template.image.uri
    return training_image_uri(
        framework_version=template.image.framework_version,
        py_version=template.image.py_version,
        region=region,
        instance_type_name=instance_type_name,
        smp=template.distribution.strategy == "smp",
    )


def hyperparameters(
    template: TemplateSpec, settings: JobSettings, name: str, platform: PlatformContext
) -> dict:
    """Run hyperparameters plus framework ones, each JSON-encoded as the SageMaker SDK does."""
    values = program_hyperparameters(template, settings)
    values.update(framework_hyperparameters(template, settings, name, platform))
    return {key: json.dumps(value) for key, value in values.items()}


def program_hyperparameters(template: TemplateSpec, settings: JobSettings) -> dict[str, Any]:
    """The run's hyperparameters, and for the platform's program the distribution's: parallelism,
    the degrees and the collective backend (SMP's mp_parameters come with the framework's)."""
    values = dict(settings.hyperparameters)
    if template.code.is_platform:
        values["parallelism"] = template.distribution.strategy
        # Code frozen before pipeline stages existed refuses the name, so it is sent only when used.
        values.update({name: degree for name, degree in settings.degrees.items()
                       if name != "pipeline_parallel_degree" or degree != 1})
        if template.distribution.smddp:
            values["collective_backend"] = "smddp"
    return values


def framework_hyperparameters(
    template: TemplateSpec, settings: JobSettings, name: str, platform: PlatformContext
) -> dict[str, Any]:
    """What the SageMaker PyTorch container reads: script mode, torchrun launch, SMP parameters."""
    framework: dict[str, Any] = {
        "sagemaker_program": template.code.entry_point,
        "sagemaker_submit_directory": code_uri(template, platform),
        "sagemaker_container_log_level": CONTAINER_LOG_LEVEL,
        "sagemaker_job_name": name,
        "sagemaker_region": platform.region,
    }
    if template.distribution.strategy == "smp":
        framework["mp_parameters"] = smp_parameters(template, settings)
        framework["sagemaker_distributed_dataparallel_enabled"] = False
    elif template.distribution.smddp:
        # The SDK's distribution={"torch_distributed": ..., "smdistributed": {"dataparallel": ...}}:
        # torchrun launches (it wins over the mpirun launcher in the PyTorch container's toolkit),
        # and the program initialises the smddp process-group backend.
        framework["sagemaker_distributed_dataparallel_enabled"] = True
        framework["sagemaker_distributed_dataparallel_custom_mpi_options"] = ""
    framework["sagemaker_torch_distributed_enabled"] = True
    # The toolkit turns EFA on (FI_PROVIDER=efa) for torchrun by this instance type.
    framework["sagemaker_instance_type"] = settings.instance_type
    return framework


def smp_parameters(template: TemplateSpec, settings: JobSettings) -> dict[str, Any]:
    """SMP v2's `mp_parameters`: degrees from the distribution, offloading from the hyperparameter."""
    parameters: dict[str, Any] = {
        "hybrid_shard_degree": settings.degrees["shard_degree"],
        "tensor_parallel_degree": settings.degrees["tensor_parallel_degree"],
    }
    if "activation_offloading" in settings.hyperparameters:
        parameters["sm_activation_offloading"] = bool(settings.hyperparameters["activation_offloading"])
    parameters.update(template.distribution.smp_parameters)
    return parameters


def _channel(name: str, uri: str, mode: str, *, accept_eula: bool = False) -> dict[str, Any]:
    channel = {
        "ChannelName": name,
        "DataSource": {
            "S3DataSource": {
                "S3DataType": "S3Prefix",
                "S3Uri": uri,
                # Every node reads the whole channel; the training program shards by rank itself.
                "S3DataDistributionType": "FullyReplicated",
            }
        },
        "InputMode": mode,
        "CompressionType": "None",
    }
    if accept_eula:
        # SageMaker reads a gated JumpStart model's weights only for a channel that accepts its EULA.
        channel["DataSource"]["S3DataSource"]["ModelAccessConfig"] = {"AcceptEula": True}
    return channel


def _resource_config(settings: JobSettings, platform: PlatformContext) -> dict[str, Any]:
    resources: dict[str, Any] = {
        "InstanceType": settings.instance_type,
        "InstanceCount": settings.instance_count,
        "VolumeSizeInGB": settings.volume_size_gb,
        "KeepAlivePeriodInSeconds": settings.keep_alive_seconds,
    }
    if settings.training_plan_arn is not None:
        resources["TrainingPlanArn"] = settings.training_plan_arn
    # Instance storage is encrypted by the instance itself; SageMaker rejects a key for it.
    if lookup_instance_type(settings.instance_type).local_storage_gb is None:
        resources["VolumeKmsKeyId"] = platform.kms_key_arn
    return resources


def _stopping_condition(settings: JobSettings) -> dict[str, int]:
    stopping = {"MaxRuntimeInSeconds": settings.max_runtime_seconds}
    if settings.spot:
        stopping["MaxWaitTimeInSeconds"] = settings.max_wait_seconds
    if settings.max_pending_seconds is not None:
        # A job in a training plan waits (Pending) for the plan's capacity, at most this long.
        stopping["MaxPendingTimeInSeconds"] = settings.max_pending_seconds
    return stopping


def _tags(template: TemplateSpec, run: RunInput, platform: PlatformContext) -> list[dict[str, str]]:
    values = {
        "template": template.name,
        "template-version": template.version,
        "run": run.run_name,
        "attempt": str(run.attempt),
        "owner": run.owner,
        "environment": platform.environment,
        # The team's job-creating role may create only jobs carrying its team's tag (IAM).
        "team": platform.team,
    }
    return [{"Key": TAG_PREFIX + key, "Value": value} for key, value in values.items()]
