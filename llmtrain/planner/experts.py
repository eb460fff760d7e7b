"""What a mixture of experts adds to a step: the all-to-all that carries each token to its experts'
ranks and back, and the expert parallel figures the plan reports.

With expert parallelism (the program's expert_parallel_degree, `ep`) each MoE layer sends every
token's hidden state to the ranks of its top-k experts (dispatch) and the experts' outputs back
(combine): forward two all-to-alls of top-k x hidden per token, backward their two mirrors, and a
fully checkpointed layer repeats its forward's two. A rank keeps 1 / ep of each all-to-all and sends
the rest: to the other ranks of its instance over NVLink, and to those of other instances over the
instance's EFA, which all of the instance's GPUs share (an all-to-all does not funnel through one
ring crossing per instance as the ring collectives in llmtrain.planner.collectives do). The two
parts run side by side; the slower sets the time. They sit on the critical path: the experts need
the tokens before they can compute (docs/planning.md, "Mixture of experts").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmtrain.planner.precision import regime
from llmtrain.planner.shapes import ModelShape
from llmtrain.planner.sharding import parameter_tensors, state_numel
from llmtrain.planner.workload import Layout, Workload

if TYPE_CHECKING:
    from llmtrain.planner.speed import SpeedEstimate


@dataclass(frozen=True)
class AllToAll:
    """One all-to-all's bytes each GPU sends over NVLink and over EFA, and its seconds."""

    nvlink_bytes: float
    network_bytes: float
    nvlink_seconds: float
    network_seconds: float

    @property
    def bytes_per_gpu(self) -> float:
        return self.nvlink_bytes + self.network_bytes

    @property
    def seconds(self) -> float:
        return max(self.nvlink_seconds, self.network_seconds)


def all_to_all(
    buffer_bytes: float,
    degree: int,
    gpus_per_node: int,
    link_bytes_per_second: float,
    network_bytes_per_second: float,
) -> AllToAll:
    """One all-to-all over `degree` consecutive ranks of a `buffer_bytes` buffer per rank, on
    instances of `gpus_per_node` GPUs (`network_bytes_per_second`: one instance's usable EFA rate;
    `link_bytes_per_second`: one GPU's usable NVLink rate)."""
    if degree <= 1 or buffer_bytes <= 0:
        return AllToAll(0.0, 0.0, 0.0, 0.0)
    inside = min(degree, gpus_per_node)
    nvlink = buffer_bytes * (inside - 1) / degree
    network = buffer_bytes * (degree - inside) / degree
    per_gpu_network = network_bytes_per_second / gpus_per_node
    return AllToAll(nvlink, network, nvlink / link_bytes_per_second, network / per_gpu_network)


def all_to_alls_per_micro_batch(work: Workload, layers: int) -> float:
    """Dispatch and combine forward and backward in each MoE layer, and the forward's again in each
    fully checkpointed one."""
    m = work.model
    moe_share = m.moe_layers / m.num_layers
    recomputed = work.checkpointed_layers * moe_share if work.activation_checkpointing == "full" else 0.0
    return 4 * layers * moe_share + 2 * recomputed


def token_buffer_bytes(work: Workload, layout: Layout, tokens: int) -> float:
    """One all-to-all's buffer on one rank: `tokens` tokens' top-k copies of the hidden state."""
    m = work.model
    return tokens * m.experts_per_token * m.hidden_size * regime(work, layout).compute


def dispatch_bytes_per_token(m: ModelShape, compute_bytes: int) -> float:
    """Activations a MoE layer keeps per token for backward beyond a dense MLP's: the dispatched
    (permuted) copies of the token the grouped matmul reads, the experts' outputs the combine weighs
    (`compute_bytes` each), and the router's fp32 scores."""
    if not m.moe:
        return 0.0
    return 2 * m.experts_per_token * m.hidden_size * compute_bytes + 4 * m.num_experts


def expert_report(work: Workload, layout: Layout, speed: SpeedEstimate) -> dict[str, object] | None:
    """A mixture of experts' figures in a plan (None for a dense model): its experts, one rank's
    experts and their fp32 weight, gradient and moment bytes, and the step's all-to-all."""
    m = work.model
    if not m.moe:
        return None
    degree = work.expert_parallel
    expert_elements = sum(p.numel for p in m.parameters() if p.kind == "expert")
    moved = [t for t in speed.transfers if t.name.startswith("expert all-to-all")]
    return {
        "num_experts": m.num_experts,
        "experts_per_token": m.experts_per_token,
        "expert_intermediate_size": m.expert_intermediate_size,
        "moe_layers": m.moe_layers,
        "expert_parallel_degree": degree,
        "experts_per_gpu": m.num_experts // degree,
        "expert_parameters": expert_elements,
        "expert_state_bytes_per_gpu": expert_state_bytes(work, layout),
        "gathered_expert_bytes_per_layer": regime(work, layout).compute
        * expert_elements
        / m.moe_layers
        / degree,
        "dispatch_bytes_per_token_per_layer": dispatch_bytes_per_token(m, regime(work, layout).compute),
        "all_to_all_bytes_per_gpu": {t.name: t.bytes_per_gpu for t in moved},
        "all_to_all_seconds": max((t.seconds for t in moved), default=0.0),
    }


def expert_state_bytes(work: Workload, layout: Layout) -> int:
    """One rank's fp32 expert weights, gradients and AdamW's two moments, as the program holds them
    (llmtrain.planner.sharding.state_numel: split over every data-sharding rank, or, in older code,
    whole on each copy of an expert slice; DDP keeps them whole)."""
    shard = layout.shard if layout.fsdp_wrapped else 1
    experts = [p for p in parameter_tensors(work).all if p.kind == "expert"]
    return 16 * sum(state_numel(p, work, layout.tensor, shard, padded=False) for p in experts)
