"""The mixture-of-experts families, registered once: how each one's router scores and picks experts,
which transformers block the program's MoeBlock replaces, and which balance loss it trains with.

transformers builds the model (attention, norms, embeddings, dense layers, DeepSeek-V3's leading
dense layers and multi-head latent attention); `install` then swaps every sparse block of a family
for a MoeBlock that takes over the block's own parameters and buffers (no copy, any device, also
meta), so weights load and save under transformers' names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from .layer import GroupedExperts, MoeBlock, RouteFn, Router

# Switch Transformer's loss over every layer's tokens (as transformers computes it), or DeepSeek-V3's
# complementary sequence-wise balance loss (trainer/moe/losses.py).
BalanceLoss = Literal["switch", "sequence"]


def softmax_top_k(logits: torch.Tensor, router: Router) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over every expert, the k largest, renormalised over those k where the family does
    (Mixtral always, which equals a softmax over the top-k logits; Qwen3-MoE per norm_topk_prob)."""
    probabilities = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, indices = torch.topk(probabilities, router.top_k, dim=-1)
    if router.settings["normalize"]:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router.settings["weight_dtype"] or logits.dtype), indices


def sigmoid_group_top_k(logits: torch.Tensor, router: Router) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: sigmoid scores; the experts are chosen by score + correction bias among the
    `topk_group` groups whose two best biased scores are largest; their unbiased scores, normalised
    over the k, times routed_scaling_factor, weigh them."""
    settings = router.settings
    groups, experts = settings["n_group"], router.num_experts
    scores = logits.sigmoid()
    biased = scores + router.e_score_correction_bias
    group_scores = biased.view(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
    best_groups = torch.topk(group_scores, k=settings["topk_group"], dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, best_groups, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
    biased = biased.masked_fill(~expert_mask.bool(), float("-inf"))
    indices = torch.topk(biased, k=router.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if settings["normalize"]:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * settings["scaling"], indices


@dataclass(frozen=True)
class MoeFamily:
    model_type: str
    block_class: str  # the name of transformers' sparse block this family's MoeBlock replaces
    route: RouteFn
    router_settings: Callable[[Any], dict[str, Any]]  # from the HF config
    logits_in_fp32: bool  # the router's matmul in fp32 whatever the compute dtype
    balance_loss: BalanceLoss
    has_shared_experts: bool = False
    has_score_bias: bool = False
    jitter_attribute: str | None = None  # the config field of Mixtral's router jitter


FAMILIES: dict[str, MoeFamily] = {family.model_type: family for family in (
    MoeFamily("qwen3_moe", "Qwen3MoeSparseMoeBlock", softmax_top_k,
              lambda c: {"normalize": c.norm_topk_prob, "weight_dtype": None},
              logits_in_fp32=False, balance_loss="switch"),
    MoeFamily("mixtral", "MixtralSparseMoeBlock", softmax_top_k,
              lambda c: {"normalize": True, "weight_dtype": torch.float},
              logits_in_fp32=False, balance_loss="switch", jitter_attribute="router_jitter_noise"),
    MoeFamily("deepseek_v3", "DeepseekV3MoE", sigmoid_group_top_k,
              lambda c: {"normalize": c.norm_topk_prob, "n_group": c.n_group, "topk_group": c.topk_group,
                         "scaling": c.routed_scaling_factor},
              logits_in_fp32=True, balance_loss="sequence", has_shared_experts=True, has_score_bias=True),
)}


def family_of(model: nn.Module) -> MoeFamily | None:
    """The MoE family of a transformers model; None for a dense one."""
    return FAMILIES.get(model.config.model_type)


def _block(family: MoeFamily, hf_block: nn.Module, config) -> MoeBlock:
    gate, experts = hf_block.gate, hf_block.experts
    router = Router(gate.weight, config.num_experts_per_tok, family.route, family.router_settings(config),
                    gate.e_score_correction_bias if family.has_score_bias else None,
                    family.logits_in_fp32)
    shared = hf_block.shared_experts if family.has_shared_experts else None
    jitter = getattr(config, family.jitter_attribute) if family.jitter_attribute else 0.0
    return MoeBlock(router, GroupedExperts(experts.gate_up_proj, experts.down_proj, experts.act_fn),
                    shared, jitter_noise=jitter or 0.0)


def install(model: nn.Module) -> list[MoeBlock]:
    """Replace the family's sparse blocks of `model` by MoeBlocks in place; returns them in layer
    order (none for a dense model)."""
    family = family_of(model)
    if family is None:
        return []
    blocks = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child).__name__ == family.block_class:
                block = _block(family, child, model.config)
                block.layer_index = _layer_index(parent_name, len(blocks))
                setattr(parent, child_name, block)
                blocks.append(block)
    return blocks


def _layer_index(decoder_layer_name: str, default: int) -> int:
    """The decoder layer's index in the model ("model.layers.3" -> 3)."""
    last = decoder_layer_name.rsplit(".", 1)[-1]
    return int(last) if last.isdigit() else default


def moe_blocks(model: nn.Module) -> list[MoeBlock]:
    """The MoeBlocks of a model (under any wrapper), in layer order."""
    return [module for module in model.modules() if isinstance(module, MoeBlock)]
