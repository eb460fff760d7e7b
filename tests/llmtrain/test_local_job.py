"""The local plan: what of a rendered request runs on this machine, and what is scaled down (loudly)."""

from __future__ import annotations

import json

import pytest

from llmtrain.core.catalog import Catalog
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.team_context import local_context
from llmtrain.local.job import (
    PROCESSES_PER_HOST_HP,
    LocalLimits,
    LocalRunError,
    cpu_has_bf16_matmuls,
    local_job,
)


def rendered(ref: str, **overrides) -> dict:
    template = Catalog.load().resolve(ref)
    return render(template, RunInput(run_name="plan-test", overrides=overrides), local_context())


def decoded(plan) -> dict:
    return {name: json.loads(value) for name, value in plan.hyperparameters.items()}


def adjusted(plan) -> dict[str, tuple[str, str]]:
    return {a.setting: (a.cloud, a.local) for a in plan.adjustments}


def test_default_template_is_scaled_to_two_hosts_of_two_cpu_processes_and_says_so():
    request = rendered("llama-pretrain-fsdp")
    plan = local_job(request)

    assert plan.job_name == request["TrainingJobName"]
    assert plan.hosts == ("algo-1", "algo-2")
    assert plan.processes_per_host == 2
    assert plan.world_size == 4
    changes = adjusted(plan)
    assert changes["ResourceConfig.InstanceType"][0].startswith("ml.p4d.24xlarge (8 GPUs)")
    assert changes["processes per host"] == ("8 (one per GPU)", "2")
    assert changes["HyperParameters.model_preset"] == ("llama-7b", "llama-tiny")
    assert changes["HyperParameters.seq_len"] == ("4096", "256")
    assert changes["HyperParameters.max_steps"] == ("20000", "50")
    values = decoded(plan)
    # The toolkit starts one process per GPU, and 1 on a CPU host unless this is set.
    assert values[PROCESSES_PER_HOST_HP] == 2
    assert values["model_preset"] == "llama-tiny"
    assert values["warmup_steps"] <= values["max_steps"]


def test_everything_not_adjusted_is_the_request_unchanged():
    request = rendered("llama-pretrain-fsdp")
    plan = local_job(request)
    changed = {a.setting.removeprefix("HyperParameters.") for a in plan.adjustments}
    for name, value in request["HyperParameters"].items():
        if name not in changed:
            assert plan.hyperparameters[name] == value, name
    assert plan.metric_definitions and [d.regex for d in plan.metric_definitions] == [
        m["Regex"] for m in request["AlgorithmSpecification"]["MetricDefinitions"]
    ]
    assert plan.max_runtime_seconds == request["StoppingCondition"]["MaxRuntimeInSeconds"]
    assert plan.checkpoint_subpath == "checkpoints"
    assert plan.tensorboard_subpath == "output/data/tensorboard"  # where the program writes events
    assert [c.name for c in plan.channels] == [c["ChannelName"] for c in request["InputDataConfig"]]


def test_synced_folders_outside_the_container_root_are_refused():
    request = rendered("llama-pretrain-fsdp")
    for setting in ("CheckpointConfig", "TensorBoardOutputConfig"):
        moved = {**request, setting: {**request[setting], "LocalPath": "/tmp/elsewhere"}}
        with pytest.raises(LocalRunError, match=rf"{setting}.LocalPath '/tmp/elsewhere' is outside "
                                                r"/opt/ml"):
            local_job(moved)
    assert local_job(rendered("gpt2-ddp")).tensorboard_subpath is None  # tensorboard off


def test_settings_the_user_set_are_kept_with_a_note():
    request = rendered("llama-pretrain-fsdp", model_preset="llama-1b", max_steps=80)
    plan = local_job(request, user_settings=frozenset({"model_preset", "max_steps"}))
    values = decoded(plan)
    assert values["model_preset"] == "llama-1b"
    assert values["max_steps"] == 80
    assert "HyperParameters.model_preset" not in adjusted(plan)
    assert any(note.startswith("model_preset=llama-1b is kept") for note in plan.notes)


def test_mesh_degrees_are_rederived_for_the_smaller_world():
    request = rendered("llama-pretrain-hsdp-tp")
    plan = local_job(request)
    values = decoded(plan)
    # 4 hosts x 8 GPUs with shard 2 x tensor 4 -> 2 hosts x 2 processes: tensor parallel within a host.
    assert plan.world_size == 4
    assert values["tensor_parallel_degree"] == 2
    assert values["shard_degree"] == 0
    assert values["replicate_degree"] == 0
    assert adjusted(plan)["HyperParameters.tensor_parallel_degree"] == ("4", "2")


def test_pipeline_stages_are_left_out_locally_when_the_mesh_does_not_fit():
    plan = local_job(rendered("llama-pretrain-3d"))
    values = decoded(plan)
    # 16 hosts x 8 GPUs with 4 stages x tensor 8 -> 2 hosts x 2 processes: tensor 2, no stages.
    degrees = (values["tensor_parallel_degree"], values["pipeline_parallel_degree"])
    assert plan.world_size == 4 and degrees == (2, 1)
    assert adjusted(plan)["HyperParameters.pipeline_parallel_degree"] == ("4", "1")


def test_limits_are_parameters():
    limits = LocalLimits(max_hosts=1, max_processes_per_host=1)
    plan = local_job(rendered("llama-pretrain-fsdp"), limits=limits)
    assert plan.hosts == ("algo-1",)
    assert plan.processes_per_host == 1


def test_smp_templates_are_refused_before_anything_runs():
    with pytest.raises(LocalRunError, match="SMP"):
        local_job(rendered("llama-pretrain-smp"))


def test_requests_the_container_could_not_run_name_the_field():
    request = rendered("gpt2-ddp")
    broken = json.loads(json.dumps(request))
    del broken["HyperParameters"]["sagemaker_program"]
    with pytest.raises(LocalRunError, match="sagemaker_program"):
        local_job(broken)
    outside = json.loads(json.dumps(request))
    outside["CheckpointConfig"]["LocalPath"] = "/data/checkpoints"
    with pytest.raises(LocalRunError, match="CheckpointConfig.LocalPath"):
        local_job(outside)
    groups = json.loads(json.dumps(request))
    groups["ResourceConfig"]["InstanceGroups"] = [{"InstanceGroupName": "a"}]
    with pytest.raises(LocalRunError, match="InstanceGroups"):
        local_job(groups)


BF16_CPU, AVX2_CPU = LocalLimits(bf16_matmuls=True), LocalLimits(bf16_matmuls=False)


def test_the_bf16_probe_gives_torchs_own_answer_for_this_cpu():
    import torch

    cpu_has_bf16_matmuls.cache_clear()
    assert cpu_has_bf16_matmuls() is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_gpu_only_precision_and_quantization_are_replaced():
    request = rendered("llama-finetune-lora")
    request["HyperParameters"]["mixed_precision"] = json.dumps("fp16")
    request["HyperParameters"]["quantization"] = json.dumps("nf4")
    changes = adjusted(local_job(request, limits=BF16_CPU))
    assert changes["HyperParameters.mixed_precision"] == ("fp16", "bf16")
    assert changes["HyperParameters.quantization"] == ("nf4", "none")
    slow_cpu = adjusted(local_job(request, limits=AVX2_CPU))
    assert slow_cpu["HyperParameters.mixed_precision"] == ("fp16", "fp32")


def test_a_cpu_without_bf16_matmuls_trains_in_fp32_unless_fp8_needs_bf16_or_the_user_set_it():
    request = rendered("llama-pretrain-fsdp")
    assert decoded(local_job(request, limits=BF16_CPU))["mixed_precision"] == "bf16"
    slow = local_job(request, limits=AVX2_CPU)
    assert decoded(slow)["mixed_precision"] == "fp32"
    [change] = [a for a in slow.adjustments if a.setting == "HyperParameters.mixed_precision"]
    assert (change.cloud, change.local) == ("bf16", "fp32") and "50x slower" in change.reason
    unset = json.loads(json.dumps(request))
    del unset["HyperParameters"]["mixed_precision"]  # the program's default, bf16
    assert adjusted(local_job(unset, limits=AVX2_CPU))["HyperParameters.mixed_precision"] == ("bf16", "fp32")
    fp8 = json.loads(json.dumps(request))
    fp8["HyperParameters"]["fp8"] = "true"
    assert decoded(local_job(fp8, limits=AVX2_CPU))["mixed_precision"] == "bf16"
    kept = local_job(request, limits=AVX2_CPU, user_settings=frozenset({"mixed_precision"}))
    assert decoded(kept)["mixed_precision"] == "bf16"
    assert any("mixed_precision=bf16 is kept as you set it" in note for note in kept.notes)


USER_MAX_STEPS = frozenset({"max_steps"})


def test_the_schedule_follows_a_scaled_down_max_steps_and_the_run_evaluates():
    plan = local_job(rendered("llama-finetune-lora"))
    values = decoded(plan)
    assert values["max_steps"] == 50
    # The template decays over its 1000 steps and evaluates every 100: scaled like max_steps (x0.05).
    assert adjusted(plan)["HyperParameters.lr_decay_steps"] == ("1000", "50")
    assert adjusted(plan)["HyperParameters.eval_every_steps"] == ("100", "5")
    assert values["eval_steps"] == LocalLimits().max_eval_steps


def test_a_max_steps_of_the_users_keeps_the_decay_and_says_what_it_leads_to():
    plan = local_job(rendered("llama-finetune-lora", max_steps=200), user_settings=USER_MAX_STEPS)
    values = decoded(plan)
    assert values["max_steps"] == 200 and values["lr_decay_steps"] == 1000
    # the warm-up scaled to 20 steps: 200 steps are (200 - 20) / (1000 - 20) = 18% of the decay
    assert values["warmup_steps"] == 20
    assert ("lr_decay_steps=1000 is longer than max_steps=200: the run ends 18% of the way through the "
            "learning-rate decay, far above min_lr; --set lr_decay_steps=200 decays it fully within this run"
            ) in plan.notes
    # Evaluating every 100 steps fits in 200 steps: unchanged.
    assert values["eval_every_steps"] == 100


def test_evaluation_reaches_a_short_run_of_the_users_at_its_end():
    plan = local_job(rendered("llama-finetune-lora", max_steps=30), user_settings=USER_MAX_STEPS)
    assert adjusted(plan)["HyperParameters.eval_every_steps"] == ("100", "30")


def test_a_learning_rate_scaled_by_the_global_batch_is_explained_with_its_values_and_the_fix():
    plan = local_job(rendered("gpt2-ddp"))
    # gpt2-ddp: lr 1.5e-4 per 256 samples; cloud 32 x 1 x 4 GPUs = 128 samples, local 4 x 1 x 2 = 8.
    note = next(n for n in plan.notes if n.startswith("scale_lr_by_global_batch"))
    assert "= 7.5e-05 in the cloud (128 samples per step) but 4.69e-06 here (8 samples per step, 16x fewer)" \
        in note
    assert note.endswith("--set lr=0.0024 trains at the cloud's peak rate")
    assert not any(n.startswith("scale_lr") for n in local_job(rendered("llama-finetune-lora")).notes)


def test_a_mixture_of_experts_stays_one_with_its_expert_degree_within_the_local_world():
    plan = local_job(rendered("qwen3-moe-pretrain"))
    values = decoded(plan)
    # 2 hosts x 8 GPUs with expert parallel 8 -> 2 hosts x 2 processes: expert parallel 4
    assert plan.world_size == 4
    assert (values["model_preset"], values["expert_parallel_degree"]) == ("qwen3-moe-tiny", 4)
    assert adjusted(plan)["HyperParameters.expert_parallel_degree"] == ("8", "4")
    kept = decoded(local_job(rendered("moe-tiny-local")))
    assert (kept["model_preset"], kept["expert_parallel_degree"]) == ("qwen3-moe-tiny", 2)
