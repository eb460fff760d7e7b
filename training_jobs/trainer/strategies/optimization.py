"""The optimizer side shared by the PyTorch-native strategies: AdamW and the learning-rate schedule
over one or more model parts (a pipeline rank may hold several stages), fp16 loss scaling, the
optimizer step, and the model + optimizer state as torch.distributed.checkpoint reads and writes it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch
from torch import nn

from ...contract.hyperparameters import TrainConfig
from ..optim import build_optimizer, build_scheduler, peak_lr, resume_schedule
from .protocol import UpdateGate


class Optimization:
    """One AdamW and one schedule per model part (they stay in step: the same lambda, the same
    steps), so each part's optimizer state is keyed by its own parameter names.

    `keyed_by_name` flattens the optimizer state to keys named by parameter (pipeline stages): the
    state of a stage then does not depend on which rank or position holds it."""

    def __init__(self, config: TrainConfig, parts: list[nn.Module], device: torch.device,
                 data_parallel_size: int, *, keyed_by_name: bool = False) -> None:
        data = config.data
        self.peak_lr = peak_lr(config, data_parallel_size * data.micro_batch_size * data.grad_accum_steps)
        self.optimizers = [build_optimizer(part, config.optim, self.peak_lr) for part in parts]
        self.schedulers = [build_scheduler(optimizer, config, self.peak_lr)
                           for optimizer in self.optimizers]
        self.parameters = [p for part in parts for p in part.parameters() if p.requires_grad]
        self.scaler = torch.amp.GradScaler(device.type) \
            if config.parallel.mixed_precision == "fp16" else None
        self.max_grad_norm = config.optim.max_grad_norm
        self.applied_lr: float | None = None
        self.after_update: list[Callable[[], None]] = []  # run after each optimizer update
        self.keyed_by_name = keyed_by_name or len(parts) > 1

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, clip: Callable[[float], torch.Tensor], gate: UpdateGate | None = None) -> torch.Tensor:
        """Unscale, clip (`clip(max_norm)` returns the norm before clipping), update unless `gate`
        withholds it, schedule."""
        if self.scaler:
            for optimizer in self.optimizers:
                self.scaler.unscale_(optimizer)
        norm = clip(self.max_grad_norm)
        update = gate is None or gate(norm)
        for optimizer in self.optimizers:
            if update and self.scaler:
                self.scaler.step(optimizer)
            elif update:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for callback in self.after_update:
            callback()
        if self.scaler:
            self.scaler.update()
        self.applied_lr = self.schedulers[0].get_last_lr()[0]
        for scheduler in self.schedulers:
            scheduler.step()
        return norm

    def current_lr(self) -> float:
        return self.applied_lr if self.applied_lr is not None else self.schedulers[0].get_last_lr()[0]

    def scheduler_state(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_scheduler(self, state: dict) -> None:
        for scheduler in self.schedulers:
            resume_schedule(scheduler, state)

    # --- state for torch.distributed.checkpoint ---

    def state(self, models: list[nn.Module]) -> dict:
        """Model and optimizer state of `models` (the parts, in the order of this object's
        optimizers), merged."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        flatten = self.keyed_by_name
        options = StateDictOptions(flatten_optimizer_state_dict=flatten)
        state: dict = {"model": {}, "optimizer": {}}
        for model, optimizer in zip(models, self.optimizers, strict=True):
            model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
            state["model"].update(model_state)
            if flatten:
                state["optimizer"].update(optimizer_state)
            else:
                state["optimizer"] = optimizer_state
        if self.scaler:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state(self, models: list[nn.Module], state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        options = StateDictOptions(flatten_optimizer_state_dict=self.keyed_by_name,
                                   strict=not self.keyed_by_name)
        for model, optimizer in zip(models, self.optimizers, strict=True):
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"], options=options)
        if self.scaler:
            self.scaler.load_state_dict(state["scaler"])


def write_state(state: dict, folder: Path, background_group=None) -> Future | None:
    """dcp.save, or with a process group dcp.async_save over it (returns once copied to memory)."""
    import torch.distributed.checkpoint as dcp

    if background_group is None:
        dcp.save(state, checkpoint_id=str(folder))
        return None
    return dcp.async_save(state, checkpoint_id=str(folder), process_group=background_group)


def read_state(state: dict, folder: Path) -> None:
    """Fill `state` (this rank's tensors, sharded as they are now) from `folder`; DCP reshards
    what was written by another number of ranks."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=str(folder))
