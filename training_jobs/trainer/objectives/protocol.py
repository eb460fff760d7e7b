"""The interface of a training objective: what the loop asks of the loss it optimizes.

An objective turns one optimizer step's micro batches into the loss function the strategy calls on
each micro batch's logits, keeps its own metrics for the log line, and evaluates on the validation
channel. The objectives (next_token, dpo) are registered once in objectives/__init__.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from ...contract.hyperparameters import TrainConfig
from ..data import EvalBatches, TrainBatches
from ..parallel import Topology
from ..strategies import Strategy
from ..strategies.protocol import LossFn, MicroBatch


class Objective(Protocol):
    def prepare_step(self, micro_batches: list[MicroBatch],
                     samples: list[np.ndarray]) -> tuple[list[MicroBatch], LossFn]:
        """The micro batches to train one step on (those read, or what the objective makes of them:
        GRPO's sampled completions) and the loss function the strategy calls once per micro batch,
        in order; `samples` are the read micro batches' sample indices."""
        ...

    def window_metrics(self) -> dict[str, float]:
        """The objective's own metrics, averaged over the steps since the last call and over the
        batch ranks (a collective: every rank calls it); {} when it has none."""
        ...

    def evaluate(self, batches: EvalBatches) -> dict[str, float]:
        """eval_loss (and the objective's metrics, prefixed eval_) of the validation batches, the
        same on every rank (a collective); the model is already in evaluation mode."""
        ...


class PolicyModel(Protocol):
    """What the post-training objectives need of a strategy besides Strategy itself: forwards
    without gradients, of the policy or of another model spread like it (the strategies that
    train the whole model on every rank: trainer/strategies/whole_model.py, torch_native.py)."""

    topology: Topology
    hf_model: nn.Module

    def inference_logits(self, inputs: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
        """The logits of `inputs` under `model` (default: the policy), without gradients."""
        ...

    def sample(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
               temperature: float) -> torch.Tensor:
        """Completions sampled from the policy after left-padded prompts, full length."""
        ...

    def adapters_off(self) -> contextlib.AbstractContextManager:
        """The policy's LoRA adapters switched off inside the context (the base model)."""
        ...

    def frozen_copy(self) -> nn.Module:
        """A frozen copy of the initial model without adapters, spread over the ranks like the
        policy (sharded under fsdp)."""
        ...


@dataclass(frozen=True)
class ObjectiveContext:
    """What an objective is built from."""

    config: TrainConfig
    strategy: Strategy
    train: TrainBatches
    evaluation: EvalBatches | None
    device: torch.device
    tokenizer: object = None  # the job's tokenizer (GRPO decodes its completions for the rewards)
