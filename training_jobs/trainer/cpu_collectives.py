"""FSDP2's all-gather and reduce-scatter for CPU processes: faster transfers, and overlap with compute.

Two costs make FSDP2 on CPU slower than DDP, and this module removes most of both.

Transfer. Gloo's own all_gather_into_tensor and reduce_scatter_tensor take 2-2.5x as long on CPU as
moving the same bytes with point-to-point sends (all-gather) or one all-to-all (reduce-scatter).
Measured per decoder layer of the benchmark model (13 MB, two processes): all-gather 12-18 ms
against 5-6 ms, reduce-scatter 17 ms against 8 ms (docs/benchmarks.md).

Waiting. On GPUs FSDP2 overlaps its collectives with compute through CUDA streams; CPU has none, so
every layer's collectives block, and at each one the rank that got ahead waits for the other: a
step has a dozen such meeting points where DDP has one (its reducer all-reduces in gloo's threads
while backward goes on). So here:
- the all-gather returns a work handle instead of finishing, and FSDP2 waits on it only when it
  needs the parameters; with `prefetch_forward` the next layer's gather travels during this one's
  forward, and FSDP2's own backward prefetch does the same in backward;
- the reduce-scatter starts its all-to-all and returns; the sums run once backward has finished
  (an autograd final callback), or earlier once a transfer has arrived. FSDP2 only makes views of
  the output as the gradients, so deferring is safe exactly when nothing reads those views before
  backward ends: see `OverlappedReduceScatter` for the conditions, checked on every call.

Both classes follow the duck-typed interface of `FSDPModule.set_custom_all_gather` and
`set_custom_reduce_scatter` (an `allocate` method and a call).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


class _PlainAllocation:
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class _Requests(dist.Work):
    """The sends and receives of one all-gather, waited on as one work handle (what FSDP2 expects)."""

    def __init__(self, requests: list[dist.Work]):
        super().__init__()
        self._requests = requests

    def wait(self, timeout=None) -> bool:
        while self._requests:
            self._requests.pop(0).wait()
        return True

    def is_completed(self) -> bool:
        return all(request.is_completed() for request in self._requests)


class PointToPointAllGather(_PlainAllocation):
    """Each process sends its shard straight to every other one and receives theirs in place.

    Returns the pending transfer: FSDP2 waits on it before it copies the parameters out.
    """

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work:
        world_size, rank = group.size(), group.rank()
        slots = output_tensor.view(world_size, -1)
        if slots[rank].data_ptr() != input_tensor.data_ptr():
            slots[rank].copy_(input_tensor)  # FSDP2 lays the input out in place; others may not
        operations = []
        for peer in range(world_size):
            if peer != rank:
                peer_rank = dist.get_global_rank(group, peer)
                operations += [dist.P2POp(dist.isend, input_tensor, peer_rank, group),
                               dist.P2POp(dist.irecv, slots[peer], peer_rank, group)]
        return _Requests(dist.batch_isend_irecv(operations))


def _reduce_operation(op) -> bool:
    """True for an average, False for a sum; anything else is refused."""
    if op == dist.ReduceOp.AVG:
        return True
    if op != dist.ReduceOp.SUM:
        raise NotImplementedError(f"the CPU reduce-scatter sums or averages; FSDP2 asked for {op}")
    return False


def _sum_chunks(received: torch.Tensor, output_tensor: torch.Tensor, world_size: int,
                averaged: bool) -> None:
    torch.sum(received.view(world_size, -1), dim=0, out=output_tensor)
    if averaged:
        output_tensor.div_(world_size)


class AllToAllReduceScatter(_PlainAllocation):
    """Each process receives its chunk from every process in one all-to-all, then sums them."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False) -> None:
        _start_all_to_all(output_tensor, input_tensor, group, op).sum()


@dataclass
class _Reduction:
    """One reduce-scatter in flight. Holds the input so its memory outlives the transfer."""

    work: dist.Work
    received: torch.Tensor
    input_tensor: torch.Tensor
    output_tensor: torch.Tensor
    world_size: int
    averaged: bool
    parameters: Sequence[nn.Parameter]

    def sum(self) -> None:
        self.work.wait()
        _sum_chunks(self.received, self.output_tensor, self.world_size, self.averaged)

    def finish(self) -> None:
        """The sum of a deferred reduction, which FSDP2's gradients must be viewing."""
        self.sum()
        self._check_gradients_view_output()

    def _check_gradients_view_output(self) -> None:
        # FSDP2 reduces only the parameters that got a gradient (unused ones keep None).
        grads = [parameter.grad for parameter in self.parameters if parameter.grad is not None]
        storages = {(grad.to_local() if hasattr(grad, "to_local") else grad).untyped_storage().data_ptr()
                    for grad in grads}
        if storages != {self.output_tensor.untyped_storage().data_ptr()}:
            raise RuntimeError(
                "FSDP2 no longer keeps the reduce-scatter output as the gradient, so the deferred "
                "CPU reduce-scatter cannot fill it in; this torch version needs "
                "training_jobs/trainer/cpu_collectives.py reviewed")


def _start_all_to_all(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                      group: dist.ProcessGroup, op, parameters: Sequence[nn.Parameter] = ()) -> _Reduction:
    averaged = _reduce_operation(op)
    received = torch.empty_like(input_tensor)
    work = dist.all_to_all_single(received, input_tensor, group=group, async_op=True)
    return _Reduction(work, received, input_tensor, output_tensor, group.size(), averaged, parameters)


class PendingReductions:
    """The reduce-scatters of one model that are still travelling; all finish before backward ends."""

    def __init__(self):
        self._pending: list[_Reduction] = []

    def add(self, reduction: _Reduction) -> None:
        self._finish_arrived()
        self._pending.append(reduction)
        # Queued once per deferred reduction: a backward that failed half-way leaves no stale flag.
        torch.autograd.Variable._execution_engine.queue_callback(self.finish_all)

    def finish_all(self) -> None:
        while self._pending:
            self._pending.pop(0).finish()

    def _finish_arrived(self) -> None:
        """Sum the transfers that have already arrived, in order, so their buffers go early."""
        while self._pending and self._pending[0].work.is_completed():
            self._pending.pop(0).finish()

    def __len__(self) -> int:
        return len(self._pending)


class OverlappedReduceScatter(AllToAllReduceScatter):
    """Starts the all-to-all and returns; `PendingReductions` sums when backward ends.

    FSDP2 (torch 2.13) turns the output into the gradients by viewing it, so a sum written later
    lands in them. It reads the output at once in these cases, where this reduces synchronously:
    a parameter already holds a gradient (accumulation adds to it), a parameter has a
    post-accumulate-grad hook, the output's dtype differs from the parameters' (a cast copies it),
    the call comes outside a backward pass (nothing would finish it), or it asks for a sum (FSDP2
    divides a summed output as soon as the call returns: a gradient divide factor with force-sum
    reduction, as the routed experts of trainer/expert_parallel.py have). Replicated meshes (HSDP
    all-reduces the output next) and CPU offload do not install this class. When a deferred
    reduction finishes, it checks the gradients still view its output and fails loudly if not.
    """

    def __init__(self, parameters: list[nn.Parameter], pending: PendingReductions):
        self._parameters = parameters
        self._pending = pending

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False) -> None:
        if not self._can_defer(output_tensor, op):
            super().__call__(output_tensor, input_tensor, group, op)
            return
        self._pending.add(_start_all_to_all(output_tensor, input_tensor, group, op, self._parameters))

    def _can_defer(self, output_tensor: torch.Tensor, op) -> bool:
        return (op == dist.ReduceOp.AVG and torch._C._current_graph_task_id() != -1 and bool(self._parameters)
                and all(parameter.grad is None
                        and not getattr(parameter, "_post_accumulate_grad_hooks", None)
                        and parameter.dtype == output_tensor.dtype
                        for parameter in self._parameters))


def _own_parameters(module: nn.Module, sharded: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters of `module` that its own fully_shard group manages (not a sharded child's)."""
    descendants = {id(descendant) for descendant in module.modules() if descendant is not module}
    children = {id(parameter) for child in sharded if id(child) in descendants
                for parameter in child.parameters()}
    return [parameter for parameter in module.parameters()
            if parameter.requires_grad and id(parameter) not in children]


def custom_collectives_supported() -> bool:
    """Whether this torch's FSDP2 takes custom collectives. Older releases (the PyTorch 2.8 Deep
    Learning Container's, when its tests run on a CPU: `make test-container`) lack the hooks and keep
    FSDP2's own gloo collectives: the same results, only slower. A feature test of torch's class, as
    its release notes do not date the hooks."""
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "set_custom_all_gather") and hasattr(FSDPModule, "set_custom_reduce_scatter")


def use_fast_cpu_collectives(sharded: list[nn.Module], *, overlap_reductions: bool) -> None:
    """Route the collectives of fully_shard-ed modules (CPU meshes) through the classes above.

    `sharded` lists every fully_shard-ed module of one model. With `overlap_reductions`, the
    reduce-scatters are deferred to the end of backward (1-D meshes without offload only).
    """
    if not custom_collectives_supported():
        for module in sharded:
            # FSDP2 averages with ReduceOp.AVG, which gloo's reduce-scatter of these releases sums
            # instead (gradients twice too large on two ranks): sum, and let FSDP2 divide after.
            module.set_force_sum_reduction_for_comms(True)
        return
    pending = PendingReductions()
    for module in sharded:
        module.set_custom_all_gather(PointToPointAllGather())
        module.set_custom_reduce_scatter(
            OverlappedReduceScatter(_own_parameters(module, sharded), pending)
            if overlap_reductions else AllToAllReduceScatter())


def prefetch_forward(layers: Sequence[nn.Module], root: nn.Module) -> None:
    """Start each layer's all-gather when the one before begins its forward (root: the first)."""
    if layers:
        root.set_modules_to_forward_prefetch([layers[0]])
    for layer, following in itertools.pairwise(layers):
        layer.set_modules_to_forward_prefetch([following])
