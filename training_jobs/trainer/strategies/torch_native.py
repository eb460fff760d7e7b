"""single, ddp and fsdp (FSDP2, optionally with tensor parallel): PyTorch-native training of the
whole model on every rank's data-parallel slice."""

from __future__ import annotations

import dataclasses

from torch import nn

from ...contract.hyperparameters import LoraConfig
from .. import parallel
from ..float8 import precompute_scales, precomputes_scales
from .setup import SetupContext, device_ids, prepare_model
from .whole_model import WholeModelStrategy


class TorchStrategy(WholeModelStrategy):
    """single, ddp and fsdp (with tensor parallel) on the whole model; DCP checkpoints."""

    def __init__(self, ctx: SetupContext) -> None:
        kind = ctx.config.parallel.parallelism
        topology = parallel.build_topology(ctx.dims, ctx.device, needs_mesh=kind == "fsdp")
        par = ctx.config.parallel
        # FSDP2 with one data-parallel rank (tensor parallel only) has nothing to shard, except
        # to offload, or to train one process the same way as many.
        sharded = kind == "fsdp" and (ctx.dims.data_parallel * ctx.dims.context > 1 or par.offload_params
                                      or ctx.world_size == 1)
        hf_model = _build_sharded(ctx, topology, sharded) if kind == "fsdp" else \
            _build_replicated(ctx, topology)
        model, accumulation = hf_model, "fsdp2" if sharded else "local"
        if kind == "ddp" and ctx.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            model, accumulation = DistributedDataParallel(hf_model, device_ids=device_ids(ctx.device)), \
                "no_sync"
        super().__init__(ctx.config, ctx.device, topology, kind=kind, model=model, hf_model=hf_model,
                         accumulation=accumulation, asynchronous=True)
        if precomputes_scales(par, sharded):
            self.optimization.after_update.append(lambda: precompute_scales([hf_model]))
        self._setup, self._sharded = ctx, sharded

    def frozen_copy(self) -> nn.Module:
        """The initial model again, without LoRA adapters and never trained (DPO's reference copy),
        built and spread like the policy: sharded with the same mesh under fsdp, replicated else.
        Its activations are not kept (no backward), so it needs no activation checkpointing."""
        config = self._setup.config
        quiet = dataclasses.replace(config.parallel, activation_checkpointing="none",
                                    activation_offloading=False)
        ctx = dataclasses.replace(self._setup, config=dataclasses.replace(config, lora=LoraConfig(),
                                                                          parallel=quiet))
        model = _build_sharded(ctx, self.topology, self._sharded) if self.kind == "fsdp" else \
            _build_replicated(ctx, self.topology)
        return model.requires_grad_(False).eval()


def _build_sharded(ctx: SetupContext, topology: parallel.Topology, sharded: bool) -> nn.Module:
    if ctx.world_size == 1:
        model = prepare_model(ctx, materialize=True).to(ctx.device)
        parallel.transform(model, ctx.config, topology, ctx.device, with_fsdp=sharded)
        return model
    # Rank 0 alone reads or initialises the weights; the others allocate only their shards.
    initial = parallel.snapshot(prepare_model(ctx, materialize=True)) if ctx.rank == 0 else None
    model = prepare_model(ctx, materialize=False)
    parallel.transform(model, ctx.config, topology, ctx.device, with_fsdp=sharded)
    parallel.load_from_rank0(model, ctx.device, initial)
    return model


def _build_replicated(ctx: SetupContext, topology: parallel.Topology) -> nn.Module:
    model = prepare_model(ctx, materialize=True, load_weights=ctx.rank == 0).to(ctx.device)
    if ctx.world_size > 1:
        parallel.broadcast_module(model)
    parallel.transform(model, ctx.config, topology, ctx.device, with_fsdp=False)
    return model
