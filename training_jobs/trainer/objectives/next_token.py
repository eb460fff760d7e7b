"""The next-token objective: pretraining on packed text, or supervised fine-tuning when the data has a
loss mask (only the completions' targets count)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..data import EvalBatches
from ..loss import causal_lm_loss, causal_lm_loss_sum, trained_targets
from ..strategies.protocol import LossFn, MicroBatch
from .protocol import ObjectiveContext


class NextTokenObjective:
    def __init__(self, ctx: ObjectiveContext) -> None:
        self.strategy = ctx.strategy
        self.loss_masked = ctx.train.samples.manifest.loss_mask

    def prepare_step(self, micro_batches: list[MicroBatch],
                     samples: list[np.ndarray]) -> tuple[list[MicroBatch], LossFn]:
        token_weight = self._trained_token_weight(micro_batches)
        if token_weight is None:
            return micro_batches, causal_lm_loss
        return micro_batches, lambda logits, targets: causal_lm_loss_sum(logits, targets) * token_weight

    def _trained_token_weight(self, micro_batches: list[MicroBatch]) -> torch.Tensor | None:
        """With a loss-masked dataset, the factor of a micro batch's summed loss that makes the step's
        gradient (divided by the accumulation steps in backward, averaged over the batch ranks: data
        and context parallel) the mean over every trained token of the global batch, however unevenly
        they fall into micro batches: accumulation steps x ranks / trained targets. None for packed
        text, where every micro batch holds the same number of targets and its mean is the right
        loss."""
        if not self.loss_masked:
            return None
        group = self.strategy.topology.batch_group()
        count = sum(trained_targets(targets) for _, targets in micro_batches)
        dist.all_reduce(count, group=group)
        return len(micro_batches) * dist.get_world_size(group) / count.clamp(min=1)

    def window_metrics(self) -> dict[str, float]:
        return {}

    def evaluate(self, batches: EvalBatches) -> dict[str, float]:
        strategy = self.strategy
        total = torch.zeros(2, device=strategy.topology.device)  # summed loss, trained targets
        listed = list(batches)
        for start in range(0, len(listed), strategy.eval_micro_batches):
            total += strategy.evaluate(listed[start:start + strategy.eval_micro_batches])
        strategy.topology.sum_loss(total)
        return {"eval_loss": float(total[0] / total[1].clamp(min=1))}
