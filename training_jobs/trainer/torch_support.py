"""The oldest PyTorch this program runs on, checked when a job starts.

The table is the contract's (training_jobs/contract/torch_versions.py), which the platform also
checks a template's container against before it renders a job; the check here also covers images
the platform cannot see into (an explicit image.uri).
"""

from __future__ import annotations

import torch

from ..contract.torch_versions import min_torch, torch_release
from .errors import ContainerError


def check_torch(parallelism: str, version: str | None = None) -> None:
    """ContainerError when this container's torch is older than the program needs."""
    version = version or torch.__version__
    minimum = min_torch(parallelism)
    if torch_release(version) < torch_release(minimum):
        raise ContainerError(
            f"this container has PyTorch {version}, and the training program needs {minimum} or newer "
            f"for parallelism={parallelism}: use a template version on a newer Deep Learning Container"
        )
