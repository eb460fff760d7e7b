"""The next-token loss: cross-entropy over whole or vocabulary-sharded logits, without an fp32 copy
of them.

PyTorch's cross_entropy on bf16 logits needs them in fp32 (`logits.float()`) and saves its fp32
log-softmax for backward: 4 bytes per logit held from the loss to its backward, on top of the
logits. Here the loss is computed a chunk of tokens at a time in fp32 and saves the logits as they
are (in the compute dtype) plus one fp32 log-sum-exp per token; backward recomputes the softmax a
chunk at a time. At no moment does more than one chunk exist in fp32.

Loss parallel: under tensor parallelism the output head is sharded on the vocabulary (its logits
arrive as a DTensor sharded on the last dimension) and no rank ever holds the whole vocabulary's
logits: each computes its shard's maximum, sum of exponentials and target logit, and three values
per token are all-reduced over the tensor-parallel group (a max, then a sum of two); backward needs
no communication (each shard's gradient is its own softmax minus the one-hot target).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .data import IGNORE_INDEX

# Elements of one fp32 chunk (64 MiB): a few hundred tokens of a 128K vocabulary at a time.
CHUNK_ELEMENTS = 1 << 24


def _chunk_rows(columns: int) -> int:
    """Tokens per fp32 chunk."""
    return max(1, CHUNK_ELEMENTS // max(columns, 1))


class _ShardedCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy [tokens] (0 at ignored targets) of `logits` [tokens, vocab shard] whose
    columns are vocabulary ids `first` .. first + shard - 1, over `group` (None: the whole vocabulary
    is here)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, first: int, group) -> torch.Tensor:
        rows, columns = logits.shape
        local = targets - first
        here = (local >= 0) & (local < columns)
        picked = logits.gather(1, local.clamp(0, columns - 1).unsqueeze(1)).squeeze(1).float() * here
        maxima = logits.amax(dim=1).float()  # exact in any dtype: no fp32 copy needed
        if group is not None:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        sums = torch.empty_like(maxima)
        step = _chunk_rows(columns)
        for start in range(0, rows, step):
            block = logits[start:start + step].float()
            sums[start:start + step] = (block - maxima[start:start + step, None]).exp().sum(dim=1)
        if group is not None:
            reduced = torch.stack([sums, picked])
            dist.all_reduce(reduced, group=group)
            sums, picked = reduced[0], reduced[1]
        log_normalizer = maxima + sums.log()
        trained = targets != IGNORE_INDEX
        ctx.save_for_backward(logits, local, log_normalizer, trained)
        return (log_normalizer - picked) * trained

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        logits, local, log_normalizer, trained = ctx.saved_tensors
        rows, columns = logits.shape
        grad = torch.empty_like(logits)
        scale = grad_output.float().expand(rows) * trained  # ignored targets get no gradient
        step = _chunk_rows(columns)
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            probabilities = (logits[start:stop].float() - log_normalizer[start:stop, None]).exp()
            targets = local[start:stop]
            own = (targets >= 0) & (targets < columns)
            rows_here = torch.arange(stop - start, device=logits.device)[own]
            probabilities[rows_here, targets[own]] -= 1.0
            grad[start:stop] = probabilities * scale[start:stop, None]
        return grad, None, None, None


def _vocabulary_shard(logits: torch.Tensor) -> tuple[torch.Tensor, int, object]:
    """(local logits, first vocabulary id held, process group or None) of whole or sharded logits."""
    from torch.distributed.tensor import DTensor

    if not isinstance(logits, DTensor):
        return logits, 0, None
    placements = logits.placements
    if len(placements) != 1 or not placements[0].is_shard(logits.ndim - 1):
        raise ValueError(f"the loss takes logits sharded on the vocabulary only, got {placements}")
    mesh = logits.device_mesh
    local = logits.to_local()
    return local, mesh.get_local_rank() * local.shape[-1], mesh.get_group()


def causal_lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the trained targets (for means over several batches);
    `logits` may be sharded on the vocabulary (loss parallel)."""
    return token_cross_entropy(logits, targets).sum()


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of every target, shaped like `targets` (0 where a target is
    IGNORE_INDEX); `logits` may be sharded on the vocabulary (loss parallel)."""
    local, first, group = _vocabulary_shard(logits)
    return _ShardedCrossEntropy.apply(local.reshape(-1, local.shape[-1]), targets.reshape(-1), first,
                                      group).view(targets.shape)


def sequence_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[rows]: each row's summed log-probability of its trained targets (a completion's log-likelihood
    under the model, as DPO and GRPO take it)."""
    return -token_cross_entropy(logits, targets).sum(dim=-1)


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the trained targets: every position of packed text;
    with a loss-masked dataset, only those not set to IGNORE_INDEX (-100, cross-entropy's
    default). A micro batch without any trained target gives 0, not 0/0."""
    return causal_lm_loss_sum(logits, targets) / trained_targets(targets).clamp(min=1)


def trained_targets(targets: torch.Tensor) -> torch.Tensor:
    """How many targets the loss counts (a float device scalar)."""
    return (targets != IGNORE_INDEX).sum().float()

