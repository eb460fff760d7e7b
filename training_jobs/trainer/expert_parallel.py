"""Expert parallelism: each MoE layer's experts split over `expert_parallel_degree` ranks, the tokens
carried to their experts and back by all-to-all (dispatch and combine), as torchtitan's
ExpertParallel does; and each expert slice FSDP-sharded over the ranks that hold it, as torchtitan's
`dp_shard_mod_ep` ("efsdp") dimension does.

The expert ranks are borrowed from the data-sharding dimension (fsdp): of the `shard` ranks,
consecutive groups of `expert` ranks split the experts between them (rank i of a group holds experts
i x E/expert ..), and the `shard / expert` ranks with the same slice (its copies, mesh dimension
"expert_copies") shard it between them with FSDP2. The routed experts' weights become DTensors
sharded on the expert dimension over the expert group ("ep"), which FSDP2 shards again over the
copies, so each rank keeps 1 / shard of every expert weight, its gradient and its optimizer state;
DCP checkpoints reshard across expert degrees and the export gathers them whole.

Their gradients: the combine's backward already sums, on the rank holding an expert, the gradients
of every rank of its expert group; FSDP2's reduce-scatter over the copies adds the copies' and
divides by the data-sharding size (`set_gradient_divide_factor`), which makes them the same mean
over all ranks that FSDP2 gives the other weights (divided by their mesh's size).

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


def apply_expert_parallel(model: nn.Module, mesh) -> None:
    """Split every MoE layer's routed experts over mesh["ep"] and route through all-to-all."""
    from torch.distributed.tensor import Shard, distribute_tensor

    experts_mesh = mesh["ep"]
    group, degree = experts_mesh.get_group(), experts_mesh.size()
    blocks = moe_blocks(model)
    if dist.get_rank() == 0:
        log(f"expert parallel: the {blocks[0].num_experts} experts of each of {len(blocks)} MoE "
              f"layers split over {degree} ranks ({blocks[0].num_experts // degree} each), "
              f"each slice sharded over the {mesh['expert_copies'].size()} ranks holding it")
    for block in blocks:
        for name in EXPERT_WEIGHTS:
            weight = getattr(block.experts, name)
            split = distribute_tensor(weight.data, experts_mesh, [Shard(0)])
            setattr(block.experts, name, nn.Parameter(split, requires_grad=weight.requires_grad))
        block.dispatcher = AllToAllDispatch(group, degree, block.num_experts)


def shard_experts(layer: nn.Module, mesh, options: dict, *, reshard: bool, mean_over: int) -> list[nn.Module]:
    """fully_shard the routed experts of `layer`'s MoE blocks over mesh["expert_copies"] (before
    the layer itself: FSDP2 groups bottom-up); `options` are the layer's own (precision, offload).
    Their reduce-scatter divides by `mean_over`, the other weights' data-sharding size (see the
    module docstring). Returns the sharded modules."""
    from torch.distributed.fsdp import fully_shard

    copies = mesh["expert_copies"]
    sharded = []
    for block in moe_blocks(layer):
        experts = fully_shard(block.experts, mesh=copies, reshard_after_forward=reshard,
                              shard_placement_fn=_copy_placement(copies.size()), **options)
        experts.set_gradient_divide_factor(mean_over)
        if copies.size() > 1:
            # A factor other than the group's size is NCCL's PREMUL_SUM, which gloo and the CPU
            # collectives (trainer/cpu_collectives.py) lack: sum, and FSDP2 divides the shard after.
            # Not on a group of one, where FSDP2 (torch 2.13) divides as it copies and, with a
            # forced sum, again after: gradients half as large at expert degree = shard ranks.
            experts.set_force_sum_reduction_for_comms(True)
        sharded.append(experts)
    return sharded


def _copy_placement(copies: int):
    """Where FSDP2 splits an expert slice between its `copies`: on the expert dimension when each
    copy can take whole experts, else on the next one, as torchtitan does (with fewer experts on a
    rank than copies, dim 0 would leave ranks holding padding only)."""
    from torch.distributed.tensor import Shard

    def placement(param: nn.Parameter):
        return Shard(0) if local_tensor(param).shape[0] % copies == 0 else Shard(1)

    return placement
