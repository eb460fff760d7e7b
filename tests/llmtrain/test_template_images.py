"""The image table and the instance table, checked against the sources they summarise."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from llmtrain.core.images import (
    ImageNotAvailableError,
    supported_framework_versions,
    supported_regions,
    training_image_uri,
)
from llmtrain.core.instances import EFA_INSTANCE_TYPES, INSTANCE_TYPES

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from sagemaker import image_uris

# A spot check of CPU images is enough: the account and tag rules are the same as for GPU.
CPU_REGIONS = ("us-east-1", "eu-central-1", "cn-north-1", "us-gov-west-1")
SMP_DISTRIBUTION = {
    "torch_distributed": {"enabled": True},
    "smdistributed": {"modelparallel": {"enabled": True, "parameters": {}}},
}


@pytest.fixture(autouse=True)
def fast_sdk_lookups(monkeypatch):
    """The SDK re-reads botocore's endpoints.json on every lookup; cache it (same answers, ~10x faster)."""
    import functools

    import sagemaker.utils

    monkeypatch.setattr(
        sagemaker.utils, "_botocore_resolver", functools.cache(sagemaker.utils._botocore_resolver)
    )


@pytest.mark.parametrize(("version", "py_version"), sorted(supported_framework_versions().items()))
def test_pytorch_images_match_the_sagemaker_sdk(version, py_version):
    for region in sorted(supported_regions()):
        for instance_type in (
            ("ml.p4d.24xlarge", "ml.c5.2xlarge") if region in CPU_REGIONS else ("ml.p4d.24xlarge",)
        ):
            expected = image_uris.retrieve(
                "pytorch",
                region,
                version=version,
                py_version=py_version,
                instance_type=instance_type,
                image_scope="training",
            )
            ours = training_image_uri(
                framework_version=version,
                py_version=py_version,
                region=region,
                instance_type_name=instance_type,
            )
            assert ours == expected, (region, instance_type)


@pytest.mark.parametrize(("version", "py_version"), sorted(supported_framework_versions(smp=True).items()))
def test_smp_images_match_the_sagemaker_sdk(version, py_version):
    for region in sorted(supported_regions(smp=True)):
        for instance_type in ("ml.p4d.24xlarge", "ml.p5.48xlarge"):
            expected = image_uris.get_training_image_uri(
                region,
                "pytorch",
                framework_version=version,
                py_version=py_version,
                distribution=SMP_DISTRIBUTION,
                instance_type=instance_type,
            )
            ours = training_image_uri(
                framework_version=version,
                py_version=py_version,
                region=region,
                instance_type_name=instance_type,
                smp=True,
            )
            assert ours == expected, (region, instance_type)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"framework_version": "1.13.1", "py_version": "py39"},
            "image.framework_version '1.13.1': no PyTorch training",
        ),
        (
            {"framework_version": "2.8.0", "py_version": "py311"},
            "the PyTorch training 2.8.0 image ships py312",
        ),
        (
            {"framework_version": "2.8.0", "py_version": "py312", "region": "xx-nowhere-1"},
            "region 'xx-nowhere-1'",
        ),
        (
            {"framework_version": "2.5.1", "py_version": "py311", "region": "af-south-1", "smp": True},
            "region 'af-south-1' has no SMP v2 image",
        ),
        (
            {
                "framework_version": "2.5.1",
                "py_version": "py311",
                "instance_type_name": "ml.c5.2xlarge",
                "smp": True,
            },
            "SMP v2 images exist for GPU instances only",
        ),
    ],
)
def test_unavailable_images_say_why(kwargs, message):
    arguments = {"region": "us-east-1", "instance_type_name": "ml.p4d.24xlarge", **kwargs}
    with pytest.raises(ImageNotAvailableError, match=message):
        training_image_uri(**arguments)


def test_gpu_counts_match_the_sdks_instance_table():
    table = json.loads(
        (Path(image_uris.__file__).parent / "image_uri_config" / "instance_gpu_info.json").read_text()
    )
    sdk = table["us-east-1"]
    checked = [name for name in INSTANCE_TYPES if name in sdk]
    assert len(checked) >= 20
    for name in checked:
        assert INSTANCE_TYPES[name].gpus == sdk[name]["Count"], name
    # CPU types have no GPUs; the SDK's table lacks ml.p5e (8 H200) and spells ml.g5.xlarge "ml.g5n.xlarge".
    unchecked = {name for name in INSTANCE_TYPES if name not in sdk}
    assert unchecked == {name for name in INSTANCE_TYPES if name.startswith(("ml.c5.", "ml.m5."))} | {
        "ml.g5.xlarge",
        "ml.p5e.48xlarge",
    }
    assert all(INSTANCE_TYPES[name].gpus == 0 for name in unchecked if name.startswith(("ml.c5.", "ml.m5.")))


def test_efa_types_are_those_the_training_toolkit_enables_efa_on():
    from sagemaker_training import SM_EFA_NCCL_INSTANCES

    assert EFA_INSTANCE_TYPES <= set(SM_EFA_NCCL_INSTANCES)
    assert {"ml.p4d.24xlarge", "ml.p5.48xlarge", "ml.g5.48xlarge"} <= EFA_INSTANCE_TYPES
    assert "ml.g5.12xlarge" not in EFA_INSTANCE_TYPES


def test_instance_types_are_sagemaker_training_types():
    from llmtrain.core.validate import create_training_job_shape

    allowed = set(create_training_job_shape().members["ResourceConfig"].members["InstanceType"].enum)
    assert set(INSTANCE_TYPES) <= allowed
