"""The router losses: each family's load-balancing auxiliary loss, and the router z-loss.

- switch (Qwen3-MoE, Mixtral): Switch Transformer's E x sum_i f_i P_i, with f_i the fraction of
  routed choices that picked expert i and P_i its mean softmax probability, over the tokens of every
  MoE layer together, exactly as transformers' load_balancing_loss_func computes it (so our loss is
  transformers' loss with output_router_logits=True).
- sequence (DeepSeek-V3, eq. 17-20 of its report): per sequence, sum_i f_i P_i with
  f_i = E / (k T) x the tokens that chose expert i and P_i the mean of the sigmoid scores normalised
  over all experts; averaged over the sequences and the MoE layers.
- z-loss (ST-MoE): the mean over tokens of logsumexp(router logits)^2, averaged over the layers.
"""

from __future__ import annotations

import torch

from .layer import Routing


def choice_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many routed choices of `indices` [tokens, k] picked each expert (float, no host sync)."""
    flat = indices.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.float32, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.float32))


def switch_balance_loss(routings: list[Routing], num_experts: int) -> torch.Tensor:
    """E x sum_i f_i P_i over the tokens of all layers together (transformers' formula)."""
    counts = sum(choice_counts(r.indices, num_experts) for r in routings)
    probabilities = sum(torch.softmax(r.logits.float(), dim=-1).sum(dim=0) for r in routings)
    rows = sum(r.logits.shape[0] for r in routings)
    return num_experts * torch.sum((counts / rows) * (probabilities / rows))


def sequence_balance_loss(routings: list[Routing], num_experts: int) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss, averaged over sequences and layers."""
    losses = []
    for routing in routings:
        top_k = routing.indices.shape[1]
        scores = routing.logits.float().sigmoid()
        scores = scores / scores.sum(dim=-1, keepdim=True)
        sequences = routing.batch_size
        per_sequence = scores.view(sequences, -1, num_experts)
        tokens = per_sequence.shape[1]
        chosen = torch.zeros_like(scores).scatter_(1, routing.indices, 1.0).view(sequences, tokens, -1)
        fraction = chosen.sum(dim=1) * num_experts / (top_k * tokens)
        losses.append((fraction * per_sequence.mean(dim=1)).sum(dim=-1).mean())
    return torch.stack(losses).mean()


def z_loss(routings: list[Routing]) -> torch.Tensor:
    """The mean squared log-sum-exp of the router logits, averaged over the layers."""
    return torch.stack([torch.logsumexp(r.logits.float(), dim=-1).square().mean() for r in routings]).mean()


BALANCE_LOSSES = {"switch": switch_balance_loss, "sequence": sequence_balance_loss}
