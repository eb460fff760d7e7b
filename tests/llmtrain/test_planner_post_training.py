"""The planner's post-training objectives (llmtrain.planner.objective_load, post_training): DPO's two
rows per pair and its reference (memory and forwards), GRPO's sampling (prefill and decode, KV
cache) and its optional reference, each against the next-token plan of the same rows and against
counts by hand. Timings are the planner's, not measured."""

from __future__ import annotations

import json

import pytest

from llmtrain.cli import main
from llmtrain.core.instances import instance_type
from llmtrain.planner import memory, speed
from llmtrain.planner.compute_times import layer_times
from llmtrain.planner.objective_load import OBJECTIVE_LOADS
from llmtrain.planner.post_training import RECAST_BYTES, decode_weight_bytes
from llmtrain.planner.precision import FP32, LOW
from llmtrain.planner.speed_calibration import CALIBRATION
from llmtrain.planner.workload import workload_and_layout
from training_jobs.contract.objectives import OBJECTIVES

P4D = instance_type("ml.p4d.24xlarge")
GPU = P4D.gpu_model
BASE = {
    "model_preset": "llama-7b",
    "seq_len": 1024,
    "micro_batch_size": 2,
    "grad_accum_steps": 4,
    "mixed_precision": "bf16",
    "activation_checkpointing": "none",
    "parallelism": "fsdp",
}


def _plan(**hyperparameters):
    work, layout = workload_and_layout({**BASE, **hyperparameters}, P4D.gpus, 1)
    rate = speed.estimate(work, layout, speed.Cluster.of(P4D, 1))
    return work, layout, rate, memory.estimate(work, layout, GPU.memory_bytes)


def _forward(work, layout) -> float:
    return layer_times(work, layout, GPU, CALIBRATION, list(range(work.model.num_layers)), head=True).forward


def test_every_objective_of_the_contract_has_a_load():
    assert set(OBJECTIVE_LOADS) == set(OBJECTIVES)


def test_a_dpo_step_is_two_policy_passes_and_two_reference_forwards():
    """Per pair: chosen and rejected through the policy's forward and backward, and through the
    reference's forward: (2 fwd+bwd + 2 fwd) / (1 fwd+bwd) of next-token training on the pair's
    prompt-and-completion rows, about 2 + 2/3 without checkpointing (backward ~ 2 forwards)."""
    sft_work, layout, sft, _ = _plan()
    dpo_work, _, dpo, _ = _plan(objective="dpo")
    assert (dpo_work.micro_batch_size, dpo_work.seq_len) == (2 * sft_work.micro_batch_size, sft_work.seq_len)
    assert dpo_work.samples_per_micro_batch == sft_work.micro_batch_size
    assert sft.objective.named() == {}
    assert dpo.compute_seconds == pytest.approx(2 * sft.compute_seconds)
    reference = dpo.objective.named()["reference_forward"]
    assert reference == pytest.approx(2 * BASE["grad_accum_steps"] * _forward(sft_work, layout))
    ratio = (dpo.compute_seconds + reference) / sft.compute_seconds
    assert 2.55 < ratio < 2.75
    assert dpo.step_seconds == pytest.approx(
        dpo.compute_seconds + dpo.exposed_communication_seconds + dpo.optimizer_seconds + reference
    )


def test_dpo_reference_memory_with_a_copy_and_without_one():
    """A frozen copy holds the model's parameters again, stored like the policy's (fp32 shards under
    FSDP2, fp32 replicas under DDP); LoRA's adapters-off reference and precomputed log-probabilities
    hold none, and precomputed runs no reference forward either."""
    _, _, _, sft_memory = _plan()
    work, _, copy_speed, copy = _plan(objective="dpo")
    assert work.objective.reference == "copy"
    assert copy.reference == sft_memory.parameters > 0
    assert copy.per_gpu - sft_memory.per_gpu > copy.reference

    _, _, lora_speed, lora = _plan(objective="dpo", lora_r=16)
    assert lora.reference == 0 and "reference_forward" in lora_speed.objective.named()

    _, _, pre_speed, pre = _plan(objective="dpo", dpo_reference="precomputed")
    assert pre.reference == 0 and pre_speed.objective.named() == {}
    assert pre_speed.compute_seconds == pytest.approx(copy_speed.compute_seconds)

    ddp_work, _, _, ddp = _plan(objective="dpo", parallelism="ddp", model_preset="llama-1b")
    assert ddp.reference == FP32 * ddp_work.model.num_parameters


GRPO = {
    "objective": "grpo",
    "parallelism": "ddp",
    "model_preset": "llama-1b",
    "seq_len": 256,
    "micro_batch_size": 1,
    "grpo_group_size": 4,
    "grpo_max_new_tokens": 128,
    "lora_r": 16,
}


def test_grpo_trains_prompt_and_completion_rows_after_sampling_them():
    work, layout, rate, estimate = _plan(**GRPO)
    assert (work.micro_batch_size, work.seq_len) == (4, 256 + 128)
    named = rate.objective.named()
    assert set(named) == {"generation_prefill", "generation_decode"}  # no KL penalty: no reference
    # every decode step reads the weights at least once (the frozen base recast from fp32 each step)
    floor = BASE["grad_accum_steps"] * 128 * decode_weight_bytes(work, layout) / GPU.memory_bytes_per_second
    assert named["generation_decode"] >= floor
    assert estimate.reference == 0
    m = work.model
    assert estimate.sampling == 4 * (256 + 128) * m.num_layers * 2 * m.kv_size * LOW


def test_decode_reads_trained_weights_once_cast_and_frozen_ones_recast():
    """The token embedding reads one row per token; a tied output head (llama-1b's) reads the table."""
    full, layout, _, _ = _plan(**{**GRPO, "lora_r": 0})
    assert full.model.tie_embeddings and decode_weight_bytes(full, layout) == LOW * full.model.num_parameters
    untied, _, _, _ = _plan(**{**GRPO, "lora_r": 0, "model_preset": "llama-7b"})
    embedding = untied.model.vocab_size * untied.model.hidden_size
    assert decode_weight_bytes(untied, layout) == LOW * (untied.model.num_parameters - embedding)
    lora, _, _, _ = _plan(**GRPO)
    assert decode_weight_bytes(lora, layout) > RECAST_BYTES / LOW * decode_weight_bytes(full, layout)


def test_grpo_sampling_scales_with_the_group_and_the_completion_length():
    """Twice the group: twice the rows to train and to prefill; decoding reads the same weights per
    token step for all the rows, so it grows by less than twice (memory-bound). Twice the tokens
    sampled: at least twice the decode steps."""
    _, _, four, _ = _plan(**GRPO)
    _, _, eight, _ = _plan(**{**GRPO, "grpo_group_size": 8})
    _, _, longer, _ = _plan(**{**GRPO, "grpo_max_new_tokens": 256})
    small, large = four.objective.named(), eight.objective.named()
    assert eight.compute_seconds == pytest.approx(2 * four.compute_seconds)
    assert large["generation_prefill"] == pytest.approx(2 * small["generation_prefill"])
    assert small["generation_decode"] < large["generation_decode"] < 2 * small["generation_decode"]
    assert longer.objective.named()["generation_decode"] >= 2 * small["generation_decode"]


def test_grpo_kl_penalty_adds_a_reference():
    _, _, lora_speed, lora = _plan(**GRPO, grpo_beta=0.04)
    assert "reference_forward" in lora_speed.objective.named() and lora.reference == 0
    work, _, _, full = _plan(**{**GRPO, "lora_r": 0}, grpo_beta=0.04)
    assert full.reference == FP32 * work.model.num_parameters


def test_plan_names_the_objectives_terms(capsys):
    assert main(["plan", "llama-dpo"]) == 0
    text = capsys.readouterr().out
    assert "reference forward" in text and "a frozen copy of the model" in text
    assert main(["plan", "llama-grpo", "--set", "seq_len=256", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["throughput"]["objective_seconds"]) == {"generation_prefill", "generation_decode"}
    assert data["memory"]["sampling_kv_cache_bytes"] > 0
    assert data["workload"]["rows_per_sample"] == 8
    assert data["workload"]["global_batch_size"] == 2 * 4 * 8
