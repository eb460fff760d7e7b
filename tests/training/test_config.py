"""The hyperparameter contract: typed parsing, validation with messages that name the field, and
the contract table in docs/architecture.md kept in step with the dataclasses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from training_jobs.trainer.config import (
    ConfigError,
    ParallelConfig,
    from_hyperparameters,
    hyperparameter_fields,
    parse_command_line,
    profile_window,
)
from training_jobs.trainer.parallel_dims import ParallelDims

REPO = Path(__file__).resolve().parents[2]


def test_defaults_and_grouping():
    config = from_hyperparameters({"model_preset": "llama-1b"})
    assert config.model.model_preset == "llama-1b"
    assert config.parallel.parallelism == "ddp" and config.optim.lr == 3e-4
    assert config.decay_steps == config.run.max_steps
    assert set(config.flat()) == set(hyperparameter_fields())


def test_json_values_from_sm_hps_are_typed():
    config = from_hyperparameters({
        "model_preset": "gpt2-small", "lr": 1, "max_steps": 1000.0, "compile": True,
        "model_overrides": {"n_layer": 4}, "lora_target_modules": ["q_proj", "v_proj"],
        "mp_parameters": {"hybrid_shard_degree": 8}})
    assert config.optim.lr == 1.0 and isinstance(config.optim.lr, float)
    assert config.run.max_steps == 1000 and isinstance(config.run.max_steps, int)
    assert config.parallel.compile is True
    assert config.model.model_overrides == {"n_layer": 4}
    assert config.lora.lora_target_modules == ["q_proj", "v_proj"]


def test_command_line_strings_are_typed():
    raw = parse_command_line(["--model_preset", "llama-tiny", "--lr=0.001", "--compile", "true",
                              "--model_overrides", '{"num_hidden_layers": 1}',
                              "--lora_target_modules", "q_proj,v_proj", "--max-steps", "7"])
    config = from_hyperparameters(raw)
    assert config.optim.lr == 0.001 and config.parallel.compile is True and config.run.max_steps == 7
    assert config.model.model_overrides == {"num_hidden_layers": 1}
    assert config.lora.lora_target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize(("raw", "message"), [
    ({"lerning_rate": 1}, "unknown hyperparameter 'lerning_rate'"),
    ({"max_step": 1}, "did you mean 'max_steps'?"),
    ({"compile": 1}, "invalid hyperparameter 'compile': got 1, expected true or false"),
    ({"compile": "yes"}, "invalid hyperparameter 'compile'"),
    ({"seq_len": 2.5}, "invalid hyperparameter 'seq_len': got 2.5, expected an integer"),
    ({"seq_len": True}, "invalid hyperparameter 'seq_len'"),
    ({"lr": 0}, "invalid hyperparameter 'lr': got 0.0, expected a value > 0.0"),
    ({"zero_stage": 4}, "invalid hyperparameter 'zero_stage': got 4, expected a value <= 3"),
    ({"adam_beta2": 1.0}, "invalid hyperparameter 'adam_beta2'"),
    ({"fsdp_sharding": "FULL"}, "expected one of full, hybrid, grad_op"),
    ({"model_preset": "llama-3b"}, "invalid hyperparameter 'model_preset': got 'llama-3b'"),
    ({"model_overrides": "[1]"}, "invalid hyperparameter 'model_overrides'"),
    ({"model_overrides": "{oops"}, "expected a JSON dict"),
    ({"lora_target_modules": [1, 2]}, "invalid hyperparameter 'lora_target_modules'"),
    ({"min_lr": 1.0}, "invalid hyperparameter 'min_lr': got 1.0, expected a value <= lr"),
    ({"warmup_steps": 2000}, "invalid hyperparameter 'warmup_steps'"),
    ({"profile_steps": "7-5"}, "invalid hyperparameter 'profile_steps'"),
    ({"tensor_parallel_degree": 2}, "1 with parallelism=ddp"),
    ({"parallelism": "fsdp", "replicate_degree": 2}, "unless fsdp_sharding=hybrid"),
    ({"offload_params": True}, "offload needs fsdp or deepspeed"),
    ({"offload_optimizer": True}, "invalid hyperparameter 'offload_optimizer'"),
    ({"parallelism": "deepspeed", "offload_params": True}, "unless zero_stage=3"),
    ({"quantization": "nf4"}, "unless lora_r > 0"),
    ({"merge_lora": True}, "false unless lora_r > 0"),
    ({"lora_r": 8, "quantization": "nf4", "merge_lora": True}, "false with quantization=nf4"),
    ({"parallelism": "fsdp", "tensor_parallel_degree": 2, "lora_r": 8}, "LoRA with tensor parallel"),
    ({"activation_offloading": True}, "activation_checkpointing is full or selective"),
    ({"parallelism": "fsdp", "mixed_precision": "fp16"}, "bf16 or fp32 with fsdp"),
    ({"parallelism": "single", "compile_mode": "cuda_graphs"}, "unless compile=true"),
    ({"compile": True, "compile_mode": "cuda_graphs", "parallelism": "fsdp"}, "parallelism=single"),
    ({"compile": True, "compile_mode": "cuda_graphs", "parallelism": "single", "grad_accum_steps": 2},
     "grad_accum_steps=1"),
])
def test_invalid_values_name_the_hyperparameter(raw, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_hyperparameters({"model_preset": "llama-tiny", **raw})


def test_command_line_shape_errors():
    with pytest.raises(ConfigError, match="pass hyperparameters as --name value"):
        parse_command_line(["train.py"])
    with pytest.raises(ConfigError, match="has no value"):
        parse_command_line(["--lr"])


def test_profile_window():
    assert profile_window("") is None
    assert profile_window("5-7") == (5, 7)


@pytest.mark.parametrize(("settings", "world", "hosts", "expected"), [
    ({"parallelism": "ddp"}, 8, 1, ParallelDims(1, 8, 1, 1)),
    ({"parallelism": "fsdp"}, 8, 1, ParallelDims(1, 1, 8, 1)),
    ({"parallelism": "fsdp", "fsdp_sharding": "hybrid"}, 16, 2, ParallelDims(1, 2, 8, 1)),
    ({"parallelism": "fsdp", "fsdp_sharding": "hybrid", "replicate_degree": 2}, 4, 1,
     ParallelDims(1, 2, 2, 1)),
    ({"parallelism": "fsdp", "tensor_parallel_degree": 2}, 8, 1, ParallelDims(1, 1, 4, 2)),
    ({"parallelism": "fsdp", "fsdp_sharding": "hybrid", "tensor_parallel_degree": 2}, 16, 2,
     ParallelDims(1, 2, 4, 2)),
    ({"parallelism": "deepspeed"}, 4, 1, ParallelDims(1, 4, 1, 1)),
    ({"parallelism": "ddp", "pipeline_parallel_degree": 2}, 8, 1, ParallelDims(2, 4, 1, 1)),
    ({"parallelism": "fsdp", "pipeline_parallel_degree": 4, "tensor_parallel_degree": 8,
      "fsdp_sharding": "hybrid"}, 256, 32, ParallelDims(4, 8, 1, 8)),
])
def test_mesh_degrees_resolve_to_the_world_size(settings, world, hosts, expected):
    dims = ParallelDims.resolve(ParallelConfig(**settings), world, hosts)
    assert dims == expected and dims.world_size == world


@pytest.mark.parametrize(("settings", "world", "message"), [
    ({"parallelism": "fsdp", "tensor_parallel_degree": 3}, 8, "(1 x 1 x 3) dividing the world size 8"),
    ({"parallelism": "fsdp", "context_parallel_degree": 3}, 8,
     "'context_parallel_degree': got 3, expected pipeline_parallel_degree x context_parallel_degree x "
     "tensor_parallel_degree (1 x 3 x 1) dividing the world size 8"),
    ({"parallelism": "fsdp", "shard_degree": 3}, 8, "must equal the world size 8"),
    ({"parallelism": "fsdp", "fsdp_sharding": "hybrid", "replicate_degree": 3}, 8, "a divisor"),
    ({"parallelism": "single"}, 2, "2 processes were launched"),
    ({"parallelism": "ddp", "shard_degree": 4}, 8, "invalid hyperparameter 'shard_degree'"),
    ({"parallelism": "fsdp", "pipeline_parallel_degree": 3}, 8,
     "'pipeline_parallel_degree': got 3, expected pipeline_parallel_degree x context_parallel_degree x "
     "tensor_parallel_degree (3 x 1 x 1) dividing the world size 8"),
])
def test_mesh_degrees_that_do_not_fit_are_rejected(settings, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ParallelDims.resolve(ParallelConfig(**settings), world, 1)


def test_contract_table_in_architecture_doc_names_every_hyperparameter():
    """docs/architecture.md's table and training_jobs/trainer/config.py must change together."""
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text.split("### The training program's hyperparameters")[1].split("### ")[0]
    documented = set(re.findall(r"`([a-z0-9_]+)`", table.split("| name | type | meaning |")[1]))
    names = set(hyperparameter_fields())
    assert names <= documented, f"missing from docs/architecture.md: {sorted(names - documented)}"


def test_training_doc_documents_every_hyperparameter():
    text = (REPO / "docs" / "training.md").read_text()
    missing = [name for name in hyperparameter_fields() if f"`{name}`" not in text]
    assert not missing, f"missing from docs/training.md: {missing}"
