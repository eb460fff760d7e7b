"""The training contract: typed parsing, validation with messages that name the field, the mesh
and the cluster rules, and the docs' tables generated from the dataclasses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from training_jobs.contract import docs
from training_jobs.contract.hyperparameters import (
    ConfigError,
    ParallelConfig,
    from_hyperparameters,
    hyperparameter_fields,
    parse_command_line,
    profile_window,
)
from training_jobs.contract.parallel_dims import ParallelDims, resolve_cluster

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
    # SMP shards over groups of shard_degree (its hybrid_shard_degree) inside its own FSDP.
    ({"parallelism": "smp", "shard_degree": 8}, 16, 2, ParallelDims(1, 1, 16, 1)),
    ({"parallelism": "smp", "tensor_parallel_degree": 2}, 16, 2, ParallelDims(1, 1, 8, 2)),
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
    ({"parallelism": "smp", "shard_degree": 3}, 16,
     "'shard_degree': got 3, expected a divisor of world size / tensor_parallel_degree = 16"),
])
def test_mesh_degrees_that_do_not_fit_are_rejected(settings, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ParallelDims.resolve(ParallelConfig(**settings), world, 1)


def test_the_docs_tables_are_generated_from_the_contract():
    """docs/training.md's hyperparameter tables and docs/architecture.md's summary are the
    contract's: a field added or changed without regenerating them fails here, naming the command."""
    stale = docs.stale_pages(REPO / "docs")
    assert not stale, f"{', '.join(stale)} stale: run `{docs.COMMAND}`"
    tables = docs.hyperparameter_tables()
    for name, (_, field, _) in hyperparameter_fields().items():
        assert f"| `{name}` |" in tables and field.metadata["help"] in tables, name
    assert "| `lr` | float | `0.0003` | > 0.0 |" in tables
    assert "| `lr_schedule` | str | `\"cosine\"` | `cosine`, `linear`, `constant` |" in tables


def test_stale_docs_are_found_and_rewritten(tmp_path):
    for page in docs.GENERATED:
        (tmp_path / page).write_text((REPO / "docs" / page).read_text().replace("Tokens per sample.", "Old."))
    assert docs.stale_pages(tmp_path) == ["training.md"]
    assert docs.main(["--check", "--docs", str(tmp_path)]) == 1
    assert docs.main(["--docs", str(tmp_path)]) == 0 and docs.stale_pages(tmp_path) == []
    (tmp_path / "training.md").write_text("no markers")
    assert docs.main(["--check", "--docs", str(tmp_path)]) == 2


def test_the_cluster_rules_run_in_the_order_the_job_runs_them():
    """resolve_cluster: the mesh, the rules that need it (GPipe with DDP-replicated stages), then the
    accumulation a global batch gives on this data-parallel size."""
    config = from_hyperparameters({"parallelism": "fsdp", "global_batch_size": 64, "micro_batch_size": 2})
    derived, dims = resolve_cluster(config, 8, 1)
    assert dims == ParallelDims(1, 1, 8, 1) and derived.data.grad_accum_steps == 4
    gpipe = from_hyperparameters({"parallelism": "ddp", "pipeline_parallel_degree": 2,
                                  "pipeline_schedule": "gpipe", "grad_accum_steps": 4})
    resolve_cluster(gpipe, 2, 1)  # one data-parallel rank: GPipe runs
    with pytest.raises(ConfigError, match="'pipeline_schedule': got 'gpipe'.*use 1f1b"):
        resolve_cluster(gpipe, 4, 1)
