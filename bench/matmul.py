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
    """FLOP/s of repeated `a @ b` on size x size matrices, timed for about `seconds` (at least one
    call: where the dtype has no hardware support, e.g. bf16 on a CPU without AVX-512 BF16 or AMX,
    one 2048-size call takes about a minute)."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, dtype=dtype, device=device, generator=generator)
    b = torch.randn(size, size, dtype=dtype, device=device, generator=generator)
    out = torch.empty(size, size, dtype=dtype, device=device)
    torch.matmul(a, b, out=out)  # oneDNN / cuBLAS pick and cache their kernels on the first call
    _synchronize(device)
    # A CUDA clock read needs a synchronisation, which would cost small sizes their overlap.
    calls_per_read = 4 if device == "cuda" else 1
    iterations = 0
    start = time.perf_counter()
    while True:
        torch.matmul(a, b, out=out)
        iterations += 1
        if iterations % calls_per_read == 0:
            _synchronize(device)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return 2 * size**3 * iterations / elapsed


def measure_peaks(device: str, sizes: tuple[int, ...], seconds: float) -> dict:
    """{"fp32": {"peak_flops": F, "by_size": {size: F}}, "bf16": {...}}. A dtype's larger sizes are
    left out once one call of a size took longer than `seconds` and ran slower than the size
    before it (no hardware support: larger only gets slower)."""
    peaks = {}
    for name, dtype in DTYPES.items():
        by_size: dict[str, float] = {}
        for size in sizes:
            flops = matmul_flops(size, dtype, device, seconds)
            by_size[str(size)] = flops
            single_call = 2 * size**3 / flops
            if single_call > seconds and flops < max(by_size.values()):
                break
        peaks[name] = {"peak_flops": max(by_size.values()), "by_size": by_size}
    peaks["threads"] = torch.get_num_threads()
    return peaks


def best_of(first: dict, second: dict) -> dict:
    """Merges two measurements (start and end of a run) keeping the higher figure per size."""
    merged = {"threads": first["threads"]}
    for name in DTYPES:
        sizes = first[name]["by_size"].keys() | second[name]["by_size"].keys()
        by_size = {
            size: max(run[name]["by_size"].get(size, 0.0) for run in (first, second))
            for size in sorted(sizes, key=int)
        }
        merged[name] = {"peak_flops": max(by_size.values()), "by_size": by_size}
    return merged
