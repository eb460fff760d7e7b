"""The template spec: strict parsing, with errors that name the field and say what to fix."""

from __future__ import annotations

import copy

import pytest
import yaml
from templates_support import REPO_ROOT

from llmtrain.core.errors import TemplateSpecError
from llmtrain.core.spec import TemplateSpec


def _data(name: str = "llama-pretrain-fsdp") -> dict:
    return yaml.safe_load((REPO_ROOT / "templates" / name / "1.0.0.yaml").read_text())


def test_round_trip_through_data():
    spec = TemplateSpec.from_dict(_data(), "fsdp")
    again = TemplateSpec.from_dict(spec.to_dict(), "again")
    assert again == spec
    assert spec.ref == "llama-pretrain-fsdp@1.0.0"
    assert spec.distribution.strategy == "fsdp"
    assert spec.overridable["max_steps"].min == 1
    assert spec.retry.fallback_instance_types == ("ml.p5.48xlarge",)


def _set(data: dict, path: str, value) -> dict:
    data = copy.deepcopy(data)
    # setting names such as channels.train contain a dot themselves
    *parents, last = path.split(".", 1) if path.startswith("overridable.") else path.split(".")
    node = data
    for key in parents:
        node = node[key]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return data


_DELETE = object()

# (a change to the fsdp template, what the error must say)
REJECTIONS = [
    ("compute.instance_count", True, "'compute.instance_count' must be an integer, got a boolean"),
    ("compute.instance_count", 0, "'compute.instance_count' must be >= 1"),
    ("compute.instance_type", "ml.p9.mega", "'compute.instance_type' 'ml.p9.mega' is not an instance type"),
    ("compute.gpus", 8, "unknown field(s) compute.gpus"),
    ("surprise", 1, "unknown field(s) surprise"),
    ("version", "1.0", "'version' '1.0' is not a semantic version"),
    ("name", "Llama_FSDP", "'name' 'Llama_FSDP' must be lowercase letters, digits and single dashes"),
    (
        "distribution.strategy",
        "zero",
        "'distribution.strategy' must be one of single, ddp, fsdp, deepspeed, smp",
    ),
    ("distribution.shard_degree", -1, "'distribution.shard_degree' must be >= 0"),
    (
        "distribution.smp_parameters",
        {"activation_loading_horizon": 2},
        "'distribution.smp_parameters' is only valid with strategy 'smp'",
    ),
    (
        "hyperparameters.sagemaker_program",
        "x.py",
        "sagemaker_program are reserved for the SageMaker container",
    ),
    ("hyperparameters.parallelism", "ddp", "parallelism come from the 'distribution' section"),
    (
        "hyperparameters.max_steps",
        _DELETE,
        "'max_steps' must be a hyperparameter and listed in 'overridable'",
    ),
    ("overridable.max_steps", _DELETE, "'max_steps' must be a hyperparameter and listed in 'overridable'"),
    ("overridable.lr", {"type": "float", "min": 1, "max": 0.1}, "'overridable.lr': min is greater than max"),
    (
        "overridable.lr",
        {"type": "decimal"},
        "'overridable.lr.type' must be one of int, float, bool, str, s3_uri",
    ),
    (
        "overridable.seq_len",
        {"type": "int", "choices": [1024, "2048"]},
        "'overridable.seq_len.choices' holds '2048', which is not of type int",
    ),
    ("overridable.channels.model", {"type": "s3_uri"}, "names channel 'model', which 'input.channels' lacks"),
    ("overridable.parallelism", {"type": "str"}, "the strategy is fixed by the template version"),
    ("overridable.instance_count", {"type": "str"}, "'overridable.instance_count.type' must be int"),
    ("overridable.instance_type", {"type": "str"}, "'overridable.instance_type' needs 'choices'"),
    (
        "overridable.instance_type",
        {"type": "str", "choices": ["ml.p4d.24xlarge", "ml.z9.huge"]},
        "unknown: ml.z9.huge",
    ),
    (
        "input.channels.train",
        "s3://bucket/x/",
        "'input.channels.train' must be a key prefix in the datasets bucket",
    ),
    ("input.channels", {"validation": None}, "'input.channels' must define the 'train' channel"),
    ("input.mode", "Pipe", "'input.mode' must be one of File, FastFile"),
    ("image.uri", "123.dkr.ecr.us-east-1.amazonaws.com/x:1", "'image.uri' excludes 'framework_version'"),
    ("code.entry_point", "train.py", "'code.entry_point' must be training_jobs/train.py for platform code"),
    (
        "code.source",
        "../elsewhere",
        "'code.source' must be 'platform' or a folder relative to the repository root",
    ),
    ("stopping.max_runtime_seconds", 0, "'stopping.max_runtime_seconds' must be 1..2419200"),
    ("warm_pool.keep_alive_seconds", -5, "'warm_pool.keep_alive_seconds' must be >= 0"),
    ("spot.max_wait_seconds", 60, "'spot.max_wait_seconds' must be >= 'stopping.max_runtime_seconds'"),
    ("retry.internal_error_attempts", 31, "'retry.internal_error_attempts' must be 1..30"),
    ("retry.quota_policy", "retry", "'retry.quota_policy' must be one of fail, wait"),
    ("retry.fallback_instance_types", ["ml.p9.mega"], "'retry.fallback_instance_types[0]' 'ml.p9.mega'"),
    ("retry.backoff_rate", 0.5, "'retry.backoff_rate' must be >= 1.0"),
    (
        "metrics",
        [{"name": "a", "regex": "(x)=(y)"}],
        "'metrics[0].regex' must have exactly one capture group",
    ),
    ("metrics", [{"name": "a", "regex": "x=("}], "'metrics[0].regex' does not compile"),
    (
        "metrics",
        [{"name": "a", "regex": "a=(1)"}, {"name": "a", "regex": "b=(1)"}],
        "metric names must be unique; repeated: a",
    ),
]


@pytest.mark.parametrize(
    ("path", "value", "message"), REJECTIONS, ids=[r[0] + ":" + r[2][:30] for r in REJECTIONS]
)
def test_malformed_template_is_rejected_naming_the_field(path, value, message):
    with pytest.raises(TemplateSpecError) as error:
        TemplateSpec.from_dict(_set(_data(), path, value), "fsdp.yaml")
    assert message in str(error.value)
    assert str(error.value).startswith("fsdp.yaml: ")


def test_a_quantized_base_under_fsdp_is_rejected():
    data = _set(_data("llama-finetune-lora"), "hyperparameters.quantization", "nf4")
    expected = r"quantization=nf4 \(QLoRA\) trains with strategy single or ddp"
    with pytest.raises(TemplateSpecError, match=expected):
        TemplateSpec.from_dict(data, "lora.yaml")


def test_spot_with_a_warm_pool_is_rejected():
    data = _set(_data(), "spot.enabled", True)
    data = _set(data, "warm_pool.keep_alive_seconds", 600)
    with pytest.raises(TemplateSpecError, match="warm pools do not work with managed spot training"):
        TemplateSpec.from_dict(data, "fsdp.yaml")


def test_spot_overridable_needs_a_max_wait():
    data = _set(_data(), "spot.max_wait_seconds", _DELETE)
    with pytest.raises(
        TemplateSpecError, match="'spot.max_wait_seconds' is required when runs may turn spot on"
    ):
        TemplateSpec.from_dict(data, "fsdp.yaml")


def test_smp_parameters_may_not_shadow_the_degrees():
    data = _set(_data("llama-pretrain-smp"), "distribution.smp_parameters", {"hybrid_shard_degree": 8})
    with pytest.raises(
        TemplateSpecError, match="must not set hybrid_shard_degree: they come from shard_degree"
    ):
        TemplateSpec.from_dict(data, "smp.yaml")


def _long_context(version: str) -> dict:
    path = REPO_ROOT / "templates" / "llama3-8b-long-context" / f"{version}.yaml"
    return yaml.safe_load(path.read_text())


def test_every_parallel_degree_is_declared_under_distribution():
    spec = TemplateSpec.from_dict(_long_context("1.1.0"))
    assert spec.distribution.degrees == {
        "shard_degree": 0, "replicate_degree": 1, "tensor_parallel_degree": 1,
        "pipeline_parallel_degree": 1, "context_parallel_degree": 2, "expert_parallel_degree": 1,
    }
    assert "context_parallel_degree" not in spec.hyperparameters


def test_a_published_version_that_set_a_degree_as_a_hyperparameter_reads_the_same():
    """llama3-8b-long-context@1.0.0 set context_parallel_degree under hyperparameters; its YAML stays as
    written and its spec holds the degree where every later step reads it."""
    old, new = TemplateSpec.from_dict(_long_context("1.0.0")), TemplateSpec.from_dict(_long_context("1.1.0"))
    assert old.distribution.degrees == new.distribution.degrees
    assert old.hyperparameters == new.hyperparameters
    assert old.to_dict()["hyperparameters"]["context_parallel_degree"] == 2  # the data is unchanged


def test_a_degree_set_in_both_places_is_refused():
    data = _set(_long_context("1.1.0"), "hyperparameters.context_parallel_degree", 2)
    with pytest.raises(TemplateSpecError, match="'context_parallel_degree' is set under both"):
        TemplateSpec.from_dict(data)


@pytest.mark.parametrize("name", ["context_parallel_degree", "expert_parallel_degree"])
def test_a_degree_that_cannot_be_derived_is_at_least_one(name):
    data = _set(_data(), f"distribution.{name}", 0)
    with pytest.raises(TemplateSpecError, match=f"'distribution.{name}' must be >= 1"):
        TemplateSpec.from_dict(data)
