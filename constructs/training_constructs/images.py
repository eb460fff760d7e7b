"""Where SageMaker's Deep Learning Container images live, so the execution role can pull exactly those.

AWS publishes the PyTorch training images (``pytorch-training``, ``huggingface-pytorch-training``)
from one registry account per region, and the SageMaker model parallelism (SMP v2) images
(``smdistributed-modelparallel``) from another, in fewer regions. The registry tables live once, in
``llmtrain.core.images`` (which renders the image URIs), and match the SageMaker Python SDK's own
(``pytorch.json``, ``huggingface.json``, ``pytorch-smp.json``); a test checks them against the SDK.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmtrain.core.images import DLC_REGISTRY_ACCOUNTS, SMP_REGIONS, SMP_REGISTRY_ACCOUNT

DLC_REPOSITORIES = ("pytorch-training", "huggingface-pytorch-training")

# Region -> the account that serves the SMP v2 images (only these regions have them).
SMP_REGISTRY_ACCOUNTS: Mapping[str, str] = {region: SMP_REGISTRY_ACCOUNT for region in SMP_REGIONS}
SMP_REPOSITORY = "smdistributed-modelparallel"


def training_image_repositories(region: str) -> list[tuple[str, str]]:
    """The ``(account, repository)`` pairs of the training images published in ``region``."""
    if region not in DLC_REGISTRY_ACCOUNTS:
        raise KeyError(region)
    pairs = [(DLC_REGISTRY_ACCOUNTS[region], repository) for repository in DLC_REPOSITORIES]
    if region in SMP_REGISTRY_ACCOUNTS:
        pairs.append((SMP_REGISTRY_ACCOUNTS[region], SMP_REPOSITORY))
    return pairs


__all__ = [
    "DLC_REGISTRY_ACCOUNTS",
    "DLC_REPOSITORIES",
    "SMP_REGISTRY_ACCOUNTS",
    "SMP_REPOSITORY",
    "training_image_repositories",
]
