"""GRPO's math, as TRL's GRPOTrainer computes it: group-relative advantages, the clipped surrogate
objective per completion token, the k3 KL estimator, and the two ways of averaging.

For a prompt's group of G completions with rewards r, a completion's advantage is
(r - mean(group)) / (std(group) + 1e-4) (Bessel-corrected std, TRL's scale_rewards="group"). With the
probability ratio p = exp(logp - logp_old) of each completion token,

    loss_token = -min(p A, clip(p, 1 - eps, 1 + eps) A) + beta p (exp(ref - logp) - (ref - logp) - 1)

averaged per completion then over completions (grpo), or over every completion token of the step
(dapo). The KL term (k3) is weighted by p for the unbiased reverse-KL gradient (TRL's default
use_bias_correction_kl). The program samples and trains once per batch, so logp_old is logp itself
(p = 1, with its gradient); the clipping matters where logp_old comes from an earlier update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EPSILON_STD = 1e-4


def group_advantages(rewards: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, each group's reward std repeated per completion) of rewards [groups x G] laid
    out group by group."""
    grouped = rewards.view(-1, group_size)
    std = grouped.std(dim=1).repeat_interleave(group_size)
    return (rewards - grouped.mean(dim=1).repeat_interleave(group_size)) / (std + EPSILON_STD), std


@dataclass(frozen=True)
class TokenLoss:
    """Per-token terms of one micro batch: the loss [rows, T], the KL [rows, T] (zeros without a
    penalty) and whether each token's ratio was clipped [rows, T]."""

    loss: torch.Tensor
    kl: torch.Tensor
    clipped: torch.Tensor


def token_loss(logps: torch.Tensor, old_logps: torch.Tensor, reference_logps: torch.Tensor | None,
               advantages: torch.Tensor, epsilon: float, beta: float) -> TokenLoss:
    """The clipped surrogate (and KL penalty) of each completion token; `advantages` [rows]."""
    ratio = torch.exp(logps - old_logps)
    advantage = advantages.unsqueeze(1)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
    loss = -torch.min(ratio * advantage, clipped_ratio * advantage)
    kl = torch.zeros_like(logps)
    if beta:
        log_ratio = reference_logps - logps
        # Times the probability ratio (1 on-policy, but differentiable): the unbiased reverse-KL
        # gradient, TRL's default (use_bias_correction_kl).
        kl = (torch.exp(log_ratio) - log_ratio - 1) * ratio
        loss = loss + beta * kl
    clipped = ((ratio < 1 - epsilon) & (advantage < 0)) | ((ratio > 1 + epsilon) & (advantage > 0))
    return TokenLoss(loss, kl.detach(), clipped)


def averaged(loss: torch.Tensor, mask: torch.Tensor, kind: str, tokens_per_rank: torch.Tensor | None = None
             ) -> torch.Tensor:
    """The micro batch's loss: grpo, each completion's mean, then their mean; dapo, the sum over its
    tokens divided by `tokens_per_rank` (the step's completion tokens on all ranks / ranks, so that
    the step's gradient is the mean over all of them)."""
    mask = mask.to(loss.dtype)
    if kind == "grpo":
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return (loss * mask).sum() / tokens_per_rank.clamp(min=1.0)
