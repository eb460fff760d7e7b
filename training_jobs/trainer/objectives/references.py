"""DPO's reference model: a frozen copy spread like the policy, the policy's base with its LoRA
adapters switched off, or log-probabilities computed before training.

`precomputed` runs a first pass over the train (and validation) pairs with the initial model (its
adapters off under LoRA), before any checkpoint is loaded, so a resumed job computes the same
values; the table of every pair's (chosen, rejected) log-probabilities stays in host memory beside
the data, and no reference model is kept while training.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from ..data import BatchLayout, Samples
from ..loss import sequence_log_probs
from ..metrics import log
from .protocol import ObjectiveContext, PolicyModel


class Reference(Protocol):
    def log_probs(self, inputs: torch.Tensor, targets: torch.Tensor, indices: np.ndarray,
                  channel: str) -> torch.Tensor:
        """[2B]: the summed completion log-probabilities of a micro batch's rows (pairs `indices`
        of `channel`), without gradients."""
        ...


class CopyReference:
    def __init__(self, policy: PolicyModel) -> None:
        self.policy, self.model = policy, policy.frozen_copy()

    def log_probs(self, inputs, targets, indices, channel) -> torch.Tensor:
        return sequence_log_probs(self.policy.inference_logits(inputs, self.model), targets)


class AdaptersOffReference:
    def __init__(self, policy: PolicyModel) -> None:
        self.policy = policy

    def log_probs(self, inputs, targets, indices, channel) -> torch.Tensor:
        with self.policy.adapters_off():
            return sequence_log_probs(self.policy.inference_logits(inputs), targets)


class PrecomputedReference:
    def __init__(self, tables: dict[str, torch.Tensor]) -> None:
        self.tables = tables  # channel -> [pairs, 2] (chosen, rejected) on the device

    def log_probs(self, inputs, targets, indices, channel) -> torch.Tensor:
        rows = self.tables[channel][torch.from_numpy(np.asarray(indices))]
        return torch.cat([rows[:, 0], rows[:, 1]])


def _initial_model(ctx: ObjectiveContext) -> Reference:
    """The initial model as a reference computed on the fly (for the first pass)."""
    policy: PolicyModel = ctx.strategy
    return AdaptersOffReference(policy) if ctx.config.lora.lora_r else _PolicyNow(policy)


class _PolicyNow:
    def __init__(self, policy: PolicyModel) -> None:
        self.policy = policy

    def log_probs(self, inputs, targets, indices, channel) -> torch.Tensor:
        return sequence_log_probs(self.policy.inference_logits(inputs), targets)


def precompute(reference: Reference, samples: Samples, layout: BatchLayout, policy: PolicyModel,
               device: torch.device) -> torch.Tensor:
    """[pairs, 2]: every pair's (chosen, rejected) log-probabilities under `reference`, each rank
    computing its share of micro batches (every rank the same number: the forwards of a sharded
    model are collectives) and all ranks gathering the table."""
    per_rank, ranks = layout.micro_batch_size, layout.data_parallel_size
    steps = math.ceil(samples.num_samples / (per_rank * ranks))
    mine = []
    for step in range(steps):
        positions = BatchLayout(ranks, layout.data_parallel_rank, per_rank, 1).positions(
            step * per_rank * ranks, 0)
        indices = positions % samples.num_samples  # the last step wraps around
        inputs, targets = samples.batch(indices, device)
        chosen, rejected = reference.log_probs(inputs, targets, indices, samples.channel).chunk(2)
        mine.append(torch.stack([chosen, rejected], dim=1).float())
    local = torch.stack(mine)  # [steps, per_rank, 2]
    gathered = [local]
    if ranks > 1:
        gathered = [torch.empty_like(local) for _ in range(ranks)]
        dist.all_gather(gathered, local, group=policy.topology.data_parallel_group())
    table = torch.empty(samples.num_samples, 2, device=device)
    for rank, values in enumerate(gathered):
        for step in range(steps):
            start = step * per_rank * ranks + rank * per_rank
            positions = torch.arange(start, start + per_rank, device=device) % samples.num_samples
            table[positions] = values[step]
    return table


def build_reference(ctx: ObjectiveContext) -> Reference:
    settings, lora = ctx.config.objective, ctx.config.lora
    policy: PolicyModel = ctx.strategy
    kind = settings.reference(lora.lora_r)
    if kind == "copy":
        return CopyReference(policy)
    if kind == "adapters_off":
        return AdaptersOffReference(policy)
    first_pass = _initial_model(ctx)
    layout = ctx.train.layout
    channels = {"train": ctx.train.samples,
                **({"validation": ctx.evaluation.samples} if ctx.evaluation else {})}
    ctx.strategy.train(False)
    tables = {channel: precompute(first_pass, samples, layout, policy, ctx.device)
              for channel, samples in channels.items()}
    ctx.strategy.train(True)
    if dist.get_rank() == 0:
        counts = ", ".join(f"{len(table)} {channel} pairs" for channel, table in tables.items())
        log(f"reference log-probabilities precomputed for {counts}")
    return PrecomputedReference(tables)
