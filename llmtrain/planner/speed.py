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

This module adds up a step; its parts are each in their own module:
- llmtrain.planner.compute_times: the compute of a micro-batch on a rank's layers;
- llmtrain.planner.collectives: the collectives of each strategy and where they overlap compute;
- llmtrain.planner.speed_calibration: the constants (`Calibration`, `CALIBRATION`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from llmtrain.planner.collectives import (
    Cluster,
    Links,
    Share,
    StepComm,
    Transfer,
    data_parallel_comm,
    model_parallel_comm,
    pipeline_p2p,
    stage_communication,
    trainable_elements,
)
from llmtrain.planner.compute_times import StageTimes, accumulation_seconds, layer_times, stage_times
from llmtrain.planner.pipeline_memory import pipeline_stages, rank_stages, stage_tensors
from llmtrain.planner.post_training import ObjectiveTimes, objective_times
from llmtrain.planner.precision import FP32
from llmtrain.planner.sharding import state_numel, tp_local_numel
from llmtrain.planner.speed_calibration import CALIBRATION, Calibration
from llmtrain.planner.workload import Layout, Workload

# The speed model's interface: `estimate` of a workload on a `Cluster` with a `Calibration`.
__all__ = ["CALIBRATION", "Calibration", "Cluster", "SpeedEstimate", "estimate", "pipeline_bubble"]


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
    # A post-training objective's reference forwards and sampling (in step_seconds).
    objective: ObjectiveTimes = ObjectiveTimes()

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
            "objective_seconds": self.objective.named(),
            "tokens_per_step": self.tokens_per_step,
            "communication": [
                {"collective": t.name, "bytes_per_gpu": t.bytes_per_gpu, "seconds": t.seconds}
                for t in self.transfers
            ],
        }


# --- the step ---------------------------------------------------------------------------------------


def estimate(
    work: Workload, layout: Layout, cluster: Cluster, calibration: Calibration = CALIBRATION
) -> SpeedEstimate:
    if layout.pipelined:
        return _pipeline_estimate(work, layout, cluster, calibration)
    m = work.model
    times = layer_times(work, layout, cluster.gpu, calibration, list(range(m.num_layers)), head=True)
    share = Share.whole(work)
    accumulate = accumulation_seconds(work, layout, cluster.gpu, share.tensors)
    times = replace(times, backward_weight=times.backward_weight + accumulate,
                    parts=(times.parts[0], times.parts[1], times.parts[2] + accumulate))
    forward, backward = times.forward, times.backward_input + times.backward_weight
    links = Links(cluster, calibration)
    comm = data_parallel_comm(work, layout, links, share)
    model_parallel_comm(work, layout, links, comm, share)
    accum = work.grad_accum_steps
    exposed = _exposed(comm, forward, backward, accum)
    optimizer = _optimizer_seconds(work, layout, cluster, calibration, share)
    compute = accum * (forward + backward)
    objective = objective_times(work, layout, cluster.gpu, calibration, forward, comm.forward)
    return SpeedEstimate(
        step_seconds=compute + exposed + optimizer + objective.total,
        compute_seconds=compute,
        exposed_communication_seconds=exposed,
        optimizer_seconds=optimizer,
        tokens_per_step=work.micro_batch_tokens * accum * layout.data_parallel,
        world_size=layout.world_size,
        model_flops_per_token=m.flops_per_token(work.seq_len),
        peak_flops=cluster.gpu.peak_flops,
        transfers=tuple(comm.transfers),
        compute_parts=tuple(accum * part for part in times.parts),
        objective=objective,
    )


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
        _updated_elements(work, layout, share)
        * calibration.optimizer_bytes_per_parameter
        / cluster.gpu.memory_bytes_per_second
    )
    return seconds + _offload_seconds(work, layout, calibration, share)


def _updated_elements(work: Workload, layout: Layout, share: Share) -> float:
    """Trainable elements one rank's AdamW updates: 1 / shard of each (all of them under DDP); of an
    expert slice under expert parallelism, what the rank holds of it (`state_numel`: 1 / copies, or
    the whole slice in older code), not 1 / shard of the slice."""
    shard = layout.shard if layout.strategy != "ddp" else 1
    experts = [p for p in share.tensors.trainable if p.experts] if work.expert_parallel > 1 else []
    split = sum(tp_local_numel(p, layout.tensor) for p in experts)
    held = sum(state_numel(p, work, layout.tensor, shard, padded=False) for p in experts)
    return (trainable_elements(share, layout) - split) / shard + held


def _offload_seconds(work: Workload, layout: Layout, calibration: Calibration, share: Share) -> float:
    """Offloading copies the shards to and from the host and runs AdamW there (rough: PCIe and
    the host's update rate)."""
    if not (layout.offload_params or layout.offload_optimizer):
        return 0.0
    shard = trainable_elements(share, layout) / layout.shard
    copies = 2 * FP32 * shard * (work.grad_accum_steps if layout.offload_params else 1)
    return (
        copies / calibration.offload_bytes_per_second
        + shard / calibration.host_optimizer_parameters_per_second
    )


# --- pipeline stages ---------------------------------------------------------------------------------


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


def _pipeline_estimate(
    work: Workload, layout: Layout, cluster: Cluster, calibration: Calibration
) -> SpeedEstimate:
    """The step of the slowest pipeline rank: its stages' compute for every micro-batch, the
    bubble, the communication it cannot hide (its stages' data-parallel collectives, tensor and
    context parallel, the point-to-point transfers) and its optimizer update."""
    stages = pipeline_stages(work, layout)
    times = [stage_times(work, layout, stage, cluster.gpu, calibration) for stage in stages]
    links = Links(cluster, calibration)
    accumulate = [accumulation_seconds(work, layout, cluster.gpu, stage_tensors(work, [s]))
                  for s in stages]
    times = [replace(t, backward_weight=t.backward_weight + a, parts=(t.parts[0], t.parts[1], t.parts[2] + a))
             for t, a in zip(times, accumulate, strict=True)]
    bubble = pipeline_bubble(layout, times, [stage_communication(work, layout, links, s) for s in stages])
    accum = work.grad_accum_steps
    slowest = None
    for rank in range(layout.pipeline):
        held = rank_stages(work, layout, rank)
        share = Share(stage_tensors(work, held), sum(s.num_layers for s in held))
        forward = sum(times[s.index].forward for s in held)
        backward = sum(times[s.index].backward_input + times[s.index].backward_weight for s in held)
        comm = data_parallel_comm(work, layout, links, share)
        model_parallel_comm(work, layout, links, comm, share)
        pipeline_p2p(work, layout, links, comm, held)
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
