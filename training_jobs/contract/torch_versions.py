"""The oldest PyTorch the training program runs on, by parallelism.

The versions are the oldest container torch the program's tests pass under (`make test-container`,
docs/templates.md "Publishing a version"). SMP jobs run in the SMP image, built on an older torch;
the program's SMP path and the parts it shares are tested there. The program refuses an older torch
at start-up (training_jobs/trainer/torch_support.py: also for images the platform cannot see into),
and the platform refuses to render a template whose container is older (llmtrain/core/images.py).
"""

from __future__ import annotations

MIN_TORCH = {"default": "2.8.0", "smp": "2.5.1"}


def min_torch(parallelism: str) -> str:
    return MIN_TORCH.get(parallelism, MIN_TORCH["default"])


def torch_release(version: str) -> tuple[int, ...]:
    """(2, 8, 0) for "2.8.0" or "2.8.0+cu129"."""
    return tuple(int(part) for part in version.split("+", 1)[0].split(".")[:3] if part.isdigit())
