"""Mixture-of-experts models in one process: the program's MoE blocks against transformers' own
implementation of each family, the grouped matmul against its fallback, the router losses on
hand-computed cases and against transformers' load_balancing_loss_func, the balance metrics, the
auxiliary-loss-free bias update, the router_collapse rule and the configuration's refusals."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from training_jobs.contract.hyperparameters import ConfigError, MoeConfig, RulesConfig, from_hyperparameters
from training_jobs.contract.presets import PRESETS
from training_jobs.trainer.moe import families
from training_jobs.trainer.moe.layer import GroupedExperts, Routing, expert_matmul, grouped_mm_runs
from training_jobs.trainer.moe.losses import sequence_balance_loss, switch_balance_loss, z_loss
from training_jobs.trainer.moe.signals import RouterSignals
from training_jobs.trainer.rules import Rules

MOE_PRESETS = ("qwen3-moe-tiny", "mixtral-tiny", "deepseek-moe-tiny")
VOCAB = 128
# torch 2.8 (the Deep Learning Container's, `make test-container`) has no grouped matmul: the experts
# take the fallback there (grouped_mm_runs), and the tests that force the kernel do not apply.
NEEDS_GROUPED_MM = pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"),
                                      reason="this torch has no torch.nn.functional.grouped_mm")
GROUPED = pytest.param(True, marks=NEEDS_GROUPED_MM)


def _hf_pair(preset: str, aux_coef: float = 0.0):
    """transformers' model of the preset's family with random weights, and a copy with our blocks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family, architecture = PRESETS[preset]
    config = AutoConfig.for_model(family, **architecture, vocab_size=VOCAB, max_position_embeddings=64,
                                  router_aux_loss_coef=aux_coef, output_router_logits=aux_coef > 0)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for module in reference.modules():  # DeepSeek-V3's bias matters to the choice: not zero
            if getattr(module, "e_score_correction_bias", None) is not None:
                module.e_score_correction_bias.normal_(0, 0.05)
    ours = copy.deepcopy(reference)
    blocks = families.install(ours)
    return reference, ours, blocks


def _batch():
    torch.manual_seed(1)
    return torch.randint(0, VOCAB, (2, 24))


@pytest.mark.parametrize("preset", MOE_PRESETS)
@pytest.mark.parametrize("grouped", [GROUPED, False], ids=["grouped_mm", "per_expert"])
def test_logits_loss_and_gradients_equal_transformers(preset, grouped):
    # qwen3_moe and mixtral with their load-balancing loss in the loss, as transformers adds it
    aux = 0.0 if preset.startswith("deepseek") else 0.1
    reference, ours, blocks = _hf_pair(preset, aux)
    assert len(blocks) == 2  # deepseek-moe-tiny: 3 layers, the first one dense
    for block in blocks:
        block.experts.grouped = grouped
    signals = RouterSignals(blocks, families.family_of(ours), MoeConfig(moe_aux_loss_coef=aux),
                            batch_group=lambda: None)
    ids = _batch()
    expected = reference(input_ids=ids, labels=ids)
    got = ours(input_ids=ids, labels=ids, output_router_logits=False)  # ours adds its own
    loss = got.loss + signals.router_loss()
    assert (got.logits - expected.logits).abs().max().item() < 1e-5
    assert loss.item() == pytest.approx(expected.loss.item(), abs=1e-5)
    if aux:
        assert expected.aux_loss.item() * aux > 1e-3  # the auxiliary loss is really in both losses
    expected.loss.backward()
    loss.backward()
    reference_grads = {name: p.grad for name, p in reference.named_parameters()}
    for name, param in ours.named_parameters():
        assert (param.grad - reference_grads[name]).abs().max().item() < 1e-5, name


def test_flops_count_only_each_tokens_top_k_routed_experts():
    """MFU counts the weights a token meets: a qwen3-moe-tiny step read 1.54 when all 8 experts
    counted where each token meets 2 (bench: 0.58)."""
    from training_jobs.trainer.models import non_embedding_parameters

    reference, model, _ = _hf_pair("qwen3-moe-tiny")
    config = model.config
    experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    assert experts == config.num_hidden_layers * config.num_experts * 3 * config.hidden_size \
        * config.moe_intermediate_size
    dense = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    inactive = experts * (config.num_experts - config.num_experts_per_tok) // config.num_experts
    assert non_embedding_parameters(model) == dense - inactive
    assert non_embedding_parameters(reference) == dense  # without our blocks: every weight counts


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_state_dict_keeps_transformers_names(preset):
    reference, ours, _ = _hf_pair(preset)
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in reference.state_dict().items()}


def test_deepseek_keeps_its_leading_dense_layers_and_shared_experts():
    _, ours, blocks = _hf_pair("deepseek-moe-tiny")
    assert [block.layer_index for block in blocks] == [1, 2]  # first_k_dense_replace = 1
    assert all(block.shared_experts is not None for block in blocks)
    assert not isinstance(ours.model.layers[0].mlp, type(blocks[0]))


@NEEDS_GROUPED_MM
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_equals_one_matmul_per_expert_with_an_idle_expert(dtype):
    torch.manual_seed(0)
    tokens = torch.randn(10, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(3, 16, 32, dtype=dtype, requires_grad=True)
    counts = torch.tensor([4, 0, 6])
    assert grouped_mm_runs(tokens, weight)
    grouped = expert_matmul(tokens, weight, counts, grouped=True)
    looped = expert_matmul(tokens, weight, counts, grouped=False)
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    assert (grouped - looped).abs().max().item() < tolerance
    upstream = torch.randn_like(grouped)
    first = torch.autograd.grad(grouped, (tokens, weight), upstream)
    second = torch.autograd.grad(looped, (tokens, weight), upstream)
    for a, b in zip(first, second, strict=True):
        assert (a - b).abs().max().item() < tolerance * 10
    assert not grouped_mm_runs(torch.randn(4, 6), torch.randn(2, 6, 8))  # rows not 16-byte aligned


@pytest.mark.parametrize("grouped", [GROUPED, False, None])
def test_experts_run_in_autocasts_dtype_whatever_the_residual_streams(grouped):
    """Under mixed precision the residual stream reaching the experts is fp32: both matmuls (grouped
    or not) run in autocast's dtype, as nn.Linear's would, so the grouped kernel never sees two dtypes
    (on CUDA the fallback's bf16 output met an fp32 down projection)."""
    torch.manual_seed(0)
    gate_up, down = torch.nn.Parameter(torch.randn(3, 64, 16)), torch.nn.Parameter(torch.randn(3, 16, 32))
    experts = GroupedExperts(gate_up, down, torch.nn.functional.silu)
    experts.grouped = grouped
    tokens, counts = torch.randn(10, 16), torch.tensor([4, 0, 6])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = experts(tokens, counts)
    assert mixed.dtype == torch.bfloat16
    full = experts(tokens, counts)
    assert full.dtype == torch.float32
    assert ((mixed.float() - full).abs().max() / full.abs().max()).item() < 2e-2


def _routing(logits: list[list[float]], indices: list[list[int]], batch_size: int = 1) -> Routing:
    return Routing(torch.tensor(logits), torch.tensor(indices), batch_size)


def test_switch_balance_loss_on_a_hand_computed_case():
    third = math.log(3.0)
    # softmax rows [.75,.25], [.75,.25], [.25,.75]; top-1 picks 0, 0, 1: f = [2/3, 1/3],
    # P = [1.75/3, 1.25/3]; E x sum f P = 2 x (3.5 + 1.25) / 9
    routing = _routing([[third, 0.0], [third, 0.0], [0.0, third]], [[0], [0], [1]])
    assert switch_balance_loss([routing], 2).item() == pytest.approx(9.5 / 9, abs=1e-6)


def test_switch_balance_loss_equals_transformers_over_several_layers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    torch.manual_seed(3)
    layers = [torch.randn(12, 6) for _ in range(3)]
    routings = [Routing(logits, torch.topk(logits.softmax(-1), 2, dim=-1)[1], 2) for logits in layers]
    expected = load_balancing_loss_func(tuple(layers), num_experts=6, top_k=2)
    assert switch_balance_loss(routings, 6).item() == pytest.approx(expected.item(), abs=1e-6)


def test_deepseek_sequence_balance_loss_on_a_hand_computed_case():
    # sigmoid scores [.75,.25] and [.5,.5] (already normalised); both tokens chose expert 0:
    # f = E/(kT) x counts = [2, 0], P = [.625, .375]: loss = 1.25
    routing = _routing([[math.log(3.0), -math.log(3.0)], [0.0, 0.0]], [[0], [0]])
    assert sequence_balance_loss([routing], 2).item() == pytest.approx(1.25, abs=1e-6)


def test_z_loss_on_a_hand_computed_case():
    routing = _routing([[0.0, 0.0], [math.log(3.0), 0.0]], [[0], [0]])
    expected = (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
    assert z_loss([routing]).item() == pytest.approx(expected, abs=1e-6)


def test_window_balance_metrics_and_bias_update(group_of_one):
    _, ours, blocks = _hf_pair("deepseek-moe-tiny")
    signals = RouterSignals(blocks, families.family_of(ours), MoeConfig(moe_bias_update_rate=0.01),
                            batch_group=lambda: None)
    for block in blocks:
        block.routing = _routing([[0.0] * 8] * 4, [[0, 1], [0, 2], [0, 3], [0, 4]])
    signals.router_loss()
    before = blocks[0].gate.e_score_correction_bias.clone()
    signals.after_update()
    moved = blocks[0].gate.e_score_correction_bias - before
    balance = signals.window_balance()
    # 8 choices over 8 experts: mean 1; expert 0 took 4 (bias down), 1-4 took 1 (unchanged), 5-7 none (up)
    assert moved.tolist() == pytest.approx([-0.01, 0, 0, 0, 0, 0.01, 0.01, 0.01])
    layer = balance.layers[0]
    assert (layer.layer, layer.load_balance, layer.max_expert_share) == (1, pytest.approx(4.0), 1.0)
    metrics = balance.metrics(step=7)
    assert metrics["moe_dropped_tokens"] == 0 and metrics["moe_load_balance_layer2"] == pytest.approx(4.0)
    # equal router probabilities: P = 1/8 each, f = [1, .25 x 4, 0 x 3]: E x sum f P = 2 (= k)
    assert metrics["moe_aux_loss"] == pytest.approx(2.0)


def test_router_collapse_rule_stops_a_collapsed_router_only():
    rules = Rules(RulesConfig(rule_warmup_steps=0))
    assert rules.judge_routing(10, 0.30, 0.25) == []
    (verdict,) = rules.judge_routing(20, 0.97, 0.25)
    assert (verdict.rule, verdict.action, verdict.step) == ("router_collapse", "stop", 20)
    assert rules.take_pending() == verdict
    quiet = Rules(RulesConfig(rule_warmup_steps=0, rule_router_collapse_action="off"))
    assert quiet.judge_routing(20, 1.0, 0.25) == []


BASE = {"model_preset": "qwen3-moe-tiny", "parallelism": "fsdp"}


@pytest.mark.parametrize(("changes", "message"), [
    ({"expert_parallel_degree": 3}, "'expert_parallel_degree': got 3, expected a divisor of the 8 experts"),
    ({"model_overrides": {"num_experts_per_tok": 9}}, "routes each token to 9 experts"),
    ({"model_preset": "llama-tiny", "expert_parallel_degree": 2}, "dense llama model"),
    ({"parallelism": "ddp", "expert_parallel_degree": 2}, "expected 1 with parallelism=ddp"),
    ({"parallelism": "deepspeed"}, "'parallelism': got 'deepspeed'"),
    ({"tensor_parallel_degree": 2, "expert_parallel_degree": 2}, "tensor_parallel_degree > 1"),
    ({"context_parallel_degree": 2, "expert_parallel_degree": 2}, "context_parallel_degree > 1"),
    ({"pipeline_parallel_degree": 2, "grad_accum_steps": 2}, "not split into pipeline stages"),
    ({"tensor_parallel_degree": 2}, "'tensor_parallel_degree': got 2, expected 1 for model_preset "
                                    "qwen3-moe-tiny: tensor parallel splits dense Llama-layout models only"),
    ({"context_parallel_degree": 2}, "'context_parallel_degree': got 2, expected 1 for model_preset "
                                     "qwen3-moe-tiny: context parallel splits"),
    ({"fp8": True, "mixed_precision": "bf16"}, "'fp8': got True, expected false for model_preset "
                                               "qwen3-moe-tiny: FP8 converts linear layers only"),
    ({"fp8": True, "fp8_recipe": "rowwise", "mixed_precision": "bf16", "expert_parallel_degree": 2},
     "'fp8': got True, expected false"),
    ({"model_preset": "mixtral-tiny", "fp8": True, "mixed_precision": "bf16"},
     "for model_preset mixtral-tiny"),
    ({"fsdp_sharding": "hybrid", "expert_parallel_degree": 2}, "expected 1 with fsdp_sharding=hybrid"),
    ({"lora_r": 8, "expert_parallel_degree": 2}, "expected 1 with lora_r > 0"),
    ({"moe_bias_update_rate": 0.001}, "only deepseek_v3 routers"),
    ({"rule_router_collapse_action": "skip"}, "'rule_router_collapse_action'"),
])
def test_bad_moe_settings_are_refused_before_any_work(changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_hyperparameters({**BASE, **changes})


def test_expert_degree_must_divide_the_data_sharding_ranks():
    from training_jobs.contract.parallel_dims import ParallelDims

    config = from_hyperparameters({**BASE, "expert_parallel_degree": 4})
    assert ParallelDims.resolve(config.parallel, 8, 1).expert_data_parallel == 2
    with pytest.raises(ConfigError, match="a divisor of the data-sharding ranks \\(2 of the world size 2\\)"):
        ParallelDims.resolve(config.parallel, 2, 1)


def test_moe_metric_line_and_its_json_line(tmp_path, capsys):
    import json
    import re

    from training_jobs.trainer.metrics import MetricsLogger
    from training_jobs.trainer.moe.signals import LayerBalance, WindowBalance

    balance = WindowBalance([LayerBalance(1, 1.25, 0.3125, 2.0104), LayerBalance(2, 1.5, 0.375, 2.0208)])
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False)
    logger.moe(balance.metrics(step=10))
    logger.close()
    (line,) = capsys.readouterr().out.splitlines()
    assert line == ("[moe] step=10 moe_aux_loss=2.015600 moe_load_balance=1.5000 moe_max_expert_share=0.3750 "
                    "moe_dropped_tokens=0 moe_load_balance_layer1=1.2500 moe_aux_loss_layer1=2.010400 "
                    "moe_load_balance_layer2=1.5000 moe_aux_loss_layer2=2.020800")
    assert re.search(r"\[moe\].* moe_load_balance=([0-9.eE+-]+)", line)[1] == "1.5000"
    (record,) = map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert record["kind"] == "moe" and record["moe_load_balance_layer2"] == 1.5


@pytest.mark.parametrize(("changes", "message"), [
    ({"tensor_parallel_degree": 2}, "'tensor_parallel_degree': got 2, expected 1 for the model channel's "
                                    "config.json: tensor parallel splits dense Llama-layout models only"),
    ({"fp8": True, "mixed_precision": "bf16"}, "'fp8': got True, expected false for the model channel's"),
    ({"expert_parallel_degree": 3}, "a divisor of the 4 experts of the model channel's config.json"),
])
def test_a_model_channels_mixture_of_experts_is_checked_as_a_preset_is(changes, message):
    """A `model` channel's config.json is only read by the program: the same rules, before any weight."""
    from training_jobs.contract import moe as moe_contract

    config = from_hyperparameters({"parallelism": "fsdp", **changes})
    mixtral = {"num_local_experts": 4, "num_experts_per_tok": 2}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        moe_contract.check_model(config, "mixtral", mixtral, "the model channel's config.json")
    if "expert_parallel_degree" not in changes:  # a dense model takes tensor parallel and FP8
        moe_contract.check_model(config, "llama", {}, "the model channel's config.json")
