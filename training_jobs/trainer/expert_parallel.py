"""Expert parallelism: each MoE layer's experts split over `expert_parallel_degree` ranks, the tokens
carried to their experts and back by all-to-all (dispatch and combine), as torchtitan's
ExpertParallel does.

The expert ranks are borrowed from the data-sharding dimension (fsdp): of the `shard` ranks,
consecutive groups of `expert` ranks split the experts between them (rank i of a group holds experts
i x E/expert ..), and the `shard / expert` ranks with the same slice hold copies of it. The routed
experts' weights become DTensors sharded on the expert dimension over the expert group, so DCP
checkpoints reshard across expert degrees and the export gathers them whole; FSDP2 manages every
other weight and leaves these out. Their gradients: the combine's backward already sums, on the rank
holding an expert, the gradients of every rank of its group; `reduce_expert_gradients` adds the
copies' (an all-reduce over the ranks holding the same slice) and divides by the data-parallel size,
which makes them the same mean over all ranks that FSDP2's reduce-scatter gives the other weights.
Expert weights are therefore replicated, not sharded, across the `shard / expert` copies.

No model math here: the MoE block (trainer/moe/layer.py) sorts its tokens by expert and hands them to
a `Dispatcher`; this module's dispatcher moves them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..contract.parallel_dims import ParallelDims
from .metrics import log
from .moe.families import moe_blocks
from .moe.layer import local_tensor

EXPERT_MESH_DIMS = ("expert_copies", "ep")
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def expert_mesh(dims: ParallelDims, device: torch.device):
    """The world as (copies of a slice, expert ranks); only for expert parallelism with fsdp, whose
    mesh is the shard dimension alone."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dims.shard // dims.expert, dims.expert),
                            mesh_dim_names=EXPERT_MESH_DIMS)


@dataclass
class _Exchange:
    """What combine needs of a dispatch: the order the received rows were regrouped in, and the
    rows sent to and received from each rank."""

    order: torch.Tensor
    sent: list[int]
    received: list[int]


class AllToAllDispatch:
    """Dispatch: rows sorted by global expert go to the rank holding their expert; the received rows
    (grouped by sending rank, then expert) are regrouped by local expert. Combine undoes both."""

    def __init__(self, group, degree: int, num_experts: int) -> None:
        self.group, self.degree = group, degree
        self.local_experts = num_experts // degree

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor):
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        incoming = torch.empty_like(counts)  # [rank, local expert]: what each rank sends here
        dist.all_to_all_single(incoming, counts, group=self.group)
        sent = counts.view(self.degree, self.local_experts).sum(dim=1).tolist()
        incoming = incoming.view(self.degree, self.local_experts)
        received = incoming.sum(dim=1).tolist()
        arrived = all_to_all_single_autograd(rows, received, sent, self.group)
        experts = torch.arange(self.local_experts, device=rows.device).repeat(self.degree)
        order = torch.argsort(torch.repeat_interleave(experts, incoming.reshape(-1)), stable=True)
        return arrived[order], incoming.sum(dim=0), _Exchange(order, sent, received)

    def combine(self, outputs: torch.Tensor, state: _Exchange) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        by_rank = outputs[torch.argsort(state.order)]
        return all_to_all_single_autograd(by_rank, state.sent, state.received, self.group)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [getattr(block.experts, name) for block in moe_blocks(model) for name in EXPERT_WEIGHTS]


def apply_expert_parallel(model: nn.Module, mesh) -> None:
    """Split every MoE layer's routed experts over mesh["ep"] and route through all-to-all."""
    from torch.distributed.tensor import Shard, distribute_tensor

    experts_mesh = mesh["ep"]
    group, degree = experts_mesh.get_group(), experts_mesh.size()
    blocks = moe_blocks(model)
    if dist.get_rank() == 0:
        log(f"expert parallel: the {blocks[0].num_experts} experts of each of {len(blocks)} MoE "
              f"layers split over {degree} ranks ({blocks[0].num_experts // degree} each), "
              f"{mesh['expert_copies'].size()} copies of each slice")
    for block in blocks:
        for name in EXPERT_WEIGHTS:
            weight = getattr(block.experts, name)
            split = distribute_tensor(weight.data, experts_mesh, [Shard(0)])
            setattr(block.experts, name, nn.Parameter(split, requires_grad=weight.requires_grad))
        block.dispatcher = AllToAllDispatch(group, degree, block.num_experts)


def reduce_expert_gradients(parameters: list[nn.Parameter], mesh, data_parallel: int) -> None:
    """The experts' gradients as the mean over every data-parallel rank (see the module docstring)."""
    copies = mesh["expert_copies"]
    for param in parameters:
        if param.grad is None:
            continue
        grad = local_tensor(param.grad)
        if copies.size() > 1:
            dist.all_reduce(grad, group=copies.get_group())
        grad.div_(data_parallel)
