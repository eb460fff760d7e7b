"""The mixture-of-experts block: a top-k router, dropless token routing, and the experts as one
grouped matmul.

The block keeps the parameter names and shapes of transformers' own blocks (`gate.weight`,
`experts.gate_up_proj` [experts, 2 x intermediate, hidden], `experts.down_proj` [experts, hidden,
intermediate], `shared_experts.*`, DeepSeek-V3's `gate.e_score_correction_bias`), so checkpoints,
safetensors folders and exports are transformers' own. What differs is how the tokens reach the
experts: every token's k choices are sorted by expert, each expert multiplies its contiguous rows
(torch's grouped matmul, where it runs on the device, else one matmul per expert), and the outputs
are weighted and summed back per token. No token is ever dropped (no capacity factor).

Between the sort and the experts sits a `Dispatcher`: here the identity; expert parallelism
(trainer/expert_parallel.py) replaces it with an all-to-all that carries the rows to the rank
holding their expert and back. The block itself holds no parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

# (router logits [tokens, experts], router) -> (top-k weights [tokens, k], expert ids [tokens, k])
RouteFn = Callable[[torch.Tensor, "Router"], tuple[torch.Tensor, torch.Tensor]]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a weight that expert parallelism split into a DTensor; the weight itself
    otherwise."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Router(nn.Module):
    """The router's linear layer and (DeepSeek-V3) its score-correction bias; `route` is the family's
    scoring, top-k and weight normalisation."""

    def __init__(self, weight: nn.Parameter, top_k: int, route: RouteFn, settings: dict[str, Any],
                 score_bias: torch.Tensor | None, logits_in_fp32: bool) -> None:
        super().__init__()
        self.weight = weight
        self.top_k, self.route, self.settings = top_k, route, settings
        self.logits_in_fp32 = logits_in_fp32
        if score_bias is not None:
            self.register_buffer("e_score_correction_bias", score_bias)
        else:
            self.e_score_correction_bias = None

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [tokens, experts], top-k weights, expert ids)."""
        if self.logits_in_fp32:
            logits = F.linear(tokens.float(), self.weight.float())
        else:
            logits = F.linear(tokens, self.weight)
        weights, indices = self.route(logits, self)
        return logits, weights, indices


def grouped_mm_runs(tokens: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped matmul runs these operands on their device: it needs 16-byte aligned
    rows, and on CUDA bf16 on compute capability 8.0 or newer (the CPU kernel takes fp32 and bf16,
    but torch.compile's shape functions only bf16)."""
    if not hasattr(F, "grouped_mm"):
        return False
    if torch.compiler.is_compiling() and tokens.dtype != torch.bfloat16:
        return False
    size = tokens.element_size()
    if any(dim * size % 16 for dim in (tokens.shape[-1], weight.shape[-1], weight.shape[-2])):
        return False
    if tokens.device.type == "cuda":
        return tokens.dtype == torch.bfloat16 and torch.cuda.get_device_capability(tokens.device) >= (8, 0)
    return tokens.device.type == "cpu"


def _per_expert_mm(tokens: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The grouped matmul one expert at a time (the fallback)."""
    parts = [rows @ weight[expert] for expert, rows in enumerate(torch.split(tokens, counts))]
    return torch.cat(parts) if parts else tokens.new_zeros(0, weight.shape[-1])


def expert_matmul(tokens: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                  grouped: bool | None = None) -> torch.Tensor:
    """Rows of `tokens` sorted by expert times their expert's `weight` [experts, in, out]; `counts`
    rows per expert. `grouped` forces the grouped kernel (True) or the fallback (False)."""
    if grouped is None:
        grouped = grouped_mm_runs(tokens, weight)
    if grouped:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return F.grouped_mm(tokens, weight, offs=offsets)
    return _per_expert_mm(tokens, weight, counts.tolist())


def compute_dtype(tokens: torch.Tensor) -> torch.dtype:
    """The experts' matmuls run in autocast's dtype where autocast is on, as nn.Linear's would: the
    residual stream reaching them is fp32 under mixed precision, and the grouped kernel takes one
    dtype on both sides (the fallback's `@` is autocast's, so mixing the two paths mixed dtypes)."""
    device = tokens.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return tokens.dtype


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLU MLPs as two 3-D weights (transformers' layout)."""

    def __init__(self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter, act: Callable) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act = gate_up_proj, down_proj, act
        self.grouped: bool | None = None  # None: the grouped kernel where it runs (tests force it)

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`tokens` sorted by expert, `counts` rows for each of this rank's experts."""
        dtype = compute_dtype(tokens)
        tokens = tokens.to(dtype)
        gate_up = local_tensor(self.gate_up_proj).to(dtype).transpose(-2, -1)
        down = local_tensor(self.down_proj).to(dtype).transpose(-2, -1)
        gate, up = expert_matmul(tokens, gate_up, counts, self.grouped).chunk(2, dim=-1)
        return expert_matmul(self.act(gate) * up, down, counts, self.grouped)


class Dispatcher(Protocol):
    """Moves the expert-sorted rows to the experts that compute them and their outputs back."""

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(rows for this rank's experts sorted by expert, their counts, what `combine` needs)."""
        ...

    def combine(self, outputs: torch.Tensor, state: Any) -> torch.Tensor:
        """The experts' outputs back in the order and on the rank of the rows `dispatch` took."""
        ...


class LocalDispatch:
    """All experts are on this rank: the rows stay where they are."""

    def dispatch(self, rows, counts):
        return rows, counts, None

    def combine(self, outputs, state):
        return outputs


@dataclass
class Routing:
    """What the last forward's router decided, for the losses and the metrics (trainer/moe/signals.py)."""

    logits: torch.Tensor  # [tokens, experts], in the graph
    indices: torch.Tensor  # [tokens, k]
    batch_size: int  # sequences of the batch (DeepSeek's balance loss is per sequence)


class MoeBlock(nn.Module):
    """Router, routed experts and (DeepSeek) shared experts; transformers' parameter names."""

    def __init__(self, gate: Router, experts: GroupedExperts, shared_experts: nn.Module | None = None,
                 jitter_noise: float = 0.0) -> None:
        super().__init__()
        self.gate, self.experts = gate, experts
        if shared_experts is not None:
            self.shared_experts = shared_experts
        else:
            self.shared_experts = None
        self.jitter_noise = jitter_noise
        self.layer_index = 0  # the decoder layer holding this block (families.install sets it)
        self.dispatcher: Dispatcher = LocalDispatch()
        self.routing: Routing | None = None

    @property
    def num_experts(self) -> int:
        return self.gate.num_experts

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        if self.training and self.jitter_noise > 0:  # Mixtral's multiplicative jitter
            noise = torch.empty_like(tokens).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            tokens = tokens * noise
        logits, weights, indices = self.gate(tokens)
        self.routing = Routing(logits, indices, shape[0] if len(shape) == 3 else 1)
        routed = self._routed(tokens, weights, indices)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(hidden_states).reshape(-1, shape[-1])
        return routed.reshape(shape)

    def _routed(self, tokens: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Sum over each token's k experts of weight x expert(token), dropless."""
        choices = indices.reshape(-1)
        order = torch.argsort(choices, stable=True)
        counts = torch.bincount(choices, minlength=self.num_experts)
        source = order // indices.shape[1]  # the token of each sorted row
        rows, local_counts, state = self.dispatcher.dispatch(tokens[source], counts)
        outputs = self.dispatcher.combine(self.experts(rows, local_counts), state)
        outputs = outputs * weights.reshape(-1)[order].unsqueeze(1)
        # Each token's k rows back in token order, then summed: a gather and a reduction. (An
        # index_add_ over `source` gives the same sums but runs as a serial scatter-add on a CPU,
        # which took a seventh of the block's step in bench/profile.py's measurement.)
        unsorted = outputs[_inverse(order)].view(*indices.shape, -1)
        return unsorted.sum(dim=1).to(tokens.dtype)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes `order` (positions[order[i]] = i)."""
    positions = torch.empty_like(order)
    positions[order] = torch.arange(order.numel(), device=order.device)
    return positions
