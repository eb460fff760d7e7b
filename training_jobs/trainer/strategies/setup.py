"""What every strategy builds from: the job's settings, the model source, and the model itself."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ...contract.hyperparameters import TrainConfig
from ...contract.parallel_dims import ParallelDims
from ..lora import apply_lora, quantization_config
from ..models import ModelSource, build_model, non_embedding_parameters, parameter_count
from .protocol import ModelSummary


@dataclass(frozen=True)
class SetupContext:
    """What every strategy needs to build itself."""

    config: TrainConfig
    source: ModelSource
    device: torch.device
    dims: ParallelDims

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()


def prepare_model(ctx: SetupContext, *, materialize: bool, load_weights: bool = True) -> nn.Module:
    """The HF model with LoRA adapters when configured (identical on every rank that materializes)."""
    lora = ctx.config.lora
    model = build_model(ctx.source, materialize=materialize, seed=ctx.config.run.seed,
                        load_weights=load_weights, quantization=quantization_config(lora))
    if lora.quantization == "nf4":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model)
    torch.manual_seed(ctx.config.run.seed)  # the same adapter initialisation on every rank
    return apply_lora(model, lora)


def summarize(model: nn.Module) -> ModelSummary:
    """The counts of a model that this rank holds whole (sharded parameters count whole)."""
    return ModelSummary(model.config, sum(map(parameter_count, model.parameters())),
                        non_embedding_parameters(model))


def device_ids(device: torch.device) -> list[int] | None:
    return [device.index] if device.type == "cuda" else None
