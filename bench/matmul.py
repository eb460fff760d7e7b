"""The machine's measured peak: dense square matmuls, fp32 and bf16, the best size wins.

This is the denominator of MFU. It uses every core the training runs use (torch's default thread
count on CPU), so a configuration can reach at most about 100%.
"""

from __future__ import annotations

import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_flops(size: int, dtype: torch.dtype, device: str, seconds: float) -> float:
    """FLOP/s of repeated `a @ b` on size x size matrices, timed for about `seconds`."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, dtype=dtype, device=device, generator=generator)
    b = torch.randn(size, size, dtype=dtype, device=device, generator=generator)
    out = torch.empty(size, size, dtype=dtype, device=device)
    for _ in range(3):  # oneDNN / cuBLAS pick and cache their kernels on the first calls
        torch.matmul(a, b, out=out)
    _synchronize(device)
    iterations = 0
    start = time.perf_counter()
    while True:
        torch.matmul(a, b, out=out)
        iterations += 1
        if iterations % 4 == 0:
            _synchronize(device)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return 2 * size**3 * iterations / elapsed


def measure_peaks(device: str, sizes: tuple[int, ...], seconds: float) -> dict:
    """{"fp32": {"peak_flops": F, "by_size": {size: F}}, "bf16": {...}}"""
    peaks = {}
    for name, dtype in DTYPES.items():
        by_size = {str(size): matmul_flops(size, dtype, device, seconds) for size in sizes}
        peaks[name] = {"peak_flops": max(by_size.values()), "by_size": by_size}
    peaks["threads"] = torch.get_num_threads()
    return peaks


def best_of(first: dict, second: dict) -> dict:
    """Merges two measurements (start and end of a run) keeping the higher figure per size."""
    merged = {"threads": first["threads"]}
    for name in DTYPES:
        by_size = {
            size: max(first[name]["by_size"][size], second[name]["by_size"][size])
            for size in first[name]["by_size"]
        }
        merged[name] = {"peak_flops": max(by_size.values()), "by_size": by_size}
    return merged
