"""Pipeline parallelism's pure parts, and the settings around it, in one process: the stage split,
the stages' model slices, the mesh degrees, resuming on another shape, and the refusals (SMP v2,
FP8 and SMDDP outside the hardware they need). The distributed runs are in test_pipeline.py."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from training_jobs.contract.hyperparameters import ConfigError, ParallelConfig, from_hyperparameters
from training_jobs.contract.parallel_dims import ParallelDims, with_global_batch
from training_jobs.contract.stage_split import balanced_split, stage_indices
from training_jobs.trainer import parallel
from training_jobs.trainer.errors import ContainerError
from training_jobs.trainer.float8 import apply_float8
from training_jobs.trainer.stage_model import CausalLMStage, stage_of_parameter
from training_jobs.trainer.strategies.pipeline import layer_stages

PIPELINE = {"parallelism": "fsdp", "pipeline_parallel_degree": 2, "grad_accum_steps": 4}


def _brute_force_best(layers: int, stages: int, head: float) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        counts = [b - a for a, b in zip((0, *cuts), (*cuts, layers), strict=True)]
        best = min(best, max(*counts[:-1], counts[-1] + head) if stages > 1 else counts[0] + head)
    return best


def test_the_balanced_split_is_as_cheap_as_the_best_possible():
    for layers, head in itertools.product(range(2, 10), (0.0, 0.6, 1.5, 3.0)):
        for stages in range(1, min(layers, 4) + 1):
            counts = balanced_split(layers, stages, head)
            assert len(counts) == stages and sum(counts) == layers and min(counts) >= 1
            cost = max(*counts[:-1], counts[-1] + head) if stages > 1 else counts[0] + head
            assert cost == pytest.approx(_brute_force_best(layers, stages, head)), (layers, stages, head)


def test_llama_70b_on_four_stages_gives_the_head_stage_fewer_layers():
    # The head (8192 x 128256) is 1.2 layers' worth of matmuls.
    assert balanced_split(80, 4, 8192 * 128256 / 855_654_400) == (21, 20, 20, 19)
    with pytest.raises(ConfigError, match="8 pipeline stages need at least as many decoder layers"):
        balanced_split(4, 8, 0.1)


def test_stages_loop_over_the_pipeline_ranks():
    assert [stage_indices(rank, 2, 1) for rank in range(2)] == [[0], [1]]
    assert [stage_indices(rank, 2, 2) for rank in range(2)] == [[0, 2], [1, 3]]
    stages = layer_stages((1, 2, 1))
    assert stages == [0, 1, 1, 2]
    names = ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.2.input_layernorm.weight", "model.layers.3.self_attn.q_proj.weight",
             "model.norm.weight", "lm_head.weight")
    assert [stage_of_parameter(name, stages) for name in names] == [0, 0, 1, 2, 2, 2]


def _tiny(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=96, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_two_stages_compute_exactly_what_the_whole_model_computes(model_type):
    import copy

    whole = _tiny(model_type)
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    first = CausalLMStage(copy.deepcopy(whole), [0], first=True, last=False)
    last = CausalLMStage(copy.deepcopy(whole), [1, 2], first=False, last=True)
    with torch.no_grad():
        assert torch.equal(last(first(tokens)), whole(input_ids=tokens).logits)
    names = {name for stage in (first, last) for name, _ in stage.named_parameters()}
    assert names == {name for name, _ in whole.named_parameters()}  # the whole model's names
    assert len(parallel.decoder_layers(last)) == 2


def test_models_the_stages_cannot_hold_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96))
    with pytest.raises(ConfigError, match="gpt2 models cannot be split into pipeline stages"):
        CausalLMStage(gpt2, [0], first=True, last=False)
    tied = _tiny("llama")
    tied.config.tie_word_embeddings = True
    with pytest.raises(ConfigError, match="ties its input and output embeddings"):
        CausalLMStage(tied, [0], first=True, last=False)


@pytest.mark.parametrize(("settings", "message"), [
    ({"parallelism": "smp"}, "SMP v2 has no pipeline parallelism"),
    ({"parallelism": "deepspeed"}, "1 with parallelism=deepspeed"),
    ({"lora_r": 8}, "0 with pipeline_parallel_degree > 1"),
    ({"parallelism": "ddp", "mixed_precision": "fp16"}, "fp16 loss scaling is not pipelined"),
    ({"pipeline_schedule": "interleaved_1f1b", "pipeline_stages_per_rank": 1}, "2 or more"),
    ({"pipeline_stages_per_rank": 2}, "0 or 1 with pipeline_schedule=1f1b"),
    ({"pipeline_split": "1,x"}, "positive integers"),
    ({"pipeline_split": "1,2,3"}, "2 numbers, one per stage"),
    ({"grad_accum_steps": 1}, "at least pipeline_parallel_degree (2)"),
    ({"global_batch_size": 64}, "1 when global_batch_size is set"),
])
def test_pipeline_settings_that_cannot_work_are_refused(settings, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_hyperparameters({**PIPELINE, **settings})


def test_a_manual_split_and_interleaved_stages_are_accepted():
    config = from_hyperparameters({**PIPELINE, "pipeline_schedule": "zero_bubble",
                                   "pipeline_split": "3, 5, 5, 3"}).parallel
    assert config.pipeline_stages_per_rank == 0  # derived: 2 for the interleaved schedules


def test_the_global_batch_keeps_its_size_on_another_number_of_ranks():
    config = from_hyperparameters({"parallelism": "fsdp", "global_batch_size": 8, "micro_batch_size": 1})
    four, two = ParallelDims(1, 1, 4, 1), ParallelDims(1, 1, 2, 1)
    assert with_global_batch(config, four).data.grad_accum_steps == 2
    assert with_global_batch(config, two).data.grad_accum_steps == 4
    with pytest.raises(ConfigError, match=re.escape("a multiple of data-parallel size x micro_batch_size "
                                                    "(3 x 1 = 3)")):
        with_global_batch(config, ParallelDims(1, 1, 3, 1))
    with pytest.raises(ConfigError, match="fewer than the 4 pipeline stages"):
        with_global_batch(config, ParallelDims(4, 1, 4, 1))


def test_a_checkpoint_resumes_on_another_data_parallel_size_only_where_it_reshards():
    dims = ParallelDims(2, 1, 2, 1)
    dims.check_resume({"pipeline": 2, "data_parallel": 4, "tensor": 1}, reshards=True)
    with pytest.raises(ConfigError, match="written by 4 data-parallel ranks and this job has 2"):
        dims.check_resume({"pipeline": 2, "data_parallel": 4, "tensor": 1}, reshards=False)
    with pytest.raises(ConfigError, match="pipeline_parallel_degree=4 and this job has 2"):
        dims.check_resume({"pipeline": 4, "data_parallel": 2, "tensor": 1}, reshards=True)
    dims.check_resume({}, reshards=False)  # checkpoints from before the mesh was recorded


def test_fp8_and_smddp_are_refused_where_they_cannot_run():
    fp8 = from_hyperparameters({"parallelism": "fsdp", "fp8": True}).parallel
    with pytest.raises(ConfigError, match="fp8': FP8 training needs an NVIDIA GPU"):
        apply_float8(_tiny("llama"), torch.device("cpu"), fp8, with_fsdp=True)
    with pytest.raises(ConfigError, match="'fp8_recipe': got 'rowwise', expected tensorwise with "
                                          "tensor_parallel_degree > 1"):
        from_hyperparameters({"parallelism": "fsdp", "fp8": True, "fp8_recipe": "rowwise",
                              "tensor_parallel_degree": 2})
    with_tensor_parallel = {"parallelism": "fsdp", "fp8": True, "tensor_parallel_degree": 2}
    assert from_hyperparameters(with_tensor_parallel).parallel.fp8
    with pytest.raises(ConfigError, match="false unless parallelism is single, ddp or fsdp"):
        from_hyperparameters({"parallelism": "deepspeed", "fp8": True})
    with pytest.raises(ConfigError, match="mixed_precision=bf16"):
        from_hyperparameters({"fp8": True, "mixed_precision": "fp32"})
    with pytest.raises(ConfigError, match="'fp8_recipe': got 'columnwise', expected one of tensorwise"):
        from_hyperparameters({"fp8": True, "fp8_recipe": "columnwise"})
    with pytest.raises(ConfigError, match="its all-reduce \\(ddp\\) needs SageMaker's mpirun launcher"):
        from_hyperparameters({"parallelism": "ddp", "collective_backend": "smddp"})
    with pytest.raises(ConfigError, match="smddp runs its collectives on NVIDIA GPUs"):
        parallel.gpu_backend(torch.device("cpu"), "smddp")
    with pytest.raises(ContainerError, match="needs SageMaker's distributed data parallel library"):
        parallel.gpu_backend(torch.device("cuda", 0), "smddp")  # no smdistributed here
    assert parallel.gpu_backend(torch.device("cpu"), "nccl") == "gloo"


def test_pipeline_degree_is_resolved_with_the_other_degrees():
    dims = ParallelDims.resolve(ParallelConfig(parallelism="fsdp", pipeline_parallel_degree=2,
                                               tensor_parallel_degree=2), 8, 1)
    assert dims.mesh_shape == (2, 1, 2, 1, 2) and dims.data_parallel == 2
    dims = ParallelDims.resolve(ParallelConfig(parallelism="fsdp", pipeline_parallel_degree=2,
                                               context_parallel_degree=2, tensor_parallel_degree=2), 16, 2)
    assert dims.mesh_shape == (2, 1, 2, 2, 2) and dims.data_parallel == 2  # context ranks share samples


def test_each_cluster_shape_trains_the_same_positions_of_the_global_order():
    """The data position is a sample count: 4 ranks x 2 micro-batches and 2 ranks x 4 micro-batches
    of the same global batch train the same next samples, each once."""
    from training_jobs.trainer.data import BatchLayout

    def step(ranks: int, micro_steps: int, first: int) -> list[int]:
        return sorted(int(position) for rank in range(ranks) for micro in range(micro_steps)
                      for position in BatchLayout(ranks, rank, 1, micro_steps).positions(first, micro))

    assert step(4, 2, 16) == step(2, 4, 16) == list(range(16, 24))
