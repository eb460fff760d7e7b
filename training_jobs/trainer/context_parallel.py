"""Context parallelism: each sequence split across `context_parallel_degree` ranks, as in the Llama 3
paper (Dubey et al. 2024, section 3.3.2): every rank holds two of the sequence's 2 x degree chunks,
gathers the keys and values of the whole sequence from the other ranks, and attends with its own
queries over them.

Load balance: rank i holds chunks i and 2 x degree - 1 - i, so every rank holds one early and one late
chunk and does the same causal attention work ((2 x degree + 1) chunk x chunk blocks); chunk-order
position ids follow the tokens into the model, so rotary embeddings see their true positions.

What it is and why it lives here: the parallel form of the attention kernel (as torch keeps its
ring attention in torch.distributed), registered with transformers' AttentionInterface under
"context_parallel" and switched on per model (its config's attention implementation). The model's
projections, rotary embeddings and output stay in the model's own code; this module gathers keys and
values (whose gradients travel back as a reduce-scatter) and calls PyTorch's SDPA once per query
chunk with a lower-right causal mask (the chunk's queries see every earlier key and the causal
triangle of their own chunk): the flash kernel on GPUs, the CPU's fused kernel here.

Memory and communication per decoder layer and rank (for the planner, docs/training.md): forward
all-gathers keys and values of the whole sequence (2 x B x S x kv_heads x head_dim elements
received per rank, in the compute dtype; with tensor parallel, of the rank's kv heads only);
backward reduce-scatters their gradients (the same bytes). Attention saves, unless activation
checkpointing recomputes it, the gathered keys and values repeated to the query heads (the SDPA
kernel's inputs) and its output for the rank's S / degree queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch import nn

ATTENTION_NAME = "context_parallel"


@dataclass(frozen=True)
class SequenceSplit:
    """Which part of every sequence one context-parallel rank holds."""

    rank: int
    degree: int

    @property
    def chunks(self) -> tuple[int, int]:
        """This rank's two chunks (of 2 x degree), in the order its tokens are laid out."""
        return self.rank, 2 * self.degree - 1 - self.rank

    def shard(self, tokens: torch.Tensor) -> torch.Tensor:
        """[batch, seq_len] -> [batch, seq_len / degree]: this rank's chunks of every sample."""
        size = tokens.shape[1] // (2 * self.degree)
        return torch.cat([tokens[:, chunk * size:(chunk + 1) * size] for chunk in self.chunks], dim=1)

    def positions(self, local_length: int, device: torch.device) -> torch.Tensor:
        """[1, local_length] position ids of this rank's tokens (for rotary embeddings)."""
        size = local_length // 2
        return torch.cat([torch.arange(chunk * size, (chunk + 1) * size, device=device)
                          for chunk in self.chunks]).unsqueeze(0)

    @cached_property
    def natural_order(self) -> list[int]:
        """For each chunk of the sequence in order, its index among the gathered chunks (rank 0's
        two, then rank 1's, ...)."""
        owner = {chunk: 2 * rank + half for rank in range(self.degree)
                 for half, chunk in enumerate(SequenceSplit(rank, self.degree).chunks)}
        return [owner[chunk] for chunk in range(2 * self.degree)]


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dimension (2) of [batch, heads, local_seq, head_dim]; backward
    sums each rank's gradient of the gathered tensor and returns this rank's part (reduce-scatter)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        gathered = torch.empty((world * local.shape[0], *local.shape[1:]), dtype=local.dtype,
                               device=local.device)
        dist.all_gather_into_tensor(gathered, local.contiguous(), group=group)
        # [world x batch, heads, local_seq, dim] -> [batch, heads, world x local_seq, dim]
        return gathered.unflatten(0, (world, -1)).permute(1, 2, 0, 3, 4).flatten(2, 3)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        batch, heads, length, dim = grad.shape
        parts = grad.reshape(batch, heads, world, length // world, dim).permute(2, 0, 1, 3, 4)
        local = torch.empty((batch, heads, length // world, dim), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(local, parts.flatten(0, 1).contiguous(), group=ctx.group)
        return local, None


class ContextParallelAttention:
    """transformers' attention interface for one context-parallel group: this rank's queries over the
    whole sequence's keys and values (a callable registered under ATTENTION_NAME)."""

    def __init__(self, split: SequenceSplit, group, seq_len: int) -> None:
        from torch.nn.attention.bias import causal_lower_right

        self.split, self.group = split, group
        self.chunk = seq_len // (2 * split.degree)
        # Made once, here: a CausalBias is a tensor subclass, which cannot be created under the
        # dispatch mode of selective activation checkpointing.
        self.masks = [causal_lower_right(self.chunk, (chunk + 1) * self.chunk) for chunk in split.chunks]

    def _whole_sequence(self, local: torch.Tensor) -> torch.Tensor:
        """[batch, heads, S / degree, dim] of this rank -> [batch, heads, S, dim] in sequence order."""
        gathered = _GatherSequence.apply(local, self.group)
        batch, heads, _, dim = gathered.shape
        chunks = gathered.reshape(batch, heads, 2 * self.split.degree, self.chunk, dim)
        order = torch.tensor(self.split.natural_order, device=local.device)
        return chunks.index_select(2, order).reshape(batch, heads, -1, dim)

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 **_: object) -> tuple[torch.Tensor, None]:
        if attention_mask is not None:
            raise ValueError("context parallel attention takes no attention mask (the training "
                             "program packs sequences without padding)")
        if query.shape[2] != 2 * self.chunk:
            raise ValueError(f"context parallel attention expects {2 * self.chunk} queries per rank "
                             f"(seq_len / context_parallel_degree) and got {query.shape[2]}")
        repeats = query.shape[1] // key.shape[1]  # grouped-query attention: kv heads serve groups
        keys = self._whole_sequence(key).repeat_interleave(repeats, dim=1)
        values = self._whole_sequence(value).repeat_interleave(repeats, dim=1)
        outputs = []
        for index, (chunk, mask) in enumerate(zip(self.split.chunks, self.masks, strict=True)):
            visible = (chunk + 1) * self.chunk  # the chunk's queries see keys 0 .. its own end
            queries = query[:, :, index * self.chunk:(index + 1) * self.chunk]
            outputs.append(nn.functional.scaled_dot_product_attention(
                queries, keys[:, :, :visible], values[:, :, :visible], attn_mask=mask,
                dropout_p=dropout, scale=scaling))
        return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def apply_context_parallel(model: nn.Module, split: SequenceSplit, group, seq_len: int) -> None:
    """Make every attention layer of `model` (its transformers config) use context parallel
    attention for this rank's part of the sequence."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ContextParallelAttention(split, group, seq_len))
    model.config._attn_implementation = ATTENTION_NAME
