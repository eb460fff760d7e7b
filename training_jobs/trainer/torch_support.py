"""The oldest PyTorch this program runs on, checked when a job starts.

The same table as llmtrain.images.PROGRAM_MIN_TORCH (the platform refuses to render a template whose
container's torch is older; tests/llmtrain/test_platform_features.py keeps the two equal). The check
here also covers images the platform cannot see into (an explicit image.uri). The versions are the
oldest container torch the program's tests pass under: `make test-container`.
"""

from __future__ import annotations

import torch

from .errors import ContainerError

MIN_TORCH = {"default": "2.8.0", "smp": "2.5.1"}


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+", 1)[0].split(".")[:3] if part.isdigit())


def check_torch(parallelism: str, version: str | None = None) -> None:
    """ContainerError when this container's torch is older than the program needs."""
    version = version or torch.__version__
    minimum = MIN_TORCH.get(parallelism, MIN_TORCH["default"])
    if _release(version) < _release(minimum):
        raise ContainerError(
            f"this container has PyTorch {version}, and the training program needs {minimum} or newer "
            f"for parallelism={parallelism}: use a template version on a newer Deep Learning Container"
        )
