"""The platform's shared resources as the constructs take them: its storage and its network.

A construct that uses the platform's buckets and key takes one ``storage``, and one that places
jobs or endpoints in the VPC takes one ``network``, never each bucket, key, subnet or group one by
one. Both are interfaces (``Protocol``s): ``TrainingStorage`` and ``TrainingNetwork`` provide them,
and so do ``ExistingStorage`` and ``ExistingNetwork``, the records of resources a caller brings
(imported with ``s3.Bucket.from_bucket_name``, ``kms.Key.from_key_arn``, ``ec2.Vpc.from_vpc_attributes``
and the like).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3

from training_constructs._props import freeze_sequences, require

# SageMaker's VpcConfig limits.
MAX_SUBNETS = 16
MAX_SECURITY_GROUPS = 5


@runtime_checkable
class StorageResources(Protocol):
    """The platform's data key and its four data buckets."""

    @property
    def data_key(self) -> kms.IKey:
        """Encrypts the buckets, the jobs' volumes and outputs."""

    @property
    def datasets_bucket(self) -> s3.IBucket: ...

    @property
    def checkpoints_bucket(self) -> s3.IBucket: ...

    @property
    def artifacts_bucket(self) -> s3.IBucket: ...

    @property
    def code_bucket(self) -> s3.IBucket: ...


@runtime_checkable
class NetworkResources(Protocol):
    """Where jobs run: the VPC, its training subnets and the training (EFA) security group."""

    @property
    def vpc(self) -> ec2.IVpc: ...

    @property
    def subnets(self) -> Sequence[ec2.ISubnet]: ...

    @property
    def security_group(self) -> ec2.ISecurityGroup:
        """The security group of the jobs' instances."""

    @property
    def endpoint_security_group(self) -> ec2.ISecurityGroup | None:
        """The interface endpoints' security group; None when the VPC brings its own endpoints
        (constructs then add none)."""


@dataclass(frozen=True, kw_only=True)
class ExistingStorage:
    """Buckets and a key the caller brings (a ``StorageResources``)."""

    data_key: kms.IKey
    datasets_bucket: s3.IBucket
    checkpoints_bucket: s3.IBucket
    artifacts_bucket: s3.IBucket
    code_bucket: s3.IBucket

    @property
    def buckets(self) -> dict[str, s3.IBucket]:
        return data_buckets(self)


@dataclass(frozen=True, kw_only=True)
class ExistingNetwork:
    """A VPC, subnets and security groups the caller brings (a ``NetworkResources``)."""

    vpc: ec2.IVpc
    subnets: Sequence[ec2.ISubnet]
    security_group: ec2.ISecurityGroup
    endpoint_security_group: ec2.ISecurityGroup | None = None

    def __post_init__(self) -> None:
        freeze_sequences("ExistingNetwork", self)
        require(
            1 <= len(self.subnets) <= MAX_SUBNETS,
            "ExistingNetwork",
            "subnets",
            f"must hold 1 to {MAX_SUBNETS} subnets (SageMaker's VpcConfig limit)",
        )


def data_buckets(storage: StorageResources) -> dict[str, s3.IBucket]:
    """The data buckets by name (datasets, checkpoints, artifacts, code)."""
    return {
        "datasets": storage.datasets_bucket,
        "checkpoints": storage.checkpoints_bucket,
        "artifacts": storage.artifacts_bucket,
        "code": storage.code_bucket,
    }


def subnet_selection(network: NetworkResources) -> ec2.SubnetSelection:
    return ec2.SubnetSelection(subnets=list(network.subnets))


def check_storage(construct: str, storage: object) -> None:
    require(
        isinstance(storage, StorageResources),
        construct,
        "storage",
        f"must be a TrainingStorage or an ExistingStorage (a data_key and four buckets), got "
        f"{type(storage).__name__}",
    )


def check_network(construct: str, network: object) -> None:
    require(
        isinstance(network, NetworkResources),
        construct,
        "network",
        f"must be a TrainingNetwork or an ExistingNetwork (a VPC, its subnets and security group), got "
        f"{type(network).__name__}",
    )
    require(
        1 <= len(network.subnets) <= MAX_SUBNETS,
        construct,
        "network",
        f"must have 1 to {MAX_SUBNETS} subnets (SageMaker's VpcConfig limit), has {len(network.subnets)}",
    )


__all__ = [
    "ExistingNetwork",
    "ExistingStorage",
    "NetworkResources",
    "StorageResources",
    "check_network",
    "check_storage",
    "data_buckets",
    "subnet_selection",
]
