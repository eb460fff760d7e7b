"""What the platform knows about SageMaker training instance types.

A small table of our own so that rendering stays a pure function (no AWS calls, no SDK import).
Each entry also names its accelerator (`GPU_MODELS`: memory, dense peak, the bandwidth collectives
reach between the GPUs of one instance) and the instance's network bandwidth, which the run planner
(llmtrain.planner) needs. The GPUs' peaks are the training program's (its contract's
hardware table, which its MFU divides by).
"""

from __future__ import annotations

from dataclasses import dataclass

from training_jobs.contract.hardware import device_peak_tflops

GIB = 1024**3


@dataclass(frozen=True)
class GpuModel:
    """One accelerator as the planner sees it.

    memory_bytes: what CUDA reports as the device's total memory. peak_flops: the dense bf16 (fp16
    where the GPU has no bf16) tensor-core peak from the vendor's data sheet (`gpu_peak`).
    link_bytes_per_second: the bandwidth one GPU sends to the others of its instance (NVLink, else
    PCIe), nominal and one direction; the planner applies its measured efficiency
    (llmtrain.planner.speed).
    """

    name: str
    memory_bytes: int
    peak_flops: float
    link_bytes_per_second: float
    # HBM bandwidth from the data sheet (the optimizer's update is bound by it).
    memory_bytes_per_second: float


def gpu_peak(device_name: str) -> float:
    """The dense peak FLOP/s of a GPU (the training program's hardware table)."""
    tflops = device_peak_tflops(device_name)
    if tflops is None:
        raise KeyError(f"the training program's hardware table has no peak for GPU {device_name!r}")
    return tflops * 1e12


GPU_MODELS: dict[str, GpuModel] = {
    gpu.name: gpu
    for gpu in (
        GpuModel("T4", 15360 * 1024**2, gpu_peak("T4"), 16e9, 320e9),  # fp16: no bf16 tensor cores; PCIe 3
        GpuModel("A10G", 23028 * 1024**2, gpu_peak("A10G"), 32e9, 600e9),  # PCIe 4, no NVLink
        GpuModel("V100-16GB", 16384 * 1024**2, gpu_peak("V100"), 150e9, 900e9),  # fp16; NVLink 2
        GpuModel("V100-32GB", 32768 * 1024**2, gpu_peak("V100"), 150e9, 900e9),
        GpuModel("A100-40GB", 40960 * 1024**2, gpu_peak("A100"), 300e9, 1555e9),  # NVLink 3
        GpuModel("A100-80GB", 81920 * 1024**2, gpu_peak("A100"), 300e9, 2039e9),
        GpuModel("H100-80GB", 81559 * 1024**2, gpu_peak("H100"), 450e9, 3350e9),  # SXM, NVLink 4
        GpuModel("H200-141GB", 143771 * 1024**2, gpu_peak("H200"), 450e9, 4800e9),
    )
}


@dataclass(frozen=True)
class InstanceType:
    name: str
    gpus: int
    # True where the SageMaker training toolkit enables EFA (FI_PROVIDER=efa) for torchrun jobs.
    efa: bool
    # NVMe instance storage in GB; SageMaker mounts it instead of an EBS volume, so a training job
    # may not ask for a VolumeKmsKeyId or for more than this many GB.
    local_storage_gb: int | None = None
    # The accelerator (a key of GPU_MODELS); None for CPU instances.
    gpu: str | None = None
    # The instance's network bandwidth to other instances (EFA where `efa`), Gbit/s.
    network_gbps: float = 10.0

    @property
    def gpu_model(self) -> GpuModel | None:
        return GPU_MODELS[self.gpu] if self.gpu else None

    @property
    def processes_per_host(self) -> int:
        """torchrun starts one process per GPU; a CPU instance runs one process."""
        return max(self.gpus, 1)


_TABLE = (
    # CPU instances: for smoke tests and small byo jobs.
    InstanceType("ml.c5.xlarge", 0, False, network_gbps=10),
    InstanceType("ml.c5.2xlarge", 0, False, network_gbps=10),
    InstanceType("ml.c5.4xlarge", 0, False, network_gbps=10),
    InstanceType("ml.c5.9xlarge", 0, False, network_gbps=12),
    InstanceType("ml.c5.18xlarge", 0, False, network_gbps=25),
    InstanceType("ml.m5.xlarge", 0, False, network_gbps=10),
    InstanceType("ml.m5.2xlarge", 0, False, network_gbps=10),
    InstanceType("ml.m5.4xlarge", 0, False, network_gbps=10),
    InstanceType("ml.m5.12xlarge", 0, False, network_gbps=12),
    InstanceType("ml.m5.24xlarge", 0, False, network_gbps=25),
    # GPU instances.
    InstanceType("ml.g4dn.xlarge", 1, False, 125, "T4", 25),
    InstanceType("ml.g4dn.2xlarge", 1, False, 225, "T4", 25),
    InstanceType("ml.g4dn.4xlarge", 1, False, 225, "T4", 25),
    InstanceType("ml.g4dn.8xlarge", 1, True, 900, "T4", 50),
    InstanceType("ml.g4dn.12xlarge", 4, True, 900, "T4", 50),
    InstanceType("ml.g4dn.16xlarge", 1, False, 900, "T4", 50),
    InstanceType("ml.g5.xlarge", 1, False, 250, "A10G", 10),
    InstanceType("ml.g5.2xlarge", 1, False, 450, "A10G", 10),
    InstanceType("ml.g5.4xlarge", 1, False, 600, "A10G", 25),
    InstanceType("ml.g5.8xlarge", 1, False, 900, "A10G", 25),
    InstanceType("ml.g5.12xlarge", 4, False, 3800, "A10G", 40),
    InstanceType("ml.g5.16xlarge", 1, False, 1900, "A10G", 25),
    InstanceType("ml.g5.24xlarge", 4, False, 3800, "A10G", 50),
    InstanceType("ml.g5.48xlarge", 8, True, 7600, "A10G", 100),
    InstanceType("ml.p3.2xlarge", 1, False, gpu="V100-16GB", network_gbps=10),
    InstanceType("ml.p3.8xlarge", 4, False, gpu="V100-16GB", network_gbps=10),
    InstanceType("ml.p3.16xlarge", 8, False, gpu="V100-16GB", network_gbps=25),
    InstanceType("ml.p3dn.24xlarge", 8, True, 1800, "V100-32GB", 100),
    InstanceType("ml.p4d.24xlarge", 8, True, 8000, "A100-40GB", 400),
    InstanceType("ml.p4de.24xlarge", 8, True, 8000, "A100-80GB", 400),
    InstanceType("ml.p5.48xlarge", 8, True, 30720, "H100-80GB", 3200),
    InstanceType("ml.p5e.48xlarge", 8, True, 30720, "H200-141GB", 3200),
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


def gpu_instance_types() -> tuple[InstanceType, ...]:
    """The instance types with accelerators, in table order."""
    return tuple(t for t in _TABLE if t.gpu is not None)
