"""Speed: step time, tokens per second and MFU from FLOPs, the GPU's peak and the collectives.

A step is `grad_accum_steps` micro steps of compute at an achievable fraction of the GPU's dense
peak, plus the communication the strategy does not hide behind compute, plus the optimizer's
update. Compute per micro step is the model's FLOPs for the rank's tokens (6 per matmul weight and
token, 12 x layers x hidden x sequence for attention; forward a third, backward two thirds) plus
what activation checkpointing recomputes, divided over the tensor-parallel ranks.

Collectives move `(n - 1) / n` of their buffer per GPU (all-gather, reduce-scatter; twice that
for all-reduce) over the slowest link they cross: NVLink (or PCIe) inside an instance, the
instance's network share per GPU between instances, each at a measured efficiency. FSDP's and
ZeRO-3's gathers and reductions overlap the compute of their phase (forward, backward); what
exceeds it is exposed, and so are the transfers with nothing to hide behind (the first gather of
a step, the last reduction). DDP's all-reduce overlaps the last micro step's backward. Tensor
parallel's all-reduces sit on the critical path.

The achievable fractions were calibrated on torchtitan's published Llama 3.1 8B runs on 8 H100s,
and everything else is checked against other published runs (docs/planning.md, `python -m
bench.plan`); `CALIBRATION` holds the values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmtrain.instances import GpuModel, InstanceType
from llmtrain.planner import memory
from llmtrain.planner.memory import FP32, LOW, Tensors, parameter_tensors, tp_local_numel
from llmtrain.planner.pipeline import Stage
from llmtrain.planner.workload import Layout, Workload


@dataclass(frozen=True)
class Calibration:
    """The measured constants of the speed model.

    achievable_eager / achievable_compiled: the fraction of the dense bf16 peak the program's
    step reaches in compute (all of it: matmuls, attention, norms, the loss), without and with
    torch.compile (calibrated: torchtitan's 8-GPU runs). link_efficiency / network_efficiency:
    the fraction of the nominal bandwidth collectives reach inside an instance and between
    instances (NCCL's bus bandwidth on NVLink and EFA; assumed, not fitted). fp32_peak_fraction:
    the dense fp32 rate relative to bf16 (tensor cores unused: PyTorch keeps TF32 off for matmuls
    by default).
    """

    achievable_eager: float = 0.3706
    achievable_compiled: float = 0.4295
    link_efficiency: float = 0.80
    network_efficiency: float = 0.80
    fp32_peak_fraction: float = 1 / 16
    # Bytes the AdamW update reads and writes per trainable fp32 parameter (p, grad, m, v in; p, m,
    # v out), which bound it by the GPU's memory bandwidth.
    optimizer_bytes_per_parameter: int = 28
    # Host-device copies for offloading (PCIe), and the host's AdamW rate, parameters per second.
    offload_bytes_per_second: float = 20e9
    host_optimizer_parameters_per_second: float = 1e9


CALIBRATION = Calibration()
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
        return {
            "tokens_per_second": self.tokens_per_second,
            "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu,
            "step_seconds": self.step_seconds,
            "mfu": self.mfu,
            "compute_seconds": self.compute_seconds,
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


def recompute_flops_per_token(work: Workload) -> float:
    """Forward FLOPs activation checkpointing repeats in backward, per token: the whole forward
    of a fully checkpointed block; under selective checkpointing the matmuls the policy recomputes."""
    m = work.model
    blocks = work.checkpointed_layers
    block_matmuls = sum(p.numel for p in m.parameters() if p.kind == "linear" and p.layer == 0)
    if work.activation_checkpointing == "full":
        return blocks * (2 * block_matmuls + 4 * m.hidden_size * work.seq_len)
    if work.activation_checkpointing == "selective":
        return blocks * 2 * block_matmuls * selective_recompute(m)
    return 0.0


def selective_recompute(m) -> float:
    """The share of a block's matmul FLOPs the program's selective policy (torchtitan's op-level
    one) recomputes: every second matmul, of q, k, v, o, gate, up, down the k, o and up
    projections (GPT-2: c_proj and the MLP's c_proj of c_attn, c_proj, c_fc, c_proj)."""
    h, i, kv = m.hidden_size, m.intermediate_size, m.kv_size
    if m.family != "llama":
        return (h * h + i * h) / (3 * h * h + h * h + 2 * i * h)
    return (kv * h + h * h + i * h) / (2 * h * h + 2 * kv * h + 3 * i * h)


def compute_rate(work: Workload, cluster: Cluster, calibration: Calibration) -> float:
    fraction = calibration.achievable_compiled if work.compile else calibration.achievable_eager
    peak = cluster.gpu.peak_flops * (calibration.fp32_peak_fraction if work.precision == "fp32" else 1.0)
    return peak * fraction


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


def _unit_bytes(share: Share, layout: Layout, dtype_bytes: int) -> tuple[float, float, float]:
    """Bytes of (all parameters, one block, the root's parameters) on one tensor-parallel rank."""
    tensors = share.tensors.all
    first = min((p.layer for p in tensors if p.layer is not None), default=0)
    total = sum(tp_local_numel(p, layout.tensor) for p in tensors) * dtype_bytes
    block = sum(tp_local_numel(p, layout.tensor) for p in tensors if p.layer == first) * dtype_bytes
    root = sum(p.numel for p in tensors if p.layer is None) * dtype_bytes
    return total, block, root


def _trainable_elements(share: Share, layout: Layout) -> float:
    return sum(tp_local_numel(p, layout.tensor) for p in share.tensors.trainable)


def _fsdp_comm(work: Workload, layout: Layout, links: Links, comm: StepComm, share: Share) -> None:
    """FSDP2: gather in the compute dtype before forward (and again before backward for resharded
    blocks), reduce-scatter fp32 gradients after backward (grad_op: only in the last micro step);
    hybrid all-reduces the shards across replicas once per step."""
    compute = FP32 if work.precision == "fp32" else LOW
    n, accum = layout.shard, work.grad_accum_steps
    span = layout.tensor  # the shard group's stride: tensor-parallel ranks are innermost
    params, block, root = _unit_bytes(share, layout, compute)
    trainable_fraction = _trainable_elements(share, layout) / max(params / compute, 1)
    grads, grad_block, grad_root = (x / compute * FP32 * trainable_fraction for x in (params, block, root))
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
    compute = FP32 if work.precision == "fp32" else LOW
    n, accum = layout.shard, work.grad_accum_steps
    params, block, root = _unit_bytes(share, layout, compute)
    grads = compute * _trainable_elements(share, layout)
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


def _tensor_parallel_comm(work: Workload, layout: Layout, links: Links, comm: StepComm, share: Share) -> None:
    """Two all-reduces of the block's activations in forward (after o_proj and down_proj) and two
    in backward, per block and micro step, on the critical path."""
    compute = FP32 if work.precision == "fp32" else LOW
    activation = work.micro_batch_tokens * work.model.hidden_size * compute
    t = layout.tensor
    count = 4 * share.layers * work.grad_accum_steps
    comm.exposed += comm.add(
        "tensor-parallel all-reduce", links.seconds("all_reduce", activation, t), times=count
    )


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


# --- the step ---------------------------------------------------------------------------------------


def estimate(
    work: Workload, layout: Layout, cluster: Cluster, calibration: Calibration = CALIBRATION
) -> SpeedEstimate:
    if layout.pipelined:
        return _pipeline_estimate(work, layout, cluster, calibration)
    m = work.model
    rate = compute_rate(work, cluster, calibration)
    model_flops = m.flops_per_token(work.seq_len)
    micro_tokens = work.micro_batch_tokens
    forward = micro_tokens * model_flops / 3 / layout.tensor / rate
    backward = micro_tokens * (2 * model_flops / 3 + recompute_flops_per_token(work)) / layout.tensor / rate
    links = Links(cluster, calibration)
    share = Share.whole(work)
    comm = _data_parallel_comm(work, layout, links, share)
    if layout.tensor > 1:
        _tensor_parallel_comm(work, layout, links, comm, share)
    accum = work.grad_accum_steps
    exposed = _exposed(comm, forward, backward, accum)
    optimizer = _optimizer_seconds(work, layout, cluster, calibration, share)
    compute = accum * (forward + backward)
    tokens = micro_tokens * accum * layout.data_parallel
    return SpeedEstimate(
        step_seconds=compute + exposed + optimizer,
        compute_seconds=compute,
        exposed_communication_seconds=exposed,
        optimizer_seconds=optimizer,
        tokens_per_step=tokens,
        world_size=layout.world_size,
        model_flops_per_token=model_flops,
        peak_flops=cluster.gpu.peak_flops,
        transfers=tuple(comm.transfers),
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


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one micro-batch on one stage: forward, the input-gradient part of backward
    (with what checkpointing recomputes) and the weight-gradient part."""

    forward: float
    backward_input: float
    backward_weight: float

    @property
    def total(self) -> float:
        return self.forward + self.backward_input + self.backward_weight


def stage_times(work: Workload, layout: Layout, stage: Stage, rate: float) -> StageTimes:
    """Per token, a stage's matmuls cost 2 FLOPs per weight in forward, 2 more for the input
    gradient and 2 for the weight gradient (its blocks' linears, and the head on the last stage);
    attention 4 x hidden x sequence per block in forward and twice that in backward (all for the
    input); full checkpointing repeats the forward of its checkpointed blocks."""
    m, tokens = work.model, work.micro_batch_tokens
    block = sum(p.numel for p in m.parameters() if p.kind == "linear" and p.layer == 0)
    weights = stage.num_layers * block + (m.vocab_size * m.hidden_size if stage.last else 0)
    attention = 4 * stage.num_layers * m.hidden_size * work.seq_len
    recompute = 0.0
    if work.activation_checkpointing == "full":
        checkpointed = sum(1 for layer in stage.layers if layer % work.checkpoint_every == 0)
        recompute = checkpointed * (2 * block + 4 * m.hidden_size * work.seq_len)
    elif work.activation_checkpointing == "selective":
        checkpointed = sum(1 for layer in stage.layers if layer % work.checkpoint_every == 0)
        recompute = checkpointed * 2 * block * selective_recompute(m)
    scale = tokens / layout.tensor / rate
    return StageTimes(
        forward=(2 * weights + attention) * scale,
        backward_input=(2 * weights + 2 * attention + recompute) * scale,
        backward_weight=2 * weights * scale,
    )


def pipeline_bubble(layout: Layout, times: list[StageTimes]) -> float:
    """Seconds a rank idles while the pipeline fills and drains: (p - 1) times the slowest stage's
    micro-batch (with v stages per rank a stage is 1/v of a rank's work, so the bubble shrinks by
    v: the fraction (p - 1) / (v x m + p - 1)); zero bubble fills it with weight gradients, leaving
    (p - 1) x (forward + input backward - 2 x weight backward) of the slowest stage."""
    p = layout.pipeline
    if layout.schedule == "zero_bubble":
        return (p - 1) * max(max(0.0, t.forward + t.backward_input - 2 * t.backward_weight) for t in times)
    return (p - 1) * max(t.total for t in times)


def _pipeline_p2p(work: Workload, layout: Layout, links: Links, comm: StepComm, held: list[Stage]) -> None:
    """Each micro-batch's activation goes to the next stage, its gradient back; pipeline neighbours
    are data-parallel x tensor-parallel ranks apart (the outermost mesh dimension), so across
    instances when an instance holds no more than one stage's ranks. torch's schedules wait for a
    micro-batch's transfers before its next computation, so none is hidden; the first micro-batch's
    activation crosses every boundary before the last stage starts, and its gradient back."""
    hidden = memory.regime(work, layout).residual * work.model.hidden_size * work.micro_batch_tokens
    stride = layout.data_parallel * layout.tensor
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
    compute = FP32 if work.precision == "fp32" else LOW
    n, accum, span = layout.shard, work.grad_accum_steps, layout.tensor
    params, block, root = _unit_bytes(share, layout, compute)
    grads = params / compute * FP32
    if layout.fsdp_sharding != "grad_op":
        resharded = params - root - block
        comm.backward += comm.each_micro_step(
            "fsdp all-gather (backward)", links.seconds("all_gather", resharded, n, span), accum
        )
    comm.exposed += comm.add("fsdp all-gather (step start)", links.seconds("all_gather", params, n, span))
    comm.last_backward += comm.add("fsdp reduce-scatter", links.seconds("reduce_scatter", grads, n, span))
    if layout.replicate > 1:
        replicas = links.seconds("all_reduce", grads / n, layout.replicate, n * layout.tensor)
        comm.last_backward += comm.add("hsdp all-reduce across replicas", replicas)


def _pipeline_estimate(
    work: Workload, layout: Layout, cluster: Cluster, calibration: Calibration
) -> SpeedEstimate:
    """The step of the slowest pipeline rank: its stages' compute for every micro-batch, the
    bubble, the communication it cannot hide (its stages' data-parallel collectives, tensor
    parallel, the point-to-point transfers) and its optimizer update."""
    rate = compute_rate(work, cluster, calibration)
    stages = memory.pipeline_stages(work, layout)
    times = [stage_times(work, layout, stage, rate) for stage in stages]
    bubble = pipeline_bubble(layout, times)
    links = Links(cluster, calibration)
    accum = work.grad_accum_steps
    slowest = None
    for rank in range(layout.pipeline):
        held = memory.rank_stages(work, layout, rank)
        share = Share(memory.stage_tensors(work, held), sum(s.num_layers for s in held))
        forward = sum(times[s.index].forward for s in held)
        backward = sum(times[s.index].backward_input + times[s.index].backward_weight for s in held)
        comm = _data_parallel_comm(work, layout, links, share)
        if layout.tensor > 1:
            _tensor_parallel_comm(work, layout, links, comm, share)
        _pipeline_p2p(work, layout, links, comm, held)
        exposed = _exposed(comm, forward, backward, accum)
        optimizer = _optimizer_seconds(work, layout, cluster, calibration, share)
        compute = accum * (forward + backward)
        candidate = (compute + exposed + optimizer, compute, exposed, optimizer, comm)
        if slowest is None or candidate[0] > slowest[0]:
            slowest = candidate
    step, compute, exposed, optimizer, comm = slowest
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
    )
