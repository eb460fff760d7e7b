"""Memory per GPU: what the training program holds, part by part, at the peak of a step.

Each part is the most the program holds of it during a step, as bench/plan_memory.py measures it:

- parameters: parameter storage at the end of the forward pass: the rank's (sharded) weights plus
  the gathered copies a sharding strategy still holds then (FSDP2's unsharded compute-dtype copies of
  modules it does not reshard after forward: the root and the last block, or every block with
  grad_op);
- gradients: gradient storage after backward (or between micro steps when they are larger there):
  `.grad`, DDP's buckets, DeepSpeed's partitions and reduction buckets;
- optimizer: AdamW's moments and step counts, and the fp32 master weights DeepSpeed keeps apart from
  the model's low-precision weights;
- activations: what autograd saves for backward during one micro batch's forward (all decoder
  blocks, the final norm, the output head, the loss), and the compute-dtype weight copies autocast
  saves; never parameter storage;
- working: buffers that exist for a moment at the peak: the next block gathered ahead of use, one
  checkpointed block recomputed, the logits and their gradient, a block's unsharded gradients;
- overhead: the CUDA context, NCCL's buffers and the allocator's unusable remainder (on GPUs only).

With pipeline stages every pipeline rank is planned apart (its stages' states, the activations of
the micro-batches its schedule holds at once, torch's receive buffers and the last stage's kept
logits; "pipeline stages" below) and the plan reports the rank that holds the most.

How each part follows from the strategy is in docs/planning.md ("The memory model", "The pipeline"). The
activation terms follow the Hugging Face Llama block op by op (which tensor each op saves, in which
dtype) rather than a fitted constant, so they hold for any width, depth, sequence and batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from llmtrain.planner import pipeline
from llmtrain.planner.shapes import ALL_LINEAR, ModelShape, ParameterTensor
from llmtrain.planner.workload import Layout, Workload
from training_jobs.contract.stage_split import balanced_split, stage_indices

FP32, LOW = 4, 2
# Elements of one fp32 chunk of the program's cross-entropy (training_jobs/trainer/loss.py).
LOSS_CHUNK_ELEMENTS = 1 << 24
ADAM_MOMENTS = 2
# DeepSpeed's defaults as the program configures it (training_jobs/trainer/deepspeed_strategy.py).
DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000
DEEPSPEED_PERSISTENCE_THRESHOLD = 100_000  # ZeRO-3 keeps smaller parameters whole on every rank
# ZeRO-3 leaves up to this many gathered parameter elements in place after forward when backward
# will use them again soon (stage3_max_live_parameters and max_reuse_distance, both 1e9).
DEEPSPEED_MAX_LIVE_PARAMETERS = 1_000_000_000
# The CUDA context, NCCL's buffers and what the caching allocator cannot hand out: the part of a
# GPU no tensor gets (torchtitan's H100 runs, docs/planning.md; measured there, not here).
CUDA_CONTEXT_BYTES = 1_000_000_000
ALLOCATOR_RESERVE_FRACTION = 0.05
GIB = 1024**3


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    working: int
    overhead: int
    capacity: int
    offloaded: int = 0  # bytes moved to host memory (offload), not counted above
    details: dict[str, int] = field(default_factory=dict)

    @property
    def per_gpu(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.activations
            + self.working
            + self.overhead
        )

    @property
    def fits(self) -> bool:
        return self.per_gpu <= self.capacity

    @property
    def headroom(self) -> int:
        return self.capacity - self.per_gpu

    def to_dict(self) -> dict[str, object]:
        return {
            "per_gpu_bytes": self.per_gpu,
            "capacity_bytes": self.capacity,
            "headroom_bytes": self.headroom,
            "parameters_bytes": self.parameters,
            "gradients_bytes": self.gradients,
            "optimizer_bytes": self.optimizer,
            "activations_bytes": self.activations,
            "working_bytes": self.working,
            "overhead_bytes": self.overhead,
            "offloaded_bytes": self.offloaded,
            "details": dict(self.details),
        }


# --- which parameters train, and how big each rank's piece is ------------------------------------


def lora_targets(model: ModelShape, targets: tuple[str, ...]) -> list[ParameterTensor]:
    """The decoder blocks' linear weights that get LoRA adapters."""
    linears = [p for p in model.parameters() if p.kind == "linear" and p.layer is not None]
    if ALL_LINEAR in targets:
        return linears
    return [p for p in linears if p.module in targets]


@dataclass(frozen=True)
class Tensors:
    """The model's parameter tensors with the trainable ones marked (LoRA adds its adapters)."""

    frozen: tuple[ParameterTensor, ...]
    trainable: tuple[ParameterTensor, ...]

    @property
    def all(self) -> tuple[ParameterTensor, ...]:
        return self.frozen + self.trainable


def parameter_tensors(work: Workload) -> Tensors:
    base = work.model.parameters()
    if not work.behaviour.loss_parallel:
        # older code kept the embedding and the output head whole on every tensor-parallel rank
        base = tuple(replace(p, tp=None) if p.layer is None else p for p in base)
    if not work.lora:
        return Tensors((), base)
    adapters = []
    for weight in lora_targets(work.model, work.lora_targets):
        out_dim, in_dim = _linear_dims(work.model, weight)
        prefix = weight.name.removesuffix(".weight")
        # peft splits the adapters like their base under tensor parallel: not supported (the
        # program refuses LoRA with TP), so they carry no tp tag.
        adapters += [
            ParameterTensor(f"{prefix}.lora_A.weight", (work.lora_r, in_dim), "linear", weight.layer),
            ParameterTensor(f"{prefix}.lora_B.weight", (out_dim, work.lora_r), "linear", weight.layer),
        ]
    return Tensors(base, tuple(adapters))


def _linear_dims(model: ModelShape, weight: ParameterTensor) -> tuple[int, int]:
    """(out, in) of a linear: Llama stores (out, in), GPT-2's Conv1D (in, out)."""
    rows, cols = weight.shape
    return (cols, rows) if model.family == "gpt2" else (rows, cols)


def tp_local_numel(param: ParameterTensor, tensor: int) -> int:
    """Elements on one tensor-parallel rank (colwise splits rows, rowwise columns)."""
    if tensor <= 1 or param.tp is None:
        return param.numel
    return param.numel // tensor


def shard_numel(param: ParameterTensor, tensor: int, shard: int, *, padded: bool) -> int:
    """Elements of one FSDP2 shard: dim 0 split in `shard` chunks, padded to equal chunks."""
    local = tp_local_numel(param, tensor)
    rows = param.shape[0] // tensor if param.tp == "colwise" and tensor > 1 else param.shape[0]
    rest = local // rows
    if padded:
        return -(-rows // shard) * rest
    return local // shard if rows % shard == 0 else -(-rows // shard) * rest


# --- the parts ------------------------------------------------------------------------------------


def estimate(work: Workload, layout: Layout, capacity: int, *, on_gpu: bool = True) -> MemoryEstimate:
    """The memory one rank holds for `work` under `layout` (see the module docstring); with
    pipeline stages, the pipeline rank that holds the most."""
    if layout.pipelined:
        return max(pipeline_estimates(work, layout, capacity, on_gpu=on_gpu), key=lambda e: e.per_gpu)
    tensors = parameter_tensors(work)
    activations, details = activation_bytes(work, layout, on_gpu)
    states = _model_states(work, layout, tensors)
    return _assemble(
        work, layout, capacity, on_gpu, states, activations, working_bytes(work, layout, tensors), details
    )


def _assemble(
    work: Workload,
    layout: Layout,
    capacity: int,
    on_gpu: bool,
    states: ModelStates,
    activations: int,
    working: int,
    act_details: dict[str, int],
) -> MemoryEstimate:
    gpu_states = states.on_gpu(layout)
    if work.activation_offloading and work.activation_checkpointing != "none":
        offloaded_activations, activations = activations, 0
    else:
        offloaded_activations = 0
    subtotal = sum(gpu_states) + activations + working
    overhead = int(CUDA_CONTEXT_BYTES + ALLOCATOR_RESERVE_FRACTION * subtotal) if on_gpu else 0
    return MemoryEstimate(
        parameters=gpu_states[0],
        gradients=gpu_states[1],
        optimizer=gpu_states[2],
        activations=activations,
        working=working,
        overhead=overhead,
        capacity=capacity,
        offloaded=sum(states.all()) - sum(gpu_states) + offloaded_activations,
        details={**act_details, **states.details},
    )


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


def _model_states(work: Workload, layout: Layout, tensors: Tensors) -> ModelStates:
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
    sharded = sum(FP32 * shard_numel(p, t, n, padded=True) for p in tensors.all)
    kept = _unsharded_after_forward(work, layout, tensors)
    reg = regime(work, layout)
    gathered = sum(gathered_bytes(work, layout, reg, p) * shard_numel(p, t, 1, padded=True) for p in kept)
    trainable_shard = sum(shard_numel(p, t, n, padded=False) for p in tensors.trainable)
    grads = FP32 * sum(shard_numel(p, t, n, padded=True) for p in tensors.trainable)
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


# --- activations ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Regime:
    """Dtypes of one precision setup, in bytes: the residual stream, matmul inputs and outputs, and
    whether every matmul input and weight is a fresh compute-dtype copy (autocast)."""

    residual: int
    compute: int
    autocast: bool


def regime(work: Workload, layout: Layout) -> Regime:
    if work.precision == "fp32":
        return Regime(FP32, FP32, False)
    if layout.strategy in ("single", "ddp") or (layout.strategy == "fsdp" and not layout.fsdp_wrapped):
        return Regime(FP32, LOW, True)  # autocast over fp32 weights
    return Regime(LOW, LOW, False)  # the weights themselves are bf16/fp16 in compute


class BlockTrace:
    """Walks a Llama block op by op, the way autograd records it: which tensors each op saves for
    backward (per token of the rank's part of the sequence, keyed so that a tensor saved twice
    counts once), which weights autocast copies and keeps (per block, not per token), and which
    outputs require a gradient.

    Under tensor parallel with sequence parallel the norms run on the rank's 1 / tp of the tokens
    and each region opens with an all-gather of the norm's output (a new tensor, what the region's
    linears keep); under context parallel attention keeps the keys and values of the whole sequence
    (all-gathered and repeated to the query heads: `context` x a query's width per local token) and
    its output twice (SDPA's two chunks and o_proj's contiguous input)."""

    def __init__(
        self, work: Workload, reg: Regime, layout: Layout, input_requires_grad: bool, on_gpu: bool = True
    ) -> None:
        self.work, self.reg, self.on_gpu = work, reg, on_gpu
        self.t, self.sp, self.c = layout.tensor, layout.sequence_shards, layout.context
        self.per_token: dict[str, float] = {}
        self.weight_copies = 0.0
        self.grad: dict[str, bool] = {"input": input_requires_grad}
        self.adapted = _adapted_modules(work)

    def save(self, key: str, bytes_per_token: float) -> None:
        self.per_token[key] = bytes_per_token

    def norm(self, name: str, source: str) -> None:
        """RMSNorm in fp32: the (upcast) input and 1/rms for the input's gradient, the normalized
        value (in the input dtype) for the scale's; on 1 / tp of the tokens with sequence parallel."""
        h = self.work.model.hidden_size
        trains_scale = not self.work.lora
        if self.grad[source]:
            self.save(f"{name}.x", FP32 * h / self.sp)
            self.save(f"{name}.rstd", FP32 / self.sp)
        if trains_scale:
            self.save(f"{name}.y", self.reg.residual * h / self.sp)
        self.grad[name] = self.grad[source] or trains_scale

    def region_input(self, norm: str) -> str:
        """The tensor a tensor-parallel region's linears take: the norm's output, or under sequence
        parallel its all-gather (full width, every token of the rank's sequence part)."""
        return norm if self.sp == 1 else f"{norm}.gathered"

    def linear(self, module: str, source: str, d_in: int, d_out: int, source_bytes: float,
               saved: str | None = None) -> None:
        """A linear layer taking `source` (whose gradient flag it reads) as the tensor `saved` (the
        key of what it keeps; `source` itself unless a collective made a new tensor of it)."""
        trains_weight = not self.work.lora
        needs_input_grad = self.grad[source]
        cast_input = self.reg.autocast and source_bytes == FP32 * d_in
        if trains_weight:
            self._save_input(f"{module}.input", saved or source, d_in, source_bytes, cast_input)
        # torchao's Float8Linear keeps its high-precision weight itself, not an autocast copy.
        if self.reg.autocast and (trains_weight or needs_input_grad) and not self.work.fp8:
            self.weight_copies += LOW * d_in * d_out
        adapted = module in self.adapted
        if adapted:
            self._adapter(module, source, d_in, d_out, source_bytes, cast_input, needs_input_grad)
        self.grad[module] = needs_input_grad or trains_weight or adapted

    def _save_input(self, key: str, source: str, d_in: int, source_bytes: float, cast: bool) -> None:
        if cast:
            self.save(key, LOW * d_in)  # autocast copies a fp32 input at every call
        else:
            self.save(source, source_bytes)

    def _adapter(
        self,
        module: str,
        source: str,
        d_in: int,
        d_out: int,
        source_bytes: float,
        cast_input: bool,
        needs_input_grad: bool,
    ) -> None:
        """peft's LoRA: B(A(dropout(x))) x scale, with x first cast to the adapter weights' dtype.
        lora_A saves its input (dropout's output, or x itself; under autocast always a fresh
        compute-dtype copy, since peft casts x to the fp32 adapter dtype first), lora_B lora_A's
        output; dropout saves its mask when x needs a gradient: a bool tensor on CUDA, the scaled
        noise in the adapter dtype on a CPU."""
        r, e = self.work.lora_r, self.reg.compute
        adapter_dtype = FP32 if self.reg.autocast or self.reg.compute == FP32 else LOW
        if self.work.lora_dropout > 0:
            if needs_input_grad:
                self.save(f"{module}.dropout_mask", (1 if self.on_gpu else adapter_dtype) * d_in)
            self.save(f"{module}.dropout_out", (LOW if self.reg.autocast else adapter_dtype) * d_in)
        elif self.reg.autocast:
            self.save(f"{module}.lora_input", LOW * d_in)
        else:
            self._save_input(f"{module}.lora_input", source, d_in, source_bytes, cast_input)
        self.save(f"{module}.lora_a_out", e * r)
        if self.reg.autocast:
            self.weight_copies += LOW * r * d_out + (LOW * r * d_in if needs_input_grad else 0)

    def trace(self) -> BlockTrace:
        m, t, e = self.work.model, self.t, self.reg.compute
        h, i, kv = m.hidden_size, m.intermediate_size, m.kv_size
        region_bytes = (FP32 if self.reg.autocast else self.reg.residual) * h
        self.norm("norm1", "input")
        for module, d_out in (("q_proj", h // t), ("k_proj", kv // t), ("v_proj", kv // t)):
            self.linear(module, "norm1", h, d_out, region_bytes, self.region_input("norm1"))
        self.grad["attn"] = self.grad["q_proj"] or self.grad["k_proj"] or self.grad["v_proj"]
        if self.grad["attn"]:
            self._attention()
        self.linear("o_proj", "attn", h // t, h, e * h / t, "attn" if self.c == 1 else "attn.contiguous")
        self.grad["mid"] = self.grad["input"] or self.grad["o_proj"]
        self.norm("norm2", "mid")
        for module in ("gate_proj", "up_proj"):
            self.linear(module, "norm2", h, i // t, region_bytes, self.region_input("norm2"))
        if self.grad["gate_proj"]:
            self.save("gate", e * i / t)
        if self.grad["gate_proj"] or self.grad["up_proj"]:
            self.save("silu", e * i / t)
            self.save("up", e * i / t)
        self.grad["prod"] = self.grad["gate_proj"] or self.grad["up_proj"]
        self.linear("down_proj", "prod", i // t, h, e * i / t)
        return self

    def _attention(self) -> None:
        """What SDPA keeps: its inputs (q and k after rotary, v), its output and its fp32
        log-sum-exp; under context parallel the keys and values of the whole sequence repeated to
        the query heads, and the output once more as o_proj's contiguous input (the two query
        chunks' outputs are concatenated and transposed)."""
        m, t, e, c = self.work.model, self.t, self.reg.compute, self.c
        h, kv = m.hidden_size, m.kv_size
        if c == 1:
            widths = (("q_rotary", h / t), ("k_rotary", kv / t), ("v", kv / t), ("attn", h / t))
        else:
            widths = (("q_rotary", h / t), ("keys", c * h / t), ("values", c * h / t), ("attn", h / t),
                      ("attn.contiguous", h / t))
        for key, width in widths:
            self.save(key, e * width)
        self.save("lse", FP32 * m.num_heads / t)

    def bytes(self, tokens: int) -> float:
        return sum(self.per_token.values()) * tokens + self.weight_copies


def _adapted_modules(work: Workload) -> set[str]:
    if not work.lora:
        return set()
    return {p.module for p in lora_targets(work.model, work.lora_targets)}


def local_tokens(work: Workload, layout: Layout) -> int:
    """Tokens of one micro batch on one rank: its part of every sequence under context parallel."""
    return work.micro_batch_tokens // layout.context


def _block_traces(
    work: Workload, layout: Layout, reg: Regime, on_gpu: bool = True
) -> tuple[BlockTrace, BlockTrace]:
    """The first block (whose input needs no gradient when the embedding is frozen, as with LoRA)
    and every other block."""
    first = BlockTrace(work, reg, layout, input_requires_grad=not work.lora, on_gpu=on_gpu)
    rest = BlockTrace(work, reg, layout, input_requires_grad=True, on_gpu=on_gpu)
    return first.trace(), rest.trace()


def _matmul_widths(work: Workload, layout: Layout) -> list[float]:
    """Output widths per token of a block's matmuls in the order it runs them (LoRA's two matmuls
    per adapted projection after their base's); o and down write the full width (partial sums
    under tensor parallel)."""
    m, t = work.model, layout.tensor
    h, i, kv = m.hidden_size, m.intermediate_size, m.kv_size
    adapted = _adapted_modules(work)
    outputs = {
        "q_proj": h / t,
        "k_proj": kv / t,
        "v_proj": kv / t,
        "o_proj": h,
        "gate_proj": i / t,
        "up_proj": i / t,
        "down_proj": h,
    }
    matmuls = []
    for module, width in outputs.items():
        matmuls.append(width)
        if module in adapted:
            matmuls += [work.lora_r, width]
    return matmuls


def _selective_bytes(work: Workload, layout: Layout, reg: Regime, tokens: int) -> float:
    """What a selectively checkpointed block keeps, per its code's policy: the block's input (which
    the checkpoint keeps; 1 / tp of the tokens with sequence parallel), SDPA's output and
    log-sum-exp, and
    - torchtitan's op-level policy (this program): every other matmul's output in the block's
      order (the 1st, 3rd, ...: q, v, gate and down without adapters; LoRA's two matmuls per adapted
      projection take their turns) and, with sequence parallel, the outputs of the two
      reduce-scatters that close the tensor-parallel regions;
    - older code ("every_matmul"): every matmul's output."""
    m, t, e = work.model, layout.tensor, reg.compute
    h = m.hidden_size
    matmuls = _matmul_widths(work, layout)
    per_token = reg.residual * h / layout.sequence_shards + e * h / t + FP32 * m.num_heads / t
    if work.behaviour.selective_policy == "every_matmul":
        return (per_token + e * sum(matmuls)) * tokens
    per_token += e * sum(matmuls[0::2])
    if layout.sequence_parallel:
        per_token += 2 * e * h / layout.tensor
    return per_token * tokens


def _checkpointed_block_bytes(work: Workload, layout: Layout, reg: Regime, tokens: int) -> float | None:
    """What a checkpointed block keeps; None without checkpointing."""
    if work.activation_checkpointing == "full":
        return reg.residual * work.model.hidden_size * tokens / layout.sequence_shards
    if work.activation_checkpointing == "selective":
        return _selective_bytes(work, layout, reg, tokens)
    return None


def _head_bytes(work: Workload, layout: Layout, reg: Regime, tokens: int) -> float:
    """After the blocks: the final norm, the output head's input (or, frozen under autocast, its
    weight copy), the loss and the token ids the embedding and the loss keep."""
    ids = 8 + (8 if not work.lora else 0)
    return (_head_per_token(work, layout, reg) + ids) * tokens + _head_weight_copy(work, layout, reg)


def _head_per_token(work: Workload, layout: Layout, reg: Regime) -> float:
    """The final norm (on 1 / tp of the tokens with sequence parallel), the head's input (all of the
    rank's tokens) and the loss's: with the chunked loss the logits as the head computed them (the
    rank's vocabulary shard under loss parallel), an fp32 log-sum-exp and a flag per token; older
    code's cross-entropy kept an fp32 log-softmax of the whole vocabulary instead."""
    h = work.model.hidden_size
    trains = not work.lora
    per_token = (FP32 * h + FP32 + (reg.residual * h if trains else 0)) / layout.sequence_shards
    per_token += (LOW if reg.autocast else reg.compute) * h if trains else 0
    if not work.behaviour.chunked_loss:
        return per_token + FP32 * work.model.vocab_size
    return per_token + _logit_bytes(reg) * _vocabulary_shard(work, layout) + FP32 + 1


def _vocabulary_shard(work: Workload, layout: Layout) -> float:
    """Vocabulary entries whose logits one rank computes: its shard under loss parallel."""
    return work.model.vocab_size / (layout.tensor if work.behaviour.loss_parallel else 1)


def _logit_bytes(reg: Regime) -> int:
    return LOW if reg.autocast else reg.compute


def _head_weight_copy(work: Workload, layout: Layout, reg: Regime) -> float:
    """Autocast's compute-dtype copy of the output head's weight (the rank's vocabulary shard)."""
    return LOW * _vocabulary_shard(work, layout) * work.model.hidden_size if reg.autocast else 0


def _rotary_bytes(work: Workload, layout: Layout, reg: Regime) -> float:
    """cos and sin of the rank's positions, shared by the blocks that save them."""
    return 2 * work.seq_len / layout.context * work.model.head_dim * reg.residual


def activation_bytes(work: Workload, layout: Layout, on_gpu: bool = True) -> tuple[int, dict[str, int]]:
    """Bytes saved for backward during one micro batch's forward, on one rank."""
    if work.model.family != "llama":
        return _gpt2_activation_bytes(work, layout)
    reg = regime(work, layout)
    tokens = local_tokens(work, layout)
    m = work.model
    first, rest = _block_traces(work, layout, reg, on_gpu)
    kept = _checkpointed_block_bytes(work, layout, reg, tokens)
    blocks = 0.0
    for layer in range(m.num_layers):
        checkpointed = kept is not None and layer % work.checkpoint_every == 0
        blocks += kept if checkpointed else (first if layer == 0 else rest).bytes(tokens)
    head = _head_bytes(work, layout, reg, tokens)
    # cos and sin, shared by the blocks that save them (a checkpointed block keeps them only as
    # its inputs, outside autograd's saved tensors)
    uncheckpointed = m.num_layers - work.checkpointed_layers
    rotary = _rotary_bytes(work, layout, reg) if uncheckpointed else 0
    total = int(blocks + head + rotary)
    return total, {"activation_block_bytes": int(rest.bytes(tokens)), "activation_head_bytes": int(head)}


def _gpt2_activation_bytes(work: Workload, layout: Layout) -> tuple[int, dict[str, int]]:
    """GPT-2 blocks op by op (LayerNorm keeps its input, mean and 1/std; Conv1D its input; SDPA the
    fused q/k/v projection, its output and log-sum-exp; the tanh GELU four intermediates; the
    second Conv1D the GELU's output); dropout is off in the presets. Autocast copies the LayerNorms'
    fp32 outputs and every weight to the compute dtype."""
    reg = regime(work, layout)
    m, tokens, e = work.model, work.micro_batch_tokens, reg.compute
    h, i = m.hidden_size, m.intermediate_size
    norm = (FP32 if reg.autocast else reg.residual) * h + 2 * FP32  # input, mean, 1/std
    norm_output = (LOW if reg.autocast else e) * h  # what the next Conv1D keeps
    per_token = 2 * (norm + norm_output) + e * (3 * h + h) + FP32 * m.num_heads + 5 * e * i
    block_weights = sum(p.numel for p in m.parameters() if p.kind == "linear" and p.layer == 0)
    full_block = per_token * tokens + (LOW * block_weights if reg.autocast else 0)
    if work.activation_checkpointing == "full":
        kept = reg.residual * h * tokens
    elif work.activation_checkpointing == "selective":  # attention and every other matmul: c_attn, c_fc
        matmuls = 3 * h + i if work.behaviour.selective_policy != "every_matmul" else 3 * h + i + 2 * h
        kept = (reg.residual * h + e * (h + matmuls) + FP32 * m.num_heads) * tokens
    else:
        kept = full_block
    checkpointed = work.checkpointed_layers
    blocks = checkpointed * kept + (m.num_layers - checkpointed) * full_block
    loss = _logit_bytes(reg) * m.vocab_size + FP32 + 1 if work.behaviour.chunked_loss else FP32 * m.vocab_size
    head = (norm + norm_output + loss + 8 + 8) * tokens + 8 * work.seq_len
    head += LOW * m.vocab_size * h if reg.autocast else 0
    return int(blocks + head), {"activation_block_bytes": int(full_block), "activation_head_bytes": int(head)}


# --- working buffers ------------------------------------------------------------------------------


def working_bytes(work: Workload, layout: Layout, tensors: Tensors) -> int:
    """Transient buffers at the peak (beginning of backward): the logits' gradient and the loss's
    fp32 working copy; one checkpointed block recomputed; for FSDP the next block gathered ahead
    and one block's unsharded gradients; for ZeRO-3 the gathered block."""
    m = work.model
    reg = regime(work, layout)
    tokens = local_tokens(work, layout)
    recompute = 0
    if work.activation_checkpointing != "none" and m.family == "llama":
        recompute = int(_block_traces(work, layout, reg)[1].bytes(tokens))
    block = [p for p in tensors.all if p.layer == 0]
    gathered = 0
    if layout.fsdp_wrapped:
        # prefetched block (FP8 weights gathered in one byte) + its unsharded fp32 gradients
        gathered = sum((gathered_bytes(work, layout, reg, p) + FP32) * tp_local_numel(p, layout.tensor)
                       for p in block)
    elif layout.strategy == "deepspeed" and layout.zero_stage == 3:
        gathered = 2 * reg.compute * sum(tp_local_numel(p, layout.tensor) for p in block)
    return int(_loss_working_bytes(work, layout, reg, tokens) + recompute + gathered)


def _loss_working_bytes(work: Workload, layout: Layout, reg: Regime, tokens: int) -> float:
    """The chunked loss: the logits' gradient in their dtype and one fp32 chunk of its backward (64
    MiB at most), on the rank's vocabulary shard; older code: the logits, the fp32 log-softmax's
    gradient and the fp32 logits' gradient, of the whole vocabulary."""
    if not work.behaviour.chunked_loss:
        return (reg.compute + FP32 + FP32) * work.model.vocab_size * tokens
    shard = _vocabulary_shard(work, layout) * tokens
    return _logit_bytes(reg) * shard + FP32 * min(shard, LOSS_CHUNK_ELEMENTS)


def fp8_converted(work: Workload, param: ParameterTensor) -> bool:
    """A weight torchao's Float8Linear multiplies in FP8: the decoder layers' linear layers."""
    return work.fp8 and param.kind == "linear" and param.layer is not None and ".lora_" not in param.name


def gathered_bytes(work: Workload, layout: Layout, reg: Regime, param: ParameterTensor) -> int:
    """Bytes per element of a parameter as FSDP2 gathers it: the compute dtype, or one byte for an
    FP8 weight with the tensorwise recipe (torchao casts the shard before the all-gather)."""
    if fp8_converted(work, param) and work.fp8_recipe == "tensorwise" and layout.fsdp_wrapped:
        return 1
    return reg.compute


# --- pipeline stages --------------------------------------------------------------------------------
# A pipeline rank holds its stages' weights, gradients and optimizer states, and the activations of
# the micro-batches its schedule has in flight (pipeline.rank_actions replays torch's order).


def stage_layer_counts(work: Workload, layout: Layout) -> tuple[int, ...]:
    """Decoder layers per stage: pipeline_split, or the program's split balanced by compute (the
    head costs its parameters over one block's)."""
    if layout.split:
        return layout.split
    params = work.model.parameters()
    block = sum(p.numel for p in params if p.layer == 0)
    head = work.model.vocab_size * work.model.hidden_size
    return balanced_split(work.model.num_layers, layout.num_stages, head / block)


def pipeline_stages(work: Workload, layout: Layout) -> tuple[pipeline.Stage, ...]:
    return pipeline.stages_from_counts(stage_layer_counts(work, layout))


def rank_stages(work: Workload, layout: Layout, rank: int) -> list[pipeline.Stage]:
    stages = pipeline_stages(work, layout)
    return [stages[i] for i in stage_indices(rank, layout.pipeline, layout.stages_per_rank)]


def _holds(stage: pipeline.Stage, param: ParameterTensor) -> bool:
    """The embedding on the first stage, the final norm and head on the last (the others run an
    identity in place of the norm), each block on its stage."""
    if param.layer is not None:
        return param.layer in stage.layers
    return stage.first if param.kind == "embedding" else stage.last


def stage_tensors(work: Workload, stages: list[pipeline.Stage]) -> Tensors:
    held = tuple(p for p in parameter_tensors(work).trainable if any(_holds(s, p) for s in stages))
    return Tensors((), held)


def pipeline_estimates(
    work: Workload, layout: Layout, capacity: int, *, on_gpu: bool = True
) -> list[MemoryEstimate]:
    """What each pipeline rank holds (rank r at index r)."""
    estimates = []
    for rank in range(layout.pipeline):
        held = rank_stages(work, layout, rank)
        tensors = stage_tensors(work, held)
        activations, details = pipeline_activation_bytes(work, layout, rank)
        states = _model_states(work, layout, tensors)
        working = _pipeline_working_bytes(work, layout, tensors, held)
        estimate = _assemble(work, layout, capacity, on_gpu, states, activations, working, details)
        estimates.append(estimate)
    return estimates


def _stage_memory(work: Workload, layout: Layout, reg: Regime, stage: pipeline.Stage) -> pipeline.StageMemory:
    """What a stage saves per micro-batch: its blocks (as in a whole model), cos and sin, its
    output kept for backward (non-last stages) or the head and the loss (last); minus its input
    where the first block saves the very tensor it received (a receive buffer, counted apart):
    fp32 residuals, or a checkpointed first block. Autocast's weight copies are cached for the
    step, once per stage. The last stage's logits live from its forward until their gradient
    exists (the program frees them then, where torch would keep them for the step's result)."""
    tokens = local_tokens(work, layout)
    hidden = _boundary_bytes(work, layout, reg)
    trace = BlockTrace(work, reg, layout, input_requires_grad=True).trace()
    kept = _checkpointed_block_bytes(work, layout, reg, tokens)
    per_mb = copies = 0.0
    uncheckpointed = False
    for layer in stage.layers:
        if kept is not None and layer % work.checkpoint_every == 0:
            per_mb += kept
        else:
            per_mb += sum(trace.per_token.values()) * tokens
            copies += trace.weight_copies
            uncheckpointed = True
    per_mb += _rotary_bytes(work, layout, reg) if uncheckpointed else 0
    first_checkpointed = kept is not None and stage.first_layer % work.checkpoint_every == 0
    if not stage.first and (first_checkpointed or reg.residual == FP32):
        per_mb -= hidden
    if stage.last:
        # the logits the schedule keeps are the ones the loss saves: one storage
        per_mb += _head_per_token(work, layout, reg) * tokens
        copies += _head_weight_copy(work, layout, reg)
    else:
        per_mb += hidden
    between = after = 0.0
    if layout.schedule == "zero_bubble" and not stage.first:
        between = _weight_gradient_inputs(work, layout, reg, stage)
        after = _input_backward_only(work, layout, reg, stage)
    return pipeline.StageMemory(per_mb, between, after, copies)


def _weight_gradient_inputs(work: Workload, layout: Layout, reg: Regime, stage: pipeline.Stage) -> float:
    """Zero bubble's input backward keeps, for the weight backward, the gradient of every output
    a weight produced: each linear's output (compute dtype) and each norm's scaled output (its
    input's dtype), per block; the head's logits and the final norm's output on the last stage."""
    m, t, tokens = work.model, layout.tensor, local_tokens(work, layout)
    h, i, kv = m.hidden_size, m.intermediate_size, m.kv_size
    linears = (h + 2 * kv + 2 * i) / t + 2 * h
    norm_dtype = FP32 if reg.autocast else reg.residual
    per_token = stage.num_layers * (reg.compute * linears + 2 * norm_dtype * h)
    if stage.last:
        per_token += reg.compute * m.vocab_size + norm_dtype * h
    return per_token * tokens


def _input_backward_only(work: Workload, layout: Layout, reg: Regime, stage: pipeline.Stage) -> float:
    """What zero bubble's weight backward leaves of a micro-batch until the step ends, as measured
    here (bench/workers/plan_memory.py, torch 2.13): what only the input gradient needs. Per block:
    SDPA's q, k, v, output and log-sum-exp, both norms' fp32 inputs and 1/rms, and the MLP's gate,
    SiLU and up outputs unless the block ends a stage that is not the last; on the last stage the
    log-softmax and the final norm's input; cos and sin. The stage's first norm input is the
    received activation when it is fp32 (a receive buffer, counted apart)."""
    m, t, tokens = work.model, layout.tensor, local_tokens(work, layout)
    h, kv, i = m.hidden_size, m.kv_size, m.intermediate_size
    per_block = reg.compute * (2 * h + 2 * kv) / t + FP32 * m.num_heads / t + 2 * (FP32 * h + FP32)
    mlp = 3 * reg.compute * i / t
    per_token = stage.num_layers * (per_block + mlp) - (0 if stage.last else mlp)
    per_token -= FP32 * h if reg.residual == FP32 else 0
    if stage.last:
        per_token += FP32 * m.vocab_size + FP32 * h + FP32
    return per_token * tokens + _rotary_bytes(work, layout, reg)


def _boundary_bytes(work: Workload, layout: Layout, reg: Regime) -> float:
    """The activation one micro-batch passes between stages on one rank: its tokens' residual
    stream (its sequence shard under sequence parallel)."""
    return reg.residual * work.model.hidden_size * local_tokens(work, layout) / layout.sequence_shards


def receive_buffer_bytes(work: Workload, layout: Layout, stage: pipeline.Stage) -> float:
    """torch allocates, once, a buffer per micro-batch for the activation a non-first stage
    receives and for the gradient a non-last stage receives; zero bubble's input backward also
    leaves each received activation's gradient on its buffer until the next step."""
    hidden = _boundary_bytes(work, layout, regime(work, layout))
    count = (not stage.first) + (not stage.last)
    count += layout.schedule == "zero_bubble" and not stage.first
    return count * work.grad_accum_steps * hidden


def pipeline_activation_bytes(work: Workload, layout: Layout, rank: int) -> tuple[int, dict[str, int]]:
    """The most pipeline rank `rank` holds for backward while its schedule runs (its actions
    replayed), plus the token ids and targets of the step (their storage is the step's whole
    batch) and the receive buffers."""
    reg = regime(work, layout)
    held = rank_stages(work, layout, rank)
    memories = {stage.index: _stage_memory(work, layout, reg, stage) for stage in held}
    actions = pipeline.rank_actions(
        layout.schedule, layout.pipeline, layout.stages_per_rank, work.grad_accum_steps, rank
    )
    peak = pipeline.peak_held(actions, memories)
    step_tokens = local_tokens(work, layout) * work.grad_accum_steps
    ids = 8 * step_tokens * sum(stage.first + stage.last for stage in held)
    buffers = sum(receive_buffer_bytes(work, layout, stage) for stage in held)
    details = {
        "pipeline_rank": rank,
        "pipeline_stages": len(held),
        "pipeline_layers": sum(stage.num_layers for stage in held),
        "pipeline_micro_batches_in_flight": peak.in_flight,
        "pipeline_receive_buffer_bytes": int(buffers),
    }
    return int(peak.bytes + ids + buffers), details


def _pipeline_working_bytes(
    work: Workload, layout: Layout, tensors: Tensors, held: list[pipeline.Stage]
) -> int:
    """As for a whole model, on the rank's stages: the loss's working buffers on the last stage (the
    compute-dtype logits are kept, with the activations), one checkpointed block recomputed, FSDP's
    next block gathered and its unsharded gradients in flight."""
    reg = regime(work, layout)
    tokens = local_tokens(work, layout)
    last = any(stage.last for stage in held)
    logits = _loss_working_bytes(work, layout, reg, tokens) if last else 0
    recompute = 0
    if work.activation_checkpointing != "none":
        recompute = int(BlockTrace(work, reg, layout, input_requires_grad=True).trace().bytes(tokens))
    block = [p for p in tensors.all if p.layer == held[0].first_layer]
    gathered = 0
    if layout.fsdp_wrapped:
        gathered = sum((gathered_bytes(work, layout, reg, p) + FP32) * tp_local_numel(p, layout.tensor)
                       for p in block)
    return int(logits + recompute + gathered)
