"""The accelerators' dense peaks, which model FLOPs utilisation (MFU) and the run planner divide by.

One table by the name CUDA reports for the device, and the accelerator of each SageMaker instance
family: the program reports MFU against it (training_jobs/trainer/metrics.py), the platform's
instance table takes its GPUs' peaks from it (llmtrain/core/instances.py).
"""

from __future__ import annotations

# Dense bf16 tensor-core peak per accelerator (fp16 where the GPU has no bf16), TFLOP/s, from the
# vendors' data sheets, by a fragment of the device name: the first match wins, so the more specific
# names come first.
PEAK_TFLOPS_BY_DEVICE_NAME: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0), ("B200", 2250.0),
    ("A100", 312.0), ("A10G", 70.0), ("L40S", 362.0), ("L4", 121.0), ("V100", 125.0), ("T4", 65.0),
)
# The accelerator of each SageMaker instance family (ml.p4d.24xlarge: family ml.p4d).
GPU_BY_INSTANCE_FAMILY = {
    "ml.p4d": "A100",
    "ml.p4de": "A100",   # A100 80 GB
    "ml.p5": "H100",     # H100 SXM
    "ml.p5e": "H200",
    "ml.p5en": "H200",
    "ml.p6-b200": "B200",
    "ml.g4dn": "T4",
    "ml.g5": "A10G",
    "ml.g6": "L4",
    "ml.g6e": "L40S",
    "ml.p3": "V100",
    "ml.p3dn": "V100",
}


def device_peak_tflops(device_name: str) -> float | None:
    """The dense peak of the accelerator CUDA names `device_name`, or None when it is not listed."""
    for fragment, tflops in PEAK_TFLOPS_BY_DEVICE_NAME:
        if fragment in device_name:
            return tflops
    return None


def instance_peak_tflops(instance_type: str) -> float | None:
    """The dense peak of one accelerator of a SageMaker instance type (ml.p5.48xlarge), or None."""
    family = instance_type.rsplit(".", 1)[0] if instance_type.count(".") >= 2 else instance_type
    gpu = GPU_BY_INSTANCE_FAMILY.get(family)
    return device_peak_tflops(gpu) if gpu else None
