"""Preflight collective health check (preflight_check=true).

Before spending hours of a cluster, check that every rank answers and that the collectives run at
a sane speed: a monitored barrier names ranks that do not arrive in time (a hung or dead host), an
all-reduce checks the arithmetic, and each rank's all-reduce bus bandwidth and local matmul speed
are gathered so that a rank far slower than the median (a degraded GPU, a bad link) stops the job
with its host named instead of slowing every step of the run.

The speed comparison stops only GPU jobs. On GPUs with NCCL a rank several times slower than the
others is a fault; on CPU hosts (local runs, tests) the cores are shared with the other ranks and
whatever else runs on the machine, and a rank 3x slower than the median is timing noise: CPU jobs
report their slow ranks and train.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import ContainerError


@dataclass(frozen=True)
class RankHealth:
    rank: int
    host: str
    allreduce_seconds: float
    bus_gbps: float
    matmul_seconds: float

    def describe(self) -> str:
        return (f"rank {self.rank} on {self.host} (all-reduce {self.allreduce_seconds * 1e3:.1f} ms, "
                f"matmul {self.matmul_seconds * 1e3:.1f} ms)")


@dataclass(frozen=True)
class Preflight:
    """Every rank's measurements, the ranks slower than the factor allows, and whether slowness
    stops the job (GPU timings) or was only reported (CPU timings)."""

    ranks: list[RankHealth]
    slow: list[RankHealth]
    timings_checked: bool
    factor: float


def _timed_allreduce(tensor: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        _sync(tensor.device)
        start = time.perf_counter()
        dist.all_reduce(tensor)
        _sync(tensor.device)
        best = min(best, time.perf_counter() - start)
    return best


def _timed_matmul(device: torch.device, size: int, repeats: int) -> float:
    a = torch.randn(size, size, device=device)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, a)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gloo_group(timeout: timedelta):
    """gloo runs the monitored barrier; with NCCL as the default backend, make a gloo group."""
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    try:
        return dist.new_group(backend="gloo", timeout=timeout)
    except RuntimeError as error:  # creating a group needs every rank too
        seconds = timeout.total_seconds()
        raise ContainerError(f"preflight check: not every rank joined within {seconds:.0f} s (hung or "
                             f"unreachable host): {error}") from error


def wait_for_all_ranks(timeout_seconds: float) -> None:
    """Fail naming the ranks that do not reach the barrier in time (gloo's monitored barrier)."""
    timeout = timedelta(seconds=timeout_seconds)
    try:
        dist.monitored_barrier(group=_gloo_group(timeout), timeout=timeout, wait_all_ranks=True)
    except RuntimeError as error:
        raise ContainerError(f"preflight check: ranks did not answer within {timeout_seconds:.0f} s "
                             f"(hung or unreachable host): {error}") from error


def slow_ranks(results: list[RankHealth], factor: float) -> list[RankHealth]:
    """Ranks whose all-reduce or matmul took more than `factor` x the median."""
    median_reduce = statistics.median(r.allreduce_seconds for r in results)
    median_matmul = statistics.median(r.matmul_seconds for r in results)
    return [r for r in results if r.allreduce_seconds > factor * median_reduce
            or r.matmul_seconds > factor * median_matmul]


def measure(device: torch.device, host: str, megabytes: float, repeats: int) -> RankHealth:
    world = dist.get_world_size()
    tensor = torch.ones(int(megabytes * 2**20 / 4), device=device)
    dist.all_reduce(tensor)  # warm-up, and the arithmetic check below
    if not torch.all(tensor == world):
        raise ContainerError(f"preflight check: all-reduce on {host} (rank {dist.get_rank()}) returned "
                             f"wrong values; the interconnect or the GPU is faulty")
    seconds = _timed_allreduce(tensor, repeats)
    bus = tensor.numel() * 4 * 2 * (world - 1) / world / seconds / 1e9  # NCCL-tests bus bandwidth
    return RankHealth(dist.get_rank(), host, seconds, bus, _timed_matmul(device, 512, repeats))


def check_speeds(results: list[RankHealth], device_type: str, factor: float) -> list[RankHealth]:
    """The ranks slower than `factor` x the median. On GPUs they stop the job (ContainerError naming
    them); on a CPU they are returned, to be reported: shared cores make such timings noise."""
    slow = slow_ranks(results, factor) if len(results) > 1 else []
    if slow and timings_are_checked(device_type):
        raise ContainerError(f"preflight check: {', '.join(r.describe() for r in slow)} slower than "
                             f"{factor:g}x the median; replace the instance or exclude it")
    return slow


def timings_are_checked(device_type: str) -> bool:
    return device_type == "cuda"


def preflight(device: torch.device, host: str, *, timeout_seconds: float = 300.0,
              megabytes: float | None = None, repeats: int = 5, factor: float = 3.0) -> Preflight:
    """Run the whole check; returns every rank's numbers, raises naming the unhealthy ranks."""
    wait_for_all_ranks(timeout_seconds)
    size = megabytes if megabytes is not None else (256.0 if device.type == "cuda" else 8.0)
    mine = measure(device, host, size, repeats)
    gathered: list[RankHealth | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    results = [r for r in gathered if r is not None]
    slow = check_speeds(results, device.type, factor)
    return Preflight(results, slow, timings_are_checked(device.type), factor)
