"""Every parallelism gives the loss curve of the DDP reference on the same data.

Same seed, same global batch, same sample order. Bit for bit equal to DDP: FSDP2 grad-op sharding
and DeepSpeed ZeRO-1 (both reduce gradients once per optimizer step, like DDP), FSDP2 full sharding
and ZeRO-2 without gradient accumulation (with accumulation they reduce after every micro step to
keep gradients sharded, which sums (a1+b1)+(a2+b2) instead of DDP's (a1+a2)+(b1+b2)); activation
checkpointing changes no loss at all. Within 1e-5, because the floating-point sums are associated
differently: full sharding and ZeRO-2 with accumulation, hybrid sharding on 2x2 (four ranks'
gradients summed as (a+b)+(c+d), against the ring order of DDP's all-reduce), tensor parallel alone
or under FSDP (a split matmul) and ZeRO-3 (partitioned reductions).

The exact comparisons run without gradient clipping: the global gradient norm is a sum over
differently partitioned shards in each strategy, so it can differ in the last bit, and so can the
clipping factor. Clipping is compared separately, within 1e-5, on runs where it engages.
"""

from __future__ import annotations

import json

import pytest
import torch

from .conftest import TINY, job_root, losses, outcome, run_jobs, train_records

pytestmark = pytest.mark.slow

VALIDATION = "with the validation channel"
TWO_RANK_JOBS: dict[str, dict] = {
    "ddp": {"parallelism": "ddp"},
    "fsdp_full": {"parallelism": "fsdp", "fsdp_sharding": "full"},
    "fsdp_grad_op": {"parallelism": "fsdp", "fsdp_sharding": "grad_op"},
    "fsdp_ac_full": {"parallelism": "fsdp", "activation_checkpointing": "full",
                     "activation_offloading": True},
    "ddp_ac_selective_every_2": {"parallelism": "ddp", "activation_checkpointing": "selective",
                                 "activation_checkpointing_every": 2},
    "tp": {"parallelism": "fsdp", "tensor_parallel_degree": 2, "micro_batch_size": 4},
    "zero1": {"parallelism": "deepspeed", "zero_stage": 1},
    "zero2": {"parallelism": "deepspeed", "zero_stage": 2},
    "ddp_no_accumulation": {"parallelism": "ddp", "micro_batch_size": 4, "grad_accum_steps": 1,
                            VALIDATION: True, "eval_every_steps": 2, "preflight_check": True,
                            "tensorboard": True, "profile_steps": "2-3"},
    "zero2_no_accumulation": {"parallelism": "deepspeed", "zero_stage": 2, "micro_batch_size": 4,
                              "grad_accum_steps": 1, VALIDATION: True, "eval_every_steps": 2},
    "fsdp_full_no_accumulation": {"parallelism": "fsdp", "micro_batch_size": 4, "grad_accum_steps": 1},
    "fsdp_cpu_offload_no_accumulation": {"parallelism": "fsdp", "offload_params": True,
                                         "micro_batch_size": 4, "grad_accum_steps": 1},
    "zero3": {"parallelism": "deepspeed", "zero_stage": 3},
    "zero3_offload": {"parallelism": "deepspeed", "zero_stage": 3, "offload_params": True,
                      "offload_optimizer": True},
    "gpt2_ddp": {"parallelism": "ddp", "model_preset": "gpt2-tiny"},
    "gpt2_fsdp": {"parallelism": "fsdp", "model_preset": "gpt2-tiny"},
    "ddp_clipped": {"parallelism": "ddp", "max_grad_norm": 1.0},
    "fsdp_clipped": {"parallelism": "fsdp", "max_grad_norm": 1.0},
    "zero2_clipped": {"parallelism": "deepspeed", "zero_stage": 2, "max_grad_norm": 1.0},
    "ddp_bf16": {"parallelism": "ddp", "mixed_precision": "bf16"},
    "fsdp_bf16": {"parallelism": "fsdp", "mixed_precision": "bf16"},
    "zero2_bf16": {"parallelism": "deepspeed", "zero_stage": 2, "mixed_precision": "bf16"},
    "fsdp_compiled": {"parallelism": "fsdp", "compile": True},
}
FOUR_RANK_JOBS: dict[str, dict] = {
    "ddp4": {"parallelism": "ddp", "micro_batch_size": 1},
    "hsdp_2x2": {"parallelism": "fsdp", "fsdp_sharding": "hybrid", "replicate_degree": 2,
                 "micro_batch_size": 1},
    "fsdp_tp_2x2": {"parallelism": "fsdp", "tensor_parallel_degree": 2},
}


def _launch(tmp_path_factory, tiny_data, nproc: int, jobs: dict[str, dict]) -> dict:
    base = tmp_path_factory.mktemp(f"ranks{nproc}")
    roots = {name: job_root(base / name, tiny_data, validation=hps.get(VALIDATION, False))
             for name, hps in jobs.items()}
    completed = run_jobs(nproc, [(roots[name], {**TINY, **{k: v for k, v in hps.items() if k != VALIDATION}})
                                 for name, hps in jobs.items()], base)
    roots["launch output"] = completed.output
    return roots


@pytest.fixture(scope="module")
def two(tmp_path_factory, tiny_data):
    return _launch(tmp_path_factory, tiny_data, 2, TWO_RANK_JOBS)


@pytest.fixture(scope="module")
def four(tmp_path_factory, tiny_data):
    return _launch(tmp_path_factory, tiny_data, 4, FOUR_RANK_JOBS)


def test_every_job_finished(two, four):
    for roots, jobs in ((two, TWO_RANK_JOBS), (four, FOUR_RANK_JOBS)):
        for name in jobs:
            assert outcome(roots[name]) == {"ok": True}, name
            assert len(train_records(roots[name])) == TINY["max_steps"], name


def test_reference_learns(two):
    records = train_records(two["ddp"])
    assert records[-1]["loss"] < records[0]["loss"] - 0.05


def test_gradient_clipping_engages_and_agrees_across_strategies(two):
    reference = losses(two["ddp_clipped"])
    assert max(r["grad_norm"] for r in train_records(two["ddp"])) > 1.0
    assert reference[1:] != losses(two["ddp"])[1:]  # clipping to 1.0 changed the updates
    for name in ("fsdp_clipped", "zero2_clipped"):
        assert losses(two[name]) == pytest.approx(reference, abs=1e-5, rel=0), name


@pytest.mark.parametrize("name", ["fsdp_grad_op", "zero1"])
def test_sharded_data_parallel_equals_ddp_exactly(two, name):
    assert losses(two[name]) == losses(two["ddp"])


@pytest.mark.parametrize("name", ["fsdp_full_no_accumulation", "fsdp_cpu_offload_no_accumulation",
                                  "zero2_no_accumulation"])
def test_sharding_gradients_equals_ddp_exactly_without_accumulation(two, name):
    assert losses(two[name]) == losses(two["ddp_no_accumulation"])


@pytest.mark.parametrize("name", ["fsdp_full", "zero2"])
def test_sharded_gradient_accumulation_within_1e_5(two, name):
    assert losses(two[name]) == pytest.approx(losses(two["ddp"]), abs=1e-5, rel=0)


def test_hybrid_sharding_2x2_within_1e_5_of_ddp(four):
    assert losses(four["hsdp_2x2"]) == pytest.approx(losses(four["ddp4"]), abs=1e-5, rel=0)


@pytest.mark.parametrize(("name", "without"), [("fsdp_ac_full", "fsdp_full"),
                                               ("ddp_ac_selective_every_2", "ddp")])
def test_activation_checkpointing_changes_no_loss(two, name, without):
    assert losses(two[name]) == losses(two[without])


@pytest.mark.parametrize("name", ["tp", "zero3", "zero3_offload", "fsdp_compiled"])
def test_tensor_parallel_zero3_and_compile_within_1e_5(two, name):
    assert losses(two[name]) == pytest.approx(losses(two["ddp"]), abs=1e-5, rel=0)


def test_fsdp_with_tensor_parallel_within_1e_5_of_ddp(two, four):
    # dp=2 x tp=2 on four ranks has the same global batch as DDP on two ranks.
    assert losses(four["fsdp_tp_2x2"]) == pytest.approx(losses(two["ddp"]), abs=1e-5, rel=0)


def test_gpt2_with_tied_embeddings_fsdp_agrees_with_ddp(two):
    assert losses(two["gpt2_fsdp"]) == pytest.approx(losses(two["gpt2_ddp"]), abs=1e-5, rel=0)


def test_grad_norm_and_lr_agree_across_strategies(two):
    reference = train_records(two["ddp"])
    for name in ("fsdp_full", "zero2", "tp"):
        records = train_records(two[name])
        assert [r["lr"] for r in records] == [r["lr"] for r in reference], name
        assert [r["grad_norm"] for r in records] == pytest.approx(
            [r["grad_norm"] for r in reference], rel=1e-5), name


def _exported(root) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(root / "model" / "model.safetensors"))


@pytest.mark.parametrize(("name", "reference"), [("fsdp_grad_op", "ddp"), ("zero1", "ddp"),
                                               ("fsdp_full_no_accumulation", "ddp_no_accumulation"),
                                               ("zero2_no_accumulation", "ddp_no_accumulation")])
def test_exports_of_exact_strategies_are_identical(two, name, reference):
    expected, exported = _exported(two[reference]), _exported(two[name])
    assert exported.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(exported[key], tensor), key


def _checkpoint_weights(folder, tmp_path) -> dict[str, torch.Tensor]:
    """The model weights of a torch.distributed.checkpoint folder, read without any process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp_path / f"{folder.parent.parent.name}.pt"
    dcp_to_torch_save(str(folder), str(target))
    return torch.load(target, weights_only=False)["model"]


@pytest.mark.parametrize("name", ["fsdp_full", "gpt2_fsdp", "tp"])
def test_full_export_reloads_with_transformers_and_same_logits(two, name, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = two[name]
    exported = AutoModelForCausalLM.from_pretrained(str(root / "model")).eval()
    trained = AutoModelForCausalLM.from_config(exported.config).eval()
    trained.load_state_dict(_checkpoint_weights(root / "checkpoints" / "step_00000004", tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(str(root / "model"))
    inputs = tokenizer(["The old farmer visits the green field slowly."], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(exported(**inputs).logits, trained(**inputs).logits)


@pytest.mark.parametrize("name", ["ddp_bf16", "fsdp_bf16", "zero2_bf16"])
def test_bf16_mixed_precision_trains_close_to_fp32(two, name):
    curve, reference = losses(two[name]), losses(two["ddp"])
    assert curve[-1] < curve[0]
    assert curve == pytest.approx(reference, abs=0.05)


def _eval_records(root) -> list[dict]:
    lines = (root / "output" / "data" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "eval"]


def test_periodic_evaluation_on_the_validation_channel(two):
    evaluations = _eval_records(two["ddp_no_accumulation"])
    assert [r["step"] for r in evaluations] == [2, 4]
    assert evaluations[1]["eval_loss"] < evaluations[0]["eval_loss"]
    assert _eval_records(two["zero2_no_accumulation"]) == evaluations  # exactly, as the losses
    assert "[eval] step=2 eval_loss=" in two["launch output"]


def test_tensorboard_profiler_and_preflight_outputs(two):
    output = two["ddp_no_accumulation"] / "output" / "data"
    assert list((output / "tensorboard").iterdir())
    traces = sorted(p.name for p in (output / "profile").iterdir())
    assert traces == ["trace_rank0_steps2-3.json", "trace_rank1_steps2-3.json"]
    assert "ProfilerStep" in (output / "profile" / traces[0]).read_text() or \
        "aten::" in (output / "profile" / traces[0]).read_text()
    assert "[train] preflight ok: 2 ranks" in two["launch output"]
