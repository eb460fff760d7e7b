"""The run planner: its arithmetic on cases computed by hand here, the program's own rules (its
contract) as the planner applies them, and torch's schedule order. Timings are never asserted: the
planner's predictions are checked against measured memory and published runs by `python -m
bench.plan` (tests/bench/test_plan_bench.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from botocore.stub import Stubber

from llmtrain.cli import main
from llmtrain.core.catalog import Catalog
from llmtrain.core.errors import LlmtrainError, RequestValidationError
from llmtrain.core.instances import GPU_MODELS, INSTANCE_TYPES, instance_type
from llmtrain.planner import (
    activation_memory,
    collectives,
    compute_times,
    memory,
    model_states,
    pipeline,
    pipeline_memory,
    prices,
    sharding,
    speed,
)
from llmtrain.planner.plan import BILLED_STARTUP_SECONDS, PlanOptions, plan_run
from llmtrain.planner.shapes import (
    PRESET_VOCAB,
    ModelShape,
    ModelShapeError,
    preset_shape,
    shape_from_file,
)
from llmtrain.planner.suggest import fit_advice, mesh_changes, suggest
from llmtrain.planner.workload import (
    Layout,
    PlanInputError,
    Workload,
    hyperparameter_values,
    resolve_layout,
    workload_and_layout,
)
from training_jobs.contract.hyperparameters import MULTI_STAGE_SCHEDULES, PIPELINE_SCHEDULES
from training_jobs.contract.parallel_dims import ParallelDims
from training_jobs.contract.presets import PRESETS, padded_vocab_size

# llama-tiny with the shipped tokenizer: h 64, i 176, 2 layers, 4 heads of 16, 2 kv heads, V 640.
TINY = ModelShape(
    "llama",
    vocab_size=640,
    hidden_size=64,
    intermediate_size=176,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    tie_embeddings=False,
)
# Its parameters: embedding and head 640 x 64 each; per block q, o 64 x 64, k, v 32 x 64, three
# MLP matrices 176 x 64, two norms of 64; the final norm.
TINY_BLOCK = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 176 * 64 + 2 * 64
TINY_PARAMETERS = 2 * 640 * 64 + 2 * TINY_BLOCK + 64
TINY_TENSORS = 2 + 2 * 9 + 1


def _work(model: ModelShape = TINY, **changes) -> Workload:
    base = Workload(
        model=model, seq_len=32, micro_batch_size=2, grad_accum_steps=1, max_steps=10, precision="bf16"
    )
    return dataclasses.replace(base, **changes)


def _layout(strategy: str, world: int = 1, **changes) -> Layout:
    """The program's mesh of `world` ranks for `strategy` (fsdp shards, the others replicate)."""
    dims = ParallelDims(1, 1, world, 1) if strategy == "fsdp" else ParallelDims(1, world, 1, 1)
    return dataclasses.replace(Layout(strategy, 1, world, dims), **changes)


# --- what the planner reads from the training program's contract ---------------------------------


def test_every_preset_has_a_planner_vocabulary():
    assert set(PRESET_VOCAB) == set(PRESETS)


def test_unset_hyperparameters_take_the_programs_defaults_in_their_types():
    values = hyperparameter_values({"seq_len": "2048", "compile": "true", "lora_target_modules": "q,v"})
    assert (values["seq_len"], values["compile"], values["lora_target_modules"]) == (2048, True, ["q", "v"])
    assert values["micro_batch_size"] == 4 and values["parallelism"] == "ddp"
    with pytest.raises(PlanInputError, match="'seq_len': got 'long', expected an integer"):
        hyperparameter_values({"seq_len": "long"})
    assert "my_script_setting" not in hyperparameter_values({"my_script_setting": 1})  # a script's own


def _torch_order(schedule: str, degree: int, per_rank: int, micro_batches: int) -> dict[int, list]:
    """torch's own per-rank compute order (its schedule IR), built without process groups."""
    from torch.distributed.pipelining import schedules

    if schedule in ("gpipe", "1f1b"):
        kind = schedules.ScheduleGPipe if schedule == "gpipe" else schedules.Schedule1F1B
        built = object.__new__(kind)
        built._num_stages, built._n_microbatches = degree, micro_batches
        order = built._get_pipeline_order()
    else:
        kind = {
            "interleaved_1f1b": schedules.ScheduleInterleaved1F1B,
            "zero_bubble": schedules.ScheduleInterleavedZeroBubble,
        }[schedule]
        built = object.__new__(kind)
        built.pp_group_size, built.n_local_stages, built._n_microbatches = degree, per_rank, micro_batches
        built.number_of_rounds = max(1, micro_batches // degree)
        built.microbatches_per_round = micro_batches // built.number_of_rounds
        built.pipeline_order = {r: built._calculate_single_rank_operations(r) for r in range(degree)}
        if schedule == "zero_bubble":
            built.pipeline_order = built._add_bubbles_to_actions(per_rank * degree)
        order = built.pipeline_order
    return {
        rank: [
            (a.stage_index, a.computation_type.value, a.microbatch_index)
            for a in actions
            if a is not None and a.computation_type.value in "FBIW"
        ]
        for rank, actions in order.items()
    }


@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
def test_schedule_order_is_torchs(schedule):
    """The order each rank runs its stages' forwards and backwards in, as torch's schedules build
    it (torch's 1F1B IR numbers its last rank's forwards from 1, which its runtime does not: only
    the order of stages and kinds is compared there)."""
    per_ranks = (1,) if schedule in ("gpipe", "1f1b") else (2, 3)
    for degree in (2, 4):
        for per_rank in per_ranks:
            for micro_batches in (degree, 2 * degree, 2 * degree + 2, 4 * degree):
                if per_rank > 1 and micro_batches % max(1, micro_batches // degree):
                    continue
                expected = _torch_order(schedule, degree, per_rank, micro_batches)
                for rank in range(degree):
                    ours = [
                        (a.stage, a.kind, a.micro_batch)
                        for a in pipeline.rank_actions(schedule, degree, per_rank, micro_batches, rank)
                    ]
                    if schedule == "1f1b":
                        assert [a[:2] for a in ours] == [a[:2] for a in expected[rank]]
                    else:
                        assert ours == expected[rank], (schedule, degree, per_rank, micro_batches, rank)


def test_every_gpu_instance_type_has_a_price():
    table = prices.load()
    for kind in INSTANCE_TYPES.values():
        assert table.on_demand(kind.name) > 0


# --- model shapes -----------------------------------------------------------------------------------


def test_tiny_shape_counts_by_hand():
    assert TINY.num_parameters == TINY_PARAMETERS == 174_400
    assert len(TINY.parameters()) == TINY_TENSORS
    # FLOPs per token: 6 per block weight and head weight, attention 12 x layers x hidden x seq.
    assert TINY.flops_per_token(32) == 6 * (2 * (TINY_BLOCK - 128) + 640 * 64) + 12 * 2 * 64 * 32


@pytest.mark.parametrize(
    ("preset", "parameters"),
    [("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496), ("llama3-405b", 405_853_388_800)],
)
def test_llama3_presets_have_the_published_sizes(preset, parameters):
    assert preset_shape(preset, 8192).num_parameters == parameters


@pytest.mark.parametrize("preset", ["llama-20m", "llama-1b", "gpt2-small"])
def test_shapes_count_what_transformers_builds(preset):
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    family, architecture = PRESETS[preset]
    vocab = padded_vocab_size(PRESET_VOCAB[preset])  # the program pads its tokenizer's
    if family == "llama":
        config = LlamaConfig(**architecture, vocab_size=vocab)
    else:
        config = GPT2Config(**architecture, vocab_size=vocab, n_positions=512)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    built = {name: tuple(p.shape) for name, p in model.named_parameters()}
    planned = {p.name: p.shape for p in preset_shape(preset, 512, vocab_size=vocab).parameters()}
    assert built == planned


def test_hugging_face_configs(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "hidden_size": 896,
                "intermediate_size": 4864,
                "num_hidden_layers": 24,
                "num_attention_heads": 14,
                "num_key_value_heads": 2,
                "vocab_size": 151936,
                "tie_word_embeddings": True,
            }
        )
    )
    shape = shape_from_file(path)
    assert shape.attention_bias and shape.tie_embeddings and shape.kv_size == 128
    path.write_text(json.dumps({"model_type": "t5", "d_model": 512}))
    with pytest.raises(ModelShapeError, match="model_type 't5' is not one the planner models"):
        shape_from_file(path)
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ModelShapeError, match="lacks or misstates"):
        shape_from_file(path)


# --- memory, by hand --------------------------------------------------------------------------------


def test_ddp_memory_by_hand():
    """DDP: fp32 weights, fp32 .grad plus the reducer's buckets, AdamW's two moments and steps."""
    estimate = memory.estimate(_work(), _layout("ddp", 2), capacity=0, on_gpu=False)
    assert estimate.parameters == 4 * TINY_PARAMETERS
    assert estimate.gradients == 2 * 4 * TINY_PARAMETERS
    assert estimate.optimizer == 2 * 4 * TINY_PARAMETERS + 4 * TINY_TENSORS
    assert estimate.overhead == 0


def test_single_fp32_activations_by_hand():
    """What each op of a Llama block saves (fp32, SDPA): per token, the block input, 1/rms and
    the normalized value of both norms, their outputs (the linears' inputs), the rotated q and k,
    v, SDPA's output and log-sum-exp, four MLP intermediates; then the final norm, the head's
    input, the logits (the chunked loss keeps them as they are, here fp32), the loss's log-sum-exp
    and trained-target flag, the ids and targets; cos and sin once. bench/workers/plan_memory.py
    measured 877,124 bytes: these and one 4-byte scalar."""
    h, kv, i, heads, tokens = 64, 32, 176, 4, 64
    block = 4 * (2 * 3 * h + h + 2 * kv + h + 4 * i) + 2 * 4 + 4 * heads
    head = 4 * 3 * h + 4 + 4 * 640 + 4 + 1 + 8 + 8
    rotary = 2 * 32 * 16 * 4
    expected = 2 * block * tokens + head * tokens + rotary
    work = _work(precision="fp32")
    assert activation_memory.activation_bytes(work, _layout("single"))[0] == expected == 877_120


def test_fsdp_memory_by_hand():
    """FSDP2 over 2: fp32 shards of everything; bf16 unsharded copies of the root (embedding, head,
    final norm) and of the last block, which it does not reshard after forward."""
    layout = _layout("fsdp", 2)
    estimate = memory.estimate(_work(), layout, capacity=0, on_gpu=False)
    root = 2 * 640 * 64 + 64
    assert estimate.parameters == 4 * TINY_PARAMETERS // 2 + 2 * (root + TINY_BLOCK)
    assert estimate.gradients == 4 * TINY_PARAMETERS // 2
    grad_op = memory.estimate(
        _work(grad_accum_steps=4),
        dataclasses.replace(layout, fsdp_sharding="grad_op"),
        capacity=0,
        on_gpu=False,
    )
    assert grad_op.parameters == 4 * TINY_PARAMETERS // 2 + 2 * TINY_PARAMETERS
    assert grad_op.gradients == 4 * TINY_PARAMETERS  # fp32, unsharded between micro steps


def test_fsdp_shards_pad_the_first_dimension():
    odd = dataclasses.replace(TINY, vocab_size=650)  # 650 rows over 4 ranks: 163 each, padded
    embedding = odd.parameters()[0]
    assert sharding.shard_numel(embedding, 1, 4, padded=True) == 163 * 64
    assert sharding.shard_numel(embedding, 1, 5, padded=True) == 130 * 64


def test_deepspeed_memory_by_hand():
    """ZeRO over 2 with bf16: whole bf16 weights (stages 1-2) or half plus the small persistent
    ones plus those left gathered for backward (3); fp32 master partitions and moments."""
    half = TINY_PARAMETERS // 2
    zero1 = memory.estimate(_work(), _layout("deepspeed", 2, zero_stage=1), capacity=0, on_gpu=False)
    assert (zero1.parameters, zero1.gradients) == (2 * TINY_PARAMETERS, 2 * TINY_PARAMETERS)
    assert zero1.optimizer == 4 * half + 8 * half + 4 * TINY_TENSORS
    zero2 = memory.estimate(_work(), _layout("deepspeed", 2, zero_stage=2), capacity=0, on_gpu=False)
    assert zero2.gradients == 2 * (half + model_states.DEEPSPEED_REDUCE_BUCKET_ELEMENTS)
    zero3 = memory.estimate(_work(), _layout("deepspeed", 2, zero_stage=3), capacity=0, on_gpu=False)
    # Every tiny tensor is below the persistence threshold: whole on each rank, nothing gathered.
    assert zero3.parameters == 2 * TINY_PARAMETERS


def test_lora_trains_only_the_adapters():
    work = _work(lora_r=4, lora_targets=("q_proj", "v_proj"))
    tensors = sharding.parameter_tensors(work)
    # per block: q (64 in, 64 out) and v (64 in, 32 out): A is r x in, B out x r
    assert sum(p.numel for p in tensors.trainable) == 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4)
    estimate = memory.estimate(work, _layout("ddp", 2), capacity=0, on_gpu=False)
    trainable = sum(p.numel for p in tensors.trainable)
    assert estimate.gradients == 2 * 4 * trainable
    assert estimate.parameters == 4 * (TINY_PARAMETERS + trainable)


def test_checkpointing_keeps_only_block_inputs():
    full = activation_memory.activation_bytes(
        _work(activation_checkpointing="full", precision="fp32"), _layout("single")
    )[0]
    none = activation_memory.activation_bytes(_work(precision="fp32"), _layout("single"))[0]
    head = (4 * (3 * 64 + 1) + 4 * 640 + 4 + 1 + 16) * 64
    assert full == 2 * 4 * 64 * 64 + head  # two blocks keep their fp32 input; no cos/sin
    assert full < none


def test_fits_against_the_gpu_with_overhead():
    capacity = GPU_MODELS["A10G"].memory_bytes
    estimate = memory.estimate(_work(), _layout("single"), capacity=capacity)
    parts = (
        estimate.parameters
        + estimate.gradients
        + estimate.optimizer
        + estimate.activations
        + estimate.working
    )
    assert estimate.overhead == int(memory.CUDA_CONTEXT_BYTES + memory.ALLOCATOR_RESERVE_FRACTION * parts)
    assert estimate.fits and estimate.headroom == capacity - estimate.per_gpu


# --- speed, by hand ---------------------------------------------------------------------------------


def _compute_by_hand(work, gpu, tokens: int) -> tuple[float, float, float]:
    """(matmuls, attention, memory-bound) seconds of one unsharded llama micro step without
    checkpointing, bf16, eager: 6 FLOPs per weight and token at the generation's matmul rate, the
    causal attention's 2 x hidden x sequence per token and layer forward and 2.5 times that backward
    (7 in all) at the flash kernel's rate, and
    the bytes the other operations move (residual stream and region activations per layer, the
    loss per logit) at the memory's bandwidth."""
    m, c = work.model, speed.CALIBRATION
    block = sum(p.numel for p in m.parameters() if p.kind == "linear" and p.layer == 0)
    h, i, kv, layers = m.hidden_size, m.intermediate_size, m.kv_size, m.num_layers
    matmuls = 6 * (layers * block + m.vocab_size * h) * tokens / (gpu.peak_flops * c.matmul_efficiency(gpu))
    attention = 7 * h * work.seq_len * layers * tokens / (gpu.peak_flops * gpu.attention_efficiency)
    elements = (4 * h + h + 2 * kv + 3 * i) * layers
    memory_bound = (c.elementwise_bytes_eager * elements + c.loss_bytes_per_vocabulary * m.vocab_size)
    memory_bound *= tokens
    return matmuls, attention, memory_bound / gpu.memory_bytes_per_second


@pytest.mark.parametrize("instance", ["ml.p5.48xlarge", "ml.p4de.24xlarge", "ml.g5.xlarge"])
def test_single_gpu_step_by_hand(instance):
    kind = instance_type(instance)
    gpu = kind.gpu_model
    cluster = speed.Cluster(gpu, 1, 1, kind.network_gbps * 1e9 / 8)
    work = _work(model=preset_shape("llama3-8b", 4096), seq_len=4096, micro_batch_size=1)
    estimate = speed.estimate(work, _layout("single"), cluster)
    parts = _compute_by_hand(work, gpu, 4096)
    optimizer = work.model.num_parameters * 28 / gpu.memory_bytes_per_second
    assert estimate.compute_parts == pytest.approx(parts)
    assert estimate.compute_seconds == pytest.approx(sum(parts))
    assert estimate.step_seconds == pytest.approx(sum(parts) + optimizer)
    assert estimate.mfu == pytest.approx(
        4096 / estimate.step_seconds * work.model.flops_per_token(4096) / gpu.peak_flops
    )


def test_each_generation_has_its_own_balance():
    """The same step on an A100 is mostly matmuls; an H100 spends a larger share in the memory-bound
    operations, which its faster HBM (H200) and compile shorten; FP8 shortens only the matmuls."""
    work = _work(model=preset_shape("llama3-8b", 4096), seq_len=4096, micro_batch_size=1)

    def share(gpu: str, **changes) -> tuple[float, float]:
        estimate = speed.estimate(dataclasses.replace(work, **changes), _layout("single"),
                                  speed.Cluster(GPU_MODELS[gpu], 1, 1, 0.0))
        return estimate.compute_parts[2] / estimate.compute_seconds, estimate.compute_seconds

    a100, h100, h200 = share("A100-80GB"), share("H100-80GB"), share("H200-141GB")
    assert a100[0] < h100[0] and h200[1] < h100[1]
    assert share("H100-80GB", compile=True)[1] < h100[1]
    fp8 = speed.estimate(dataclasses.replace(work, fp8=True), _layout("single"),
                         speed.Cluster(GPU_MODELS["H100-80GB"], 1, 1, 0.0))
    bf16 = speed.estimate(work, _layout("single"), speed.Cluster(GPU_MODELS["H100-80GB"], 1, 1, 0.0))
    assert fp8.compute_parts[0] < bf16.compute_parts[0] and fp8.compute_parts[1] == bf16.compute_parts[1]


def test_collectives_by_hand():
    p4d = instance_type("ml.p4d.24xlarge")
    links = collectives.Links(speed.Cluster.of(p4d, 2), speed.CALIBRATION)
    inside, network = 300e9 * 0.8, 400e9 / 8 * 0.8
    assert links.bandwidth(8, 1) == inside
    assert links.bandwidth(16, 1) == network  # a ring over both instances: their whole network
    assert links.bandwidth(2, 8) == network / 8  # 8 replica groups side by side, one rank each
    sent, seconds = links.seconds("all_reduce", 1e9, 16)
    assert sent == pytest.approx(2 * 15 / 16 * 1e9) and seconds == pytest.approx(sent / network)


def test_ddp_hides_its_all_reduce_behind_backward_until_it_cannot():
    """Exposed = all-reduce beyond the last micro step's backward, plus the last bucket."""
    p4d = instance_type("ml.p4d.24xlarge")
    work = _work(model=preset_shape("gpt2-xl", 1024), seq_len=1024, micro_batch_size=1)
    layout = _layout("ddp", 16, nodes=2, gpus_per_node=8)
    estimate = speed.estimate(work, layout, speed.Cluster.of(p4d, 2))
    network = 400e9 / 8 * 0.8
    grads = 4 * work.model.num_parameters
    all_reduce = 2 * 15 / 16 * grads / network
    times = compute_times.layer_times(work, layout, p4d.gpu_model, speed.CALIBRATION,
                              list(range(work.model.num_layers)), head=True)
    backward = times.backward_input + times.backward_weight
    last_bucket = 2 * 15 / 16 * collectives.DDP_BUCKET_BYTES / network
    assert all_reduce > backward
    assert estimate.exposed_communication_seconds == pytest.approx(all_reduce - backward + last_bucket)


def test_tensor_parallel_all_reduces_are_exposed():
    p5 = instance_type("ml.p5.48xlarge")
    work = _work(model=preset_shape("llama3-8b", 2048), seq_len=2048, micro_batch_size=1)
    layout = Layout("fsdp", 1, 8, ParallelDims(1, 1, 1, 8))
    estimate = speed.estimate(work, layout, speed.Cluster.of(p5, 1))
    activation = 2048 * 4096 * 2
    expected = 4 * 32 * (2 * 7 / 8 * activation) / (450e9 * 0.8)
    assert estimate.exposed_communication_seconds == pytest.approx(expected)


def test_full_checkpointing_recomputes_the_forward():
    work = _work(model=preset_shape("llama3-8b", 2048), seq_len=2048, activation_checkpointing="full")
    block = sum(p.numel for p in work.model.parameters() if p.kind == "linear" and p.layer == 0)
    assert compute_times.recompute_flops_per_token(work) == 32 * (2 * block + 4 * 4096 * 2048)


# --- pipeline stages, by hand ------------------------------------------------------------------------


def _pipelined(pipeline: int = 2, replicate: int = 1, **changes) -> Layout:
    """`pipeline` stages, replicated by DDP over `replicate` ranks."""
    dims = ParallelDims(pipeline, replicate, 1, 1)
    return dataclasses.replace(Layout("ddp", 1, dims.world_size, dims), **changes)


def test_pipeline_states_by_hand():
    """Two stages of TINY's two layers: the embedding and layer 0, then layer 1, the final norm
    and the head; each rank holds fp32 weights and gradients and AdamW's moments of its stage."""
    ranks = memory.pipeline_estimates(_work(grad_accum_steps=4), _pipelined(), capacity=0, on_gpu=False)
    first, last = 640 * 64 + TINY_BLOCK, TINY_BLOCK + 64 + 640 * 64
    assert [e.parameters for e in ranks] == [4 * first, 4 * last]
    assert [e.gradients for e in ranks] == [4 * first, 4 * last]
    assert [e.optimizer for e in ranks] == [8 * first + 4 * 10, 8 * last + 4 * 11]
    replicated = memory.pipeline_estimates(
        _work(grad_accum_steps=4), _pipelined(replicate=2, gpus_per_node=4), capacity=0, on_gpu=False
    )
    assert replicated[0].gradients == 2 * 4 * first  # .grad and DDP's buckets


def test_pipeline_activations_by_hand():
    """fp32, 1F1B over 2 ranks, 4 micro-batches of 64 tokens. Rank 0 holds 2 micro-batches at
    once: each its block's saved tensors (as in a whole model), cos and sin and its output (kept
    for backward); plus the step's token ids and a buffer per micro-batch for the gradient it
    receives. Rank 1 holds 1: its block without the input (the fp32 activation it received, a
    buffer), cos and sin, the final norm, head and loss (the logits the loss keeps are the ones the
    schedule keeps, freed once their gradient exists; the loss's log-sum-exp and flag per token);
    plus the targets and a receive buffer per micro-batch."""
    tokens, micro_batches = 64, 4
    block = (4 * (2 * 3 * 64 + 64 + 2 * 32 + 64 + 4 * 176) + 2 * 4 + 4 * 4) * tokens
    rotary, hidden = 2 * 32 * 16 * 4, 4 * 64 * tokens
    head = (4 * 3 * 64 + 4 + 4 * 640 + 4 + 1) * tokens
    ids = 8 * tokens * micro_batches
    buffers = micro_batches * hidden
    work = _work(precision="fp32", grad_accum_steps=micro_batches)
    first, last = memory.pipeline_estimates(work, _pipelined(), capacity=0, on_gpu=False)
    assert first.activations == 2 * (block + rotary + hidden) + ids + buffers == 766_976
    assert last.activations == (block - hidden + rotary + head) + ids + buffers
    assert first.details["pipeline_micro_batches_in_flight"] == 2
    assert last.details["pipeline_receive_buffer_bytes"] == buffers
    gpipe = memory.pipeline_estimates(work, _pipelined(schedule="gpipe"), capacity=0, on_gpu=False)
    assert gpipe[0].activations == 4 * (block + rotary + hidden) + ids + buffers  # all in flight


def test_pipeline_in_flight_follows_the_schedule():
    """1F1B: rank r holds degree - r micro-batches; GPipe all; interleaved 1F1B its warm-up + 1
    stage-micro-batches: (v - 1) x rounds + 2 x (p - 1 - r) + 1."""
    unit = {stage: pipeline.StageMemory(1.0) for stage in range(8)}
    for rank in range(4):
        one_f_one_b = pipeline.rank_actions("1f1b", 4, 1, 8, rank)
        assert pipeline.peak_held(one_f_one_b, unit).bytes == 4 - rank
        assert pipeline.peak_held(pipeline.rank_actions("gpipe", 4, 1, 8, rank), unit).bytes == 8
        interleaved = pipeline.rank_actions("interleaved_1f1b", 4, 2, 8, rank)
        assert pipeline.peak_held(interleaved, unit).bytes == 4 + 2 * (3 - rank) + 1


def test_pipeline_bubble_by_hand():
    """(p - 1) x the slowest stage's micro-batch: with equal stages a share (p - 1) / (v x m + p - 1)
    of the step; zero bubble fills it but for forward + input backward - 2 x weight backward."""
    assert pipeline.bubble_fraction(4, 1, 8) == 3 / 11
    assert pipeline.bubble_fraction(4, 2, 8) == 3 / 19
    equal = [compute_times.StageTimes(1.0, 1.0, 1.0)] * 8
    one_f_one_b = _pipelined(pipeline=4)
    assert speed.pipeline_bubble(one_f_one_b, equal[:4]) == 3 * 3.0
    interleaved = _pipelined(pipeline=4, schedule="interleaved_1f1b", stages_per_rank=2)
    bubble = speed.pipeline_bubble(interleaved, equal)
    assert bubble / (8 * 2 * 3.0 + bubble) == pytest.approx(3 / 19)
    zero_bubble = _pipelined(pipeline=4, schedule="zero_bubble", stages_per_rank=2)
    assert speed.pipeline_bubble(zero_bubble, equal) == 0.0
    recomputing = [compute_times.StageTimes(1.0, 2.0, 1.0)] * 8  # checkpointing adds a forward to backward
    assert speed.pipeline_bubble(zero_bubble, recomputing) == 3 * 1.0


def test_pipeline_step_by_hand():
    """llama3-8b in 2 stages of 1F1B on one p5 (pp 2 x tp 4): each stage's FLOPs per token are 2
    per weight forward, 4 backward (the head on the last), attention the causal half of 4 and 10 x
    hidden x sequence per layer (the flash kernel's backward recomputes the scores); a step is the
    slowest rank's m micro-batches (with its communication) plus the bubble, (p - 1) x the slowest
    stage."""
    p5 = instance_type("ml.p5.48xlarge")
    work = _work(model=preset_shape("llama3-8b", 2048), seq_len=2048, micro_batch_size=1, grad_accum_steps=8)
    layout = Layout("fsdp", 1, 8, ParallelDims(2, 1, 1, 4))
    estimate = speed.estimate(work, layout, speed.Cluster.of(p5, 1))
    m = work.model
    block = sum(p.numel for p in m.parameters() if p.kind == "linear" and p.layer == 0)
    counts = pipeline_memory.stage_layer_counts(work, layout)
    assert sum(counts) == 32
    c = speed.CALIBRATION
    rate = 989e12 * c.matmul_efficiency(p5.gpu_model)
    stages = pipeline_memory.pipeline_stages(work, layout)
    times = [compute_times.stage_times(work, layout, stage, p5.gpu_model) for stage in stages]
    for stage, t, (layers, last) in zip(stages, times, zip(counts, (False, True), strict=True), strict=True):
        matmuls = 6 * (layers * block + (m.vocab_size * 4096 if last else 0)) * 2048 / 4 / rate
        assert t.parts[0] == pytest.approx(matmuls)
        assert stage.num_layers == layers
    links = collectives.Links(speed.Cluster.of(p5, 1), c)
    tp = [collectives.stage_communication(work, layout, links, stage) for stage in stages]
    seconds = [t.total for t in times]
    assert estimate.bubble_seconds == pytest.approx(max(s + x for s, x in zip(seconds, tp, strict=True)))
    assert estimate.compute_seconds in (pytest.approx(8 * seconds[0]), pytest.approx(8 * seconds[1]))
    rest = estimate.exposed_communication_seconds + estimate.optimizer_seconds
    assert estimate.step_seconds == pytest.approx(estimate.compute_seconds + rest + estimate.bubble_seconds)
    assert estimate.tokens_per_step == 8 * 2048  # one model replica: pp 2 x tp 4 = 8 GPUs


def test_pipeline_fsdp_accumulates_and_reduces_on_the_critical_path():
    """FSDP2 stages keep fp32 unsharded gradients until their last micro-batch: each micro-batch's
    backward adds its bf16 gradients into them (10 bytes per element at the GPU's bandwidth, which
    lengthens the stage, so the bubble too), and the stage's reduce-scatter runs after the last
    backward with nothing to hide it. Whole-model FSDP with full sharding reduces every micro step and
    accumulates nothing."""
    p5 = instance_type("ml.p5.48xlarge")
    gpu = p5.gpu_model
    work = _work(model=preset_shape("llama3-8b", 2048), seq_len=2048, micro_batch_size=1, grad_accum_steps=8)
    layout = Layout("fsdp", 1, 8, ParallelDims(2, 1, 2, 2))
    cluster = speed.Cluster.of(p5, 1)
    estimate = speed.estimate(work, layout, cluster)
    stages = pipeline_memory.pipeline_stages(work, layout)
    links = collectives.Links(cluster, speed.CALIBRATION)
    slowest = 0.0
    for stage in stages:
        tensors = pipeline_memory.stage_tensors(work, [stage])
        elements = sum(sharding.tp_local_numel(p, 2) for p in tensors.trainable)
        accumulate = compute_times.accumulation_seconds(work, layout, gpu, tensors)
        assert accumulate == pytest.approx(10 * elements / 3.35e12)
        total = compute_times.stage_times(work, layout, stage, gpu).total + accumulate
        slowest = max(slowest, total + collectives.stage_communication(work, layout, links, stage))
    assert estimate.bubble_seconds == pytest.approx(slowest)
    reduce_scatter = next(t for t in estimate.transfers if t.name == "fsdp reduce-scatter")
    assert estimate.exposed_communication_seconds > reduce_scatter.seconds > 0
    whole = Layout("fsdp", 1, 8, ParallelDims(1, 1, 8, 1))
    assert compute_times.accumulation_seconds(work, whole, gpu, sharding.parameter_tensors(work)) == 0.0
    grad_op = dataclasses.replace(whole, fsdp_sharding="grad_op")
    assert compute_times.accumulation_seconds(work, grad_op, gpu, sharding.parameter_tensors(work)) > 0.0


def test_pipeline_sends_by_hand():
    """Per step each rank sends every micro-batch's activation on (all but the last stage) and its
    gradient back (all but the first): the residual stream, fp32 under autocast. Stages one
    instance each (tp 8) cross EFA, the instance's network shared by its 8 GPUs; two stages on one
    instance talk over NVLink."""
    work = _work(model=preset_shape("llama3-8b", 2048), seq_len=2048, micro_batch_size=1, grad_accum_steps=4)
    hidden = 4 * 4096 * 2048
    p4d = instance_type("ml.p4d.24xlarge")
    across = Layout("fsdp", 2, 8, ParallelDims(2, 1, 1, 8))
    sends = next(
        t
        for t in speed.estimate(work, across, speed.Cluster.of(p4d, 2)).transfers
        if t.name.startswith("pipeline")
    )
    assert sends.bytes_per_gpu == 4 * hidden
    assert sends.seconds == pytest.approx(4 * hidden / (400e9 / 8 * 0.8 / 8))
    p5 = instance_type("ml.p5.48xlarge")
    inside = Layout("fsdp", 1, 8, ParallelDims(2, 1, 1, 4))
    sends = next(
        t
        for t in speed.estimate(work, inside, speed.Cluster.of(p5, 1)).transfers
        if t.name.startswith("pipeline")
    )
    assert sends.seconds == pytest.approx(4 * hidden / (450e9 * 0.8))


def test_pipeline_settings_are_checked_as_the_program_does():
    def resolve(**values):
        given = {"model_preset": "llama-20m", "parallelism": "fsdp", "pipeline_parallel_degree": 2, **values}
        return workload_and_layout(hyperparameter_values(given), 8, 1)

    work, layout = resolve(grad_accum_steps=4, pipeline_schedule="interleaved_1f1b")
    assert (layout.pipeline, layout.shard, layout.stages_per_rank, layout.num_stages) == (2, 4, 2, 4)
    work, layout = resolve(global_batch_size=64, micro_batch_size=2)
    assert work.grad_accum_steps == 64 // (4 * 2)
    for values, message in (
        ({"grad_accum_steps": 1}, "at least pipeline_parallel_degree"),
        ({"grad_accum_steps": 4, "pipeline_schedule": "1f1b", "pipeline_stages_per_rank": 2}, "0 or 1"),
        ({"grad_accum_steps": 4, "pipeline_split": "1,2"}, "places 3 decoder layers"),
        ({"grad_accum_steps": 4, "pipeline_split": "3,3,0"}, "positive integers"),
        ({"grad_accum_steps": 4, "parallelism": "deepspeed"}, "1 with parallelism=deepspeed"),
        ({"grad_accum_steps": 4, "model_preset": "llama-1b"}, "ties its input and output embeddings"),
        ({"grad_accum_steps": 4, "model_preset": "gpt2-tiny"}, "gpt2 models cannot be split"),
        ({"grad_accum_steps": 4, "pipeline_parallel_degree": 3}, r"\(3 x 1 x 1\) dividing the world size 8"),
        ({"grad_accum_steps": 4, "parallelism": "ddp", "pipeline_schedule": "gpipe"}, "use 1f1b"),
    ):
        with pytest.raises(PlanInputError, match=message):
            resolve(**values)
    alone = hyperparameter_values(
        {"model_preset": "llama-20m", "parallelism": "ddp", "pipeline_parallel_degree": 2,
         "pipeline_schedule": "gpipe", "grad_accum_steps": 4}
    )
    work, layout = workload_and_layout(alone, 2, 1)
    assert layout.data_parallel == 1  # GPipe without data-parallel replicas runs
    work, layout = resolve(grad_accum_steps=4, pipeline_split="5,1")
    assert pipeline_memory.stage_layer_counts(work, layout) == (5, 1)


# --- mesh -------------------------------------------------------------------------------------------


def test_layouts_follow_the_programs_mesh_rules():
    hybrid = resolve_layout(
        hyperparameter_values(
            {"parallelism": "fsdp", "fsdp_sharding": "hybrid", "shard_degree": 2, "tensor_parallel_degree": 4}
        ),
        8,
        4,
    )
    assert (hybrid.replicate, hybrid.shard, hybrid.tensor) == (4, 2, 4)
    with pytest.raises(PlanInputError,
                       match=r"tensor_parallel_degree \(1 x 1 x 3\) dividing the world size 8"):
        resolve_layout(hyperparameter_values({"parallelism": "fsdp", "tensor_parallel_degree": 3}), 8, 1)
    with pytest.raises(PlanInputError, match="'parallelism': got 'single', expected ddp, fsdp or deepspeed"):
        resolve_layout(hyperparameter_values({"parallelism": "single"}), 4, 1)


# --- plans, cost and suggestions ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def catalog():
    return Catalog.load()


def test_cost_is_hours_times_price(catalog):
    plan = plan_run(catalog.resolve("llama-pretrain-fsdp"), {"max_steps": 100})
    table = prices.load()
    assert plan.usd_per_hour == 2 * table.on_demand("ml.p4d.24xlarge")
    assert plan.hours == pytest.approx((100 * plan.speed.step_seconds + BILLED_STARTUP_SECONDS) / 3600)
    assert plan.usd == pytest.approx(plan.usd_per_hour * plan.hours)
    spot = plan_run(catalog.resolve("llama-pretrain-fsdp"), {"max_steps": 100, "spot": True})
    assert spot.usd_per_hour == pytest.approx(plan.usd_per_hour * (1 - table.spot_savings_assumed))


def test_overrides_are_validated_as_the_launcher_does(catalog):
    from llmtrain.core.errors import OverrideError

    with pytest.raises(OverrideError, match="micro_batch_size"):
        plan_run(catalog.resolve("llama-pretrain-fsdp"), {"micro_batch_size": 0})


def test_suggestions_fit_and_keep_the_global_batch(catalog):
    template = catalog.resolve("llama-pretrain-fsdp")
    found = suggest(template, {"model_preset": "llama-13b"}, max_hours=100)
    for plan in (found.fastest, found.cheapest):
        assert plan.fits
        work = plan.workload
        assert work.micro_batch_size * work.grad_accum_steps * plan.layout.data_parallel == 1 * 8 * 16
        assert set(plan.settings) - {"model_preset"} <= set(template.overridable)
    assert found.cheapest.hours <= 100
    assert found.fastest.training_seconds <= found.current.training_seconds


def test_fit_advice_names_a_change_that_fits(catalog):
    template = catalog.resolve("llama-pretrain-fsdp")
    overrides = {"model_preset": "llama-13b", "activation_checkpointing": "none"}
    assert not plan_run(template, overrides).fits
    advice = fit_advice(template, overrides)
    setting = advice.removeprefix("set ").split(" (")[0]
    changes = dict(item.split("=", 1) for item in setting.split(", "))
    assert plan_run(template, {**overrides, **changes}).fits


def test_the_3d_template_plans_its_pipeline(catalog):
    """llama-pretrain-3d on 16 x p5: pp 4 x shard 4 x tp 8, its global batch of 256 in 64
    micro-batches, 8 stages of the 80 layers; it fits, because the program frees each
    micro-batch's logits once their gradient exists (torch would keep all 64 micro-batches'
    logits until the step ends). With loss parallel each tensor-parallel rank holds an eighth of the
    vocabulary's logits, so the first rank, with the most micro-batches in flight, holds the most."""
    plan = plan_run(catalog.resolve("llama-pretrain-3d"), {})
    layout = plan.layout
    assert (layout.pipeline, layout.replicate, layout.shard, layout.tensor) == (4, 1, 4, 8)
    assert (layout.schedule, layout.stages_per_rank, plan.workload.grad_accum_steps) == (
        "interleaved_1f1b",
        2,
        64,
    )
    shape = plan.to_dict()["pipeline"]
    assert sum(shape["layers_per_stage"]) == 80 and len(shape["layers_per_stage"]) == 8
    assert shape["fullest_rank"] == 0
    assert plan.fits
    one_micro_batch_logits = 4096 * 128256 * 2
    assert plan.memory.activations < 64 * one_micro_batch_logits  # what torch alone would keep
    assert shape["bubble_fraction"] == pytest.approx(plan.speed.bubble_seconds / plan.speed.step_seconds)


def test_suggestions_search_meshes_the_template_allows(catalog):
    template = catalog.resolve("llama-pretrain-3d")
    base = plan_run(template, {})
    meshes = mesh_changes(template, base)
    assert meshes[0] == {} and len(meshes) > 20
    for mesh in meshes[1:]:
        settings = {**{"pipeline_schedule": "interleaved_1f1b", "pipeline_stages_per_rank": 2}, **mesh}
        assert set(mesh) <= set(template.overridable)
        if mesh.get("pipeline_parallel_degree", 4) > 1:
            multi = settings["pipeline_schedule"] in MULTI_STAGE_SCHEDULES
            assert multi == (settings["pipeline_stages_per_rank"] > 1), mesh
    found = suggest(template, {})
    assert found.fastest.fits and found.cheapest.fits
    for plan in (found.fastest, found.cheapest):
        work = plan.workload
        assert work.micro_batch_size * work.grad_accum_steps * plan.layout.data_parallel == 256


# --- prices ------------------------------------------------------------------------------------------


def _product(name: str, usd: str, component: str = "Training") -> str:
    return json.dumps(
        {
            "product": {
                "attributes": {"instanceName": name, "component": component, "regionCode": "us-east-1"}
            },
            "terms": {
                "OnDemand": {"T1": {"priceDimensions": {"D1": {"unit": "Hrs", "pricePerUnit": {"USD": usd}}}}}
            },
        }
    )


def test_refresh_reads_the_price_list_api():
    import boto3

    client = boto3.client(
        "pricing", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    filters = [
        {"Type": "TERM_MATCH", "Field": "regionCode", "Value": "us-east-1"},
        {"Type": "TERM_MATCH", "Field": "component", "Value": "Training"},
    ]
    request = {"ServiceCode": "AmazonSageMaker", "Filters": filters, "FormatVersion": "aws_v1"}
    with Stubber(client) as stub:
        stub.add_response(
            "get_products",
            {
                "PriceList": [_product("ml.p5.48xlarge", "55.04")],
                "NextToken": "page2",
                "FormatVersion": "aws_v1",
            },
            request,
        )
        stub.add_response(
            "get_products",
            {
                "PriceList": [_product("ml.g5.xlarge", "1.41"), _product("ml.c9.huge", "9.99")],
                "FormatVersion": "aws_v1",
            },
            {**request, "NextToken": "page2"},
        )
        table, missing = prices.refresh(client, prices.load())
    assert table.on_demand_per_hour == {"ml.p5.48xlarge": 55.04, "ml.g5.xlarge": 1.41}
    assert table.source.startswith("AWS Price List API") and "ml.p4d.24xlarge" in missing
    assert "Price List API" in table.describe()


def test_refresh_refuses_an_empty_answer():
    import boto3

    client = boto3.client(
        "pricing", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    with Stubber(client) as stub:
        stub.add_response("get_products", {"PriceList": [], "FormatVersion": "aws_v1"})
        with pytest.raises(prices.PriceError, match="returned no SageMaker training prices for xx-west-9"):
            prices.refresh(client, prices.load(), region="xx-west-9")


# --- the command ------------------------------------------------------------------------------------

JSON_FIELDS = (
    "fits",
    "memory.per_gpu_bytes",
    "memory.capacity_bytes",
    "memory.parameters_bytes",
    "memory.gradients_bytes",
    "memory.optimizer_bytes",
    "memory.activations_bytes",
    "throughput.tokens_per_second",
    "throughput.tokens_per_second_per_gpu",
    "throughput.step_seconds",
    "throughput.mfu",
    "cost.usd_per_hour",
    "cost.hours",
    "cost.usd",
)


def _field(data: dict, dotted: str):
    for key in dotted.split("."):
        data = data[key]
    return data


@pytest.mark.parametrize("name", [t for t in Catalog.load().names() if t != "byo-script"])
def test_plan_json_on_every_platform_template(name, capsys):
    assert main(["plan", name, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for dotted in JSON_FIELDS:
        assert isinstance(_field(data, dotted), bool | int | float), dotted


def test_plan_byo_script_needs_a_model(tmp_path, capsys):
    assert main(["plan", "byo-script"]) == 2
    assert "--model-config" in capsys.readouterr().err
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_embd": 384,
                "n_layer": 6,
                "n_head": 6,
                "vocab_size": 50257,
                "n_positions": 256,
            }
        )
    )
    assert (
        main(
            [
                "plan",
                "byo-script",
                "--model-config",
                str(config),
                "--assume",
                "seq_len=256",
                "--assume",
                "micro_batch_size=8",
            ]
        )
        == 0
    )
    assert "ml.g5.2xlarge" in capsys.readouterr().out


def test_plan_text_and_suggest(capsys):
    assert main(["plan", "llama-pretrain-fsdp", "--set", "model_preset=llama-13b"]) == 0
    text = capsys.readouterr().out
    assert "memory per GPU" in text and "fsdp reduce-scatter" in text and text.strip().endswith(")")
    assert main(["plan", "gpt2-ddp", "--suggest", "--max-hours", "1"]) == 0
    text = capsys.readouterr().out
    assert "fastest that fits:" in text and "cheapest that fits finishing within 1 h:" in text
    assert "--set instance_type=" in text


def test_plan_refuses_unknown_settings(capsys):
    assert main(["plan", "gpt2-ddp", "--set", "zero_stage=3"]) == 2
    assert "does not allow overriding it" in capsys.readouterr().err


def test_prices_show(capsys):
    assert main(["prices", "show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["on_demand_per_hour"]["ml.p5.48xlarge"] > 0


# --- FP8 and context parallel in plans -------------------------------------------------------------------


def test_fp8_changes_the_plan(catalog):
    """FP8 on the H100s: faster matmuls (the rest stays bf16) and weights gathered in one byte."""
    template = catalog.resolve("llama-pretrain-hsdp-tp@1.3.0")
    bf16 = plan_run(template, {"model_preset": "llama3-8b"})
    fp8 = plan_run(template, {"model_preset": "llama3-8b", "fp8": True})
    assert fp8.workload.fp8 and not bf16.workload.fp8
    assert fp8.speed.compute_parts[0] < 0.8 * bf16.speed.compute_parts[0]
    assert fp8.speed.compute_parts[1] == pytest.approx(bf16.speed.compute_parts[1])  # attention stays bf16
    assert fp8.speed.tokens_per_second > bf16.speed.tokens_per_second
    assert fp8.memory.per_gpu != bf16.memory.per_gpu


def test_fp8_is_refused_where_it_cannot_run(catalog):
    """An A100 instance has no FP8 tensor cores; frozen 1.2.0 code ships no torchao: plan refuses, as
    render does, and names what works."""
    a100 = catalog.resolve("llama-pretrain-fsdp@1.3.0")  # 2 x ml.p4d.24xlarge
    with pytest.raises(RequestValidationError, match=r"ml.p4d.24xlarge has none: its A100-40GB GPUs "
                                                     r".*use one of ml.p5.48xlarge, ml.p5e.48xlarge"):
        plan_run(a100, {"fp8": True})
    assert plan_run(a100, {"fp8": True, "instance_type": "ml.p5.48xlarge"}).workload.fp8
    frozen = catalog.resolve("llama-pretrain-hsdp-tp@1.2.0")
    options = PlanOptions(program=catalog.program_contract(frozen))
    with pytest.raises(LlmtrainError, match="fp8"):
        plan_run(frozen, {"fp8": True}, options)


def test_context_parallel_is_planned(catalog):
    """context_parallel_degree 2 at 32K: each rank's tokens halve, the K/V all-gathers appear."""
    template = catalog.resolve("llama-pretrain-hsdp-tp@1.3.0")
    base = {"model_preset": "llama3-8b", "seq_len": 32768, "tensor_parallel_degree": 8, "shard_degree": 1}
    plain = plan_run(template, base)
    split = plan_run(template, {**base, "context_parallel_degree": 2, "micro_batch_size": 1})
    assert split.layout.context == 2 and plain.layout.context == 1
    names = {t.name for t in split.speed.transfers}
    assert "context-parallel key/value all-gather" in names
    assert split.memory.activations < plain.memory.activations


def test_suggest_searches_context_parallel_for_long_sequences(catalog):
    template = catalog.resolve("llama-pretrain-hsdp-tp@1.3.0")
    long = plan_run(template, {"model_preset": "llama3-8b", "seq_len": 32768})
    meshes = mesh_changes(template, long)
    assert any(m.get("context_parallel_degree", 1) > 1 for m in meshes)
    # moving ranks to the context dimension keeps the mesh's size (the template sets shard_degree)
    assert all(m.get("shard_degree", 2) * m.get("context_parallel_degree", 1) == 2
               for m in meshes if m.get("tensor_parallel_degree", 4) == 4)
    short = plan_run(template, {"model_preset": "llama3-8b", "seq_len": 4096})
    assert not any("context_parallel_degree" in m for m in mesh_changes(template, short))


# --- the recipes at size ------------------------------------------------------------------------------

RECIPES_AT_SIZE = {  # template: (instances, mesh (pp, shard x context, tp, context), sequence parallel)
    "llama3-70b": (32, (1, 32, 8, 1)),
    "llama3-405b": (64, (8, 8, 8, 1)),
    "llama3-8b-long-context": (2, (1, 16, 1, 2)),
}


@pytest.mark.parametrize("name", sorted(RECIPES_AT_SIZE))
def test_recipes_at_size_are_planned_to_fit(catalog, name):
    """Each large recipe fits its H100s with headroom, on the mesh its comments describe, in bf16 and
    with fp8=true (docs/templates.md lists the predicted tokens/s per GPU)."""
    count, (pp, shard, tp, cp) = RECIPES_AT_SIZE[name]
    template = catalog.resolve(name)
    for overrides in ({}, {"fp8": True}):
        plan = plan_run(template, overrides)
        layout = plan.layout
        assert plan.instance.name == "ml.p5.48xlarge" and plan.instance_count == count
        assert (layout.pipeline, layout.shard, layout.tensor, layout.context) == (pp, shard, tp, cp)
        assert layout.sequence_parallel == (tp > 1)
        assert plan.fits and plan.memory.per_gpu < 0.9 * plan.memory.capacity, plan.summary_line()
        assert plan.workload.fp8 == bool(overrides)
    faster = plan_run(template, {"fp8": True}).speed.tokens_per_second
    assert faster > plan_run(template, {}).speed.tokens_per_second


def test_every_platform_version_fits_its_own_plan_with_its_defaults(catalog):
    """`start` refuses a run its plan says will not fit, so a version whose defaults do not fit could
    never start unchanged (llama-grpo@1.0.0's first draft: 46 of 40 GiB per GPU). byo-script runs
    code the planner does not know."""
    unfit = []
    for template in catalog.all():
        if template.code.source != "platform":
            continue
        plan = plan_run(template, {})
        if not plan.fits:
            unfit.append(f"{template.ref}: {plan.memory.per_gpu / 2**30:.1f} GiB per GPU")
    assert not unfit, unfit
