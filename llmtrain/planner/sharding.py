"""Which parameters train, and how big each rank's piece of each one is.

The model's parameter tensors with the trainable ones marked (LoRA adds its adapters, the base
freezes), and the elements of a tensor on one tensor-parallel rank and in one FSDP2 shard: what the
memory model (llmtrain.planner.memory) and the speed model (llmtrain.planner.speed) size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmtrain.planner.shapes import ALL_LINEAR, ModelShape, ParameterTensor
from llmtrain.planner.workload import Workload


def lora_targets(model: ModelShape, targets: tuple[str, ...]) -> list[ParameterTensor]:
    """The decoder blocks' linear weights that get LoRA adapters."""
    linears = [p for p in model.parameters() if p.kind == "linear" and p.layer is not None]
    if ALL_LINEAR in targets:
        return linears
    return [p for p in linears if p.module in targets]


@dataclass(frozen=True)
class Tensors:
    """The model's parameter tensors with the trainable ones marked (LoRA adds its adapters)."""

    frozen: tuple[ParameterTensor, ...]
    trainable: tuple[ParameterTensor, ...]

    @property
    def all(self) -> tuple[ParameterTensor, ...]:
        return self.frozen + self.trainable


def parameter_tensors(work: Workload) -> Tensors:
    base = _expert_slices(work.model.parameters(), work.expert_parallel)
    if not work.behaviour.loss_parallel:
        # older code kept the embedding and the output head whole on every tensor-parallel rank
        base = tuple(replace(p, tp=None) if p.layer is None else p for p in base)
    if not work.lora:
        return Tensors((), base)
    adapters = []
    for weight in lora_targets(work.model, work.lora_targets):
        out_dim, in_dim = _linear_dims(work.model, weight)
        prefix = weight.name.removesuffix(".weight")
        # peft splits the adapters like their base under tensor parallel: not supported (the
        # program refuses LoRA with TP), so they carry no tp tag.
        adapters += [
            ParameterTensor(f"{prefix}.lora_A.weight", (work.lora_r, in_dim), "linear", weight.layer),
            ParameterTensor(f"{prefix}.lora_B.weight", (out_dim, work.lora_r), "linear", weight.layer),
        ]
    return Tensors(base, tuple(adapters))


def _expert_slices(params: tuple[ParameterTensor, ...], degree: int) -> tuple[ParameterTensor, ...]:
    """One rank's experts under expert parallelism: dim 0 of each stacked expert tensor split in
    `degree` (the program's expert degree divides the experts). The rest of the data-sharding ranks
    (shard / degree, those with the same experts) shard that slice, or hold copies of it
    (`state_numel`)."""
    if degree <= 1:
        return params
    return tuple(
        replace(p, shape=(p.shape[0] // degree, *p.shape[1:]), experts=p.experts // degree,
                active=p.active) if p.experts else p
        for p in params
    )


def state_numel(param: ParameterTensor, work: Workload, tensor: int, shard: int, *, padded: bool) -> int:
    """Elements of `param`'s weight (and gradient, and each moment) on one rank under FSDP2 over
    `shard` ranks (`shard_numel`). An expert slice under expert parallelism is FSDP-sharded over the
    shard / degree ranks holding the same experts (its copies): exactly 1 / copies of it, split on
    the expert dimension, or on the next where the copies do not divide the slice's experts
    (trainer/expert_parallel.py). Older code (`Behaviour.expert_copies_sharded` false) kept the
    slice whole on each copy."""
    degree = work.expert_parallel
    if not (param.experts and degree > 1):
        return shard_numel(param, tensor, shard, padded=padded)
    copies = max(shard // degree, 1) if work.behaviour.expert_copies_sharded else 1
    return param.numel // copies


def _linear_dims(model: ModelShape, weight: ParameterTensor) -> tuple[int, int]:
    """(out, in) of a linear: Llama stores (out, in), GPT-2's Conv1D (in, out)."""
    rows, cols = weight.shape
    return (cols, rows) if model.family == "gpt2" else (rows, cols)


def tp_local_numel(param: ParameterTensor, tensor: int) -> int:
    """Elements on one tensor-parallel rank (colwise splits rows, rowwise columns)."""
    if tensor <= 1 or param.tp is None:
        return param.numel
    return param.numel // tensor


def shard_numel(param: ParameterTensor, tensor: int, shard: int, *, padded: bool) -> int:
    """Elements of one FSDP2 shard: dim 0 split in `shard` chunks, padded to equal chunks."""
    local = tp_local_numel(param, tensor)
    rows = param.shape[0] // tensor if param.tp == "colwise" and tensor > 1 else param.shape[0]
    rest = local // rows
    if padded:
        return -(-rows // shard) * rest
    return local // shard if rows % shard == 0 else -(-rows // shard) * rest
