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
    """One accelerator as the planner sees it, each figure from the vendor's data sheet.

    memory_bytes: what CUDA reports as the device's total memory. peak_flops: the dense bf16 (fp16
    where the GPU has no bf16) tensor-core peak (`gpu_peak`: the training program's hardware table,
    which its MFU divides by). fp8_peak_flops: the dense FP8 tensor-core peak; 0 where the GPU has no
    FP8 tensor cores (compute capability below 8.9). link_bytes_per_second: the bandwidth one GPU
    sends to the others of its instance (NVLink, else PCIe), nominal and one direction; the planner
    applies its measured efficiency (llmtrain.planner.speed). memory_bytes_per_second: HBM (or
    GDDR) bandwidth, which bounds the non-matmul operations and the optimizer's update.
    generation: the architecture, whose sustained matmul rate the planner calibrates
    (llmtrain.planner.speed_calibration.Calibration). attention_efficiency: the fraction of the bf16 peak
    PyTorch's flash attention (FlashAttention-2's kernels) reaches in forward and backward at head
    dimension 128, counting the FLOPs as those kernels' benchmarks do (the backward, which recomputes
    the scores, 2.5 times the forward; llmtrain.planner.compute_times.ATTENTION_BACKWARD_PASSES): on an
    A100 about 190 of 312 TFLOP/s (Dao 2023, FlashAttention-2, figure 4); on
    an H100 about 265 of 989 (PyTorch's SDPA forward measured at 287-304 TFLOP/s, pytorch/benchmark
    pull request 2296, and FlashAttention-2's backward a little slower than its forward there:
    Shah et al. 2024, FlashAttention-3, figures 4 and 6); the Ampere and Ada GPUs of the g5 and g6
    instances run the A100's kernels, for which no figure of theirs is published.
    """

    name: str
    memory_bytes: int
    peak_flops: float
    link_bytes_per_second: float
    memory_bytes_per_second: float
    compute_capability: tuple[int, int]
    fp8_peak_flops: float = 0.0
    attention_efficiency: float = 0.60

    @property
    def generation(self) -> str:
        """volta, turing, ampere, ada or hopper (from the compute capability)."""
        major, minor = self.compute_capability
        if major >= 9:
            return "hopper"
        if major == 8:
            return "ada" if minor >= 9 else "ampere"
        return "turing" if minor >= 5 else "volta"

    @property
    def has_fp8(self) -> bool:
        """FP8 tensor cores: compute capability 8.9 (Ada) or newer (Hopper, Blackwell)."""
        return self.compute_capability >= FP8_MIN_CAPABILITY


# torchao's float8 matmuls (torch._scaled_mm) need compute capability 8.9 or newer (the training
# program's trainer/float8.py refuses older GPUs at start-up).
FP8_MIN_CAPABILITY = (8, 9)
# PyTorch's flash attention forward + backward on Hopper (GpuModel.attention_efficiency).
HOPPER_ATTENTION_EFFICIENCY = 0.27


def gpu_peak(device_name: str) -> float:
    """The dense peak FLOP/s of a GPU (the training program's hardware table)."""
    tflops = device_peak_tflops(device_name)
    if tflops is None:
        raise KeyError(f"the training program's hardware table has no peak for GPU {device_name!r}")
    return tflops * 1e12


GPU_MODELS: dict[str, GpuModel] = {
    gpu.name: gpu
    for gpu in (
        GpuModel("T4", 15360 * 1024**2, gpu_peak("T4"), 16e9, 320e9, (7, 5)),  # fp16: no bf16; PCIe 3
        GpuModel("A10G", 23028 * 1024**2, gpu_peak("A10G"), 32e9, 600e9, (8, 6)),  # PCIe 4, no NVLink
        # Ada, PCIe 4: 24 GB GDDR6 at 300 GB/s, FP8 242.5 TFLOP/s dense (NVIDIA L4 data sheet)
        GpuModel("L4", 23034 * 1024**2, gpu_peak("L4"), 32e9, 300e9, (8, 9), fp8_peak_flops=242.5e12),
        # Ada, PCIe 4: 48 GB GDDR6 at 864 GB/s, FP8 733 TFLOP/s dense (NVIDIA L40S data sheet)
        GpuModel("L40S", 46068 * 1024**2, gpu_peak("L40S"), 32e9, 864e9, (8, 9), fp8_peak_flops=733e12),
        GpuModel("V100-16GB", 16384 * 1024**2, gpu_peak("V100"), 150e9, 900e9, (7, 0)),  # fp16; NVLink 2
        GpuModel("V100-32GB", 32768 * 1024**2, gpu_peak("V100"), 150e9, 900e9, (7, 0)),
        GpuModel("A100-40GB", 40960 * 1024**2, gpu_peak("A100"), 300e9, 1555e9, (8, 0)),  # NVLink 3
        GpuModel("A100-80GB", 81920 * 1024**2, gpu_peak("A100"), 300e9, 2039e9, (8, 0)),
        # SXM, NVLink 4, HBM3 at 3.35 TB/s, FP8 1,979 TFLOP/s dense (NVIDIA H100 data sheet)
        GpuModel("H100-80GB", 81559 * 1024**2, gpu_peak("H100"), 450e9, 3350e9, (9, 0),
                 fp8_peak_flops=1979e12,
                 attention_efficiency=HOPPER_ATTENTION_EFFICIENCY),
        # HBM3e at 4.8 TB/s, the H100's compute (NVIDIA H200 data sheet)
        GpuModel("H200-141GB", 143771 * 1024**2, gpu_peak("H200"), 450e9, 4800e9, (9, 0),
                 fp8_peak_flops=1979e12, attention_efficiency=HOPPER_ATTENTION_EFFICIENCY),
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


def fp8_instance_types() -> tuple[str, ...]:
    """The instance types whose GPUs have FP8 tensor cores (compute capability 8.9+)."""
    return tuple(t.name for t in _TABLE if t.gpu_model is not None and t.gpu_model.has_fp8)
