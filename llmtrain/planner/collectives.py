"""Communication of a step: the collectives each strategy runs, and what compute cannot hide of them.

Collectives move `(n - 1) / n` of their buffer per GPU (all-gather, reduce-scatter; twice that
for all-reduce) over the slowest link they cross (`Links`): NVLink (or PCIe) inside an instance,
the instance's network share per GPU between instances, each at an assumed efficiency. `StepComm`
sorts them by the phase whose compute can hide them: FSDP's and ZeRO-3's gathers and reductions
overlap the compute of their phase, DDP's all-reduce the last micro step's backward; tensor and
context parallel's collectives and the pipeline's point-to-point transfers sit on the critical path
(docs/planning.md, "Speed"; llmtrain.planner.speed adds them up).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmtrain.core.instances import GpuModel, InstanceType
from llmtrain.planner.activation_memory import local_tokens
from llmtrain.planner.experts import all_to_all, all_to_alls_per_micro_batch, token_buffer_bytes
from llmtrain.planner.pipeline import Stage
from llmtrain.planner.pipeline_memory import stage_tensors
from llmtrain.planner.precision import FP32, gathered_bytes, regime
from llmtrain.planner.sharding import Tensors, parameter_tensors, tp_local_numel
from llmtrain.planner.speed_calibration import Calibration
from llmtrain.planner.workload import Layout, Workload

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
    reg = regime(work, layout)
    tensors = share.tensors.all
    first = min((p.layer for p in tensors if p.layer is not None), default=0)

    def size(params) -> float:
        return sum(gathered_bytes(work, layout, reg, p) * tp_local_numel(p, layout.tensor)
                   for p in params)

    block = size(p for p in tensors if p.layer == first)
    return size(tensors), block, size(p for p in tensors if p.layer is None)


def trainable_elements(share: Share, layout: Layout) -> float:
    return sum(tp_local_numel(p, layout.tensor) for p in share.tensors.trainable)


def _fsdp_comm(work: Workload, layout: Layout, links: Links, comm: StepComm, share: Share, *,
               group: tuple[int, int] | None = None, name: str = "fsdp") -> None:
    """FSDP2 over the shard and context ranks (`group`: another group's size and stride): gather in
    the compute dtype (FP8 weights in one byte) before forward (and again before backward for
    resharded blocks), reduce-scatter fp32 gradients after backward (grad_op: only in the last micro
    step); hybrid all-reduces the shards across replicas once per step."""
    accum = work.grad_accum_steps
    # the shard group's stride: tensor-parallel ranks are innermost
    n, span = group or (layout.shard, layout.tensor)
    params, block, root = _gathered_bytes(work, layout, share)
    trainable = trainable_elements(share, layout)
    everything = sum(tp_local_numel(p, layout.tensor) for p in share.tensors.all)
    fraction = trainable / max(everything, 1)
    grads = FP32 * trainable
    grad_block = FP32 * fraction * sum(tp_local_numel(p, layout.tensor) for p in share.tensors.all
                                       if p.layer == min((q.layer for q in share.tensors.all
                                                          if q.layer is not None), default=0))
    grad_root = FP32 * fraction * sum(tp_local_numel(p, layout.tensor) for p in share.tensors.all
                                      if p.layer is None)
    comm.forward += comm.each_micro_step(
        f"{name} all-gather (forward)", links.seconds("all_gather", params, n, span), accum
    )
    if layout.fsdp_sharding != "grad_op":
        resharded = params - block - root
        comm.backward += comm.each_micro_step(
            f"{name} all-gather (backward)", links.seconds("all_gather", resharded, n, span), accum
        )
        comm.backward += comm.each_micro_step(
            f"{name} reduce-scatter", links.seconds("reduce_scatter", grads, n, span), accum
        )
    else:
        reduce_scatter = links.seconds("reduce_scatter", grads, n, span)
        comm.last_backward += comm.add(f"{name} reduce-scatter", reduce_scatter)
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
    grads = FP32 * trainable_elements(share, layout)
    group = layout.replicate
    comm.last_backward += comm.add("ddp all-reduce", links.seconds("all_reduce", grads, group))
    comm.exposed += links.seconds("all_reduce", min(grads, DDP_BUCKET_BYTES), group)[1]


def _deepspeed_comm(work: Workload, layout: Layout, links: Links, comm: StepComm, share: Share) -> None:
    """ZeRO-1 reduce-scatters gradients at the step, ZeRO-2 every micro step (overlapping
    backward); both all-gather the updated compute-dtype weights after the step. ZeRO-3 gathers
    weights for forward and backward and reduce-scatters every micro step, like FSDP."""
    n, accum = layout.shard, work.grad_accum_steps
    params, block, root = _gathered_bytes(work, layout, share)
    grads = regime(work, layout).compute * trainable_elements(share, layout)
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
    reg = regime(work, layout)
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
    reg = regime(work, layout)
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


def model_parallel_comm(work: Workload, layout: Layout, links: Links, comm: StepComm, share: Share) -> None:
    if work.expert_parallel > 1 and work.model.moe:
        _expert_parallel_comm(work, layout, links, comm, share)
    if layout.tensor > 1:
        _tensor_parallel_comm(work, layout, links, comm, share)
    if layout.context > 1:
        _context_parallel_comm(work, layout, links, comm, share)


def data_parallel_comm(work: Workload, layout: Layout, links: Links, share: Share) -> StepComm:
    comm = StepComm()
    if layout.fsdp_wrapped and layout.pipelined:
        _pipeline_fsdp_comm(work, layout, links, comm, share)
    elif layout.fsdp_wrapped:
        others, experts = _expert_slices_apart(work, share)
        _fsdp_comm(work, layout, links, comm, others)
        if experts is not None:
            # over the copies of each expert slice: the ranks `ep` apart (experts innermost)
            degree = work.expert_parallel
            _fsdp_comm(work, layout, links, comm, experts, group=(layout.shard // degree, degree),
                       name="expert fsdp")
    elif layout.strategy == "ddp":
        _ddp_comm(layout, links, comm, share)
    elif layout.strategy == "deepspeed":
        _deepspeed_comm(work, layout, links, comm, share)
    return comm


def _expert_slices_apart(work: Workload, share: Share) -> tuple[Share, Share | None]:
    """(the share without its expert slices, the expert slices) where the program FSDP-shards each
    expert slice over its copies (trainer/expert_parallel.py); (share, None) otherwise: without
    expert parallelism FSDP2 shards experts like every weight (older code kept the copies whole
    and is planned as that)."""
    if work.expert_parallel <= 1 or not work.behaviour.expert_copies_sharded:
        return share, None

    def split(tensors: tuple, experts: bool) -> tuple:
        return tuple(p for p in tensors if bool(p.experts) == experts)

    tensors = share.tensors
    return (Share(Tensors(split(tensors.frozen, False), split(tensors.trainable, False)), share.layers),
            Share(Tensors(split(tensors.frozen, True), split(tensors.trainable, True)), share.layers))


def _expert_parallel_comm(work: Workload, layout: Layout, links: Links, comm: StepComm, share: Share) -> None:
    """The MoE layers' dispatch and combine all-to-alls (llmtrain.planner.experts), on the critical
    path, split by the links they cross."""
    cluster, calibration = links.cluster, links.calibration
    buffer = token_buffer_bytes(work, layout, local_tokens(work, layout))
    one = all_to_all(buffer, work.expert_parallel, cluster.gpus_per_node,
                     cluster.gpu.link_bytes_per_second * calibration.link_efficiency,
                     cluster.network_bytes_per_second * calibration.all_to_all_network_efficiency)
    count = int(round(all_to_alls_per_micro_batch(work, share.layers) * work.grad_accum_steps))
    # NVLink and EFA parts run side by side: the slower is on the critical path
    comm.add("expert all-to-all (NVLink)", (one.nvlink_bytes, one.nvlink_seconds), times=count)
    comm.add("expert all-to-all (EFA)", (one.network_bytes, one.network_seconds), times=count)
    comm.exposed += one.seconds * count


# --- pipeline stages ---------------------------------------------------------------------------------


def stage_communication(work: Workload, layout: Layout, links: Links, stage: Stage) -> float:
    """Seconds of tensor- and context-parallel collectives in one micro-batch of a stage."""
    comm = StepComm()
    share = Share(stage_tensors(work, [stage]), stage.num_layers)
    model_parallel_comm(work, layout, links, comm, share)
    return comm.exposed / work.grad_accum_steps


def pipeline_p2p(work: Workload, layout: Layout, links: Links, comm: StepComm, held: list[Stage]) -> None:
    """Each micro-batch's activation goes to the next stage, its gradient back (the rank's sequence
    shard under sequence parallel); pipeline neighbours are data-parallel x context x tensor ranks
    apart (the outermost mesh dimension), so across instances when an instance holds no more than
    one stage's ranks. torch's schedules wait for a micro-batch's transfers before its next
    computation, so none is hidden; the first micro-batch's activation crosses every boundary
    before the last stage starts, and its gradient back."""
    reg = regime(work, layout)
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
