"""trainer/host.py: CPU training keeps freed memory for reuse instead of page-faulting it back in.

Each case runs in a fresh interpreter (malloc's settings are per process and sticky). The probe
allocates, touches and frees the same block sizes several times, like the activations of
consecutive training steps, and counts the minor page faults of each round.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import ctypes, json, resource, sys
sys.path.insert(0, sys.argv[2])
from training_jobs.trainer import host
tuned = host.keep_freed_memory() if sys.argv[1] == "tuned" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
sizes = [3 << 20, 5 << 20, 11 << 20, 7 << 20, 2 << 20]

def step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(size) for size in sizes]
    for block, size in zip(blocks, sizes):
        ctypes.memset(block, 1, size)
    for block in blocks:
        libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

print(json.dumps({"tuned": tuned, "faults": [step() for _ in range(4)], "pages": sum(sizes) // 4096}))
"""


def _probe(mode: str) -> dict:
    result = subprocess.run([sys.executable, "-c", PROBE, mode, str(REPO)], capture_output=True,
                            text=True, check=True)
    return json.loads(result.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_activation_memory_is_reused_without_page_faults():
    default, tuned = _probe("default"), _probe("tuned")
    assert tuned["tuned"] is True
    pages = default["pages"]
    # Without the setting, glibc unmaps the blocks on free: every step faults them in again.
    assert all(faults > pages // 2 for faults in default["faults"][1:]), default
    # With it, only the first step maps fresh pages; later steps reuse them.
    assert tuned["faults"][0] > pages // 2
    assert all(faults < pages // 20 for faults in tuned["faults"][1:]), tuned
