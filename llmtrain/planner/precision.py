"""The dtypes of the planner's memory model: bytes per element of a precision setup.

`Regime` is what one precision setup stores: the residual stream's dtype, the matmuls' (compute)
dtype, and whether autocast copies every matmul input and weight into the compute dtype;
`gathered_bytes` is what FSDP2 gathers of a parameter (one byte for an FP8 weight gathered in FP8).
The parts of the memory model (llmtrain.planner.memory) all count in these sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.planner.shapes import ParameterTensor
from llmtrain.planner.workload import Layout, Workload

FP32, LOW = 4, 2


@dataclass(frozen=True)
class Regime:
    """Dtypes of one precision setup, in bytes: the residual stream, matmul inputs and outputs, and
    whether every matmul input and weight is a fresh compute-dtype copy (autocast)."""

    residual: int
    compute: int
    autocast: bool


def regime(work: Workload, layout: Layout) -> Regime:
    if work.precision == "fp32":
        return Regime(FP32, FP32, False)
    if layout.strategy in ("single", "ddp") or (layout.strategy == "fsdp" and not layout.fsdp_wrapped):
        return Regime(FP32, LOW, True)  # autocast over fp32 weights
    return Regime(LOW, LOW, False)  # the weights themselves are bf16/fp16 in compute


def fp8_converted(work: Workload, param: ParameterTensor) -> bool:
    """A weight torchao's Float8Linear multiplies in FP8: the decoder layers' linear layers."""
    return work.fp8 and param.kind == "linear" and param.layer is not None and ".lora_" not in param.name


def gathered_bytes(work: Workload, layout: Layout, reg: Regime, param: ParameterTensor) -> int:
    """Bytes per element of a parameter as FSDP2 gathers it: the compute dtype, or one byte for an
    FP8 weight with the tensorwise recipe (torchao casts the shard before the all-gather)."""
    if fp8_converted(work, param) and work.fp8_recipe == "tensorwise" and layout.fsdp_wrapped:
        return 1
    return reg.compute
