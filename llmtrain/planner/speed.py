"""Speed: step time, tokens per second and MFU, from each GPU's physics and the collectives.

A step is `grad_accum_steps` micro steps of compute, plus the communication the strategy does not
hide behind compute, plus the optimizer's update (docs/planning.md, "Speed").

Compute per micro step and rank is three kinds of work, each at the rate its GPU runs it:

- matmuls: 2 FLOPs per weight and token forward, 2 for the input gradient and 2 for the weight
  gradient, plus what activation checkpointing recomputes, over the tensor-parallel ranks; at the
  GPU's dense bf16 peak (FP8 peak for the layers FP8 converts) times `matmul_efficiency`;
- attention: the causal half of the scores' 4 x hidden x sequence FLOPs per token and layer forward
  and 2.5 times that backward (the kernel recomputes the scores), at the GPU's FlashAttention-2
  efficiency (`GpuModel.attention_efficiency`, measured by the same count);
- the rest (norms, rotary embeddings, activations, residual adds, casts, the loss): bytes moved
  through the GPU's memory at its bandwidth, `elementwise_bytes_*` per element of the activations
  those operations touch (fewer with `compile`, which fuses them), `loss_bytes_per_vocabulary` per
  logit, `fp8_cast_bytes` per element an FP8 layer casts.

So each GPU generation gets its own balance: an A100 spends most of a step in matmuls, an H100
(three times the FLOPs, 1.6 times the bandwidth) a larger share in the memory-bound operations,
which is where compile and an H200's bandwidth help.

Collectives move `(n - 1) / n` of their buffer per GPU (all-gather, reduce-scatter; twice that
for all-reduce) over the slowest link they cross: NVLink (or PCIe) inside an instance, the
instance's network share per GPU between instances, each at an assumed efficiency. FSDP's and
ZeRO-3's gathers and reductions overlap the compute of their phase (forward, backward); what
exceeds it is exposed, and so are the transfers with nothing to hide behind (the first gather of
a step, the last reduction). DDP's all-reduce overlaps the last micro step's backward. Tensor
parallel's all-gathers and reduce-scatters (all-reduces without sequence parallel) and context
parallel's key/value all-gathers sit on the critical path, the program's as torch runs them.
FSDP on pipeline stages adds what torch's pipelining does with it: each micro-batch's gradients
added into fp32 unsharded ones (memory-bound, `ACCUMULATE_BYTES_PER_ELEMENT`), and the stage's
reduce-scatter after its last backward, with nothing to hide it.

`CALIBRATION` holds the constants; the four fitted ones are recomputed from published runs by
`bench.plan.calibrate()`, everything else is checked against other published runs
(docs/planning.md, `python -m bench.plan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from llmtrain.instances import GpuModel, InstanceType
from llmtrain.planner import memory
from llmtrain.planner.memory import FP32, Tensors, local_tokens, parameter_tensors, tp_local_numel
from llmtrain.planner.pipeline import Stage
from llmtrain.planner.workload import Layout, Workload


@dataclass(frozen=True)
class Calibration:
    """The constants of the speed model.

    Calibrated (bench.plan.calibrate(), i.e. bench.published.calibrate(), refits them; a test keeps
    them equal):
    matmul_efficiency_ampere / matmul_efficiency_hopper: the fraction of the data sheet's dense peak
    a generation's training matmuls sustain (boost clocks are not sustained under full tensor-core
    load, less so on Hopper); Ada GPUs (L4, L40S), of which no training run is published, get
    Hopper's (the lower), Volta and Turing Ampere's;
    elementwise_bytes_eager / elementwise_bytes_compiled: bytes the non-matmul operations move per
    element of the activations they touch, forward and backward, per decoder layer, without and with
    torch.compile.

    Assumed (sourced or counted, not fitted): loss_bytes_per_vocabulary (the chunked loss reads and
    writes each logit about 30 bytes' worth, forward and backward, counted op by op);
    fp8_cast_bytes_eager / _compiled (torchao casts each converted layer's input twice, forward and
    again for the weight gradient, and its output gradient twice, backward; eager, each cast reads
    the bf16 tensor for its maximum and again to write the FP8 copy, 5 bytes per element, 10 per
    element of input or output; compiled, the maximum and the cast fuse into the operation that
    produced the tensor, leaving the FP8 copy's write, 2 bytes); link_efficiency / network_efficiency (the
    fraction of nominal bandwidth NCCL's collectives reach on NVLink and EFA); fp32_peak_fraction
    (the dense fp32 rate relative to bf16: PyTorch keeps TF32 off for matmuls by default); the
    optimizer's bytes per parameter; offloading's PCIe rate and host AdamW rate.
    """

    matmul_efficiency_ampere: float = 0.762
    matmul_efficiency_hopper: float = 0.6662
    elementwise_bytes_eager: float = 56.54
    elementwise_bytes_compiled: float = 36.32
    loss_bytes_per_vocabulary: float = 30.0
    fp8_cast_bytes_eager: float = 10.0
    fp8_cast_bytes_compiled: float = 2.0
    link_efficiency: float = 0.80
    network_efficiency: float = 0.80
    fp32_peak_fraction: float = 1 / 16
    # Bytes the AdamW update reads and writes per trainable fp32 parameter (p, grad, m, v in; p, m,
    # v out), which bound it by the GPU's memory bandwidth.
    optimizer_bytes_per_parameter: int = 28
    # Host-device copies for offloading (PCIe), and the host's AdamW rate, parameters per second.
    offload_bytes_per_second: float = 20e9
    host_optimizer_parameters_per_second: float = 1e9

    def matmul_efficiency(self, gpu: GpuModel) -> float:
        if gpu.generation in ("hopper", "ada"):
            return self.matmul_efficiency_hopper
        return self.matmul_efficiency_ampere

    def elementwise_bytes(self, compiled: bool) -> float:
        return self.elementwise_bytes_compiled if compiled else self.elementwise_bytes_eager

    def fp8_cast_bytes(self, compiled: bool) -> float:
        return self.fp8_cast_bytes_compiled if compiled else self.fp8_cast_bytes_eager


CALIBRATION = Calibration()
# FlashAttention's backward recomputes the attention scores (Q K^T) and computes dV, dP, dQ and dK:
# 5 matmuls of the forward's size to its 2, 2.5 times the forward's FLOPs. The attention
# efficiencies (GpuModel.attention_efficiency) are rates measured by that count (FlashAttention-2's
# and -3's benchmarks: forward + backward = 3.5 x the forward's FLOPs), so the time counts it too.
ATTENTION_BACKWARD_PASSES = 2.5
# DDP's last gradient bucket (25 MB by default) is reduced after backward ends.
DDP_BUCKET_BYTES = 25 * 1024**2


@dataclass(frozen=True)
class Cluster:
    """Where the ranks run: `nodes` instances of `gpus_per_node` GPUs."""

    gpu: GpuModel
    gpus_per_node: int
    nodes: int
    network_bytes_per_second: float  # per instance

    @classmethod
    def of(cls, instance: InstanceType, count: int) -> Cluster:
        if instance.gpu_model is None:
            raise ValueError(f"{instance.name} has no GPU: the planner plans GPU training")
        return cls(instance.gpu_model, instance.gpus, count, instance.network_gbps * 1e9 / 8)

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Transfer:
    """One kind of collective in a step: bytes each GPU sends, and the seconds that takes."""

    name: str
    bytes_per_gpu: float
    seconds: float


@dataclass(frozen=True)
class SpeedEstimate:
    step_seconds: float
    compute_seconds: float
    exposed_communication_seconds: float
    optimizer_seconds: float
    tokens_per_step: int
    world_size: int
    model_flops_per_token: float
    peak_flops: float
    transfers: tuple[Transfer, ...] = field(default_factory=tuple)
    bubble_seconds: float = 0.0  # pipeline stages waiting while the pipeline fills and drains
    # Of compute_seconds: the matmuls, attention and memory-bound operations (in that order).
    compute_parts: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_seconds / self.step_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.tokens_per_second / self.world_size

    @property
    def mfu(self) -> float:
        """Model FLOPs (without recomputation) per second over the GPUs' dense bf16 peak."""
        return self.tokens_per_second_per_gpu * self.model_flops_per_token / self.peak_flops

    def to_dict(self) -> dict[str, object]:
        matmuls, attention, memory_bound = self.compute_parts
        return {
            "tokens_per_second": self.tokens_per_second,
            "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu,
            "step_seconds": self.step_seconds,
            "mfu": self.mfu,
            "compute_seconds": self.compute_seconds,
            "compute_matmul_seconds": matmuls,
            "compute_attention_seconds": attention,
            "compute_memory_bound_seconds": memory_bound,
            "exposed_communication_seconds": self.exposed_communication_seconds,
            "optimizer_seconds": self.optimizer_seconds,
            "bubble_seconds": self.bubble_seconds,
            "bubble_fraction": self.bubble_fraction,
            "tokens_per_step": self.tokens_per_step,
            "communication": [
                {"collective": t.name, "bytes_per_gpu": t.bytes_per_gpu, "seconds": t.seconds}
                for t in self.transfers
            ],
        }


# --- compute --------------------------------------------------------------------------------------


def block_matmul_weights(m) -> int:
    """Weights of one decoder block's linear layers."""
    return sum(p.numel for p in m.parameters() if p.kind == "linear" and p.layer == 0)


def selective_recompute(work: Workload) -> float:
    """The share of a block's matmul FLOPs the code's selective policy recomputes: torchtitan's
    op-level one (this program) every second matmul, of q, k, v, o, gate, up, down the k, o and up
    projections (GPT-2: c_proj and the MLP's c_proj of c_attn, c_proj, c_fc, c_proj); older code's,
    which kept every matmul's output, none."""
    if work.behaviour.selective_policy == "every_matmul":
        return 0.0
    m = work.model
    h, i, kv = m.hidden_size, m.intermediate_size, m.kv_size
    if m.family != "llama":
        return (h * h + i * h) / (3 * h * h + h * h + 2 * i * h)
    return (kv * h + h * h + i * h) / (2 * h * h + 2 * kv * h + 3 * i * h)


def recompute_flops_per_token(work: Workload) -> float:
    """Forward FLOPs activation checkpointing repeats in backward, per token (whole model, one
    rank without tensor parallel): the whole forward of a fully checkpointed block (its attention
    at the model-FLOPs convention, 4 x hidden x sequence); under selective checkpointing the
    matmuls the policy recomputes."""
    m = work.model
    blocks = work.checkpointed_layers
    block = block_matmul_weights(m)
    if work.activation_checkpointing == "full":
        return blocks * (2 * block + 4 * m.hidden_size * work.seq_len)
    if work.activation_checkpointing == "selective":
        return blocks * 2 * block * selective_recompute(work)
    return 0.0


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one micro-batch on one rank's layers (a whole model or a pipeline stage): forward,
    the input-gradient part of backward (with what checkpointing recomputes) and the
    weight-gradient part; `parts` splits their sum into matmuls, attention and memory-bound work."""

    forward: float
    backward_input: float
    backward_weight: float
    parts: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def total(self) -> float:
        return self.forward + self.backward_input + self.backward_weight


@dataclass(frozen=True)
class Rates:
    """The GPU's rates for one run: FLOP/s of bf16 and FP8 matmuls and of attention, bytes/s of its
    memory."""

    matmul: float
    fp8_matmul: float
    attention: float
    memory: float

    @classmethod
    def of(cls, work: Workload, gpu: GpuModel, calibration: Calibration) -> Rates:
        precision = calibration.fp32_peak_fraction if work.precision == "fp32" else 1.0
        efficiency = calibration.matmul_efficiency(gpu)
        matmul = gpu.peak_flops * precision * efficiency
        fp8 = gpu.fp8_peak_flops * efficiency if work.fp8 and gpu.has_fp8 else matmul
        attention = gpu.peak_flops * precision * gpu.attention_efficiency
        return cls(matmul, fp8, attention, gpu.memory_bytes_per_second)


def _elementwise_elements(work: Workload, layout: Layout) -> float:
    """Activation elements per token a decoder layer's non-matmul operations touch on one rank:
    the residual stream's four (two norms, two adds) on 1 / tp of the tokens with sequence
    parallel, and inside the tensor-parallel regions (split by heads and columns) q and k's rotary
    embedding, v, and the MLP's three intermediates (GPT-2: q, k, v and the GELU's input)."""
    m, t = work.model, layout.tensor
    h, i, kv = m.hidden_size, m.intermediate_size, m.kv_size
    region = (3 * h + i) if m.family != "llama" else (h + 2 * kv + 3 * i)
    return 4 * h / layout.sequence_shards + region / t


def _fp8_cast_elements(work: Workload, layout: Layout) -> float:
    """Elements per token FP8 casts per decoder layer: each converted linear's input and output
    (gradient), on one rank (q, k, v and gate, up each cast the region's input themselves)."""
    if not work.fp8:
        return 0.0
    m, t = work.model, layout.tensor
    h, i, kv = m.hidden_size, m.intermediate_size, m.kv_size
    inputs = 5 * h + h / t + i / t
    outputs = (h + 2 * kv + 2 * i) / t + 2 * h
    return inputs + outputs


def layer_times(
    work: Workload,
    layout: Layout,
    gpu: GpuModel,
    calibration: Calibration,
    layers: list[int],
    head: bool,
) -> StageTimes:
    """One micro-batch of `layers` (decoder layer indices) and, with `head`, the output head and the
    loss, on one rank: matmuls, attention and memory-bound work, forward and backward, with what
    checkpointing recomputes."""
    m, t = work.model, layout.tensor
    tokens = local_tokens(work, layout)
    rates = Rates.of(work, gpu, calibration)
    h, s = m.hidden_size, work.seq_len
    checkpointed = sum(1 for layer in layers if work.activation_checkpointing != "none"
                       and layer % work.checkpoint_every == 0)
    block = block_matmul_weights(m) / t
    head_weights = m.vocab_size * h / t if head else 0.0
    # per token: one matmul pass (2 FLOPs per weight) of the blocks and of the head
    block_pass = 2 * block * len(layers) * tokens / rates.fp8_matmul
    head_pass = 2 * head_weights * tokens / rates.matmul
    if work.activation_checkpointing == "full":
        recompute_share = 1.0
    elif work.activation_checkpointing == "selective":
        recompute_share = selective_recompute(work)
    else:
        recompute_share = 0.0
    recompute_matmul = block_pass * recompute_share * checkpointed / max(len(layers), 1)
    # causal attention: 2 x hidden x sequence FLOPs per token forward; the flash kernel's backward
    # recomputes the scores, 5 matmuls to the forward's 2 (ATTENTION_BACKWARD_PASSES)
    attention_pass = 2 * h * s / t * len(layers) * tokens / rates.attention
    recompute_attention = attention_pass / len(layers) * checkpointed if layers and \
        work.activation_checkpointing == "full" else 0.0
    bytes_per_element = calibration.elementwise_bytes(work.compile)
    elements = _elementwise_elements(work, layout) * len(layers) * tokens
    elementwise = bytes_per_element * elements / rates.memory
    casts = (calibration.fp8_cast_bytes(work.compile) * _fp8_cast_elements(work, layout) * len(layers)
             * tokens / rates.memory)
    loss = calibration.loss_bytes_per_vocabulary * m.vocab_size / t * tokens / rates.memory if head else 0.0
    recompute_memory = (elementwise + casts) / 3 * checkpointed / max(len(layers), 1)
    matmuls = block_pass + head_pass
    memory_bound = elementwise + casts + loss
    forward = matmuls + attention_pass + memory_bound / 3
    backward_input = (matmuls + ATTENTION_BACKWARD_PASSES * attention_pass + memory_bound / 3
                      + recompute_matmul + recompute_attention + recompute_memory)
    backward_weight = matmuls + memory_bound / 3
    parts = (
        3 * matmuls + recompute_matmul,
        (1 + ATTENTION_BACKWARD_PASSES) * attention_pass + recompute_attention,
        memory_bound + recompute_memory,
    )
    return StageTimes(forward, backward_input, backward_weight, parts)


# --- communication --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Links:
    """The bandwidth a collective gets per GPU, from where its ranks are.

    A ring collective whose ranks all sit in one instance runs at the NVLink (or PCIe) rate. One
    that spans instances sends its data across the network once per instance boundary, whatever
    the number of its ranks inside each instance (NCCL's rings cross the boundary on every
    channel), so each of its ranks gets the instance's network bandwidth divided by the number of
    such collectives running side by side in the instance (e.g. the 8 replica groups of a hybrid
    mesh with one rank per instance each).
    """

    cluster: Cluster
    calibration: Calibration

    def bandwidth(self, group: int, stride: int) -> float:
        """Per-GPU bandwidth of a group of `group` ranks `stride` ranks apart."""
        inside = self.cluster.gpu.link_bytes_per_second * self.calibration.link_efficiency
        per_node = self.cluster.gpus_per_node
        if group * stride <= per_node:
            return inside
        ranks_inside = max(1, per_node // stride)
        side_by_side = per_node / ranks_inside
        network = self.cluster.network_bytes_per_second * self.calibration.network_efficiency
        return min(inside, network / side_by_side)

    def seconds(self, kind: str, buffer_bytes: float, group: int, stride: int = 1) -> tuple[float, float]:
        """(bytes each GPU sends, seconds) of one collective on a `buffer_bytes` buffer."""
        if group <= 1 or buffer_bytes <= 0:
            return 0.0, 0.0
        factor = 2 * (group - 1) / group if kind == "all_reduce" else (group - 1) / group
        sent = buffer_bytes * factor
        return sent, sent / self.bandwidth(group, stride)


@dataclass
class StepComm:
    """Collectives of one optimizer step, sorted by the phase whose compute can hide them."""

    forward: float = 0.0  # per micro step, overlapping the forward
    backward: float = 0.0  # per micro step, overlapping the backward
    last_backward: float = 0.0  # once per step, overlapping the last micro step's backward
    exposed: float = 0.0  # per step, on the critical path
    transfers: list[Transfer] = field(default_factory=list)

    def add(self, name: str, sent_and_seconds: tuple[float, float], *, times: int = 1) -> float:
        """Record `times` runs of a collective in the step; their seconds."""
        sent, seconds = sent_and_seconds
        if seconds:
            self.transfers.append(Transfer(name, sent * times, seconds * times))
        return seconds * times

    def each_micro_step(self, name: str, sent_and_seconds: tuple[float, float], accum: int) -> float:
        """Record a collective run once per micro step; its seconds in one micro step."""
        return self.add(name, sent_and_seconds, times=accum) / accum


@dataclass(frozen=True)
class Share:
    """What one rank computes and keeps: the whole model, or a pipeline rank's stages."""

    tensors: Tensors
    layers: int

    @classmethod
    def whole(cls, work: Workload) -> Share:
        return cls(parameter_tensors(work), work.model.num_layers)


def _gathered_bytes(work: Workload, layout: Layout, share: Share) -> tuple[float, float, float]:
    """Bytes FSDP gathers on one rank of (all parameters, one block, the root's parameters): the
    compute dtype, one byte for FP8 weights gathered in FP8."""
    reg = memory.regime(work, layout)
    tensors = share.tensors.all
    first = min((p.layer for p in tensors if p.layer is not None), default=0)

    def size(params) -> float:
        return sum(memory.gathered_bytes(work, layout, reg, p) * tp_local_numel(p, layout.tensor)
                   for p in params)

    block = size(p for p in tensors if p.layer == first)
    return size(tensors), block, size(p for p in tensors if p.layer is None)


def _trainable_elements(share: Share, layout: Layout) -> float:
    return sum(tp_local_numel(p, layout.tensor) for p in share.tensors.trainable)


def _fsdp_comm(work: Workload, layout: Layout, links: Links, comm: StepComm, share: Share) -> None:
    """FSDP2 over the shard and context ranks: gather in the compute dtype (FP8 weights in one byte)
    before forward (and again before backward for resharded blocks), reduce-scatter fp32 gradients
    after backward (grad_op: only in the last micro step); hybrid all-reduces the shards across
    replicas once per step."""
    n, accum = layout.shard, work.grad_accum_steps
    span = layout.tensor  # the shard group's stride: tensor-parallel ranks are innermost
    params, block, root = _gathered_bytes(work, layout, share)
    trainable = _trainable_elements(share, layout)
    everything = sum(tp_local_numel(p, layout.tensor) for p in share.tensors.all)
    fraction = trainable / max(everything, 1)
    grads = FP32 * trainable
    grad_block = FP32 * fraction * sum(tp_local_numel(p, layout.tensor) for p in share.tensors.all
                                       if p.layer == min((q.layer for q in share.tensors.all
                                                          if q.layer is not None), default=0))
    grad_root = FP32 * fraction * sum(tp_local_numel(p, layout.tensor) for p in share.tensors.all
                                      if p.layer is None)
    comm.forward += comm.each_micro_step(
        "fsdp all-gather (forward)", links.seconds("all_gather", params, n, span), accum
    )
    if layout.fsdp_sharding != "grad_op":
        resharded = params - block - root
        comm.backward += comm.each_micro_step(
            "fsdp all-gather (backward)", links.seconds("all_gather", resharded, n, span), accum
        )
        comm.backward += comm.each_micro_step(
            "fsdp reduce-scatter", links.seconds("reduce_scatter", grads, n, span), accum
        )
    else:
        comm.last_backward += comm.add("fsdp reduce-scatter", links.seconds("reduce_scatter", grads, n, span))
    if layout.replicate > 1:
        replicas = links.seconds("all_reduce", grads / n, layout.replicate, n * layout.tensor)
        comm.last_backward += comm.add("hsdp all-reduce across replicas", replicas)
    # Nothing to hide behind: the root's and the first block's gather when a step starts, the
    # last reductions when backward ends.
    for buffer in (root, block):
        comm.exposed += links.seconds("all_gather", buffer, n, span)[1]
    for buffer in (grad_root, grad_block):
        comm.exposed += links.seconds("reduce_scatter", buffer, n, span)[1]


def _ddp_comm(layout: Layout, links: Links, comm: StepComm, share: Share) -> None:
    """DDP all-reduces fp32 gradients in buckets during the last micro step's backward (no_sync
    before it); the last bucket waits for backward to end."""
    grads = FP32 * _trainable_elements(share, layout)
    group = layout.replicate
    comm.last_backward += comm.add("ddp all-reduce", links.seconds("all_reduce", grads, group))
    comm.exposed += links.seconds("all_reduce", min(grads, DDP_BUCKET_BYTES), group)[1]


def _deepspeed_comm(work: Workload, layout: Layout, links: Links, comm: StepComm, share: Share) -> None:
    """ZeRO-1 reduce-scatters gradients at the step, ZeRO-2 every micro step (overlapping
    backward); both all-gather the updated compute-dtype weights after the step. ZeRO-3 gathers
    weights for forward and backward and reduce-scatters every micro step, like FSDP."""
    n, accum = layout.shard, work.grad_accum_steps
    params, block, root = _gathered_bytes(work, layout, share)
    grads = memory.regime(work, layout).compute * _trainable_elements(share, layout)
    if layout.zero_stage == 3:
        comm.forward += comm.each_micro_step(
            "zero-3 all-gather (forward)", links.seconds("all_gather", params, n), accum
        )
        comm.backward += comm.each_micro_step(
            "zero-3 all-gather (backward)", links.seconds("all_gather", params, n), accum
        )
        comm.backward += comm.each_micro_step(
            "zero-3 reduce-scatter", links.seconds("reduce_scatter", grads, n), accum
        )
        comm.exposed += links.seconds("all_gather", block + root, n)[1]
        return
    if layout.zero_stage == 2:
        comm.backward += comm.each_micro_step(
            "zero-2 reduce-scatter", links.seconds("reduce_scatter", grads, n), accum
        )
    else:
        comm.last_backward += comm.add("zero-1 reduce-scatter", links.seconds("reduce_scatter", grads, n))
    comm.exposed += comm.add("zero all-gather of updated weights", links.seconds("all_gather", params, n))


def _recomputed_region_passes(work: Workload, layout: Layout) -> tuple[float, float]:
    """(region-opening collectives, region-closing collectives) that checkpointing repeats in
    backward per layer, as a share of the forward's: full checkpointing repeats the whole forward;
    torchtitan's selective policy keeps the reduce-scatters' outputs and recomputes the all-gathers
    (without sequence parallel it keeps no all-reduce's output, so it repeats both)."""
    if work.activation_checkpointing == "full":
        return 1.0, 1.0
    if work.activation_checkpointing == "selective" and work.behaviour.selective_policy != "every_matmul":
        return 1.0, 0.0 if layout.sequence_parallel else 1.0
    return 0.0, 0.0


def _tensor_parallel_comm(work: Workload, layout: Layout, links: Links, comm: StepComm, share: Share) -> None:
    """Per block and micro step, on the critical path: with sequence parallel two all-gathers (the
    region inputs; in FP8 with the tensorwise recipe) and two reduce-scatters forward, the mirror in
    backward; without it two all-reduces each way. Checkpointing repeats the forward's that it
    recomputes. The embedding and the head add one each way."""
    t, accum = layout.tensor, work.grad_accum_steps
    reg = memory.regime(work, layout)
    tokens = local_tokens(work, layout)
    activation = tokens * work.model.hidden_size * reg.compute
    fp8_gather = work.fp8 and work.fp8_recipe == "tensorwise"
    gathers, closings = _recomputed_region_passes(work, layout)
    checkpointed = work.checkpointed_layers * share.layers / work.model.num_layers
    layers = share.layers
    if layout.sequence_parallel:
        opening = activation / reg.compute if fp8_gather else activation
        count = int(round(2 * layers * 2 + 2 * checkpointed * gathers))
        seconds = comm.add("tensor-parallel all-gather", links.seconds("all_gather", opening, t),
                           times=count * accum)
        count = int(round(2 * layers * 2 + 2 * checkpointed * closings))
        seconds += comm.add("tensor-parallel reduce-scatter", links.seconds("reduce_scatter", activation, t),
                            times=count * accum)
    else:
        count = int(round(4 * layers + 2 * checkpointed * max(gathers, closings)))
        seconds = comm.add("tensor-parallel all-reduce", links.seconds("all_reduce", activation, t),
                           times=count * accum)
    comm.exposed += seconds


def _context_parallel_comm(work: Workload, layout: Layout, links: Links, comm: StepComm,
                           share: Share) -> None:
    """Per block and micro step, on the critical path: the keys' and the values' all-gather over
    the context ranks (of the rank's kv heads) forward, their gradients' reduce-scatter backward;
    checkpointing (full or selective) repeats the gathers."""
    c, accum = layout.context, work.grad_accum_steps
    reg = memory.regime(work, layout)
    m = work.model
    whole = work.micro_batch_tokens * m.kv_size / layout.tensor * reg.compute  # one tensor, all of S
    checkpointed = work.checkpointed_layers * share.layers / work.model.num_layers
    gathers = int(round(2 * share.layers + 2 * checkpointed))
    stride = layout.tensor
    comm.exposed += comm.add("context-parallel key/value all-gather",
                             links.seconds("all_gather", whole, c, stride), times=gathers * accum)
    comm.exposed += comm.add("context-parallel key/value reduce-scatter",
                             links.seconds("reduce_scatter", whole, c, stride),
                             times=2 * share.layers * accum)


def _offload_seconds(work: Workload, layout: Layout, calibration: Calibration, share: Share) -> float:
    """Offloading copies the shards to and from the host and runs AdamW there (rough: PCIe and
    the host's update rate)."""
    if not (layout.offload_params or layout.offload_optimizer):
        return 0.0
    shard = _trainable_elements(share, layout) / layout.shard
    copies = 2 * FP32 * shard * (work.grad_accum_steps if layout.offload_params else 1)
    return (
        copies / calibration.offload_bytes_per_second
        + shard / calibration.host_optimizer_parameters_per_second
    )


def _model_parallel_comm(work: Workload, layout: Layout, links: Links, comm: StepComm, share: Share) -> None:
    if layout.tensor > 1:
        _tensor_parallel_comm(work, layout, links, comm, share)
    if layout.context > 1:
        _context_parallel_comm(work, layout, links, comm, share)


# --- the step ---------------------------------------------------------------------------------------


def estimate(
    work: Workload, layout: Layout, cluster: Cluster, calibration: Calibration = CALIBRATION
) -> SpeedEstimate:
    if layout.pipelined:
        return _pipeline_estimate(work, layout, cluster, calibration)
    m = work.model
    times = layer_times(work, layout, cluster.gpu, calibration, list(range(m.num_layers)), head=True)
    share = Share.whole(work)
    accumulate = _accumulation_seconds(work, layout, cluster.gpu, share.tensors)
    times = replace(times, backward_weight=times.backward_weight + accumulate,
                    parts=(times.parts[0], times.parts[1], times.parts[2] + accumulate))
    forward, backward = times.forward, times.backward_input + times.backward_weight
    links = Links(cluster, calibration)
    comm = _data_parallel_comm(work, layout, links, share)
    _model_parallel_comm(work, layout, links, comm, share)
    accum = work.grad_accum_steps
    exposed = _exposed(comm, forward, backward, accum)
    optimizer = _optimizer_seconds(work, layout, cluster, calibration, share)
    compute = accum * (forward + backward)
    return SpeedEstimate(
        step_seconds=compute + exposed + optimizer,
        compute_seconds=compute,
        exposed_communication_seconds=exposed,
        optimizer_seconds=optimizer,
        tokens_per_step=work.micro_batch_tokens * accum * layout.data_parallel,
        world_size=layout.world_size,
        model_flops_per_token=m.flops_per_token(work.seq_len),
        peak_flops=cluster.gpu.peak_flops,
        transfers=tuple(comm.transfers),
        compute_parts=tuple(accum * part for part in times.parts),
    )


def _data_parallel_comm(work: Workload, layout: Layout, links: Links, share: Share) -> StepComm:
    comm = StepComm()
    if layout.fsdp_wrapped and layout.pipelined:
        _pipeline_fsdp_comm(work, layout, links, comm, share)
    elif layout.fsdp_wrapped:
        _fsdp_comm(work, layout, links, comm, share)
    elif layout.strategy == "ddp":
        _ddp_comm(layout, links, comm, share)
    elif layout.strategy == "deepspeed":
        _deepspeed_comm(work, layout, links, comm, share)
    return comm


def _exposed(comm: StepComm, forward: float, backward: float, accum: int) -> float:
    """Communication beyond the compute that hides it (per micro step forward and backward, the
    last micro step's backward for once-per-step reductions), plus what nothing hides."""
    return (
        accum * (max(0.0, comm.forward - forward) + max(0.0, comm.backward - backward))
        + max(0.0, comm.last_backward - max(0.0, backward - comm.backward))
        + comm.exposed
    )


def _optimizer_seconds(
    work: Workload, layout: Layout, cluster: Cluster, calibration: Calibration, share: Share
) -> float:
    seconds = (
        _trainable_elements(share, layout)
        / (layout.shard if layout.strategy != "ddp" else 1)
        * calibration.optimizer_bytes_per_parameter
        / cluster.gpu.memory_bytes_per_second
    )
    return seconds + _offload_seconds(work, layout, calibration, share)


# --- pipeline stages ---------------------------------------------------------------------------------


def stage_times(work: Workload, layout: Layout, stage: Stage, gpu: GpuModel,
                calibration: Calibration = CALIBRATION) -> StageTimes:
    """One micro-batch of a stage: its layers, and the head and loss on the last."""
    return layer_times(work, layout, gpu, calibration, list(stage.layers), head=stage.last)


def pipeline_bubble(layout: Layout, times: list[StageTimes],
                    communication: list[float] | None = None) -> float:
    """Seconds a rank idles while the pipeline fills and drains: (p - 1) times the slowest stage's
    micro-batch, with the tensor- and context-parallel communication that lengthens it
    (`communication`, per stage; with v stages per rank a stage is 1/v of a rank's work, so the
    bubble shrinks by v: the fraction (p - 1) / (v x m + p - 1)); zero bubble fills it with weight
    gradients, leaving (p - 1) x (forward + input backward - 2 x weight backward) of the slowest
    stage."""
    p = layout.pipeline
    extra = communication or [0.0] * len(times)
    if layout.schedule == "zero_bubble":
        return (p - 1) * max(max(0.0, t.forward + t.backward_input - 2 * t.backward_weight) + c
                             for t, c in zip(times, extra, strict=True))
    return (p - 1) * max(t.total + c for t, c in zip(times, extra, strict=True))


def _stage_communication(work: Workload, layout: Layout, links: Links, stage: Stage) -> float:
    """Seconds of tensor- and context-parallel collectives in one micro-batch of a stage."""
    comm = StepComm()
    share = Share(memory.stage_tensors(work, [stage]), stage.num_layers)
    _model_parallel_comm(work, layout, links, comm, share)
    return comm.exposed / work.grad_accum_steps


def _pipeline_p2p(work: Workload, layout: Layout, links: Links, comm: StepComm, held: list[Stage]) -> None:
    """Each micro-batch's activation goes to the next stage, its gradient back (the rank's sequence
    shard under sequence parallel); pipeline neighbours are data-parallel x context x tensor ranks
    apart (the outermost mesh dimension), so across instances when an instance holds no more than
    one stage's ranks. torch's schedules wait for a micro-batch's transfers before its next
    computation, so none is hidden; the first micro-batch's activation crosses every boundary
    before the last stage starts, and its gradient back."""
    reg = memory.regime(work, layout)
    hidden = reg.residual * work.model.hidden_size * local_tokens(work, layout) / layout.sequence_shards
    stride = layout.data_parallel * layout.context * layout.tensor
    one = hidden / links.bandwidth(2, stride)
    sends = work.grad_accum_steps * sum((not s.last) + (not s.first) for s in held)
    comm.exposed += comm.add("pipeline send (activations, gradients)", (hidden, one), times=sends)
    comm.exposed += 2 * (layout.pipeline - 1) * one


def _pipeline_fsdp_comm(work: Workload, layout: Layout, links: Links, comm: StepComm, share: Share) -> None:
    """FSDP2 on pipeline stages: torch's pipelining leaves a stage gathered after each backward and
    reduces its gradients once, after its last micro-batch. With full sharding each forward still
    reshards the blocks, so each micro-batch's backward gathers them again; with grad_op the stage
    is gathered once per step. The reduce-scatter (and hybrid's all-reduce across replicas) overlap
    the last micro-batch's backward."""
    n, accum, span = layout.shard, work.grad_accum_steps, layout.tensor
    params, block, root = _gathered_bytes(work, layout, share)
    grads = FP32 * sum(tp_local_numel(p, layout.tensor) for p in share.tensors.all)
    if layout.fsdp_sharding != "grad_op":
        resharded = params - root - block
        comm.backward += comm.each_micro_step(
            "fsdp all-gather (backward)", links.seconds("all_gather", resharded, n, span), accum
        )
    comm.exposed += comm.add("fsdp all-gather (step start)", links.seconds("all_gather", params, n, span))
    # torch's pipelining runs FSDP's post-backward for a stage itself, once its last micro-batch's
    # backward has finished, and makes the compute stream wait for the reductions: nothing hides them.
    comm.exposed += comm.add("fsdp reduce-scatter", links.seconds("reduce_scatter", grads, n, span))
    if layout.replicate > 1:
        replicas = links.seconds("all_reduce", grads / n, layout.replicate, n * layout.tensor)
        comm.exposed += comm.add("hsdp all-reduce across replicas", replicas)


# FSDP2 accumulating a micro-batch's bf16 gradient into its fp32 unsharded gradient (reduce_dtype
# fp32, no reduction until the last micro-batch): read 2 and 4 bytes, write 4, per element.
ACCUMULATE_BYTES_PER_ELEMENT = 10


def _accumulation_seconds(work: Workload, layout: Layout, gpu: GpuModel, tensors: Tensors) -> float:
    """Seconds one micro-batch's backward spends adding its gradients of `tensors` into FSDP2's fp32
    unsharded gradients, where the program keeps them unsharded until the last micro-batch
    (pipeline stages; grad_op sharding): memory-bound, on the critical path."""
    unsharded = layout.pipelined or layout.fsdp_sharding == "grad_op"
    if not (layout.fsdp_wrapped and unsharded) or work.grad_accum_steps <= 1:
        return 0.0
    elements = sum(tp_local_numel(p, layout.tensor) for p in tensors.trainable)
    return ACCUMULATE_BYTES_PER_ELEMENT * elements / gpu.memory_bytes_per_second


def _pipeline_estimate(
    work: Workload, layout: Layout, cluster: Cluster, calibration: Calibration
) -> SpeedEstimate:
    """The step of the slowest pipeline rank: its stages' compute for every micro-batch, the
    bubble, the communication it cannot hide (its stages' data-parallel collectives, tensor and
    context parallel, the point-to-point transfers) and its optimizer update."""
    stages = memory.pipeline_stages(work, layout)
    times = [stage_times(work, layout, stage, cluster.gpu, calibration) for stage in stages]
    links = Links(cluster, calibration)
    accumulate = [_accumulation_seconds(work, layout, cluster.gpu, memory.stage_tensors(work, [s]))
                  for s in stages]
    times = [replace(t, backward_weight=t.backward_weight + a, parts=(t.parts[0], t.parts[1], t.parts[2] + a))
             for t, a in zip(times, accumulate, strict=True)]
    bubble = pipeline_bubble(layout, times, [_stage_communication(work, layout, links, s) for s in stages])
    accum = work.grad_accum_steps
    slowest = None
    for rank in range(layout.pipeline):
        held = memory.rank_stages(work, layout, rank)
        share = Share(memory.stage_tensors(work, held), sum(s.num_layers for s in held))
        forward = sum(times[s.index].forward for s in held)
        backward = sum(times[s.index].backward_input + times[s.index].backward_weight for s in held)
        comm = _data_parallel_comm(work, layout, links, share)
        _model_parallel_comm(work, layout, links, comm, share)
        _pipeline_p2p(work, layout, links, comm, held)
        exposed = _exposed(comm, forward, backward, accum)
        optimizer = _optimizer_seconds(work, layout, cluster, calibration, share)
        compute = accum * (forward + backward)
        parts = tuple(accum * sum(times[s.index].parts[k] for s in held) for k in range(3))
        candidate = (compute + exposed + optimizer, compute, exposed, optimizer, comm, parts)
        if slowest is None or candidate[0] > slowest[0]:
            slowest = candidate
    step, compute, exposed, optimizer, comm, parts = slowest
    return SpeedEstimate(
        step_seconds=step + bubble,
        compute_seconds=compute,
        exposed_communication_seconds=exposed,
        optimizer_seconds=optimizer,
        tokens_per_step=work.micro_batch_tokens * accum * layout.data_parallel,
        world_size=layout.world_size,
        model_flops_per_token=work.model.flops_per_token(work.seq_len),
        peak_flops=cluster.gpu.peak_flops,
        transfers=tuple(comm.transfers),
        bubble_seconds=bubble,
        compute_parts=parts,
    )
