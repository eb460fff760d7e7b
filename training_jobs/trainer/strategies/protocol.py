"""The interface every training strategy implements: what the loop, checkpoints, export and job call.

A strategy owns the wrapped model, its optimizer and learning-rate schedule, and its checkpoint
files. The loop never looks inside: it hands a strategy one optimizer step's micro-batches and a
loss function, asks it to step, to evaluate, and to save or load. The modules of this folder are
siblings (torch_native, pipeline, deepspeed_zero, smp); they share setup.py and optimization.py and
never import each other.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ..parallel import Topology

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets) of one micro-batch
# One micro-batch's loss from its logits and targets: the mean over its trained targets, or with a
# loss-masked dataset their sum weighted so that the step's loss is the global per-token mean.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Called with the step's global gradient norm (before clipping) before the update is applied; False
# withholds the update (trainer/rules.py's skip: the gradients are dropped, the schedule advances).
UpdateGate = Callable[[torch.Tensor], bool]


@dataclass(frozen=True)
class ModelSummary:
    """The whole model as the metrics see it, also where each rank holds only a part of it."""

    config: Any  # transformers.PretrainedConfig
    parameters: int
    non_embedding_parameters: int


class Strategy(Protocol):
    kind: str  # the `parallelism` it implements (of each stage, with pipeline stages)
    topology: Topology
    hf_model: nn.Module  # the transformers model this rank trains (on a pipeline rank: a stage)
    saves_asynchronously: bool  # save_checkpoint may take a background process group
    eval_micro_batches: int  # validation batches `evaluate` takes at once

    def model_summary(self) -> ModelSummary:
        """Parameter counts of the whole model (a collective where ranks hold parts)."""
        ...

    def forward_backward(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> torch.Tensor:
        """Forward and backward of one optimizer step's micro-batches (their gradients averaged:
        each loss divided by the number of micro-batches). Returns this rank's mean loss of them as
        a device tensor: averaged over the data-parallel replicas (topology.mean_loss), the step's
        loss. Pipeline ranks without the last stage return 0."""
        ...

    def evaluate(self, batches: list[MicroBatch]) -> torch.Tensor:
        """[summed loss, trained targets] of `eval_micro_batches` validation batches (zeros on
        pipeline ranks without the last stage); summed over the replicas, the eval loss."""
        ...

    def step(self, gate: UpdateGate | None = None) -> torch.Tensor:
        """Clip, update (unless `gate` says no), advance the schedule; the global gradient norm
        before clipping. DeepSpeed updates inside forward_backward and takes no gate (the
        configuration refuses a rule action that would need one)."""
        ...

    def current_lr(self) -> float:
        """The learning rate of the last optimizer step."""
        ...

    def train(self, mode: bool = True) -> None: ...

    def scheduler_state(self) -> dict: ...

    def load_scheduler(self, state: dict) -> None: ...

    def save_checkpoint(self, folder: Path, background_group=None) -> Future | None:
        """Write this rank's state into `folder`; with `background_group` (only where
        saves_asynchronously), in a thread that uses that group, returning its future once the
        state is copied to host memory. A collective."""
        ...

    def load_checkpoint(self, folder: Path) -> None:
        """Restore model and optimizer state (resharded where the data-parallel size changed)."""
        ...

    def full_state_dict(self) -> dict:
        """Every weight of the whole model under its transformers name, unsharded, on rank 0 (CPU);
        empty elsewhere. A collective."""
        ...

    def close(self) -> None: ...
