"""What a mixture-of-experts run trains with and shows besides the next-token loss.

Per micro-batch, after the forward: the router losses (the family's balance loss x
moe_aux_loss_coef, the z-loss x moe_z_loss_coef) join the micro-batch's loss, and each MoE layer's
routing is counted (detached: tokens per expert, summed router probabilities). After each optimizer
step: DeepSeek-V3's auxiliary-loss-free balancing moves each score-correction bias by
moe_bias_update_rate towards balance, from the step's counts over every data-parallel rank. At each
logging step: per layer, the load balance (the busiest expert's tokens over the mean), the busiest
expert's share of the tokens (what the router_collapse rule judges) and the Switch balance statistic
E x sum_i f_i P_i over the window's tokens; dropped tokens are always 0 (routing is dropless).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...contract.hyperparameters import MoeConfig
from .families import MoeFamily
from .layer import MoeBlock, Routing
from .losses import BALANCE_LOSSES, choice_counts, z_loss

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerBalance:
    layer: int  # the decoder layer's index
    load_balance: float  # max tokens per expert / mean tokens per expert
    max_expert_share: float  # the busiest expert's tokens / the layer's tokens
    aux_loss: float  # E x sum_i f_i P_i over the window's tokens


@dataclass(frozen=True)
class WindowBalance:
    layers: list[LayerBalance]

    @property
    def max_expert_share(self) -> float:
        return max(layer.max_expert_share for layer in self.layers)

    def metrics(self, step: int) -> dict[str, float]:
        """The `[moe]` line's values: the worst layer's, the mean aux statistic, then per layer."""
        values: dict[str, float] = {
            "step": step,
            "moe_aux_loss": sum(layer.aux_loss for layer in self.layers) / len(self.layers),
            "moe_load_balance": max(layer.load_balance for layer in self.layers),
            "moe_max_expert_share": self.max_expert_share,
            "moe_dropped_tokens": 0,
        }
        for layer in self.layers:
            values[f"moe_load_balance_layer{layer.layer}"] = layer.load_balance
            values[f"moe_aux_loss_layer{layer.layer}"] = layer.aux_loss
        return values


def _probabilities(routing: Routing, family: MoeFamily) -> torch.Tensor:
    """Each token's probability per expert: softmax, or DeepSeek's normalised sigmoid scores."""
    logits = routing.logits.detach().float()
    if family.balance_loss == "sequence":
        scores = logits.sigmoid()
        return scores / scores.sum(dim=-1, keepdim=True)
    return torch.softmax(logits, dim=-1)


class RouterSignals:
    """The router losses, counts, bias updates and balance metrics of one model's MoE layers."""

    def __init__(self, blocks: list[MoeBlock], family: MoeFamily, config: MoeConfig,
                 batch_group: Callable[[], object]) -> None:
        self.blocks, self.family, self.config = blocks, family, config
        self.batch_group = batch_group
        experts, device = blocks[0].num_experts, blocks[0].gate.weight.device
        # per layer: [tokens per expert..., router probability sums..., tokens]
        self.window = torch.zeros(len(blocks), 2 * experts + 1, device=device)
        self.step_counts = torch.zeros(len(blocks), experts, device=device)

    @property
    def num_experts(self) -> int:
        return self.blocks[0].num_experts

    @property
    def balanced_share(self) -> float:
        """Each expert's share of a layer's tokens under perfect balance: k / E."""
        return self.blocks[0].gate.top_k / self.num_experts

    def router_loss(self) -> torch.Tensor:
        """The weighted router losses of the forward just run; counts its routing."""
        routings = [block.routing for block in self.blocks]
        self._count(routings)
        loss = torch.zeros((), device=routings[0].logits.device)
        if self.config.moe_aux_loss_coef:
            balance = BALANCE_LOSSES[self.family.balance_loss](routings, self.num_experts)
            loss = loss + self.config.moe_aux_loss_coef * balance
        if self.config.moe_z_loss_coef:
            loss = loss + self.config.moe_z_loss_coef * z_loss(routings)
        return loss

    def with_router_losses(self, loss_fn: LossFn) -> LossFn:
        return lambda logits, targets: loss_fn(logits, targets) + self.router_loss()

    @torch.no_grad()
    def _count(self, routings: list[Routing]) -> None:
        experts = self.num_experts
        for index, routing in enumerate(routings):
            counts = choice_counts(routing.indices, experts)
            self.step_counts[index] += counts
            self.window[index, :experts] += counts
            self.window[index, experts:2 * experts] += _probabilities(routing, self.family).sum(dim=0)
            self.window[index, -1] += routing.indices.shape[0]

    @torch.no_grad()
    def after_update(self) -> None:
        """DeepSeek-V3's bias update from the step's tokens per expert over all data-parallel ranks:
        b_i += rate x sign(mean load - load_i)."""
        rate = self.config.moe_bias_update_rate
        if rate > 0:
            counts = self.step_counts
            dist.all_reduce(counts, group=self.batch_group())
            for block, load in zip(self.blocks, counts, strict=True):
                bias = block.gate.e_score_correction_bias
                bias += rate * torch.sign(load.mean() - load).to(bias.dtype)
        self.step_counts.zero_()

    @torch.no_grad()
    def window_balance(self) -> WindowBalance:
        """The balance of every MoE layer over the window's tokens on all data-parallel ranks; starts
        a new window. A collective."""
        totals = self.window.clone()
        dist.all_reduce(totals, group=self.batch_group())
        self.window.zero_()
        experts = self.num_experts
        layers = []
        for block, row in zip(self.blocks, totals.double().cpu(), strict=True):
            counts, probabilities, tokens = row[:experts], row[experts:2 * experts], max(row[-1].item(), 1)
            layers.append(LayerBalance(
                layer=block.layer_index,
                load_balance=float(counts.max() / counts.mean().clamp(min=1e-12)),
                max_expert_share=float(counts.max() / tokens),
                aux_loss=float(experts * torch.sum((counts / tokens) * (probabilities / tokens)))))
        return WindowBalance(layers)


def router_signals(model, config: MoeConfig, batch_group: Callable[[], object]) -> RouterSignals | None:
    """The signals of `model`'s MoE layers; None for a dense model."""
    from .families import family_of, moe_blocks

    blocks = moe_blocks(model)
    family = family_of(model) if blocks else None
    return RouterSignals(blocks, family, config, batch_group) if family is not None else None
