"""The constants of the speed model (llmtrain.planner.speed): fitted ones and assumed ones.

`CALIBRATION` holds them; the five fitted ones are recomputed from published runs by
`bench.plan.calibrate()`, everything else is checked against other published runs
(docs/planning.md, `python -m bench.plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.core.instances import GpuModel


@dataclass(frozen=True)
class Calibration:
    """The constants of the speed model.

    Calibrated (bench.plan.calibrate(), i.e. bench.published.calibrate(), refits them; a test keeps
    them equal; grouped_matmul_fraction is the fifth, below):
    matmul_efficiency_ampere / matmul_efficiency_hopper: the fraction of the data sheet's dense peak
    a generation's training matmuls sustain (boost clocks are not sustained under full tensor-core
    load, less so on Hopper); Ada GPUs (L4, L40S), of which no training run is published, get
    Hopper's (the lower), Volta and Turing Ampere's;
    elementwise_bytes_eager / elementwise_bytes_compiled: bytes the non-matmul operations move per
    element of the activations they touch, forward and backward, per decoder layer, without and with
    torch.compile.

    Assumed (sourced or counted, not fitted): loss_bytes_per_vocabulary (the chunked loss reads and
    writes each logit about 30 bytes' worth, forward and backward, counted op by op);
    fp8_cast_bytes_eager / _compiled (torchao casts each converted layer's input twice, forward and
    again for the weight gradient, and its output gradient twice, backward; eager, each cast reads
    the bf16 tensor for its maximum and again to write the FP8 copy, 5 bytes per element, 10 per
    element of input or output; compiled, the maximum and the cast fuse into the operation that
    produced the tensor, leaving the FP8 copy's write, 2 bytes); link_efficiency / network_efficiency (the
    fraction of nominal bandwidth NCCL's collectives reach on NVLink and EFA); fp32_peak_fraction
    (the dense fp32 rate relative to bf16: PyTorch keeps TF32 off for matmuls by default); the
    optimizer's bytes per parameter; offloading's PCIe rate and host AdamW rate.
    grouped_matmul_fraction (calibrated last, on torchtitan's Qwen3-30B-A3B EP 4 run on H200; two
    other runs of it check it, docs/planning.md): the rate of a mixture of experts' routed expert
    matmuls (torch._grouped_mm over the experts' uneven token groups, each a narrow matrix) relative
    to a dense training matmul's. It also absorbs what the planner does not count separately: the
    router, the token permutation and the all-to-all's token-count exchange with its host sync.
    all_to_all_network_efficiency: the fraction of an instance's EFA bandwidth NCCL's all-to-all
    reaches between instances (many small point-to-point messages, below a ring's
    network_efficiency).
    """

    matmul_efficiency_ampere: float = 0.762
    matmul_efficiency_hopper: float = 0.6662
    elementwise_bytes_eager: float = 56.54
    elementwise_bytes_compiled: float = 36.32
    loss_bytes_per_vocabulary: float = 30.0
    fp8_cast_bytes_eager: float = 10.0
    fp8_cast_bytes_compiled: float = 2.0
    link_efficiency: float = 0.80
    network_efficiency: float = 0.80
    fp32_peak_fraction: float = 1 / 16
    grouped_matmul_fraction: float = 0.265
    all_to_all_network_efficiency: float = 0.5
    # Bytes the AdamW update reads and writes per trainable fp32 parameter (p, grad, m, v in; p, m,
    # v out), which bound it by the GPU's memory bandwidth.
    optimizer_bytes_per_parameter: int = 28
    # Host-device copies for offloading (PCIe), and the host's AdamW rate, parameters per second.
    offload_bytes_per_second: float = 20e9
    host_optimizer_parameters_per_second: float = 1e9

    def matmul_efficiency(self, gpu: GpuModel) -> float:
        if gpu.generation in ("hopper", "ada"):
            return self.matmul_efficiency_hopper
        return self.matmul_efficiency_ampere

    def elementwise_bytes(self, compiled: bool) -> float:
        return self.elementwise_bytes_compiled if compiled else self.elementwise_bytes_eager

    def fp8_cast_bytes(self, compiled: bool) -> float:
        return self.fp8_cast_bytes_compiled if compiled else self.fp8_cast_bytes_eager


CALIBRATION = Calibration()
