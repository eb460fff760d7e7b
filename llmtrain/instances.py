"""What the platform knows about SageMaker training instance types.

A small table of our own so that rendering stays a pure function (no AWS calls, no SDK import).
tests/llmtrain/test_instances.py checks it against the sources it summarises: GPU counts against the
SageMaker Python SDK's instance GPU table, EFA against the training toolkit's list of instance types
on which the container turns EFA on, names against botocore's TrainingInstanceType enum.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceType:
    name: str
    gpus: int
    # True where the SageMaker training toolkit enables EFA (FI_PROVIDER=efa) for torchrun jobs.
    efa: bool
    # NVMe instance storage in GB; SageMaker mounts it instead of an EBS volume, so a training job
    # may not ask for a VolumeKmsKeyId or for more than this many GB.
    local_storage_gb: int | None = None

    @property
    def processes_per_host(self) -> int:
        """torchrun starts one process per GPU; a CPU instance runs one process."""
        return max(self.gpus, 1)


_TABLE = (
    # CPU instances: for smoke tests and small byo jobs.
    InstanceType("ml.c5.xlarge", 0, False),
    InstanceType("ml.c5.2xlarge", 0, False),
    InstanceType("ml.c5.4xlarge", 0, False),
    InstanceType("ml.c5.9xlarge", 0, False),
    InstanceType("ml.c5.18xlarge", 0, False),
    InstanceType("ml.m5.xlarge", 0, False),
    InstanceType("ml.m5.2xlarge", 0, False),
    InstanceType("ml.m5.4xlarge", 0, False),
    InstanceType("ml.m5.12xlarge", 0, False),
    InstanceType("ml.m5.24xlarge", 0, False),
    # GPU instances.
    InstanceType("ml.g4dn.xlarge", 1, False, 125),
    InstanceType("ml.g4dn.2xlarge", 1, False, 225),
    InstanceType("ml.g4dn.4xlarge", 1, False, 225),
    InstanceType("ml.g4dn.8xlarge", 1, True, 900),
    InstanceType("ml.g4dn.12xlarge", 4, True, 900),
    InstanceType("ml.g4dn.16xlarge", 1, False, 900),
    InstanceType("ml.g5.xlarge", 1, False, 250),
    InstanceType("ml.g5.2xlarge", 1, False, 450),
    InstanceType("ml.g5.4xlarge", 1, False, 600),
    InstanceType("ml.g5.8xlarge", 1, False, 900),
    InstanceType("ml.g5.12xlarge", 4, False, 3800),
    InstanceType("ml.g5.16xlarge", 1, False, 1900),
    InstanceType("ml.g5.24xlarge", 4, False, 3800),
    InstanceType("ml.g5.48xlarge", 8, True, 7600),
    InstanceType("ml.p3.2xlarge", 1, False),
    InstanceType("ml.p3.8xlarge", 4, False),
    InstanceType("ml.p3.16xlarge", 8, False),
    InstanceType("ml.p3dn.24xlarge", 8, True, 1800),
    InstanceType("ml.p4d.24xlarge", 8, True, 8000),
    InstanceType("ml.p4de.24xlarge", 8, True, 8000),
    InstanceType("ml.p5.48xlarge", 8, True, 30720),
    InstanceType("ml.p5e.48xlarge", 8, True, 30720),
)

INSTANCE_TYPES: dict[str, InstanceType] = {t.name: t for t in _TABLE}
KNOWN_INSTANCE_TYPES = frozenset(INSTANCE_TYPES)
EFA_INSTANCE_TYPES = frozenset(t.name for t in _TABLE if t.efa)


def instance_type(name: str) -> InstanceType:
    """The table entry for `name`; KeyError names the known types."""
    try:
        return INSTANCE_TYPES[name]
    except KeyError:
        raise KeyError(
            f"unknown instance type {name!r}; known: {', '.join(sorted(INSTANCE_TYPES))}"
        ) from None
