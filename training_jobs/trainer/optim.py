"""AdamW with decoupled weight decay, and the learning-rate schedule.

Weight decay skips biases and norm weights (every parameter with fewer than two dimensions).
Parameters are also grouped by the device mesh they live on: with FSDP + tensor parallel some are
2-D DTensors and some 1-D, and the optimizer's fused multi-tensor kernels run per group, never
across meshes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..contract.hyperparameters import OptimConfig, TrainConfig

FUSED_DEVICES = ("cpu", "cuda")


def _mesh_key(param: torch.Tensor) -> object:
    mesh = getattr(param, "device_mesh", None)
    return None if mesh is None else (tuple(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names)


def parameter_groups(named: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    groups: dict[tuple, list[nn.Parameter]] = {}
    for _, param in named:
        if param.requires_grad:
            decays = param.ndim >= 2
            groups.setdefault((decays, _mesh_key(param)), []).append(param)
    return [{"params": params, "weight_decay": weight_decay if decays else 0.0}
            for (decays, _), params in groups.items()]


def peak_lr(config: TrainConfig, global_batch_size: int) -> float:
    """`lr`, or `lr` per 256 samples scaled to the global batch (scale_lr_by_global_batch)."""
    if config.optim.scale_lr_by_global_batch:
        return config.optim.lr * global_batch_size / 256
    return config.optim.lr


def build_optimizer(model: nn.Module, optim: OptimConfig, lr: float) -> torch.optim.Optimizer:
    """AdamW with the fused kernel (one pass over each parameter for the whole update) where the
    parameters' device has one, else the multi-tensor (foreach) implementation."""
    groups = parameter_groups(model.named_parameters(), optim.weight_decay)
    fused = all(p.device.type in FUSED_DEVICES for group in groups for p in group["params"])
    return torch.optim.AdamW(groups, lr=lr, betas=(optim.adam_beta1, optim.adam_beta2), eps=1e-8,
                             fused=fused, foreach=not fused)


def lr_multiplier(config: TrainConfig, peak: float) -> Callable[[int], float]:
    """Factor applied to the peak lr after `step` optimizer steps (LambdaLR's contract)."""
    warmup, horizon = config.optim.warmup_steps, config.decay_steps
    floor = config.optim.min_lr / peak if peak else 0.0
    schedule = config.optim.lr_schedule

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, horizon - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
        return floor + (1 - floor) * shape

    return multiplier


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig,
                    peak: float) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(config, peak))


def resume_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict) -> None:
    """Continue this job's schedule at the step a checkpoint's scheduler state reached.

    The saved state gives the step count; the rates come from this job's schedule (its peak and
    decay horizon), written into the optimizer now. Loading the state alone would keep the rate the
    old schedule left in the optimizer's saved state for the first resumed step, wrong whenever a
    run resumes with another max_steps (without lr_decay_steps) or lr."""
    peaks = list(scheduler.base_lrs)
    scheduler.load_state_dict(state)
    scheduler.base_lrs = peaks
    scheduler.last_epoch -= 1
    scheduler.step()  # the rate at the restored step, set on the optimizer's parameter groups
