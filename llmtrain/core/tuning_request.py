"""The SageMaker tuning job of a tune (CreateHyperParameterTuningJob), built from the rendered
CreateTrainingJob request of the run, so the tuning job's trials get exactly what a run gets: the team's
role, prefixes, instance type, VPC, KMS keys and inter-container encryption. Its static
hyperparameters are the request's minus the tuned ones; SageMaker passes tuned values as plain strings.
Pure functions: no AWS calls. The tune itself (ranges, objective, checks) is llmtrain.core.tuning.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from llmtrain.core.errors import (
    RequestValidationError,
)
from llmtrain.core.platform import PlatformContext

# `--strategy` -> SageMaker's HyperParameterTuningJobConfig.Strategy.
from llmtrain.core.tuning import (
    MAX_TUNE_ATTEMPTS,
    SEARCH_STRATEGIES,
    TuneError,
    TuneSpec,
    is_evaluation_metric,
    objective_reports,
)
from llmtrain.core.validate import input_problems, job_name_problems

# SageMaker's limit of a tuning job's name.
TUNING_JOB_NAME_MAX = 32
# Hyperband counts resources in reports of the objective metric; SageMaker's maximum.
HYPERBAND_MAX_RESOURCE = 20000
TUNING_OPERATION = "CreateHyperParameterTuningJob"
# What a tuning job's training job definition takes from a CreateTrainingJob request, as is.
# CheckpointConfig is left out on purpose: every trial of a tuning job gets the same definition, so
# trials would share one checkpoint prefix and resume from each other's checkpoints. Warm pools
# (KeepAlivePeriodInSeconds) are not for tuning jobs.
_DEFINITION_FIELDS = (
    "RoleArn",
    "InputDataConfig",
    "VpcConfig",
    "OutputDataConfig",
    "StoppingCondition",
    "EnableNetworkIsolation",
    "EnableInterContainerTrafficEncryption",
    "EnableManagedSpotTraining",
    "RetryStrategy",
    "Environment",
)
_ALGORITHM_FIELDS = ("TrainingImage", "TrainingInputMode", "MetricDefinitions")
_RESOURCE_FIELDS = ("InstanceType", "InstanceCount", "VolumeSizeInGB", "VolumeKmsKeyId")


def tuning_job_name(platform: PlatformContext, run_name: str, attempt: int = 1) -> str:
    """`<team's job-name prefix>-<run>-t<attempt>`; SageMaker names the trials' training jobs
    `<tuning job name>-<NNN>-<8 hex>`, so they carry the team's prefix too."""
    return f"{platform.job_name_prefix}-{run_name}-t{attempt}"


def max_tune_run_name_length(platform: PlatformContext) -> int:
    return TUNING_JOB_NAME_MAX - len(f"{platform.job_name_prefix}--t{MAX_TUNE_ATTEMPTS}")


def check_tune_run_name(run_name: str, platform: PlatformContext) -> None:
    longest = max_tune_run_name_length(platform)
    if len(run_name) > longest:
        raise TuneError(
            f"run name {run_name!r} is {len(run_name)} characters; SageMaker names a tuning job with at "
            f"most {TUNING_JOB_NAME_MAX}, so with the job-name prefix '{platform.job_name_prefix}' a tune's "
            f"run name may be at most {max(longest, 0)}"
        )


def tuning_request(
    tune: TuneSpec,
    training_request: Mapping[str, Any],
    platform: PlatformContext,
    *,
    run_name: str,
    attempt: int = 1,
    parent_tuning_jobs: Sequence[str] = (),
) -> dict[str, Any]:
    """The CreateHyperParameterTuningJob request of a tune, from the run's rendered CreateTrainingJob
    request (its trials get everything a run gets); validated like a run's request."""
    check_tune_run_name(run_name, platform)
    name = tuning_job_name(platform, run_name, attempt)
    hyperparameters = {
        key: value
        for key, value in training_request["HyperParameters"].items()
        if key not in tune.tuned_names
    }
    hyperparameters["sagemaker_job_name"] = _json_string(name)
    request = {
        "HyperParameterTuningJobName": name,
        "HyperParameterTuningJobConfig": tuning_job_config(tune, training_request),
        "TrainingJobDefinition": training_job_definition(training_request, hyperparameters),
        "Tags": [tag for tag in training_request.get("Tags", ()) if not tag["Key"].endswith(":attempt")],
    }
    if parent_tuning_jobs:
        request["WarmStartConfig"] = {
            "ParentHyperParameterTuningJobs": [
                {"HyperParameterTuningJobName": parent} for parent in parent_tuning_jobs
            ],
            "WarmStartType": "IdenticalDataAndAlgorithm",
        }
    validate_tuning_request(request, platform)
    return request


def _json_string(text: str) -> str:
    return '"' + text + '"'


def tuning_job_config(tune: TuneSpec, training_request: Mapping[str, Any]) -> dict[str, Any]:
    ranges: dict[str, list[dict[str, Any]]] = {}
    for param in tune.params:
        member, item = param.sagemaker_range()
        ranges.setdefault(member, []).append(item)
    config: dict[str, Any] = {
        "Strategy": SEARCH_STRATEGIES[tune.strategy],
        "HyperParameterTuningJobObjective": {
            "Type": "Maximize" if tune.maximize else "Minimize",
            "MetricName": tune.objective,
        },
        "ResourceLimits": {"MaxNumberOfTrainingJobs": tune.trials, "MaxParallelTrainingJobs": tune.parallel},
        "ParameterRanges": ranges,
        # Hyperband stops poor trials itself; SageMaker refuses its early stopping beside it.
        "TrainingJobEarlyStoppingType": (
            "Auto" if tune.early_stopping and tune.strategy != "hyperband" else "Off"
        ),
    }
    if tune.strategy == "hyperband":
        hps = decoded_hyperparameters(training_request)
        config["StrategyConfig"] = {
            "HyperbandStrategyConfig": {
                "MinResource": 1,
                "MaxResource": min(HYPERBAND_MAX_RESOURCE, objective_reports(tune.objective, hps)),
            }
        }
    if tune.seed is not None:
        config["RandomSeed"] = tune.seed
    return config


def training_job_definition(training_request: Mapping[str, Any], hyperparameters: Mapping[str, str]) -> dict:
    algorithm = training_request["AlgorithmSpecification"]
    definition: dict[str, Any] = {
        "StaticHyperParameters": dict(hyperparameters),
        "AlgorithmSpecification": {key: algorithm[key] for key in _ALGORITHM_FIELDS if key in algorithm},
        "ResourceConfig": {
            key: value for key, value in training_request["ResourceConfig"].items() if key in _RESOURCE_FIELDS
        },
    }
    definition.update({key: training_request[key] for key in _DEFINITION_FIELDS if key in training_request})
    if not definition.get("Environment"):
        definition.pop("Environment", None)
    return definition


def decoded_hyperparameters(request: Mapping[str, Any]) -> dict[str, Any]:
    """A request's hyperparameters as the training toolkit decodes them (JSON where they are)."""
    values = {}
    for key, raw in request.get("HyperParameters", {}).items():
        try:
            values[key] = json.loads(raw)
        except ValueError:
            values[key] = raw
    return values


def validate_tuning_request(request: Mapping[str, Any], platform: PlatformContext) -> None:
    """botocore's CreateHyperParameterTuningJob shape (with min/max/pattern/enum) and the team's
    job-name prefix."""
    problems = input_problems("sagemaker", TUNING_OPERATION, request)
    problems += job_name_problems(request.get("HyperParameterTuningJobName", ""), platform.job_name_prefix)
    if problems:
        raise RequestValidationError(problems)


def check_tune_request(tune: TuneSpec, training_request: Mapping[str, Any]) -> None:
    """TuneError when the rendered run cannot report the tune's objective."""
    problems = tuning_problems_for_request(tune, training_request)
    if problems:
        raise TuneError(problems[0])


def tuning_problems_for_request(tune: TuneSpec, training_request: Mapping[str, Any]) -> list[str]:
    """What makes a rendered run unfit for this tune: an evaluation objective without a validation
    channel (no trial would report it)."""
    channels = {c["ChannelName"] for c in training_request.get("InputDataConfig", ())}
    if is_evaluation_metric(tune.objective) and "validation" not in channels:
        return [
            f"--objective {tune.objective} comes from the evaluation pass, which runs only with a "
            "validation channel: add --set channels.validation=s3://... (no trial would report it)"
        ]
    return []


