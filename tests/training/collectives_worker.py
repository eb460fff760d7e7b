"""Checks the CPU collectives for FSDP2 against gloo's own, inside one torchrun launch.

    python -m torch.distributed.run --nproc_per_node N tests/training/collectives_worker.py OUT.json

Inputs are whole numbers, so every summation order gives the same bits and the comparison is exact
for any process count. Rank 0 writes OUT.json.
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from training_jobs.trainer.cpu_collectives import (  # noqa: E402
    AllToAllReduceScatter,
    OverlappedReduceScatter,
    PendingReductions,
    PointToPointAllGather,
    _Reduction,
)


def _whole_numbers(numel: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-64, 64, (numel,), generator=generator).to(dtype)


def all_gather_matches(group, shard_numel: int, dtype: torch.dtype) -> bool:
    world_size, rank = group.size(), group.rank()
    ours = torch.full((shard_numel * world_size,), float("nan")).to(dtype)
    # FSDP2 lays the input out as this rank's slice of the output buffer.
    shard = ours.view(world_size, -1)[rank]
    shard.copy_(_whole_numbers(shard_numel, seed=rank, dtype=dtype))
    gloo = torch.empty_like(ours)
    dist.all_gather_into_tensor(gloo, shard.clone(), group=group)
    # Whatever FSDP2 asks for, the transfer is handed back pending, as one work handle.
    work = PointToPointAllGather()(ours, shard, group, async_op=False)
    assert isinstance(work, dist.Work)
    work.wait()
    return work.is_completed() and torch.equal(ours, gloo)


def all_gather_on_a_subgroup_matches(shard_numel: int) -> bool:
    """Ranks 1 and 2 only: group ranks are not global ranks."""
    subgroup = dist.new_group([1, 2])
    if dist.get_rank() not in (1, 2):
        return True
    return all_gather_matches(subgroup, shard_numel, torch.float32)


def reduce_scatter_matches(group, shard_numel: int, op, reduce_scatter=None) -> bool:
    world_size = group.size()
    reduce_scatter = reduce_scatter or AllToAllReduceScatter()
    local = _whole_numbers(shard_numel * world_size, seed=100 + group.rank(), dtype=torch.float32)
    ours = reduce_scatter.allocate((shard_numel,), dtype=torch.float32, device=local.device)
    gloo = torch.empty_like(ours)
    dist.reduce_scatter_tensor(gloo, local.clone(), op=op, group=group)
    reduce_scatter(ours, local, group, op)
    return torch.equal(ours, gloo)


def overlapped_outside_backward_reduces_at_once(group) -> bool:
    """Called outside a backward pass nothing would finish a deferred sum, so it reduces now."""
    pending = PendingReductions()
    overlapped = OverlappedReduceScatter([nn.Parameter(torch.zeros(1))], pending)
    return reduce_scatter_matches(group, 100, dist.ReduceOp.AVG, overlapped) and len(pending) == 0


def overlapped_sum_in_backward_reduces_at_once(group) -> bool:
    """Inside a backward pass an average is deferred, but FSDP2 divides a sum as soon as the call
    returns (the routed experts' force-sum reduction with a divide factor): it reduces now."""
    pending = PendingReductions()
    overlapped = OverlappedReduceScatter([nn.Parameter(torch.zeros(1))], pending)
    checked = []
    start = torch.zeros(1, requires_grad=True)
    start.register_hook(lambda grad: checked.append(
        reduce_scatter_matches(group, 100, dist.ReduceOp.SUM, overlapped) and len(pending) == 0))
    (start * 2).sum().backward()
    return checked == [True]


def _reduction_of_ones(group, output: torch.Tensor, parameters: list) -> _Reduction:
    """A reduce-scatter of ones in flight: each output element becomes the world size."""
    data = torch.ones(output.numel() * group.size())
    received = torch.empty_like(data)
    work = dist.all_to_all_single(received, data, group=group, async_op=True)
    return _Reduction(work, received, data, output, group.size(), False, parameters)


def unaliased_gradient_is_reported(group) -> str:
    """A deferred sum whose output the gradient does not view would be lost: it must fail loudly."""
    parameter = nn.Parameter(torch.zeros(4))
    parameter.grad = torch.zeros(4)
    output = torch.empty(4)
    try:
        _reduction_of_ones(group, output, [parameter]).finish()
    except RuntimeError as error:
        return str(error) if torch.equal(output, torch.full((4,), float(group.size()))) else ""
    return ""


def other_reductions_are_refused(group) -> str:
    data = torch.ones(group.size())
    try:
        AllToAllReduceScatter()(torch.empty(1), data, group, dist.ReduceOp.MAX)
    except NotImplementedError as error:
        return str(error)
    return ""


def _tiny_sharded_llama(overlap_reductions: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    from training_jobs.contract.hyperparameters import ParallelConfig
    from training_jobs.trainer.cpu_collectives import use_fast_cpu_collectives
    from training_jobs.trainer.parallel import apply_fsdp

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4))
    apply_fsdp(model, init_device_mesh("cpu", (dist.get_world_size(),)), ParallelConfig(), offload=False)
    if not overlap_reductions:
        sharded = [module for module in model.modules() if hasattr(module, "set_custom_all_gather")]
        use_fast_cpu_collectives(sharded, overlap_reductions=False)
    return model


def _gradients(model) -> list[torch.Tensor]:
    return [parameter.grad.full_tensor().clone() for parameter in model.parameters()]


def unused_parameter_passes_the_check(group) -> bool:
    """A parameter that got no gradient is left out of the reduce-scatter: not a lost sum."""
    output = torch.empty(4)
    used, unused = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(2))
    used.grad = output.view(4)
    _reduction_of_ones(group, output, [used, unused]).finish()
    return torch.equal(used.grad, torch.full((4,), float(group.size()))) and unused.grad is None


def fsdp_on_cpu() -> dict:
    """Which collectives FSDP2 went through in two backward passes of a sharded tiny Llama (the
    second accumulates), and whether deferring the reduce-scatters changed any gradient bit."""
    from training_jobs.trainer import cpu_collectives

    calls = {"all_gather": 0, "deferred": 0, "at_once": 0}

    def counting(name, call):
        def counted(*args, **kwargs):
            calls[name] += 1
            return call(*args, **kwargs)
        return counted

    cpu_collectives.PointToPointAllGather.__call__ = counting("all_gather", PointToPointAllGather.__call__)
    cpu_collectives.AllToAllReduceScatter.__call__ = counting("at_once", AllToAllReduceScatter.__call__)
    cpu_collectives.PendingReductions.add = counting("deferred", PendingReductions.add)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    grads = {}
    for overlap in (True, False):
        model = _tiny_sharded_llama(overlap)
        model(input_ids=tokens, labels=tokens).loss.backward()
        first = _gradients(model)
        calls_after_first = dict(calls)
        model(input_ids=tokens, labels=tokens).loss.backward()
        grads[overlap] = (first, _gradients(model))
        if overlap:
            overlapped_calls = {"first_backward": calls_after_first, "both_backwards": dict(calls)}
    same = all(torch.equal(a, b) for deferred, at_once in zip(grads[True], grads[False], strict=True)
               for a, b in zip(deferred, at_once, strict=True))
    return {**overlapped_calls, "gradients_identical": _everywhere(same)}


def _everywhere(ok: bool) -> bool:
    """True only if it held on every rank (rank 0 writes the results)."""
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    return flag.item() == 0


def main(out: str) -> int:
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    results = {
        "all_gather_fp32": _everywhere(all_gather_matches(group, 1000, torch.float32)),
        "all_gather_bf16": _everywhere(all_gather_matches(group, 37, torch.bfloat16)),
        "all_gather_subgroup": _everywhere(all_gather_on_a_subgroup_matches(100)),
        "reduce_scatter_sum": _everywhere(reduce_scatter_matches(group, 1000, dist.ReduceOp.SUM)),
        "reduce_scatter_avg": _everywhere(reduce_scatter_matches(group, 8, dist.ReduceOp.AVG)),
        "refusal": other_reductions_are_refused(group),
        "overlapped_outside_backward": _everywhere(overlapped_outside_backward_reduces_at_once(group)),
        "overlapped_sum_in_backward": _everywhere(overlapped_sum_in_backward_reduces_at_once(group)),
        "unaliased_gradient": unaliased_gradient_is_reported(group),
        "unused_parameter": _everywhere(unused_parameter_passes_the_check(group)),
        "fsdp": fsdp_on_cpu(),
    }
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
