"""The planner's mixtures of experts: their shapes against what transformers builds, active and
total parameters against the published sizes, expert states under expert parallelism, the
all-to-all's volume by link, the plan's report, --suggest's expert degree, and the refusals
before any job. Timings are checked against published runs by `python -m bench.plan`."""

from __future__ import annotations

import dataclasses
import json

import pytest

from llmtrain.cli import main
from llmtrain.core.catalog import Catalog
from llmtrain.planner import model_states, sharding
from llmtrain.planner.experts import (
    all_to_all,
    all_to_alls_per_micro_batch,
    expert_state_bytes,
    token_buffer_bytes,
)
from llmtrain.planner.plan import plan_run
from llmtrain.planner.shapes import PRESET_VOCAB, ModelShapeError, preset_shape, shape_from_hf_config
from llmtrain.planner.suggest import mesh_changes
from llmtrain.planner.workload import CURRENT, Behaviour, Layout, PlanInputError, Workload, check_model
from training_jobs.contract.parallel_dims import ParallelDims
from training_jobs.contract.presets import PRESETS, padded_vocab_size

GIB = 1024**3


def _work(preset: str = "qwen3-30b-a3b", **changes) -> Workload:
    base = Workload(model=preset_shape(preset, 4096), seq_len=4096, micro_batch_size=1,
                    grad_accum_steps=1, max_steps=10, precision="bf16", activation_checkpointing="full")
    return dataclasses.replace(base, **changes)


def _fsdp(world: int, expert: int, gpus_per_node: int = 8) -> Layout:
    dims = ParallelDims(1, 1, world, 1, expert=expert)
    return Layout("fsdp", world // gpus_per_node or 1, min(world, gpus_per_node), dims)


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_moe_shapes_are_what_transformers_builds(preset):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    family, architecture = PRESETS[preset]
    vocab = padded_vocab_size(PRESET_VOCAB[preset])
    config = AutoConfig.for_model(family, **architecture, vocab_size=vocab)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    built = {name: tuple(p.shape) for name, p in model.named_parameters()}
    planned = {p.name: p.shape for p in preset_shape(preset, 512, vocab_size=vocab).parameters()}
    assert built == planned


@pytest.mark.parametrize(
    ("preset", "total", "active"),
    # Qwen3-30B-A3B's model card: 30.5B parameters, 3.3B activated; Mixtral 8x7B's paper: 46.7B of
    # which 12.9B are used per token.
    [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("mixtral-8x7b", 46.7e9, 12.9e9)],
)
def test_total_and_active_parameters_are_the_published(preset, total, active):
    shape = preset_shape(preset, 4096)
    assert shape.num_parameters == pytest.approx(total, rel=0.01)
    assert shape.active_parameters == pytest.approx(active, rel=0.02)
    # FLOPs count the active weights only: the active ones but the embedding rows and the norms
    norms = sum(p.numel for p in shape.parameters() if p.kind == "norm")
    embedding = shape.vocab_size * shape.hidden_size
    assert shape.matmul_parameters() == shape.active_parameters - embedding - norms


def test_shared_experts_and_leading_dense_layers_are_read_from_a_config():
    tensor = Layout("fsdp", 1, 8, ParallelDims(1, 1, 4, 2))
    with pytest.raises(PlanInputError, match="'tensor_parallel_degree': got 2, expected 1 for the model, a "
                                             "mixture of experts"):
        check_model(_work(), tensor)
    context = Layout("fsdp", 1, 8, ParallelDims(1, 1, 4, 1, context=2))
    with pytest.raises(PlanInputError, match="'context_parallel_degree': got 2, expected 1"):
        check_model(_work(), context)
    with pytest.raises(PlanInputError, match="'fp8': got True, expected false for the model, a mixture"):
        check_model(_work(fp8=True), _fsdp(8, 2))
    check_model(_work(), _fsdp(8, 2))  # expert parallel under fsdp is the supported combination
    check_model(dataclasses.replace(_work("llama3-8b"), fp8=True), tensor)  # a dense model may take both
    config = {**PRESETS["qwen3-moe-tiny"][1], "model_type": "qwen3_moe", "vocab_size": 640,
              "num_hidden_layers": 3, "first_k_dense_replace": 1, "shared_expert_intermediate_size": 48}
    shape = shape_from_hf_config(config)
    names = {p.name for p in shape.parameters()}
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in names
    assert shape.moe_layers == 2
    # a token's MLP width: top-2 experts of 32 and the shared 48 in two layers, the dense 176 in one
    assert shape.token_intermediate_size == round((2 * (2 * 32 + 48) + 176) / 3)


def _states(work: Workload, layout: Layout) -> model_states.ModelStates:
    return model_states.model_states(work, layout, sharding.parameter_tensors(work))


def test_expert_slices_are_sharded_over_their_copies_and_gathers_shrink_by_the_expert_degree():
    """FSDP2 shards each rank's 1 / degree of the experts over the 16 / 8 = 2 ranks holding the
    same experts: every rank keeps 1 / 16 of the experts' states, as without expert parallelism."""
    work, split = _work(), _work(expert_parallel=8)
    without, with_ep = _states(work, _fsdp(16, 1)), _states(split, _fsdp(16, 8))
    experts = sum(p.numel for p in work.model.parameters() if p.kind == "expert")
    assert with_ep.optimizer == pytest.approx(without.optimizer, rel=1e-6)
    assert with_ep.gradients == pytest.approx(without.gradients, rel=1e-6)
    assert expert_state_bytes(split, _fsdp(16, 8)) == pytest.approx(16 * experts / 16)
    # what FSDP gathers of the last block: 16 of the 128 experts instead of all
    last = [p for p in work.model.parameters() if p.layer == 47]
    expert_gathered = 2 * sum(p.numel for p in last if p.kind == "expert")
    saved = without.details["gathered_parameter_bytes"] - with_ep.details["gathered_parameter_bytes"]
    assert saved == pytest.approx(expert_gathered * 7 / 8, rel=0.001)


def test_older_code_kept_expert_slices_whole_on_their_copies():
    """Code frozen before the copies were sharded (the MoE templates' 1.0.0, capability
    expert_copies "replicated"): each of the 2 copies kept its 1 / 8 of the experts whole."""
    older = dataclasses.replace(CURRENT, expert_copies_sharded=False)
    sharded, whole = _work(expert_parallel=8), _work(expert_parallel=8, behaviour=older)
    copies, kept = _states(sharded, _fsdp(16, 8)), _states(whole, _fsdp(16, 8))
    experts = sum(p.numel for p in sharded.model.parameters() if p.kind == "expert")
    # AdamW's two fp32 moments and the fp32 gradient: experts / 8 instead of / 16 on each rank
    assert kept.optimizer - copies.optimizer == pytest.approx(8 * experts * (1 / 8 - 1 / 16), rel=0.001)
    assert kept.gradients - copies.gradients == pytest.approx(4 * experts * (1 / 8 - 1 / 16), rel=0.001)
    assert expert_state_bytes(whole, _fsdp(16, 8)) == pytest.approx(16 * experts / 8)
    assert Behaviour.of({"expert_copies": "replicated"}).expert_copies_sharded is False
    assert CURRENT.expert_copies_sharded is True


def test_a_slice_with_fewer_experts_than_copies_is_still_split_evenly():
    """128 experts over 64 expert ranks of 256: 2 per rank, 4 copies of each slice; the program
    shards the slice on its second dimension then, and each rank keeps 1 / 256 of every expert."""
    work = _work(expert_parallel=64)
    tensors = sharding.parameter_tensors(work)
    held = sum(sharding.state_numel(p, work, 1, 256, padded=True) for p in tensors.all if p.experts)
    experts = sum(p.numel for p in work.model.parameters() if p.kind == "expert")
    assert held == experts // 256


def test_all_to_all_splits_its_volume_between_nvlink_and_efa():
    buffer = 800.0
    inside = all_to_all(buffer, 8, 8, link_bytes_per_second=100.0, network_bytes_per_second=80.0)
    assert (inside.nvlink_bytes, inside.network_bytes) == (buffer * 7 / 8, 0.0)
    assert inside.seconds == pytest.approx(7.0)
    across = all_to_all(buffer, 16, 8, link_bytes_per_second=100.0, network_bytes_per_second=80.0)
    assert across.nvlink_bytes == buffer * 7 / 16 and across.network_bytes == buffer * 8 / 16
    # the 8 GPUs of an instance share its network: 10 bytes/s each, slower than NVLink
    assert across.seconds == pytest.approx(400.0 / 10.0)
    assert all_to_all(buffer, 1, 8, 100.0, 80.0).seconds == 0.0


def test_all_to_all_count_and_buffer():
    work = _work(expert_parallel=8)
    # dispatch and combine forward, their mirrors backward, full checkpointing repeats the forward's
    assert all_to_alls_per_micro_batch(work, 48) == 6 * 48
    uncheckpointed = dataclasses.replace(work, activation_checkpointing="none")
    assert all_to_alls_per_micro_batch(uncheckpointed, 48) == 4 * 48
    assert token_buffer_bytes(work, _fsdp(16, 8), 4096) == 4096 * 8 * 2048 * 2


@pytest.fixture(scope="module")
def catalog():
    return Catalog.load()


def test_plan_reports_experts(catalog, capsys):
    plan = plan_run(catalog.resolve("qwen3-moe-pretrain"), {"max_steps": 100})
    report = plan.to_dict()
    assert report["model"]["active_parameters"] < report["model"]["parameters"] / 8
    experts = report["experts"]
    assert experts["expert_parallel_degree"] == 8 and experts["experts_per_gpu"] == 16
    # 8-GPU instances, expert degree 8: the all-to-all stays on NVLink
    assert set(experts["all_to_all_bytes_per_gpu"]) == {"expert all-to-all (NVLink)"}
    assert experts["all_to_all_seconds"] > 0
    assert plan.fits
    crossing = plan_run(catalog.resolve("qwen3-moe-pretrain"), {"expert_parallel_degree": 16})
    assert "expert all-to-all (EFA)" in crossing.to_dict()["experts"]["all_to_all_bytes_per_gpu"]
    assert crossing.speed.exposed_communication_seconds > plan.speed.exposed_communication_seconds
    assert main(["plan", "qwen3-moe-pretrain"]) == 0
    text = capsys.readouterr().out
    assert "parameters active per token" in text and "expert all-to-all (NVLink)" in text
    assert main(["plan", "llama-pretrain-fsdp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["experts"] is None


def test_expert_slices_are_gathered_and_reduced_over_their_copies_only(catalog):
    """qwen3-moe-pretrain: expert parallel 8 on 16 GPUs, so 2 copies of each slice, 8 ranks (an
    instance) apart; every other weight over all 16. At degree 16 a slice has no copy to gather."""
    plan = plan_run(catalog.resolve("qwen3-moe-pretrain"), {})
    sent = {t.name: t.bytes_per_gpu for t in plan.speed.transfers}
    experts = sum(p.numel for p in plan.workload.model.parameters() if p.kind == "expert")
    # bf16: half of the rank's 1 / 8 of the experts arrives from the other copy, every micro step
    accum = plan.workload.grad_accum_steps
    assert sent["expert fsdp all-gather (forward)"] == pytest.approx(2 * experts / 8 / 2 * accum)
    assert sent["expert fsdp reduce-scatter"] == pytest.approx(4 * experts / 8 / 2 * accum)
    others = sum(p.numel for p in plan.workload.model.parameters()) - experts
    assert sent["fsdp all-gather (forward)"] == pytest.approx(2 * others * 15 / 16 * accum, rel=0.01)
    whole = plan_run(catalog.resolve("qwen3-moe-pretrain"), {"expert_parallel_degree": 16})
    assert not any(t.name.startswith("expert fsdp") for t in whole.speed.transfers)


def test_suggest_searches_the_expert_degree_of_a_mixture_of_experts_only(catalog):
    moe = catalog.resolve("qwen3-moe-pretrain")
    changes = mesh_changes(moe, plan_run(moe, {}))
    assert {c.get("expert_parallel_degree") for c in changes} >= {1, 2, 4, 16}
    dense = catalog.resolve("llama-pretrain-3d")
    assert not any("expert_parallel_degree" in c for c in mesh_changes(dense, plan_run(dense, {})))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"expert_parallel_degree": 16, "instance_count": 1}, "divisor of the data-sharding ranks"),
        ({"model_preset": "qwen3-moe-tiny", "expert_parallel_degree": 16}, "divisor of the 8 experts"),
    ],
)
def test_plan_refuses_bad_expert_settings(capsys, overrides, message):
    args = [item for name, value in overrides.items() for item in ("--set", f"{name}={value}")]
    assert main(["plan", "qwen3-moe-pretrain", *args]) == 2
    err = capsys.readouterr().err
    assert "expert_parallel_degree" in err and message in err


def test_planner_refuses_experts_a_model_config_cannot_take():
    dense = _work("llama3-8b", expert_parallel=2)
    with pytest.raises(PlanInputError, match="'expert_parallel_degree': got 2, expected 1: the model is"):
        check_model(dense, _fsdp(8, 2))
    with pytest.raises(PlanInputError, match="a divisor of the model's 128 experts"):
        check_model(_work(expert_parallel=3), _fsdp(6, 3, gpus_per_node=6))
    tensor = Layout("fsdp", 1, 8, ParallelDims(1, 1, 4, 2))
    with pytest.raises(PlanInputError, match="'tensor_parallel_degree': got 2, expected 1 for the model, a "
                                             "mixture of experts"):
        check_model(_work(), tensor)
    context = Layout("fsdp", 1, 8, ParallelDims(1, 1, 4, 1, context=2))
    with pytest.raises(PlanInputError, match="'context_parallel_degree': got 2, expected 1"):
        check_model(_work(), context)
    with pytest.raises(PlanInputError, match="'fp8': got True, expected false for the model, a mixture"):
        check_model(_work(fp8=True), _fsdp(8, 2))
    check_model(_work(), _fsdp(8, 2))  # expert parallel under fsdp is the supported combination
    check_model(dataclasses.replace(_work("llama3-8b"), fp8=True), tensor)  # a dense model may take both
    config = {**PRESETS["qwen3-moe-tiny"][1], "model_type": "qwen3_moe", "vocab_size": 640,
              "num_experts_per_tok": 9}
    with pytest.raises(ModelShapeError, match="num_experts_per_tok 9 must be between 1 and the 8 experts"):
        shape_from_hf_config(config)
    with pytest.raises(ModelShapeError, match="multi-head latent attention"):
        shape_from_hf_config({**PRESETS["deepseek-moe-tiny"][1], "model_type": "deepseek_v3",
                              "vocab_size": 640})


@pytest.mark.parametrize(
    ("ref", "overrides", "message"),
    [
        ("qwen3-moe-pretrain", {"model_preset": "qwen3-moe-tiny", "expert_parallel_degree": 16},
         "'expert_parallel_degree': got 16, expected a divisor of the 8 experts"),
        ("qwen3-moe-pretrain", {"expert_parallel_degree": 16, "instance_count": 1},
         "'expert_parallel_degree': got 16, expected a divisor of the data-sharding ranks"),
        ("qwen3-moe-finetune", {"lora_r": 16}, "expected 1 with lora_r > 0"),
    ],
)
def test_render_refuses_bad_expert_settings_before_any_job(ref, overrides, message):
    from llmtrain.core.errors import LlmtrainError
    from llmtrain.core.render import render
    from llmtrain.core.run_settings import RunInput
    from llmtrain.core.team_context import local_context

    template = Catalog.load().resolve(ref)
    with pytest.raises(LlmtrainError, match=message):
        render(template, RunInput(run_name="r", overrides=overrides), local_context())


MOE_RUN = {"model_preset": "qwen3-moe-tiny", "parallelism": "fsdp", "mixed_precision": "bf16"}


@pytest.mark.parametrize(
    ("changes", "world_size", "message"),
    [
        ({"expert_parallel_degree": 3}, 6,
         "'expert_parallel_degree': got 3, expected a divisor of the 8 experts"),
        ({"expert_parallel_degree": 4}, 2, "'expert_parallel_degree': got 4, expected a divisor of the "
                                           "data-sharding ranks (2 of the world size 2)"),
        ({"expert_parallel_degree": 2}, 3, "divisor of the data-sharding ranks (3 of the world size 3)"),
        ({"model_overrides": {"num_experts_per_tok": 9}}, 2, "routes each token to 9 experts "
                                                             "(num_experts_per_tok) but has 8"),
        ({"model_preset": "llama-tiny", "expert_parallel_degree": 2}, 2,
         "'expert_parallel_degree': got 2, expected 1: model_preset llama-tiny is a dense llama model"),
        ({"fp8": True}, 2, "'fp8': got True, expected false for model_preset qwen3-moe-tiny"),
        ({"fp8": True, "fp8_recipe": "rowwise", "expert_parallel_degree": 2}, 2, "'fp8': got True"),
        ({"tensor_parallel_degree": 2}, 4, "'tensor_parallel_degree': got 2, expected 1 for model_preset"),
        ({"context_parallel_degree": 2}, 4, "'context_parallel_degree': got 2, expected 1 for model_preset"),
        ({"tensor_parallel_degree": 2, "expert_parallel_degree": 2}, 4,
         "expected 1 with tensor_parallel_degree"),
        ({"parallelism": "ddp", "pipeline_parallel_degree": 2, "grad_accum_steps": 4}, 2,
         "'pipeline_parallel_degree': got 2, expected 1 for model_preset qwen3-moe-tiny"),
    ],
)
def test_render_checks_refuse_what_the_program_cannot_run_with_experts(changes, world_size, message):
    """The checks render and `llmtrain plan` run before any job (the program's contract, torch-free)."""
    from llmtrain.core.errors import ProgramSettingError
    from llmtrain.core.program_contract import installed_contract

    with pytest.raises(ProgramSettingError) as refused:
        installed_contract().check({**MOE_RUN, **changes}, world_size=world_size, num_hosts=1)
    assert message in str(refused.value)


def test_render_checks_accept_the_supported_expert_combinations():
    from llmtrain.core.program_contract import installed_contract

    supported = (({"expert_parallel_degree": 2}, 2), ({"expert_parallel_degree": 2}, 4),
                 ({"expert_parallel_degree": 2, "fsdp_sharding": "grad_op"}, 4),
                 ({"expert_parallel_degree": 4, "activation_checkpointing": "full"}, 8),
                 ({"parallelism": "ddp"}, 2), ({"lora_r": 8}, 2),
                 ({"model_preset": "llama-tiny", "fp8": True, "tensor_parallel_degree": 2}, 4))
    for changes, world_size in supported:
        installed_contract().check({**MOE_RUN, **changes}, world_size=world_size, num_hosts=1)
