"""FP8 training of the decoder layers' linear layers with torchao's float8 (`fp8: true`).

torchao swaps each chosen nn.Linear for a Float8Linear that casts its input, weight and output
gradient to float8 (`fp8_recipe`: one scale per tensor, or per row) and multiplies them on the GPU's
FP8 tensor cores (torch._scaled_mm); master weights, optimizer state and every other operation stay
as before. Tensorwise under FSDP2 also all-gathers the weights in FP8 (torchao's
enable_fsdp_float8_all_gather: half the bytes of bf16), with their scales computed for all layers
at once after each optimizer step (precompute_float8_dynamic_scale_for_fsdp, as torchtitan does);
with tensor parallel, torchao's float8 parallel styles (trainer/tensor_parallel.py). FP8
matmuls need compute capability 8.9 or newer (Ada L4/L40S, Hopper H100/H200, Blackwell), so any
other device is refused before the model is touched, naming what to use instead. The embedding and
the output head stay in bf16: FP8 logits cost accuracy for little speed.
"""

from __future__ import annotations

import torch
from torch import nn

from ..contract.hyperparameters import ParallelConfig
from .errors import ConfigError, ContainerError
from .models import decoder_layers

FP8_MIN_CAPABILITY = (8, 9)
# torch._scaled_mm needs both matmul dimensions divisible by 16.
FP8_DIVISOR = 16


def check_fp8_device(device: torch.device) -> None:
    """FP8 matmuls run on NVIDIA GPUs of compute capability 8.9+ only."""
    if device.type != "cuda":
        raise ConfigError("invalid hyperparameter 'fp8': FP8 training needs an NVIDIA GPU with FP8 "
                          "tensor cores (compute capability 8.9+: H100, H200, L4, L40S; ml.p5, ml.p5e, "
                          "ml.p5en, ml.g6, ml.g6e) and this process has none; set fp8=false")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"invalid hyperparameter 'fp8': the {name} (compute capability "
                          f"{capability[0]}.{capability[1]}) has no FP8 tensor cores; FP8 training "
                          "needs 8.9+ (H100, H200, L4, L40S); set fp8=false or use ml.p5 instances")


def _fp8_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and module.in_features % FP8_DIVISOR == 0 \
        and module.out_features % FP8_DIVISOR == 0


def apply_float8(model: nn.Module, device: torch.device, par: ParallelConfig, *, with_fsdp: bool) -> int:
    """Convert the decoder layers' linear layers to torchao Float8Linear on a GPU that runs FP8
    matmuls; returns how many."""
    check_fp8_device(device)
    return convert_to_float8(model, par.fp8_recipe, fsdp_float8_all_gather=with_fsdp)


def float8_config(recipe: str, *, fsdp_float8_all_gather: bool):
    """torchao's settings for the recipe: tensorwise (dynamic per-tensor scales; under FSDP2 the
    weights are cast to FP8 before the all-gather, which then moves half the bytes of bf16) or
    rowwise (per-row scales, bf16 all-gathers)."""
    from torchao.float8 import Float8LinearConfig

    if recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    return Float8LinearConfig.from_recipe_name(recipe)


def convert_to_float8(model: nn.Module, recipe: str = "tensorwise", *,
                      fsdp_float8_all_gather: bool = False) -> int:
    """The conversion alone (any device; the matmuls then need FP8 tensor cores): every linear
    layer of the decoder layers whose dimensions FP8 matmuls take; returns how many."""
    try:
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as error:
        raise ContainerError("fp8=true needs torchao (torchao.float8) in the container: add torchao to "
                             "requirements.txt, matching the container's PyTorch") from error
    config = float8_config(recipe, fsdp_float8_all_gather=fsdp_float8_all_gather)
    converted = 0
    for layer in decoder_layers(model):
        convert_to_float8_training(layer, config=config,
                                   module_filter_fn=lambda module, _name: _fp8_linear(module))
        converted += sum(isinstance(module, Float8Linear) for module in layer.modules())
    return converted


def precomputes_scales(par: ParallelConfig, sharded: bool) -> bool:
    """Whether the FP8 all-gather's scales are computed once per step for all layers (after the
    optimizer step, as torchtitan does) instead of one small all-reduce per layer per forward."""
    return par.fp8 and par.fp8_recipe == "tensorwise" and sharded


def precompute_scales(models: list[nn.Module]) -> None:
    """One all-reduce of every FP8-gathered weight's absolute maximum (after each optimizer step)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for model in models:
        precompute_float8_dynamic_scale_for_fsdp(model)
