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

import json
from collections.abc import Mapping
from typing import Any

from llmtrain.core.distribution import LATER_DEGREES
from llmtrain.core.errors import (
    RequestValidationError,
    RunInputError,
    TeamLimitError,
)
from llmtrain.core.images import image_torch_problems, training_image_uri
from llmtrain.core.instances import instance_type as lookup_instance_type
from llmtrain.core.platform import PlatformContext
from llmtrain.core.program_contract import ProgramContract, installed_contract
from llmtrain.core.run_settings import MAX_ATTEMPTS, JobSettings, RunInput, resolve_settings
from llmtrain.core.sourcedir import SOURCEDIR_NAME
from llmtrain.core.spec import (
    TemplateSpec,
)
from llmtrain.core.validate import (
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
        # Code frozen before a later degree existed refuses its name, so it is sent only when used.
        values.update({name: degree for name, degree in settings.degrees.items()
                       if name not in LATER_DEGREES or degree != 1})
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
