"""Where SageMaker's Deep Learning Container images live, so the execution role can pull exactly those.

AWS publishes the PyTorch training images (``pytorch-training``, ``huggingface-pytorch-training``)
from one registry account per region, and the SageMaker model parallelism (SMP v2) images
(``smdistributed-modelparallel``) from another, in fewer regions. The tables below are the ones the
SageMaker Python SDK uses (``sagemaker/image_uri_config/pytorch.json``, ``huggingface.json`` and
``pytorch-smp.json``); a test checks them against the installed SDK.
"""

from __future__ import annotations

from collections.abc import Mapping

# Region -> the account that serves pytorch-training and huggingface-pytorch-training (PyTorch 2.x).
DLC_REGISTRY_ACCOUNTS: Mapping[str, str] = {
    "af-south-1": "626614931356",
    "ap-east-1": "871362719292",
    "ap-east-2": "975050140332",
    "ap-northeast-1": "763104351884",
    "ap-northeast-2": "763104351884",
    "ap-northeast-3": "364406365360",
    "ap-south-1": "763104351884",
    "ap-south-2": "772153158452",
    "ap-southeast-1": "763104351884",
    "ap-southeast-2": "763104351884",
    "ap-southeast-3": "907027046896",
    "ap-southeast-4": "457447274322",
    "ap-southeast-5": "550225433462",
    "ap-southeast-6": "633930458069",
    "ap-southeast-7": "590183813437",
    "ca-central-1": "763104351884",
    "ca-west-1": "204538143572",
    "cn-north-1": "727897471807",
    "cn-northwest-1": "727897471807",
    "eu-central-1": "763104351884",
    "eu-central-2": "380420809688",
    "eu-north-1": "763104351884",
    "eu-south-1": "692866216735",
    "eu-south-2": "503227376785",
    "eu-west-1": "763104351884",
    "eu-west-2": "763104351884",
    "eu-west-3": "763104351884",
    "il-central-1": "780543022126",
    "me-central-1": "914824155844",
    "me-south-1": "217643126080",
    "mx-central-1": "637423239942",
    "sa-east-1": "763104351884",
    "us-east-1": "763104351884",
    "us-east-2": "763104351884",
    "us-gov-east-1": "446045086412",
    "us-gov-west-1": "442386744353",
    "us-west-1": "763104351884",
    "us-west-2": "763104351884",
}
DLC_REPOSITORIES = ("pytorch-training", "huggingface-pytorch-training")

# Region -> the account that serves the SMP v2 images (only these regions have them).
SMP_REGISTRY_ACCOUNTS: Mapping[str, str] = {
    region: "658645717510"
    for region in (
        "ap-northeast-1",
        "ap-northeast-2",
        "ap-northeast-3",
        "ap-south-1",
        "ap-southeast-1",
        "ap-southeast-2",
        "ca-central-1",
        "eu-central-1",
        "eu-north-1",
        "eu-west-1",
        "eu-west-2",
        "eu-west-3",
        "sa-east-1",
        "us-east-1",
        "us-east-2",
        "us-west-1",
        "us-west-2",
    )
}
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
