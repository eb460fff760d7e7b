"""Our request equals what the SageMaker Python SDK 2.x sends for the same job.

For every catalog version, the SDK's `sagemaker.pytorch.PyTorch` estimator is configured with the
template's settings (torchrun via `torch_distributed`; SMP v2 via `smdistributed.modelparallel`) and
`fit(wait=False)` runs against moto; a botocore event hook captures the CreateTrainingJob parameters
the SDK builds. The framework hyperparameters the SageMaker PyTorch container reads
(sagemaker_program, sagemaker_submit_directory, sagemaker_region, sagemaker_container_log_level,
sagemaker_job_name, sagemaker_torch_distributed_enabled, sagemaker_instance_type,
sagemaker_distributed_dataparallel_enabled, mp_parameters) must be identical strings, and so must the
rest of the request. SageMaker itself does not run here; moto accepting the job is as far as it goes.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import boto3
import pytest
from moto import mock_aws
from templates_support import catalog, platform_context

from llmtrain.core.render import code_uri, render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.spec import TemplateSpec

pytestmark = pytest.mark.filterwarnings("ignore:.*SageMaker Python SDK v2")
PLATFORM = platform_context()
CATALOG = catalog()
# CreateTrainingJob's booleans default to false; the SDK leaves false ones out.
FALSE_BY_DEFAULT = (
    "EnableInterContainerTrafficEncryption",
    "EnableManagedSpotTraining",
    "EnableNetworkIsolation",
)


def _is_framework(name: str) -> bool:
    return name.startswith("sagemaker_") or name == "mp_parameters"


def _sdk_distribution(ours: dict, strategy: str) -> dict:
    distribution = {"torch_distributed": {"enabled": True}}
    if ours["HyperParameters"].get("sagemaker_distributed_dataparallel_enabled") == "true":
        distribution["smdistributed"] = {"dataparallel": {"enabled": True}}
    if strategy == "smp":
        parameters = json.loads(ours["HyperParameters"]["mp_parameters"])
        distribution["smdistributed"] = {"modelparallel": {"enabled": True, "parameters": parameters}}
    return distribution


def _sdk_tensorboard(ours: dict, config_class):
    """The SDK's TensorBoard setting for templates that turn TensorBoard on (tensorboard=true)."""
    ours_config = ours.get("TensorBoardOutputConfig")
    if ours_config is None:
        return None
    return config_class(s3_output_path=ours_config["S3OutputPath"],
                        container_local_output_path=ours_config["LocalPath"])


def sdk_request(spec: TemplateSpec, ours: dict) -> dict:
    """The CreateTrainingJob parameters the SDK's PyTorch estimator sends for the same job."""
    user_hyperparameters = {
        k: json.loads(v) for k, v in ours["HyperParameters"].items() if not _is_framework(k)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sagemaker
        from sagemaker.debugger import TensorBoardOutputConfig
        from sagemaker.inputs import TrainingInput
        from sagemaker.pytorch import PyTorch
    with mock_aws():
        boto_session = boto3.Session(
            region_name=PLATFORM.region, aws_access_key_id="testing", aws_secret_access_key="testing"
        )
        captured: dict = {}
        boto_session.events.register(
            "provide-client-params.sagemaker.CreateTrainingJob", lambda params, **_: captured.update(params)
        )
        session = sagemaker.Session(boto_session=boto_session, default_bucket="sdk-default-bucket")
        estimator = PyTorch(
            entry_point=spec.code.entry_point,
            source_dir=code_uri(spec, PLATFORM),  # the JobTemplate construct's upload
            role=PLATFORM.execution_role_arn,
            instance_type=spec.compute.instance_type,
            instance_count=spec.compute.instance_count,
            volume_size=spec.compute.volume_size_gb,
            max_run=spec.max_runtime_seconds,
            framework_version=spec.image.framework_version,
            py_version=spec.image.py_version,
            image_uri=spec.image.uri,
            distribution=_sdk_distribution(ours, spec.distribution.strategy),
            hyperparameters=user_hyperparameters,
            metric_definitions=[{"Name": m.name, "Regex": m.regex} for m in spec.metrics],
            output_path=ours["OutputDataConfig"]["S3OutputPath"],
            output_kms_key=PLATFORM.kms_key_arn,
            subnets=list(PLATFORM.subnet_ids),
            security_group_ids=list(PLATFORM.security_group_ids),
            checkpoint_s3_uri=ours["CheckpointConfig"]["S3Uri"],
            checkpoint_local_path="/opt/ml/checkpoints",
            use_spot_instances=spec.spot.enabled,
            max_wait=spec.spot.max_wait_seconds if spec.spot.enabled else None,
            keep_alive_period_in_seconds=spec.keep_alive_seconds,
            encrypt_inter_container_traffic=spec.inter_container_encryption,
            max_retry_attempts=spec.retry.internal_error_attempts,
            tags=ours["Tags"],
            enable_network_isolation=False,
            disable_profiler=True,
            debugger_hook_config=False,
            tensorboard_output_config=_sdk_tensorboard(ours, TensorBoardOutputConfig),
            environment=ours.get("Environment") or None,
            enable_remote_debug=ours.get("RemoteDebugConfig", {}).get("EnableRemoteDebug") or None,
            enable_infra_check=ours.get("InfraCheckConfig", {}).get("EnableInfraCheck"),
            training_plan=ours["ResourceConfig"].get("TrainingPlanArn"),
            sagemaker_session=session,
        )
        inputs = {
            channel["ChannelName"]: TrainingInput(
                channel["DataSource"]["S3DataSource"]["S3Uri"],
                distribution="FullyReplicated",
                input_mode="File",
                compression="None",
            )
            for channel in ours["InputDataConfig"]
        }
        estimator.fit(inputs=inputs, job_name=ours["TrainingJobName"], wait=False, logs=False)
        described = boto_session.client("sagemaker").describe_training_job(
            TrainingJobName=ours["TrainingJobName"]
        )
    assert described["TrainingJobName"] == ours["TrainingJobName"]  # moto accepted the SDK's request
    return captured


def _without_defaults(request: dict) -> dict:
    """Fields the SDK leaves out when they hold SageMaker's defaults (no variables, no debugging)."""
    request = dict(request)
    if request.get("Environment") == {}:
        del request["Environment"]
    if request.get("RemoteDebugConfig") == {"EnableRemoteDebug": False}:
        del request["RemoteDebugConfig"]
    return request


@pytest.mark.parametrize("ref", [spec.ref for spec in CATALOG.all()])
def test_request_equals_the_sdks(ref):
    ours = _without_defaults(render(CATALOG.resolve(ref), RunInput(run_name="equivalence"), PLATFORM))
    sdk = sdk_request(CATALOG.resolve(ref), ours)

    framework = {k: v for k, v in ours["HyperParameters"].items() if _is_framework(k)}
    assert framework == {k: v for k, v in sdk["HyperParameters"].items() if _is_framework(k)}
    assert framework["sagemaker_torch_distributed_enabled"] == "true"
    assert ours["HyperParameters"] == sdk["HyperParameters"]
    assert ours["AlgorithmSpecification"]["TrainingImage"] == sdk["AlgorithmSpecification"]["TrainingImage"]

    for flag in FALSE_BY_DEFAULT:
        if ours[flag] is False:
            assert sdk.get(flag) in (None, False), flag
    comparable = {k: v for k, v in ours.items() if not (k in FALSE_BY_DEFAULT and v is False)}
    assert comparable == sdk


def test_packages_training_plan_debugging_and_health_check_are_sent_like_the_sdk():
    platform = replace(
        PLATFORM,
        package_repository_arn=(
            "arn:aws:codeartifact:us-east-1:123456789012:repository/llmtrain-test/pypi-mirror"),
        training_plans={"week": "arn:aws:sagemaker:us-east-1:123456789012:training-plan/week"},
        remote_debug=True,
    )
    ours = render(CATALOG.resolve("llama-pretrain-fsdp@1.2.0"),
                  RunInput(run_name="features",
                           overrides={"training_plan": "week", "remote_debug": "true"}),
                  platform)
    sdk = sdk_request(CATALOG.resolve("llama-pretrain-fsdp@1.2.0"), ours)
    for field in ("Environment", "RemoteDebugConfig", "InfraCheckConfig", "ResourceConfig"):
        assert ours[field] == sdk[field], field
    # SDK 2.x has no setting for the pending limit of a job in a training plan (the API has).
    pending = dict(ours["StoppingCondition"])
    assert pending.pop("MaxPendingTimeInSeconds") == 24 * 3600
    assert pending == sdk["StoppingCondition"]
    assert sdk["ResourceConfig"]["TrainingPlanArn"].endswith("training-plan/week")


def test_smp_case_sends_mp_parameters_like_the_sdk():
    ours = render(
        CATALOG.resolve("llama-pretrain-smp"),
        RunInput(run_name="smp", overrides={"shard_degree": 16}),
        PLATFORM,
    )
    sdk = sdk_request(CATALOG.resolve("llama-pretrain-smp"), ours)
    assert sdk["HyperParameters"]["mp_parameters"] == ours["HyperParameters"]["mp_parameters"]
    assert json.loads(ours["HyperParameters"]["mp_parameters"])["hybrid_shard_degree"] == 16
    assert sdk["HyperParameters"]["sagemaker_distributed_dataparallel_enabled"] == "false"
    assert (
        "smdistributed-modelparallel:2.5.1-gpu-py311-cu124" in sdk["AlgorithmSpecification"]["TrainingImage"]
    )


def test_smddp_is_sent_like_the_sdks_smdistributed_dataparallel():
    """A template with distribution.smddp renders what the SDK sends for torch_distributed plus
    smdistributed.dataparallel. The SDK checks SMDDP's framework versions only without an image
    URI (its list ends at PyTorch 2.2), so the variant names the image."""
    data = CATALOG.resolve("llama-pretrain-fsdp").to_dict()
    data["distribution"]["smddp"] = True
    data["image"] = {"uri": "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:"
                            "2.8.0-gpu-py312-cu129-ubuntu22.04-sagemaker"}
    spec = TemplateSpec.from_dict(data)
    ours = render(spec, RunInput(run_name="smddp"), PLATFORM)
    sdk = sdk_request(spec, ours)
    assert ours["HyperParameters"] == sdk["HyperParameters"]
    assert ours["HyperParameters"]["sagemaker_distributed_dataparallel_enabled"] == "true"
    assert ours["HyperParameters"]["sagemaker_torch_distributed_enabled"] == "true"  # torchrun launches
    assert ours["HyperParameters"]["collective_backend"] == '"smddp"'
