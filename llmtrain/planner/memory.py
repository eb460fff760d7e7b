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
logits; llmtrain.planner.pipeline_memory) and the plan reports the rank that holds the most.

How each part follows from the strategy is in docs/planning.md ("The memory model", "The pipeline"). The
activation terms follow the Hugging Face Llama block op by op (which tensor each op saves, in which
dtype) rather than a fitted constant, so they hold for any width, depth, sequence and batch.

This module assembles the parts; each is counted in its own module:
- llmtrain.planner.precision: the dtypes of a precision setup;
- llmtrain.planner.sharding: which parameters train, and each rank's piece of them;
- llmtrain.planner.model_states: parameters, gradients and optimizer states per strategy;
- llmtrain.planner.activation_memory: activations and the working buffers;
- llmtrain.planner.pipeline_memory: what a pipeline rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmtrain.planner.activation_memory import activation_bytes, working_bytes
from llmtrain.planner.model_states import ModelStates, model_states
from llmtrain.planner.pipeline_memory import (
    pipeline_activation_bytes,
    pipeline_working_bytes,
    rank_stages,
    stage_tensors,
)
from llmtrain.planner.post_training import reference_bytes, sampling_bytes
from llmtrain.planner.sharding import parameter_tensors
from llmtrain.planner.workload import Layout, Workload

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
    # A post-training objective's (llmtrain.planner.post_training): the reference copy's parameters,
    # and the KV cache of sampling, which happens before the step's forward (its activations).
    reference: int = 0
    sampling: int = 0

    @property
    def per_gpu(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.reference
            + max(self.activations + self.working, self.sampling)
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
            "reference_parameters_bytes": self.reference,
            "sampling_kv_cache_bytes": self.sampling,
            "overhead_bytes": self.overhead,
            "offloaded_bytes": self.offloaded,
            "details": dict(self.details),
        }


# --- the parts ------------------------------------------------------------------------------------


def estimate(work: Workload, layout: Layout, capacity: int, *, on_gpu: bool = True) -> MemoryEstimate:
    """The memory one rank holds for `work` under `layout` (see the module docstring); with
    pipeline stages, the pipeline rank that holds the most."""
    if layout.pipelined:
        return max(pipeline_estimates(work, layout, capacity, on_gpu=on_gpu), key=lambda e: e.per_gpu)
    tensors = parameter_tensors(work)
    activations, details = activation_bytes(work, layout, on_gpu)
    states = model_states(work, layout, tensors)
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
    reference, sampling = reference_bytes(work, layout), sampling_bytes(work, layout)
    subtotal = sum(gpu_states) + reference + max(activations + working, sampling)
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
        reference=reference,
        sampling=sampling,
    )


def pipeline_estimates(
    work: Workload, layout: Layout, capacity: int, *, on_gpu: bool = True
) -> list[MemoryEstimate]:
    """What each pipeline rank holds (rank r at index r)."""
    estimates = []
    for rank in range(layout.pipeline):
        held = rank_stages(work, layout, rank)
        tensors = stage_tensors(work, held)
        activations, details = pipeline_activation_bytes(work, layout, rank)
        states = model_states(work, layout, tensors)
        working = pipeline_working_bytes(work, layout, tensors, held)
        estimate = _assemble(work, layout, capacity, on_gpu, states, activations, working, details)
        estimates.append(estimate)
    return estimates
