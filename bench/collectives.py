"""`python -m bench.collectives [--processes 2] [--megabytes 13] [--calls 10] [--rounds 2] [--steps 0]`

FSDP2's collectives on CPU: gloo's own all-gather and reduce-scatter next to the ones our program
uses (training_jobs/trainer/cpu_collectives.py), on one buffer size (13 MB is one decoder layer of
the benchmark model in fp32), taken in turns, each waited for. With `--steps N`, also whole FSDP2
training steps of the benchmark model (fp32, micro-batch 4) with three sets of collectives: gloo's
own, ours waited for at once (`ours_blocking`: the transfer alone), and ours as the program runs
them (`ours`: gathers pending until needed, reduce-scatters summed when backward ends). They switch
between rounds inside the same processes, so a change of load hits all alike. Launches torchrun
itself; rank 0 prints a table and, with `--json`, writes the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.collectives", description=__doc__.split("\n\n")[1])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--megabytes", type=float, default=13.0,
                        help="all-gather output / reduce-scatter input")
    parser.add_argument("--calls", type=int, default=10, help="timed calls of each collective per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=0, help="timed FSDP2 steps of each variant per round")
    parser.add_argument("--json", type=Path, help="also write the medians here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return _worker(args)
    worker_args = ["--worker", "--megabytes", str(args.megabytes), "--calls", str(args.calls),
                   "--rounds", str(args.rounds), "--steps", str(args.steps)]
    if args.json:
        worker_args += ["--json", str(args.json.resolve())]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.processes}", "-m", "bench.collectives", *worker_args]
    return subprocess.run(command, cwd=REPO, check=False).returncode


# --- inside torchrun ----------------------------------------------------------------------------

class _GlooAllGather:
    """What FSDP2 does by default, through the same custom-collective interface."""

    def allocate(self, size, *, dtype, device):
        import torch

        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        import torch.distributed as dist

        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class _GlooReduceScatter(_GlooAllGather):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        import torch.distributed as dist

        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class _BlockingAllGather:
    """Ours, waited for before it returns: the transfer's speed without the overlap."""

    def __init__(self):
        from training_jobs.trainer.cpu_collectives import PointToPointAllGather

        self._gather = PointToPointAllGather()
        self.allocate = self._gather.allocate

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self._gather(output_tensor, input_tensor, group).wait()


def _variants() -> dict[str, tuple[object, object]]:
    """Each set's all-gather and reduce-scatter, both finished when they return."""
    from training_jobs.trainer.cpu_collectives import AllToAllReduceScatter

    return {"gloo": (_GlooAllGather(), _GlooReduceScatter()),
            "ours": (_BlockingAllGather(), AllToAllReduceScatter())}


def _install(name: str, sharded: list) -> None:
    """Set one of the step variants on every fully_shard-ed module."""
    from training_jobs.trainer.cpu_collectives import use_fast_cpu_collectives

    if name == "ours":
        use_fast_cpu_collectives(sharded, overlap_reductions=True)
        return
    all_gather, reduce_scatter = _variants()["ours" if name == "ours_blocking" else name]
    for module in sharded:
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)


def _timed_ms(call, repeats: int) -> list[float]:
    import torch.distributed as dist

    call()
    dist.barrier()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return times


def _collective_times(args, variants) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    group, world_size, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    numel = int(args.megabytes * 1e6 / 4) // world_size * world_size
    gathered = torch.empty(numel)
    shard = gathered.view(world_size, -1)[rank]
    shard.normal_()
    gradients, reduced = torch.randn(numel), torch.empty(numel // world_size)
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, (all_gather, reduce_scatter) in variants.items():
            times.setdefault(f"all_gather_{name}_ms", []).extend(_timed_ms(
                lambda ag=all_gather: ag(gathered, shard, group), args.calls))
            times.setdefault(f"reduce_scatter_{name}_ms", []).extend(_timed_ms(
                lambda rs=reduce_scatter: rs(reduced, gradients, group, dist.ReduceOp.AVG), args.calls))
    return times


def _step_times(args) -> dict[str, list[float]]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from bench.model import build_causal_lm
    from training_jobs.contract.hyperparameters import ParallelConfig
    from training_jobs.trainer.parallel import apply_fsdp

    torch.manual_seed(0)
    model = build_causal_lm("llama-20m", 256)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("shard",))
    apply_fsdp(model, mesh, ParallelConfig(mixed_precision="fp32"), offload=False)
    sharded = [module for module in model.modules() if hasattr(module, "set_custom_all_gather")]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, 500, (4, 256))

    def step():
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name in ("gloo", "ours_blocking", "ours"):
            _install(name, sharded)
            times.setdefault(f"fsdp2_step_{name}_ms", []).extend(_timed_ms(step, args.steps))
    return times


def _worker(args) -> int:
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    dist.init_process_group("gloo")
    variants = _variants()
    times = _collective_times(args, variants)
    if args.steps:
        times.update(_step_times(args))
    if dist.get_rank() == 0:
        medians = {key: round(statistics.median(values), 2) for key, values in times.items()}
        print(f"{dist.get_world_size()} processes, {args.megabytes} MB, median ms:")
        for key, value in medians.items():
            print(f"  {key:28s} {value:10.2f}")
        if args.json:
            args.json.write_text(json.dumps({"processes": dist.get_world_size(),
                                             "megabytes": args.megabytes, "median_ms": medians}, indent=2))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
