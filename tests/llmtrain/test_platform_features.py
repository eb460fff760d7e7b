"""SageMaker features of issue 19 in rendering: packages without internet (CodeArtifact), training plans,
MLflow, remote debugging, instance health checks, and the container's torch. Every rendered request
is validated against botocore's CreateTrainingJob shape (render does it; checked again here)."""

from __future__ import annotations

import copy
import json

import pytest
from templates_support import REPO_ROOT, catalog, platform_context

from llmtrain.core.environments import load_environment, parse_environment
from llmtrain.core.errors import OverrideError, RequestValidationError, TemplateSpecError
from llmtrain.core.failures import classify_failure
from llmtrain.core.platform import PlatformContext
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.runs import RunState
from llmtrain.core.spec import TemplateSpec
from llmtrain.core.validate import shape_problems
from llmtrain.lifecycle.retries import plan_next_attempt
from llmtrain.lifecycle.submission import TrainingJobSubmission
from training_jobs.contract.torch_versions import MIN_TORCH

CATALOG = catalog()
PLAN_ARN = "arn:aws:sagemaker:us-east-1:123456789012:training-plan/p4d-week"
MLFLOW_ARN = "arn:aws:sagemaker:us-east-1:123456789012:mlflow-tracking-server/llmtrain-test"
REPOSITORY_ARN = "arn:aws:codeartifact:us-east-1:123456789012:repository/llmtrain-test/pypi-mirror"
FEATURES = platform_context(package_repository_arn=REPOSITORY_ARN, mlflow_tracking_server_arn=MLFLOW_ARN,
                            training_plans={"p4d-week": PLAN_ARN}, remote_debug=True, team="nlp",
                            job_name_prefix="llmtrain-test-nlp")
PLATFORM_TEMPLATES = [spec for spec in CATALOG.all() if spec.code.is_platform]


def _render(ref: str, platform: PlatformContext = FEATURES, **overrides) -> dict:
    request = render(CATALOG.resolve(ref), RunInput(run_name="r1", overrides=overrides), platform)
    assert shape_problems(request) == []
    return request


def test_every_platform_template_of_the_isolated_dev_environment_installs_from_codeartifact():
    """config/dev.yaml runs jobs in isolated subnets (no NAT): the container's pip must get a PyPI
    mirror it can reach, and the toolkit reads it from CA_REPOSITORY_ARN."""
    dev = load_environment(REPO_ROOT / "config" / "dev.yaml")
    assert dev.network.nat_gateways == 0 and dev.packages.codeartifact
    platform = platform_context(environment="dev", job_name_prefix=dev.job_name_prefix,
                                **dev.platform_features())
    expected = f"arn:aws:codeartifact:{dev.region}:{dev.account}:repository/llmtrain-dev/pypi-mirror"
    for spec in PLATFORM_TEMPLATES:
        if spec.distribution.strategy == "smp" and spec.version == "1.0.0":
            continue
        request = render(spec, RunInput(run_name="r1"), platform)
        assert request["Environment"]["CA_REPOSITORY_ARN"] == expected, spec.ref


def test_without_features_the_request_carries_them_switched_off():
    request = _render("llama-pretrain-fsdp@1.1.0", platform_context())
    assert request["Environment"] == {}
    assert request["RemoteDebugConfig"] == {"EnableRemoteDebug": False}
    for absent in ("MlflowConfig", "InfraCheckConfig"):
        assert absent not in request
    assert "TrainingPlanArn" not in request["ResourceConfig"]
    assert "MaxPendingTimeInSeconds" not in request["StoppingCondition"]


def test_mlflow_config_and_the_programs_environment_name_the_tracking_server():
    """One tracking server per environment, one experiment per team and template; the program records
    where SageMaker will upload the job's model (S3OutputPath/<job>/output/model.tar.gz)."""
    request = _render("llama-pretrain-fsdp@1.2.0")
    job = request["TrainingJobName"]
    assert request["MlflowConfig"] == {"MlflowResourceArn": MLFLOW_ARN, "MlflowExperimentName":
                                       "nlp-llama-pretrain-fsdp", "MlflowRunName": job}
    output = request["OutputDataConfig"]["S3OutputPath"]
    assert output == "s3://llmtrain-test-artifacts/teams/nlp/llama-pretrain-fsdp/r1/"
    assert request["Environment"] == {"CA_REPOSITORY_ARN": REPOSITORY_ARN, "MLFLOW_TRACKING_URI": MLFLOW_ARN,
                                      "MLFLOW_EXPERIMENT_NAME": "nlp-llama-pretrain-fsdp",
                                      "LLMTRAIN_MODEL_ARTIFACT_URI": f"{output}{job}/output/model.tar.gz"}


def test_a_run_in_a_training_plan_waits_for_its_capacity_at_most_max_pending_seconds():
    request = _render("llama-pretrain-fsdp@1.2.0", training_plan="p4d-week")
    assert request["ResourceConfig"]["TrainingPlanArn"] == PLAN_ARN
    assert request["StoppingCondition"]["MaxPendingTimeInSeconds"] == 24 * 3600
    longer = _render("llama-pretrain-fsdp@1.2.0", training_plan="p4d-week", max_pending_seconds="172800")
    assert longer["StoppingCondition"]["MaxPendingTimeInSeconds"] == 172800


@pytest.mark.parametrize(("overrides", "message"), [
    ({"training_plan": "p5-month"}, "not a training plan of environment test; its plans: p4d-week"),
    ({"training_plan": "p4d-week", "spot": "true"}, "turn spot off"),
    ({"max_pending_seconds": "7200"}, "only applies to a run in a training plan"),
    ({"training_plan": "p4d-week", "max_pending_seconds": "60"}, "below the minimum 1800"),
])
def test_training_plan_mistakes_are_refused_naming_the_setting(overrides, message):
    with pytest.raises(OverrideError, match=message):
        _render("llama-pretrain-fsdp@1.2.0", **overrides)


def test_remote_debugging_needs_an_environment_that_allows_it():
    assert _render("gpt2-ddp@1.2.0", remote_debug="true")["RemoteDebugConfig"] == {"EnableRemoteDebug": True}
    with pytest.raises(OverrideError, match="does not allow remote debugging") as refused:
        _render("gpt2-ddp@1.2.0", platform_context(), remote_debug="true")
    # Said for both kinds of deployment (issue 25: construct-library users were sent to config/ only).
    assert ("(TrainingLauncherProps.platform_features['remote_debug'] in a CDK app of llmtrain-constructs; "
            "remote_debug.enabled in the platform's config/<env>.yaml) and deploys") in str(refused.value)
    with pytest.raises(OverrideError) as no_plans:
        _render("gpt2-ddp@1.2.0", platform_context(), training_plan="p4d-week", spot="false")
    assert ("its plans: none (listed as TrainingLauncherProps.platform_features['training_plans'] in a CDK "
            "app of llmtrain-constructs; training_plans in the platform's config/<env>.yaml)") in str(
        no_plans.value)


def test_multi_node_gpu_templates_of_1_2_0_check_instance_health_first():
    checked = {spec.name for spec in CATALOG.all() if spec.version == "1.2.0" and spec.infra_check}
    multi_node_gpu = {spec.name for spec in CATALOG.all() if spec.version == "1.2.0"
                      and spec.compute.instance_count > 1}
    assert checked == multi_node_gpu == {"llama-pretrain-fsdp", "llama-pretrain-hsdp-tp",
                                         "llama-pretrain-smp"}
    assert _render("llama-pretrain-hsdp-tp@1.2.0")["InfraCheckConfig"] == {"EnableInfraCheck": True}


def _spec_data(ref: str) -> dict:
    return copy.deepcopy(CATALOG.resolve(ref).to_dict())


def test_infra_check_on_a_cpu_instance_is_refused_at_load():
    data = _spec_data("llama-pretrain-fsdp@1.2.0")
    data["retry"]["fallback_instance_types"] = ["ml.c5.18xlarge"]
    with pytest.raises(TemplateSpecError, match="needs GPU instance types; ml.c5.18xlarge has no GPU"):
        TemplateSpec.from_dict(data, "t.yaml")


def test_platform_run_options_cannot_be_declared_by_a_template():
    data = _spec_data("gpt2-ddp@1.2.0")
    data["overridable"]["remote_debug"] = {"type": "bool"}
    with pytest.raises(TemplateSpecError, match="platform run option every template accepts"):
        TemplateSpec.from_dict(data, "t.yaml")


def test_a_template_whose_container_torch_is_too_old_is_refused_at_render_naming_the_minimum():
    data = _spec_data("llama-pretrain-fsdp@1.2.0")
    data["image"] = {"framework_version": "2.7.1", "py_version": "py312"}
    old = TemplateSpec.from_dict(data, "t.yaml")
    with pytest.raises(RequestValidationError, match=r"PyTorch 2\.7\.1 .* needs PyTorch 2\.8\.0 or newer"):
        render(old, RunInput(run_name="r1"), platform_context())
    # SMP jobs run the program's SMP path on the SMP image's older torch.
    assert MIN_TORCH["smp"] == CATALOG.latest("llama-pretrain-smp").image.framework_version


def test_a_job_pending_in_a_training_plan_is_not_a_capacity_failure():
    job = {"TrainingJobStatus": "Failed", "TrainingJobName": "j",
           "FailureReason": "CapacityError: Unable to provision requested ML compute capacity"}
    caught = {"Error": "States.TaskFailed", "Cause": json.dumps(job)}
    assert classify_failure(caught).kind == "capacity"
    assert classify_failure(caught, in_training_plan=True).kind == "plan_capacity"
    pending = {**job, "FailureReason": "Job exceeded MaxPendingTimeInSeconds while Pending"}
    in_plan = classify_failure({"Error": "States.TaskFailed", "Cause": json.dumps(pending)},
                               in_training_plan=True)
    assert in_plan.kind == "plan_capacity"


def test_the_launcher_does_not_retry_a_plan_job_elsewhere():
    template = CATALOG.resolve("llama-pretrain-fsdp@1.2.0")
    request = _render("llama-pretrain-fsdp@1.2.0", training_plan="p4d-week")
    run = RunState(run_name="r1", team="nlp", template=template.name, version=template.version,
                   overrides={"training_plan": "p4d-week"}, owner="me", execution_arn=None, attempt=1,
                   instance_types=("ml.p4d.24xlarge", "ml.p5.48xlarge"))
    job = {"TrainingJobStatus": "Failed", "TrainingJobName": request["TrainingJobName"],
           "FailureReason": "CapacityError: Unable to provision requested ML compute capacity"}
    caught = {"Error": "States.TaskFailed", "Cause": json.dumps(job)}
    decision = plan_next_attempt(template, run, request, caught, FEATURES,
                                 TrainingJobSubmission({"all": list(request)}))
    assert decision["decision"] == "fail"
    assert decision["summary"]["error"] == "TrainingPlanCapacityUnavailable"
    assert "llmtrain plans" in decision["summary"]["advice"]
    # Without a plan the same failure is retried with backoff.
    plain = _render("llama-pretrain-fsdp@1.2.0")
    retry = plan_next_attempt(template, run.replace(overrides={}), plain, caught, FEATURES,
                              TrainingJobSubmission({"all": list(plain)}))
    assert retry["decision"] == "retry"


def test_environment_config_reads_the_features_and_refuses_mistakes():
    base = load_environment(REPO_ROOT / "config" / "dev.yaml")
    raw = {"name": "dev", "account": base.account, "region": base.region,
           "network": {"vpc_cidr": "10.40.0.0/16", "availability_zones": ["us-east-1a", "us-east-1b"]},
           "job_templates": {"enabled": ["gpt2-ddp"]}, "job_name_prefix": "llmtrain-dev"}
    env = parse_environment({**raw, "training_plans": {"p4d-week": PLAN_ARN.replace("123456789012",
                                                                                   base.account)},
                             "mlflow": {"tracking_server": True}, "remote_debug": {"enabled": True}})
    features = env.platform_features()
    assert features["mlflow_tracking_server_arn"].endswith(":mlflow-tracking-server/llmtrain-dev")
    assert features["remote_debug"] is True and list(features["training_plans"]) == ["p4d-week"]
    with pytest.raises(ValueError, match="packages.source: pypi needs a route to the internet"):
        parse_environment({**raw, "packages": {"source": "pypi"}})
    with pytest.raises(ValueError, match="training_plans.p4d: expected a training plan ARN"):
        parse_environment({**raw, "training_plans": {"p4d": "arn:aws:iam::1:role/x"}})
    with pytest.raises(ValueError, match="not in this environment's account and region"):
        parse_environment({**raw, "training_plans": {"p4d": PLAN_ARN}})  # another account


def test_a_platform_context_written_before_the_features_still_loads():
    old = platform_context().to_dict()
    for name in ("package_repository_arn", "mlflow_tracking_server_arn", "training_plans", "remote_debug"):
        old.pop(name)
    assert PlatformContext.from_dict(old) == platform_context()
    with pytest.raises(Exception, match="training plan ARN"):
        platform_context(training_plans={"x": "arn:aws:sagemaker:us-east-1:1:training-plan/x"})


def test_the_programs_own_torch_check_refuses_the_torch_render_refuses():
    """The program checks the contract's table at start-up too (images render cannot see into)."""
    from training_jobs.trainer.errors import ContainerError
    from training_jobs.trainer.torch_support import check_torch

    check_torch("fsdp", "2.8.0+cu128")
    check_torch("smp", "2.5.1")
    with pytest.raises(ContainerError, match=r"PyTorch 2\.7\.1.*needs 2\.8\.0 or newer for parallelism=fsdp"):
        check_torch("fsdp", "2.7.1+cu126")
