"""SMP v2 (the SageMaker model parallelism library, `torch.sagemaker`).

SMP v2 ships only inside the SMP-enabled SageMaker PyTorch containers. There, this strategy calls
`torch.sagemaker.init` with our settings translated to SMP's configuration, `transform`s the model
(SMP's tensor-parallel and optimized layers) and shards it with PyTorch FSDP as SMP prescribes; the
translation is a pure function, tested on any machine. Anywhere else the job stops at once with a
message saying where SMP is available and what to use instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from ...contract.hyperparameters import ParallelConfig, TrainConfig
from ...contract.parallel_dims import ParallelDims
from .. import parallel
from ..errors import ConfigError, ContainerError
from .setup import SetupContext, prepare_model
from .whole_model import WholeModelStrategy

# Our hyperparameter -> SMP v2 core configuration key, with the value meaning "not set" here.
NAMED_SETTINGS = {
    "shard_degree": ("hybrid_shard_degree", 0),
    "tensor_parallel_degree": ("tensor_parallel_degree", 1),
    "activation_offloading": ("sm_activation_offloading", False),
}
SMP_KEYS = {"hybrid_shard_degree": int, "sm_activation_offloading": bool,
            "activation_loading_horizon": int, "fsdp_cache_flush_warnings": bool,
            "allow_empty_shards": bool, "tensor_parallel_degree": int,
            "context_parallel_degree": int, "expert_parallel_degree": int, "random_seed": int}
FSDP_STRATEGIES = {"full": "FULL_SHARD", "hybrid": "HYBRID_SHARD", "grad_op": "_HYBRID_SHARD_ZERO2"}


@dataclass(frozen=True)
class SmpPlan:
    """What the SMP container needs: the torch.sagemaker.init config and the FSDP strategy name."""

    init_config: dict[str, Any]
    sharding_strategy: str
    activation_checkpointing: str


def _check_types(settings: dict[str, Any]) -> None:
    for key, value in settings.items():
        kind = SMP_KEYS.get(key)
        if kind is not None and (type(value) is not kind):
            raise ConfigError(f"invalid hyperparameter 'mp_parameters': {key}={value!r} must be "
                              f"{'true or false' if kind is bool else 'an integer'}")


def smp_plan(par: ParallelConfig, seed: int, world_size: int) -> SmpPlan:
    """Translate our hyperparameters (plus the SDK's mp_parameters) to SMP v2's configuration.

    A named hyperparameter left at its default defers to mp_parameters; set in both places with
    different values, it is an error rather than a silent choice.
    """
    settings = dict(par.mp_parameters)
    _check_types(settings)
    for name, (key, unset) in NAMED_SETTINGS.items():
        value = getattr(par, name)
        if value == unset:
            continue
        if key in settings and settings[key] != value:
            raise ConfigError(f"invalid hyperparameter {name!r}: {value!r} conflicts with mp_parameters "
                              f"{key}={settings[key]!r}; set it in one place")
        settings[key] = value
    settings.setdefault("random_seed", seed)
    tp = settings.get("tensor_parallel_degree", 1)
    shard = settings.get("hybrid_shard_degree", 0)
    if tp < 1 or world_size % tp:
        raise ConfigError(f"invalid hyperparameter 'tensor_parallel_degree': {tp} must divide the world "
                          f"size {world_size}")
    if shard and (world_size // tp) % shard:
        raise ConfigError(f"invalid hyperparameter 'shard_degree': hybrid_shard_degree {shard} must "
                          f"divide world size / tensor_parallel_degree = {world_size // tp}")
    return SmpPlan(settings, FSDP_STRATEGIES[par.fsdp_sharding], par.activation_checkpointing)


def import_smp():
    try:
        import torch.sagemaker as tsm
    except ImportError as error:
        raise ContainerError(
            "parallelism=smp needs the SageMaker model parallelism library v2 (the torch.sagemaker "
            "package), which ships only in the SMP-enabled SageMaker PyTorch containers "
            "(image tags with '-smp-' / the 'pytorch-smp' framework). This container has no "
            "torch.sagemaker: use an SMP image, or parallelism=fsdp for open-source FSDP2 sharding "
            "and tensor parallel.") from error
    return tsm


class SmpStrategy(WholeModelStrategy):
    """Inside an SMP container: init, transform, FSDP wrap; the training is the whole-model one."""

    def __init__(self, ctx: SetupContext) -> None:
        tsm = import_smp()
        plan = smp_plan(ctx.config.parallel, ctx.config.run.seed, ctx.world_size)
        tsm.init(plan.init_config)
        self._build_in_smp_container(tsm, plan, ctx)

    def _build_in_smp_container(self, tsm, plan: SmpPlan, ctx: SetupContext) -> None:  # pragma: no cover
        """Follows AWS's SMP v2 recipe: transform on the full model, then FSDP with SMP's groups."""
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        from ..models import decoder_layers

        config: TrainConfig = ctx.config
        model = tsm.transform(prepare_model(ctx, materialize=True, load_weights=ctx.rank == 0))
        layer_class = type(decoder_layers(model)[0])
        dtype = parallel.COMPUTE_DTYPES[config.parallel.mixed_precision]
        wrapped = FullyShardedDataParallel(
            model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                      transformer_layer_cls={layer_class}),
            sharding_strategy=ShardingStrategy[plan.sharding_strategy],
            mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32,
                                           buffer_dtype=dtype),
            device_id=torch.cuda.current_device(), sync_module_states=True, use_orig_params=True)
        parallel.apply_activation_checkpointing(wrapped, plan.activation_checkpointing,
                                                config.parallel.activation_checkpointing_every)
        tp = plan.init_config.get("tensor_parallel_degree", 1)
        dims = ParallelDims(pipeline=1, replicate=1, shard=ctx.world_size // tp, tensor=tp)
        # Ranks of one tensor-parallel group see the same data: SMP numbers them by dp_rank.
        topology = parallel.Topology(dims, None, tsm.state.dp_rank, ctx.device)
        super().__init__(config, ctx.device, topology, kind="smp", model=wrapped, hf_model=wrapped,
                         accumulation="no_sync", asynchronous=False,
                         clip=lambda max_norm: wrapped.clip_grad_norm_(max_norm if max_norm > 0
                                                                       else float("inf")))
