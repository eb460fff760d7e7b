"""Model states per GPU: the parameters, gradients and optimizer states one rank holds.

What each strategy keeps of them (llmtrain.planner.memory, parts "parameters", "gradients" and
"optimizer"): single, DDP and tensor parallel replicate them; FSDP2 shards them and keeps some
blocks gathered; DeepSpeed's ZeRO stages partition them. `ModelStates.offloadable` is what offloading
moves to the host. How each follows from the strategy is in docs/planning.md ("The memory model").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmtrain.planner.precision import FP32, LOW, gathered_bytes, regime
from llmtrain.planner.shapes import ParameterTensor
from llmtrain.planner.sharding import Tensors, shard_numel, state_numel, tp_local_numel
from llmtrain.planner.workload import Layout, Workload

ADAM_MOMENTS = 2
# DeepSpeed's defaults as the program configures it (training_jobs/trainer/deepspeed_strategy.py).
DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000
DEEPSPEED_PERSISTENCE_THRESHOLD = 100_000  # ZeRO-3 keeps smaller parameters whole on every rank
# ZeRO-3 leaves up to this many gathered parameter elements in place after forward when backward
# will use them again soon (stage3_max_live_parameters and max_reuse_distance, both 1e9).
DEEPSPEED_MAX_LIVE_PARAMETERS = 1_000_000_000


@dataclass(frozen=True)
class ModelStates:
    parameters: int
    gradients: int
    optimizer: int
    # What offloading moves to the host, by part (it stays in the parts above until on_gpu).
    offloadable: tuple[int, int, int] = (0, 0, 0)
    details: dict[str, int] = field(default_factory=dict)

    def all(self) -> tuple[int, int, int]:
        return self.parameters, self.gradients, self.optimizer

    def on_gpu(self, layout: Layout) -> tuple[int, int, int]:
        if not (layout.offload_params or layout.offload_optimizer):
            return self.all()
        return tuple(part - moved for part, moved in zip(self.all(), self.offloadable, strict=True))


def model_states(work: Workload, layout: Layout, tensors: Tensors) -> ModelStates:
    if layout.fsdp_wrapped:
        return _fsdp_states(work, layout, tensors)
    if layout.strategy == "deepspeed":
        return _deepspeed_states(work, layout, tensors)
    return _replicated_states(work, layout, tensors)


def _replicated_states(work: Workload, layout: Layout, tensors: Tensors) -> ModelStates:
    """single, DDP and tensor parallel alone: fp32 weights (autocast computes in bf16/fp16), fp32
    gradients, and DDP's gradient buckets (as large again: the program keeps
    gradient_as_bucket_view off)."""
    t = layout.tensor
    trainable = sum(tp_local_numel(p, t) for p in tensors.trainable)
    frozen_bytes = _frozen_bytes(work, tensors.frozen)
    buckets = FP32 * trainable if layout.strategy == "ddp" and layout.data_parallel > 1 else 0
    grads = FP32 * trainable + buckets
    return ModelStates(
        parameters=FP32 * trainable + frozen_bytes,
        gradients=grads,
        optimizer=_adam_bytes(trainable, len(tensors.trainable)),
        details={"ddp_bucket_bytes": buckets},
    )


def _frozen_bytes(work: Workload, frozen: tuple[ParameterTensor, ...]) -> int:
    """A LoRA base: fp32, or NF4 (QLoRA: 4 bits per quantized weight plus its block scales, ~0.127
    bits with double quantization; the rest fp32 as peft's prepare_model_for_kbit_training leaves it)."""
    if work.quantization != "nf4":
        return FP32 * sum(p.numel for p in frozen)
    quantized = sum(p.numel for p in frozen if p.kind == "linear" and p.layer is not None)
    others = sum(p.numel for p in frozen) - quantized
    return int(quantized * (4 + 0.127) / 8) + FP32 * others


def _adam_bytes(trainable_elements: int, tensors: int) -> int:
    """AdamW's exp_avg and exp_avg_sq in fp32, plus one fp32 step count per tensor."""
    return ADAM_MOMENTS * FP32 * trainable_elements + FP32 * tensors


def _fsdp_states(work: Workload, layout: Layout, tensors: Tensors) -> ModelStates:
    """FSDP2 (fully_shard per block, then the root) with MixedPrecisionPolicy(param_dtype=compute,
    reduce_dtype=fp32): fp32 shards of weights, gradients and moments; compute-dtype unsharded
    copies of the modules not resharded after forward (the root and the last block; every block
    with grad_op); grad_op with accumulation keeps unsharded fp32 gradients between micro steps."""
    n, t = layout.shard, layout.tensor

    def piece(p: ParameterTensor, padded: bool) -> int:
        return state_numel(p, work, t, n, padded=padded)

    sharded = sum(FP32 * piece(p, True) for p in tensors.all)
    kept = _unsharded_after_forward(work, layout, tensors)
    reg = regime(work, layout)
    gathered = sum(gathered_bytes(work, layout, reg, p) * shard_numel(p, t, 1, padded=True) for p in kept)
    trainable_shard = sum(piece(p, False) for p in tensors.trainable)
    grads = FP32 * sum(piece(p, True) for p in tensors.trainable)
    if (layout.fsdp_sharding == "grad_op" or layout.pipelined) and work.grad_accum_steps > 1:
        # fp32 unsharded gradients accumulate between micro steps (no reduction until the last;
        # pipeline stages always defer it to their last micro-batch)
        grads = max(grads, FP32 * sum(tp_local_numel(p, t) for p in tensors.trainable))
    optimizer = _adam_bytes(trainable_shard, len(tensors.trainable))
    return ModelStates(
        parameters=sharded + gathered,
        gradients=grads,
        optimizer=optimizer,
        offloadable=(sharded, grads, optimizer),
        details={"sharded_parameter_bytes": sharded, "gathered_parameter_bytes": gathered},
    )


def _unsharded_after_forward(work: Workload, layout: Layout, tensors: Tensors) -> list[ParameterTensor]:
    """What stays gathered: the root and the last block; everything with grad_op, and with
    pipeline stages (torch's pipelining does not reshard a stage after a micro-batch's backward,
    so after the first backward every block of the rank's stages is gathered until the step ends)."""
    last = work.model.num_layers - 1
    if layout.fsdp_sharding == "grad_op" or layout.pipelined:
        return list(tensors.all)
    return [p for p in tensors.all if p.layer is None or p.layer == last]


def _deepspeed_states(work: Workload, layout: Layout, tensors: Tensors) -> ModelStates:
    """ZeRO 1-3 with bf16/fp16: the model's weights in the compute dtype (whole for stages 1-2;
    partitioned for 3, except small persistent ones, and gathered ones ZeRO-3 leaves in place for
    backward), fp32 master partitions and moments in the optimizer. Gradients: stage 1 keeps every
    full gradient until the step's reduction; stages 2 and 3 reduce them through a bucket of
    reduce_bucket_size elements (allocated whole) into compute-dtype partitions."""
    n = layout.shard
    compute = FP32 if work.precision == "fp32" else LOW
    everything = sum(p.numel for p in tensors.all)
    trainable = sum(p.numel for p in tensors.trainable)
    partition = -(-trainable // n)
    bucket = DEEPSPEED_REDUCE_BUCKET_ELEMENTS
    if layout.zero_stage == 3:
        persistent = sum(p.numel for p in tensors.all if p.numel < DEEPSPEED_PERSISTENCE_THRESHOLD)
        live = min(everything - persistent, DEEPSPEED_MAX_LIVE_PARAMETERS)
        parameters = compute * (-(-(everything - persistent) // n) + persistent + live)
        grads = compute * (partition + bucket)
    elif layout.zero_stage == 2:
        parameters = compute * everything
        grads = compute * (partition + bucket)
    else:
        parameters = compute * everything
        grads = compute * trainable
    optimizer = FP32 * partition + _adam_bytes(partition, len(tensors.trainable))
    return ModelStates(
        parameters=parameters,
        gradients=grads,
        optimizer=optimizer,
        offloadable=(
            parameters if layout.zero_stage == 3 and layout.offload_params else 0,
            0,
            optimizer if layout.offload_optimizer else 0,
        ),
        details={"deepspeed_partition_elements": partition},
    )
