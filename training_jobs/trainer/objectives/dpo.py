"""Direct preference optimization (DPO) and its variants, as TRL's DPOTrainer computes them.

A micro batch holds B pairs as 2B rows, the chosen sequences then the rejected ones
(preference_data.py). Each row's log-probability is the sum over its completion tokens only (the
targets the mask trains). With the reference model's log-probabilities of the same rows, and the
log-ratios c = log pi(chosen) - log ref(chosen), r = log pi(rejected) - log ref(rejected), the loss
of a pair is, with beta and the label smoothing e:

- sigmoid: -(1 - e) log sigmoid(beta (c - r)) - e log sigmoid(-beta (c - r)) (DPO; e > 0 is
  conservative DPO, the DPO authors' label smoothing);
- robust: (-(1 - e) log sigmoid(beta (c - r)) + e log sigmoid(-beta (c - r))) / (1 - 2e);
- ipo: (c / |chosen| - r / |rejected| - 1 / (2 beta))^2, the log-ratios per completion token.

The step's loss is the mean over the pairs of the global batch (every micro batch holds the same
number of pairs). The metrics are TRL's: rewards/chosen and rewards/rejected (beta times the
log-ratios), rewards/margins, rewards/accuracies (the share of pairs whose chosen reward is the
higher), logps/chosen and logps/rejected (the policy's), each a mean over the pairs.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ...contract.objectives import ObjectiveConfig
from ..data import IGNORE_INDEX, EvalBatches
from ..loss import sequence_log_probs
from ..strategies.protocol import LossFn, MicroBatch
from .protocol import ObjectiveContext
from .references import build_reference

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


def completion_lengths(targets: torch.Tensor) -> torch.Tensor:
    """[rows]: how many targets of each row are trained (its completion's tokens)."""
    return (targets != IGNORE_INDEX).sum(dim=-1).float()


def pair_losses(policy: torch.Tensor, reference: torch.Tensor, lengths: torch.Tensor,
                settings: ObjectiveConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, chosen reward, rejected reward) of each pair, from the rows' summed log-probabilities
    under the policy and the reference and their completion lengths ([2B] each: chosen, rejected)."""
    chosen_ratio, rejected_ratio = (policy - reference).chunk(2)
    beta, smoothing = settings.dpo_beta, settings.dpo_label_smoothing
    margin = beta * (chosen_ratio - rejected_ratio)
    if settings.dpo_loss == "sigmoid":
        losses = -(1 - smoothing) * F.logsigmoid(margin) - smoothing * F.logsigmoid(-margin)
    elif settings.dpo_loss == "robust":
        losses = (-(1 - smoothing) * F.logsigmoid(margin) + smoothing * F.logsigmoid(-margin)) \
            / (1 - 2 * smoothing)
    else:  # ipo: per-token log-ratios, as the IPO authors normalise them
        chosen_tokens, rejected_tokens = lengths.clamp(min=1).chunk(2)
        losses = (chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens - 1 / (2 * beta)) ** 2
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def pair_metrics(policy: torch.Tensor, chosen_rewards: torch.Tensor,
                 rejected_rewards: torch.Tensor) -> torch.Tensor:
    """The METRICS of a micro batch, in order (means over its pairs)."""
    chosen_logps, rejected_logps = policy.detach().chunk(2)
    return torch.stack([chosen_rewards.mean(), rejected_rewards.mean(),
                        (chosen_rewards > rejected_rewards).float().mean(),
                        (chosen_rewards - rejected_rewards).mean(),
                        chosen_logps.mean(), rejected_logps.mean()]).float()


class DpoObjective:
    def __init__(self, ctx: ObjectiveContext) -> None:
        self.settings = ctx.config.objective
        self.strategy = ctx.strategy
        self.reference = build_reference(ctx)
        self._window: list[torch.Tensor] = []

    def prepare_step(self, micro_batches: list[MicroBatch],
                     samples: list[np.ndarray]) -> tuple[list[MicroBatch], LossFn]:
        # The reference's log-probabilities of every micro batch, before the policy's forwards.
        references = iter([self.reference.log_probs(inputs, targets, indices, "train")
                           for (inputs, targets), indices in zip(micro_batches, samples, strict=True)])

        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            policy = sequence_log_probs(logits, targets)
            losses, chosen, rejected = pair_losses(policy, next(references), completion_lengths(targets),
                                                   self.settings)
            self._window.append(pair_metrics(policy, chosen, rejected))
            return losses.mean()
        return micro_batches, loss

    def window_metrics(self) -> dict[str, float]:
        if not self._window:
            return {}
        means = torch.stack(self._window).mean(dim=0)
        self._window = []
        return dict(zip(METRICS, self.strategy.topology.mean_loss(means).tolist(), strict=True))

    def evaluate(self, batches: EvalBatches) -> dict[str, float]:
        totals = []
        for indices, (inputs, targets) in zip(batches.sample_indices(), batches, strict=True):
            policy = sequence_log_probs(self.strategy.inference_logits(inputs), targets)
            reference = self.reference.log_probs(inputs, targets, indices, "validation")
            losses, chosen, rejected = pair_losses(policy, reference, completion_lengths(targets),
                                                   self.settings)
            totals.append(torch.cat([losses.mean().float().reshape(1),
                                     pair_metrics(policy, chosen, rejected)]))
        means = self.strategy.topology.mean_loss(torch.stack(totals).mean(dim=0)).tolist()
        return {"eval_loss": means[0], **{f"eval_{name}": value
                                          for name, value in zip(METRICS, means[1:], strict=True)}}
