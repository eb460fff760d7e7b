"""Deep Learning Container image URIs, chosen by framework version, Python version, region and device.

Our own small table, so that rendering needs neither the SageMaker SDK nor AWS calls.
tests/llmtrain/test_images.py checks every entry against `sagemaker.image_uris` for the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmtrain.core.errors import LlmtrainError
from llmtrain.core.instances import instance_type
from training_jobs.contract.torch_versions import min_torch, torch_release

if TYPE_CHECKING:
    from llmtrain.core.spec import TemplateSpec

# The AWS account that hosts the PyTorch training DLC in each region (the SDK's pytorch.json).
# The execution role's ECR permissions (training_constructs.images) are built from these tables too.
DLC_REGISTRY_ACCOUNTS: dict[str, str] = {
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
# The SageMaker model parallelism (SMP v2) images live in one account, in fewer regions.
SMP_REGISTRY_ACCOUNT = "658645717510"
SMP_REGIONS = frozenset(
    {
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
    }
)


@dataclass(frozen=True)
class _Release:
    py_version: str
    cuda: str | None = None  # SMP image tags carry the CUDA version; DLC training tags do not


# PyTorch DLC training images: framework version -> supported Python version.
_PYTORCH_RELEASES = {
    "2.5.1": _Release("py311"),
    "2.6.0": _Release("py312"),
    "2.7.1": _Release("py312"),
    "2.8.0": _Release("py312"),
}
# SMP v2 images are tagged with the PyTorch version they are built on (SMP 2.7.0 -> 2.4.1, 2.8.0 -> 2.5.1).
_SMP_RELEASES = {
    "2.4.1": _Release("py311", "cu121"),
    "2.5.1": _Release("py311", "cu124"),
}


def image_torch_problems(template: TemplateSpec) -> list[str]:
    """A platform-code template whose container's torch is older than the program needs (the
    contract's table of the oldest torch per parallelism, which the program checks at start-up).

    The DLC and SMP images are named by their PyTorch version, so `framework_version` is the torch
    the program runs on; an explicit image.uri is checked by the program itself when it starts."""
    version = template.image.framework_version
    if not template.code.is_platform or version is None:
        return []
    minimum = min_torch(template.distribution.strategy)
    if torch_release(version) >= torch_release(minimum):
        return []
    return [
        f"{template.ref} runs the training program on PyTorch {version} (image.framework_version), "
        f"but the program needs PyTorch {minimum} or newer for strategy "
        f"{template.distribution.strategy!r}: publish a version on a newer image "
        f"({', '.join(supported_framework_versions(smp=template.distribution.strategy == 'smp'))})"
    ]


class ImageNotAvailableError(LlmtrainError):
    """No Deep Learning Container matches the requested framework, Python version and region."""


def training_image_uri(
    *, framework_version: str, py_version: str, region: str, instance_type_name: str, smp: bool = False
) -> str:
    """The PyTorch training image for these inputs; `smp=True` picks the SMP v2-enabled image."""
    releases = _SMP_RELEASES if smp else _PYTORCH_RELEASES
    kind = "SMP v2 (smdistributed-modelparallel)" if smp else "PyTorch training"
    release = releases.get(framework_version)
    if release is None:
        raise ImageNotAvailableError(
            f"image.framework_version {framework_version!r}: no {kind} image in the platform's table; "
            f"use one of {', '.join(releases)} or set image.uri"
        )
    if py_version != release.py_version:
        raise ImageNotAvailableError(
            f"image.py_version {py_version!r}: "
            f"the {kind} {framework_version} image ships {release.py_version}"
        )
    device = "gpu" if instance_type(instance_type_name).gpus else "cpu"
    if smp:
        return _smp_uri(framework_version, release, region, device)
    account = DLC_REGISTRY_ACCOUNTS.get(region)
    if account is None:
        raise ImageNotAvailableError(
            f"region {region!r} has no PyTorch training image in the platform's table"
        )
    registry = f"{account}.dkr.ecr.{region}.{_domain(region)}"
    return f"{registry}/pytorch-training:{framework_version}-{device}-{py_version}"


def _domain(region: str) -> str:
    return "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"


def _smp_uri(framework_version: str, release: _Release, region: str, device: str) -> str:
    if device != "gpu":
        raise ImageNotAvailableError("SMP v2 images exist for GPU instances only; pick a GPU instance type")
    if region not in SMP_REGIONS:
        raise ImageNotAvailableError(
            f"region {region!r} has no SMP v2 image; SMP is available in {', '.join(sorted(SMP_REGIONS))}"
        )
    return (
        f"{SMP_REGISTRY_ACCOUNT}.dkr.ecr.{region}.amazonaws.com/smdistributed-modelparallel:"
        f"{framework_version}-gpu-{release.py_version}-{release.cuda}"
    )


def supported_regions(*, smp: bool = False) -> frozenset[str]:
    return SMP_REGIONS if smp else frozenset(DLC_REGISTRY_ACCOUNTS)


def supported_framework_versions(*, smp: bool = False) -> dict[str, str]:
    """framework version -> Python version."""
    releases = _SMP_RELEASES if smp else _PYTORCH_RELEASES
    return {version: release.py_version for version, release in releases.items()}
