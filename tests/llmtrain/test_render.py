"""render(): every catalog version gives a complete, valid CreateTrainingJob request; overrides stay
within bounds; every rejection path fails with a message naming the setting."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from botocore.validate import ParamValidator
from templates_support import EVAL_LINE, METRIC_LINE, catalog, platform_context

from llmtrain.core.errors import (
    OverrideError,
    ProgramSettingError,
    RequestValidationError,
    RunInputError,
    TeamLimitError,
)
from llmtrain.core.instances import instance_type
from llmtrain.core.program_contract import archive_contract, installed_contract
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.validate import create_training_job_shape, shape_problems

CATALOG = catalog()
ALL_VERSIONS = [spec.ref for spec in CATALOG.all()]
PLATFORM = platform_context()


def _render(ref: str, platform=PLATFORM, **run) -> dict:
    """Rendered as the CLI and the launcher render: checked with the program of the version's code."""
    run.setdefault("run_name", "r1")
    spec = CATALOG.resolve(ref)
    return render(spec, RunInput(**run), platform, CATALOG.program_contract(spec))


def _decoded_hyperparameters(request: dict) -> dict:
    return {k: json.loads(v) for k, v in request["HyperParameters"].items()}


@pytest.mark.parametrize("ref", ALL_VERSIONS)
def test_every_catalog_version_renders_a_valid_request(ref):
    request = _render(ref)
    # render validated already; check again independently, botocore's validator included.
    assert not ParamValidator().validate(request, create_training_job_shape()).has_errors()
    assert shape_problems(request) == []
    spec = CATALOG.resolve(ref)
    assert request["TrainingJobName"] == "llmtrain-test-r1-a1"
    assert request["RoleArn"] == PLATFORM.execution_role_arn
    algorithm = request["AlgorithmSpecification"]
    assert algorithm["TrainingInputMode"] == "File"
    assert algorithm["EnableSageMakerMetricsTimeSeries"] is True
    assert [m["Name"] for m in algorithm["MetricDefinitions"]] == [m.name for m in spec.metrics]
    assert request["OutputDataConfig"] == {
        "S3OutputPath": f"s3://llmtrain-test-artifacts/teams/default/{spec.name}/r1/",
        "KmsKeyId": PLATFORM.kms_key_arn,
    }
    assert request["VpcConfig"] == {
        "SecurityGroupIds": ["sg-0bbbbbbbbbbbbbbb1"],
        "Subnets": ["subnet-0aaaaaaaaaaaaaaa1", "subnet-0aaaaaaaaaaaaaaa2"],
    }
    assert request["CheckpointConfig"] == {
        "S3Uri": f"s3://llmtrain-test-checkpoints/teams/default/{spec.name}/r1/",
        "LocalPath": "/opt/ml/checkpoints",
    }
    assert request["EnableNetworkIsolation"] is False
    assert request["EnableInterContainerTrafficEncryption"] is spec.inter_container_encryption
    assert request["RetryStrategy"] == {"MaximumRetryAttempts": spec.retry.internal_error_attempts}
    assert request["ResourceConfig"]["KeepAlivePeriodInSeconds"] == spec.keep_alive_seconds
    assert {t["Key"]: t["Value"] for t in request["Tags"]} == {
        "llmtrain:template": spec.name,
        "llmtrain:template-version": spec.version,
        "llmtrain:run": "r1",
        "llmtrain:attempt": "1",
        "llmtrain:owner": "unknown",
        "llmtrain:environment": "test",
        "llmtrain:team": "default",
    }
    hyperparameters = _decoded_hyperparameters(request)
    assert (
        hyperparameters["sagemaker_submit_directory"]
        == f"s3://llmtrain-test-code/templates/{spec.name}/{spec.version}/sourcedir.tar.gz"
    )
    assert hyperparameters["sagemaker_program"] == spec.code.entry_point
    assert hyperparameters["max_steps"] == spec.hyperparameters["max_steps"]


# The program's lines with every key a template may capture: the objectives' metrics (DPO's and
# GRPO's, appended to the [metrics] and [eval] lines) and a mixture of experts' [moe] line.
OBJECTIVE_VALUES = {
    "train:rewards_chosen": ("rewards/chosen", 0.125),
    "train:rewards_rejected": ("rewards/rejected", -0.25),
    "train:rewards_accuracies": ("rewards/accuracies", 0.75),
    "train:rewards_margins": ("rewards/margins", 0.375),
    "train:logps_chosen": ("logps/chosen", -12.5),
    "train:logps_rejected": ("logps/rejected", -14.25),
    "train:reward": ("reward", 0.625),
    "train:reward_std": ("reward_std", 0.2),
    "train:kl": ("kl", 0.0125),
    "train:completion_length": ("completions/mean_length", 17.5),
    "train:clip_ratio": ("clip_ratio/region_mean", 0.05),
}
EVAL_VALUES = {
    "eval:rewards_accuracies": ("eval_rewards/accuracies", 0.8125),
    "eval:rewards_margins": ("eval_rewards/margins", 0.4375),
}
MOE_VALUES = {
    "moe:aux_loss": ("moe_aux_loss", 2.012345),
    "moe:load_balance": ("moe_load_balance", 1.421),
    "moe:max_expert_share": ("moe_max_expert_share", 0.355),
    "moe:dropped_tokens": ("moe_dropped_tokens", 0),
}


def _keys(values: dict) -> str:
    return "".join(f" {key}={value}" for key, value in values.values())


LINES = {
    "train": METRIC_LINE + _keys(OBJECTIVE_VALUES),
    "eval": EVAL_LINE + _keys(EVAL_VALUES),
    "moe": f"[moe] step=10{_keys(MOE_VALUES)} moe_load_balance_layer0=1.312 moe_aux_loss_layer0=2.010001",
}


@pytest.mark.parametrize("ref", ALL_VERSIONS)
def test_metric_definitions_parse_the_contract_lines(ref):
    expected = {
        "train:loss": 4.123456,
        "train:lr": 3.0e-4,
        "train:grad_norm": 1.2345,
        "train:tokens_per_sec": 12345.6,
        "train:mfu": 0.4123,
        "train:step_time": 0.532,
        "train:memory_gb": 1.23,
        "eval:loss": 3.987654,
        **{name: value for name, (_, value) in {**OBJECTIVE_VALUES, **EVAL_VALUES, **MOE_VALUES}.items()},
    }
    for metric in _render(ref)["AlgorithmSpecification"]["MetricDefinitions"]:
        kind = metric["Name"].partition(":")[0]
        match = re.search(metric["Regex"], LINES[kind])
        assert match is not None, metric
        assert float(match.group(1)) == pytest.approx(expected[metric["Name"]])
        for other, line in LINES.items():
            if other != kind:
                assert re.search(metric["Regex"], line) is None, f"{metric['Name']} also matches {line!r}"


@pytest.mark.parametrize("ref", [r for r in ALL_VERSIONS if not r.startswith("byo-script")])
def test_every_platform_version_is_checked_with_the_program_of_its_own_code(ref):
    """A published version runs its frozen code: render checks it with that code's contract, which
    accepts the version's defaults (what the program would refuse at start is refused before). A
    version not yet published (not in catalog.lock) runs the installed program."""
    spec = CATALOG.resolve(ref)
    program = CATALOG.program_contract(spec)
    published = CATALOG.published_entry(spec)
    if published:
        assert program.code_hash == published.code
    else:
        assert dict(program.capabilities) == dict(installed_contract().capabilities)
    request = _render(ref)
    hyperparameters = {
        k: v for k, v in _decoded_hyperparameters(request).items() if not k.startswith("sagemaker_")
    }
    assert hyperparameters["parallelism"] == spec.distribution.strategy
    resources = request["ResourceConfig"]
    hosts = resources["InstanceCount"]
    world = hosts * instance_type(resources["InstanceType"]).processes_per_host
    program.check(hyperparameters, world_size=world, num_hosts=hosts)
    misspelled = "unknown hyperparameter 'max_step'.*did you mean 'max_steps'"
    with pytest.raises(ProgramSettingError, match=misspelled):
        program.check({**hyperparameters, "max_step": 5}, world_size=world, num_hosts=hosts)


def test_platform_code_gets_the_distribution_as_hyperparameters_and_byo_does_not():
    fsdp = _decoded_hyperparameters(_render("llama-pretrain-hsdp-tp"))
    assert (
        fsdp["parallelism"],
        fsdp["replicate_degree"],
        fsdp["shard_degree"],
        fsdp["tensor_parallel_degree"],
    ) == ("fsdp", 0, 2, 4)
    byo = _decoded_hyperparameters(_render("byo-script"))
    assert not {"parallelism", "shard_degree", "replicate_degree", "tensor_parallel_degree"} & set(byo)
    assert byo["sagemaker_torch_distributed_enabled"] is True


def test_hyperparameters_are_json_encoded_like_the_sdk():
    raw = _render("llama-finetune-lora")["HyperParameters"]
    assert raw["max_steps"] == "1000"
    assert raw["model_preset"] == '"llama-7b"'
    assert raw["merge_lora"] == "false"
    assert raw["lora_target_modules"] == '["all-linear"]'
    assert all(isinstance(v, str) for v in raw.values())


def test_channels_default_to_the_teams_datasets_prefix_and_optional_ones_are_left_out():
    request = _render("llama-finetune-deepspeed")
    channels = {c["ChannelName"]: c for c in request["InputDataConfig"]}
    assert set(channels) == {"train", "model"}
    assert channels["train"]["DataSource"]["S3DataSource"] == {
        "S3DataType": "S3Prefix",
        "S3Uri": "s3://llmtrain-test-datasets/teams/default/tokens/finetune/train/",
        "S3DataDistributionType": "FullyReplicated",
    }
    overridden = _render(
        "llama-finetune-deepspeed",
        overrides={"channels.validation": "s3://llmtrain-test-datasets/teams/default/val/"},
    )
    uris = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in overridden["InputDataConfig"]}
    assert uris["validation"] == "s3://llmtrain-test-datasets/teams/default/val/"


@pytest.mark.parametrize(
    "uri",
    [
        "s3://other-bucket/val/",
        "s3://llmtrain-test-datasets/val/",  # the bucket, outside every team
        "s3://llmtrain-test-datasets/teams/vision/val/",  # another team's data
        "s3://llmtrain-test-datasets/teams/nlp2/val/",  # a team whose name starts like this one's
        "s3://llmtrain-test-checkpoints/teams/nlp/x/",
    ],
)
def test_a_channel_outside_the_teams_datasets_prefix_is_refused_naming_the_prefix(uri):
    team = platform_context(team="nlp", job_name_prefix="llmtrain-test-nlp")
    with pytest.raises(OverrideError) as error:
        _render("llama-finetune-deepspeed", team, overrides={"channels.validation": uri})
    assert "override 'channels.validation'" in str(error.value)
    assert "its channels may read only under s3://llmtrain-test-datasets/teams/nlp/" in str(error.value)


# Each of these starts with team nlp's datasets prefix, which the check before issue 25 compared as a
# string, and reads elsewhere: S3 keeps `..` and `%2e` as written, other clients resolve them.
ESCAPES = {
    "s3://llmtrain-test-datasets/teams/nlp/../vision/val/": "the path segment '..'",
    "s3://llmtrain-test-datasets/teams/nlp/./../vision/val/": "the path segment '.'",
    "s3://llmtrain-test-datasets/teams/nlp/%2e%2e/vision/val/": "a percent sign",
    "s3://llmtrain-test-datasets/teams/nlp/%2E%2E%2Fvision/": "a percent sign",
    "s3://llmtrain-test-datasets/teams/nlp/val/ ": "SPACE at position 42",
    "s3://llmtrain-test-datasets/teams/nlp/val/\n": "U+000A at position 42",
    "s3://llmtrain-test-datasets/teams/nlp/va\u200bl/": "ZERO WIDTH SPACE",
    "s3://llmtrain-test-datasets/teams/nlp//val/": "an empty path segment",
    "s3://llmtrain-test-datasets/teams/nlp/..\\vision\\": "a backslash",
    "s3://llmtrain-test-datasets/teams/nlp/val?x=1": "a '?'",
}


@pytest.mark.parametrize(("uri", "problem"), ESCAPES.items())
def test_a_channel_that_could_read_outside_the_teams_prefix_is_refused_saying_what_to_fix(uri, problem):
    """Issue 25: each of these passed render (and so the launcher's Resolve) and created a job."""
    team = platform_context(team="nlp", job_name_prefix="llmtrain-test-nlp")
    with pytest.raises(OverrideError) as error:
        _render("llama-finetune-deepspeed", team, overrides={"channels.validation": uri})
    message = str(error.value)
    assert message.startswith("override 'channels.validation': ") and problem in message
    assert repr(uri)[:40] in message


def test_a_templates_default_channel_is_parsed_like_a_runs():
    template = CATALOG.resolve("llama-finetune-deepspeed")
    escaping = dataclasses.replace(
        template, inputs=dataclasses.replace(template.inputs, channels={"train": "tokens/../../vision/"})
    )
    with pytest.raises(OverrideError, match="'channels.train': .* the path segment '..'"):
        render(escaping, RunInput(run_name="r1"), platform_context(team="nlp"))


def test_bounds_are_written_in_their_settings_type():
    """Issue 25: an int setting's bounds printed as floats ("below the minimum 1.0 ... <= 1000000.0")."""
    with pytest.raises(OverrideError) as low:
        _render("gpt2-ddp@1.2.0", overrides={"max_steps": 0})
    assert str(low.value) == (
        "override 'max_steps': 0 is below the minimum 1; allowed: int >= 1 <= 1000000"
    )
    with pytest.raises(OverrideError) as wrong:
        _render("gpt2-ddp@1.2.0", overrides={"max_steps": "1.5"})
    assert str(wrong.value).endswith("is not a valid int; expected int >= 1 <= 1000000")
    with pytest.raises(OverrideError) as small:
        _render("gpt2-ddp@1.2.0", overrides={"lr": 1e-9})
    assert "below the minimum 1e-06; allowed: float >= 1e-06 <= 0.01" in str(small.value)


def test_a_teams_runs_write_under_its_prefix_and_carry_its_tag():
    team = platform_context(team="nlp", job_name_prefix="llmtrain-test-nlp")
    request = _render("llama-pretrain-fsdp", team)
    assert request["TrainingJobName"] == "llmtrain-test-nlp-r1-a1"
    assert request["CheckpointConfig"]["S3Uri"] == "s3://llmtrain-test-checkpoints/teams/nlp/llama-pretrain-fsdp/r1/"
    assert request["OutputDataConfig"]["S3OutputPath"] == (
        "s3://llmtrain-test-artifacts/teams/nlp/llama-pretrain-fsdp/r1/"
    )
    assert request["TensorBoardOutputConfig"]["S3OutputPath"].startswith("s3://llmtrain-test-artifacts/teams/nlp/")
    assert {"Key": "llmtrain:team", "Value": "nlp"} in request["Tags"]


def _set_as(limit: str) -> str:
    return (f"TeamSpec.{limit} in a CDK app of llmtrain-constructs; teams.nlp.{limit} in the platform's "
            "config/<env>.yaml")


@pytest.mark.parametrize(
    ("limits", "ref", "overrides", "message"),
    [
        ({"allowed_templates": ("gpt2-ddp",)}, "llama-pretrain-fsdp", {},
         "team 'nlp': template 'llama-pretrain-fsdp' is not one of its templates (gpt2-ddp); "
         f"the platform team sets the team's templates ({_set_as('templates')})"),
        ({"allowed_instance_types": ("ml.g5.12xlarge",)}, "gpt2-ddp", {"instance_type": "ml.p4d.24xlarge"},
         "instance type ml.p4d.24xlarge is not one of its instance types (ml.g5.12xlarge); "
         f"the platform team sets the team's instance_types ({_set_as('instance_types')})"),
        ({"max_instance_count": 2}, "llama-pretrain-fsdp", {"instance_count": 4},
         "instance_count 4 is above its cap of 2 instances per job; the platform team sets the team's "
         f"max_instance_count ({_set_as('max_instance_count')})"),
    ],
)
def test_a_run_beyond_its_teams_limits_is_refused_naming_the_limit(limits, ref, overrides, message):
    """The limit is named as both kinds of deployment set it (issue 25: the construct library's
    users were sent to this repository's config/<env>.yaml only)."""
    team = platform_context(team="nlp", job_name_prefix="llmtrain-test-nlp", **limits)
    with pytest.raises(TeamLimitError) as error:
        _render(ref, team, overrides=overrides)
    assert message in str(error.value)


def test_an_environment_with_inter_container_encryption_forces_it_on_every_job():
    assert _render("gpt2-ddp")["EnableInterContainerTrafficEncryption"] is False
    encrypted = platform_context(inter_container_traffic_encryption=True)
    for ref in ALL_VERSIONS:
        assert _render(ref, encrypted)["EnableInterContainerTrafficEncryption"] is True, ref


def test_attempts_get_unique_job_names_and_share_the_runs_checkpoints():
    first = _render("llama-pretrain-fsdp", attempt=1)
    retry = _render("llama-pretrain-fsdp", attempt=2, instance_type="ml.p5.48xlarge")
    assert (first["TrainingJobName"], retry["TrainingJobName"]) == (
        "llmtrain-test-r1-a1",
        "llmtrain-test-r1-a2",
    )
    assert first["CheckpointConfig"] == retry["CheckpointConfig"]
    assert retry["ResourceConfig"]["InstanceType"] == "ml.p5.48xlarge"
    assert json.loads(retry["HyperParameters"]["sagemaker_instance_type"]) == "ml.p5.48xlarge"
    assert json.loads(retry["HyperParameters"]["sagemaker_job_name"]) == "llmtrain-test-r1-a2"


def test_capacity_fallback_must_be_one_of_the_templates_types():
    with pytest.raises(OverrideError, match="capacity fallback 'ml.g5.48xlarge' is not one of"):
        _render("llama-pretrain-fsdp", instance_type="ml.g5.48xlarge")


def test_volume_key_only_where_the_instance_has_no_instance_storage():
    p4d = _render("llama-pretrain-fsdp")["ResourceConfig"]
    assert "VolumeKmsKeyId" not in p4d
    cpu = _render("byo-script", overrides={"instance_type": "ml.c5.2xlarge"})
    assert cpu["ResourceConfig"]["VolumeKmsKeyId"] == PLATFORM.kms_key_arn
    assert cpu["AlgorithmSpecification"]["TrainingImage"].endswith("pytorch-training:2.8.0-cpu-py312")


def test_tensorboard_events_are_synced_beside_the_runs_artifacts():
    request = _render("llama-pretrain-fsdp", run_name="tb1")
    assert json.loads(request["HyperParameters"]["tensorboard"]) is True
    assert request["TensorBoardOutputConfig"] == {
        # The training program writes to SM_OUTPUT_DATA_DIR/tensorboard.
        "LocalPath": "/opt/ml/output/data/tensorboard",
        "S3OutputPath": f"s3://{PLATFORM.artifacts_bucket}/teams/default/llama-pretrain-fsdp/tb1/tensorboard/",
    }
    assert request["OutputDataConfig"]["S3OutputPath"] == \
        f"s3://{PLATFORM.artifacts_bucket}/teams/default/llama-pretrain-fsdp/tb1/"
    # Every attempt of a run syncs to the same prefix, so TensorBoard shows one continuing run.
    second = _render("llama-pretrain-fsdp", run_name="tb1", attempt=2)
    assert second["TensorBoardOutputConfig"] == request["TensorBoardOutputConfig"]
    assert "TensorBoardOutputConfig" not in _render("gpt2-ddp")  # the template leaves it off


def test_spot_sets_max_wait_and_managed_spot():
    request = _render("gpt2-ddp")
    assert request["EnableManagedSpotTraining"] is True
    assert request["StoppingCondition"] == {"MaxRuntimeInSeconds": 21600, "MaxWaitTimeInSeconds": 43200}
    on_demand = _render("gpt2-ddp", overrides={"spot": "false"})
    assert on_demand["EnableManagedSpotTraining"] is False
    assert on_demand["StoppingCondition"] == {"MaxRuntimeInSeconds": 21600}


# The code llama-pretrain-*@1.2.0 froze (published in templates/_code/).
CODE_1_2_0 = "sha256:d998baf26db90ca3527b8f7c91652bd8d842bc1b166d3d031fcf0b1715ecac74"


def test_smp_template_uses_the_smp_image_and_mp_parameters():
    request = _render("llama-pretrain-smp@1.1.0", overrides={"shard_degree": "8"})
    assert (
        request["AlgorithmSpecification"]["TrainingImage"]
        == "658645717510.dkr.ecr.us-east-1.amazonaws.com/smdistributed-modelparallel:2.5.1-gpu-py311-cu124"
    )
    hyperparameters = _decoded_hyperparameters(request)
    assert hyperparameters["mp_parameters"] == {
        "hybrid_shard_degree": 8,
        "tensor_parallel_degree": 1,
        "sm_activation_offloading": True,
        "activation_loading_horizon": 2,
    }
    assert hyperparameters["sagemaker_distributed_dataparallel_enabled"] is False


def test_a_run_the_frozen_program_would_refuse_at_start_is_refused_at_render():
    """The program frozen in CODE_1_2_0 resolves SMP's mesh like FSDP's full sharding and stops at
    start with a hybrid shard degree (shard_degree 8 of 16 GPUs); its own contract says so at render.
    Today's program shards SMP's way (hybrid_shard_degree)."""
    spec = CATALOG.resolve("llama-pretrain-smp@1.1.0")
    run = RunInput(run_name="r1", overrides={"shard_degree": 8})
    frozen = archive_contract(CATALOG.snapshot_path(CODE_1_2_0).read_bytes(), CODE_1_2_0)
    with pytest.raises(ProgramSettingError, match=re.escape(
        "invalid hyperparameter 'shard_degree': pipeline_parallel_degree (1) x replicate_degree (1) x "
        "shard_degree (8) x tensor_parallel_degree (1) must equal the world size 16"
    )):
        render(spec, run, PLATFORM, frozen)
    assert _decoded_hyperparameters(render(spec, run, PLATFORM, installed_contract()))["shard_degree"] == 8


def test_render_is_deterministic():
    assert _render("llama-pretrain-smp") == _render("llama-pretrain-smp")


# --- overrides ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"max_steps": 100}, {"max_steps": 100}),
        ({"max_steps": "100"}, {"max_steps": 100}),  # strings, as the CLI's --set gives them
        ({"lr": "3e-4"}, {"lr": 3e-4}),
        ({"lr": "0.001"}, {"lr": 0.001}),
        ({"compile": "true"}, {"compile": True}),
        ({"activation_checkpointing": "selective"}, {"activation_checkpointing": "selective"}),
    ],
)
def test_allowed_overrides_reach_the_hyperparameters(overrides, expected):
    hyperparameters = _decoded_hyperparameters(_render("llama-pretrain-fsdp", overrides=overrides))
    for key, value in expected.items():
        assert hyperparameters[key] == value


def test_resource_overrides_reach_the_request():
    request = _render(
        "llama-pretrain-fsdp",
        overrides={
            "instance_count": 4,
            "volume_size_gb": 1000,
            "max_runtime_seconds": 7200,
            "keep_alive_seconds": 600,
        },
    )
    assert request["ResourceConfig"]["InstanceCount"] == 4
    assert request["ResourceConfig"]["VolumeSizeInGB"] == 1000
    assert request["ResourceConfig"]["KeepAlivePeriodInSeconds"] == 600
    assert request["StoppingCondition"] == {"MaxRuntimeInSeconds": 7200}
    assert request["EnableManagedSpotTraining"] is False
    spot = _render(
        "llama-pretrain-fsdp",
        overrides={"spot": True, "max_wait_seconds": 14400, "max_runtime_seconds": 7200},
    )
    assert spot["EnableManagedSpotTraining"] is True
    assert spot["StoppingCondition"] == {"MaxRuntimeInSeconds": 7200, "MaxWaitTimeInSeconds": 14400}


@pytest.mark.parametrize(
    ("ref", "overrides", "message"),
    [
        (
            "llama-finetune-lora",
            {"instance_count": 2},
            "override 'instance_count': llama-finetune-lora@1.3.0 does not allow overriding it (did you mean "
            "'instance_type'?); it allows: ",
        ),
        ("llama-pretrain-fsdp", {"sagemaker_program": "evil.py"}, "does not allow overriding it"),
        ("llama-pretrain-fsdp", {"max_steps": 0}, "override 'max_steps': 0 is below the minimum 1"),
        ("llama-pretrain-fsdp", {"max_steps": 10**8}, "is above the maximum 10000000"),
        (
            "llama-pretrain-fsdp",
            {"lr": "fast"},
            "override 'lr': 'fast' is not a valid float; expected float >= 1e-06",
        ),
        ("llama-pretrain-fsdp", {"lr": "nan"}, "override 'lr': 'nan' is not a valid float"),
        # Enormous numbers are refused like any bad value, and quoted cut short.
        ("llama-pretrain-fsdp", {"lr": 10**400}, "override 'lr': 1000000000"),
        ("llama-pretrain-fsdp", {"lr": 10**400}, "... (401 characters) is not a valid float"),
        ("llama-pretrain-fsdp", {"max_steps": 10**400}, "(401 characters) is above the maximum"),
        ("llama-pretrain-fsdp", {"max_steps": True}, "override 'max_steps': True is not a valid int"),
        ("llama-pretrain-fsdp", {"max_steps": "1.5"}, "'1.5' is not a valid int"),
        ("llama-pretrain-fsdp", {"compile": "yes"}, "override 'compile': 'yes' is not a valid bool"),
        (
            "llama-pretrain-fsdp",
            {"seq_len": 3000},
            "override 'seq_len': 3000 is not allowed; allowed: int one of 512",
        ),
        ("llama-pretrain-fsdp", {"instance_type": "ml.g5.48xlarge"}, "'ml.g5.48xlarge' is not allowed"),
        (
            "llama-pretrain-fsdp",
            {"channels.train": "/local/path"},
            "must be an S3 URI such as s3://bucket/prefix/",
        ),
        (
            "gpt2-ddp",
            {"spot": False, "max_wait_seconds": 7200},
            "override 'max_wait_seconds': only applies to managed spot training",
        ),
    ],
)
def test_bad_overrides_are_rejected_naming_the_setting(ref, overrides, message):
    with pytest.raises(OverrideError) as error:
        _render(ref, overrides=overrides)
    assert message in str(error.value)


# --- the platform's rules -------------------------------------------------------------------------


def _problems(ref: str, platform=PLATFORM, **run) -> str:
    with pytest.raises(RequestValidationError) as error:
        _render(ref, platform, **run)
    return str(error.value)


def test_multi_node_on_a_non_efa_instance_type_is_rejected():
    message = _problems("gpt2-ddp", overrides={"instance_count": 2})
    assert (
        "instance_count 2 on ml.g5.12xlarge: more than one node needs an EFA-capable instance type" in message
    )
    # the same count on an EFA type is fine
    assert _render("gpt2-ddp", overrides={"instance_count": 2, "instance_type": "ml.p4d.24xlarge"})


def test_degrees_that_do_not_divide_the_world_size_are_refused_in_the_programs_words():
    with pytest.raises(ProgramSettingError, match=re.escape(
        "the training program refuses this run: invalid hyperparameter 'shard_degree': "
        "pipeline_parallel_degree (1) x replicate_degree (1) x shard_degree (4) x tensor_parallel_degree "
        "(8) must equal the world size 8"
    )):
        _render("llama-pretrain-hsdp-tp@1.2.0", overrides={"instance_count": 1, "shard_degree": 4,
                                                     "tensor_parallel_degree": 8})


def test_qlora_is_rejected_under_a_strategy_that_shards_the_base():
    # 1.0.0 listed nf4 among its overridable values; render refuses it, naming the fix.
    message = _problems("llama-finetune-lora@1.0.0", overrides={"quantization": "nf4"})
    assert (
        "quantization=nf4 (QLoRA) trains with strategy single or ddp, and llama-finetune-lora@1.0.0 "
        "uses fsdp: set quantization=none" in message
    )
    # 1.1.0 no longer offers it.
    with pytest.raises(OverrideError, match="llama-finetune-lora@1.1.0 does not allow overriding it"):
        _render("llama-finetune-lora@1.1.0", overrides={"quantization": "nf4"})
    request = _render("llama-finetune-qlora")
    hyperparameters = _decoded_hyperparameters(request)
    assert hyperparameters["quantization"] == "nf4" and hyperparameters["parallelism"] == "ddp"


def test_warm_pool_over_the_environments_cap_is_rejected():
    message = _problems("llama-finetune-deepspeed", platform_context(warm_pool_cap_seconds=600))
    assert "keep_alive_seconds 1800 exceeds this environment's warm-pool cap of 600 seconds" in message
    message = _problems(
        "llama-pretrain-fsdp",
        platform_context(warm_pool_cap_seconds=1800),
        overrides={"keep_alive_seconds": 3600},
    )
    assert "keep_alive_seconds 3600 exceeds" in message


def test_warm_pool_with_spot_is_rejected():
    message = _problems("gpt2-ddp", overrides={"keep_alive_seconds": 600})
    assert "warm pools do not work with managed spot training" in message


@pytest.mark.parametrize(
    ("run_name", "message"),
    [
        ("my_run", "run input 'run_name': 'my_run' must be letters, digits and single dashes"),
        ("-run", "must be letters, digits and single dashes"),
        (
            "x" * 46,
            "is 46 characters; with the job-name prefix 'llmtrain-test' and the attempt suffix "
            "it may be at most 45",
        ),
    ],
)
def test_bad_run_names_are_rejected(run_name, message):
    with pytest.raises(RunInputError, match=re.escape(message)):
        _render("gpt2-ddp", run_name=run_name)
    _render("gpt2-ddp", run_name="x" * 45)  # the longest name that fits


def test_run_input_from_dict_rejects_unknown_fields():
    with pytest.raises(RunInputError, match="run input 'instances': is not a run input field"):
        render(CATALOG.resolve("gpt2-ddp"), {"run_name": "r1", "instances": 3}, PLATFORM)
    request = render(
        CATALOG.resolve("gpt2-ddp"), {"run_name": "r1", "attempt": 3, "owner": "ada@example.com"}, PLATFORM
    )
    assert request["TrainingJobName"] == "llmtrain-test-r1-a3"
    assert {"Key": "llmtrain:owner", "Value": "ada@example.com"} in request["Tags"]
    for bad in (
        {"run_name": "r1", "attempt": 0},
        {"run_name": "r1", "attempt": True},
        {"run_name": "r1", "owner": "a,b"},
        {"attempt": 1},
    ):
        with pytest.raises(RunInputError):
            render(CATALOG.resolve("gpt2-ddp"), bad, PLATFORM)


def test_the_pipeline_degree_is_a_distribution_degree():
    request = _render("llama-pretrain-3d@1.0.0")
    hyperparameters = _decoded_hyperparameters(request)
    assert (hyperparameters["pipeline_parallel_degree"], hyperparameters["tensor_parallel_degree"],
            request["ResourceConfig"]["InstanceCount"]) == (4, 8, 16)
    # Versions without pipeline stages never send the name (their frozen code does not know it).
    assert "pipeline_parallel_degree" not in _decoded_hyperparameters(_render("llama-pretrain-hsdp-tp@1.2.0"))
    with pytest.raises(ProgramSettingError, match=re.escape(
        "invalid hyperparameter 'pipeline_parallel_degree': got 8, expected pipeline_parallel_degree x "
        "tensor_parallel_degree (8 x 8) dividing the world size 48"
    )):
        _render("llama-pretrain-3d@1.0.0", overrides={"instance_count": 6, "pipeline_parallel_degree": 8})
    # Another instance count only changes the data-parallel size (global_batch_size stays).
    smaller = _decoded_hyperparameters(_render("llama-pretrain-3d@1.0.0", overrides={"instance_count": 8}))
    assert smaller["global_batch_size"] == 256 and smaller["shard_degree"] == 0


def test_distributions_the_program_cannot_run_are_refused_at_load():
    from llmtrain.core.errors import TemplateSpecError
    from llmtrain.core.spec import TemplateSpec

    smp = CATALOG.resolve("llama-pretrain-smp").to_dict()
    smp["distribution"]["pipeline_parallel_degree"] = 2
    with pytest.raises(TemplateSpecError, match="SMP v2 has no pipeline parallelism"):
        TemplateSpec.from_dict(smp)
    ddp = CATALOG.resolve("gpt2-ddp").to_dict()
    ddp["distribution"]["smddp"] = True
    with pytest.raises(TemplateSpecError, match="'distribution.smddp' needs strategy fsdp"):
        TemplateSpec.from_dict(ddp)


def test_smddp_runs_only_on_the_instance_types_that_support_it():
    import sagemaker.fw_utils

    from llmtrain.core.spec import TemplateSpec
    from llmtrain.core.validate import SMDDP_INSTANCE_TYPES

    assert set(SMDDP_INSTANCE_TYPES) == set(sagemaker.fw_utils.SM_DATAPARALLEL_SUPPORTED_INSTANCE_TYPES) \
        - {"local_gpu"}
    data = CATALOG.resolve("llama-pretrain-fsdp").to_dict()
    data["distribution"]["smddp"] = True
    spec = TemplateSpec.from_dict(data)
    assert _decoded_hyperparameters(render(spec, RunInput(run_name="ok"), PLATFORM))[
        "collective_backend"] == "smddp"
    with pytest.raises(RequestValidationError, match="distribution.smddp runs on .*not ml.p5.48xlarge"):
        render(spec, RunInput(run_name="p5", overrides={"instance_type": "ml.p5.48xlarge"}), PLATFORM)


def test_a_global_batch_the_cluster_cannot_split_is_refused_before_a_job_exists():
    # 12 instances: 96 GPUs / (4 stages x 8 tensor-parallel) = 3 data-parallel ranks for 256 samples.
    with pytest.raises(ProgramSettingError, match=re.escape(
        "invalid hyperparameter 'global_batch_size': got 256, expected a multiple of data-parallel size x "
        "micro_batch_size (3 x 1 = 3) on this cluster"
    )):
        _render("llama-pretrain-3d", overrides={"instance_count": 12})
    _render("llama-pretrain-3d", overrides={"instance_count": 8})


# --- FP8: only where the GPU, the code and the image can run it ----------------------------------------


def test_fp8_renders_on_fp8_gpus():
    request = _render("llama-pretrain-hsdp-tp@1.3.0", overrides={"fp8": True})
    assert _decoded_hyperparameters(request)["fp8"] is True
    assert request["ResourceConfig"]["InstanceType"] == "ml.p5.48xlarge"


def test_fp8_is_refused_on_gpus_without_fp8_naming_those_with_it():
    with pytest.raises(RequestValidationError) as error:
        _render("llama-pretrain-hsdp-tp@1.3.0", overrides={"fp8": True, "instance_type": "ml.p4de.24xlarge"})
    message = str(error.value)
    assert "fp8=true" in message and "A100-80GB" in message and "compute capability 8.0" in message
    assert "ml.p5.48xlarge" in message and "ml.p5e.48xlarge" in message and "ml.p4d.24xlarge" not in message
    # without FP8 the same run renders
    _render("llama-pretrain-hsdp-tp@1.3.0", overrides={"instance_type": "ml.p4de.24xlarge"})


def test_fp8_is_refused_for_code_without_torchao_and_old_images():
    from llmtrain.core.program_contract import LEGACY_CAPABILITIES
    from llmtrain.core.validate import fp8_problems

    settings = {"fp8": True}
    current = installed_contract().capabilities
    assert fp8_problems("t@1.3.0", "ml.p5.48xlarge", settings, current, "2.8.0") == []
    assert fp8_problems("t@1.3.0", "ml.p5.48xlarge", {"fp8": False}, LEGACY_CAPABILITIES, "2.8.0") == []
    (legacy,) = fp8_problems("t@1.2.0", "ml.p5.48xlarge", settings, LEGACY_CAPABILITIES, "2.8.0")
    assert "ships no torchao" in legacy and "fp8=false" in legacy
    (old,) = fp8_problems("t@1.3.0", "ml.p5.48xlarge", settings, installed_contract().capabilities, "2.3.0")
    assert "PyTorch 2.8.0 or newer" in old and "2.3.0" in old
