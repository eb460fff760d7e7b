"""The host's memory allocator, tuned for training on a CPU.

A training step frees its activations and allocates the same sizes again in the next step. glibc's
malloc hands blocks above its mmap threshold (at first 128 KiB) back to the kernel on free and maps
fresh pages on the next allocation, so every step page-faults through all of its activation memory
again; on a virtual machine each fault is expensive. Keeping freed memory in the process's heap for
reuse makes a CPU step about 7% faster on this project's machine (docs/benchmarks.md), the effect
Intel's CPU training guides get from jemalloc or tcmalloc, without another library. The cost: the
process keeps its peak memory until it exits instead of shrinking between steps.
"""

from __future__ import annotations

import ctypes
import sys

# mallopt(3) parameters (glibc malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's maximum: only blocks above 32 MiB are still mapped
TRIM_THRESHOLD_BYTES = 2**31 - 1  # the largest value mallopt's int takes: shrink the heap (almost) never
TOP_PAD_BYTES = 64 * 2**20  # grow the heap in large steps


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse; False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl and other C libraries
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
                (M_TOP_PAD, TOP_PAD_BYTES))
    return all(mallopt(option, value) == 1 for option, value in settings)
