"""A training strategy owns the wrapped model, its optimizer and schedule, and its checkpoints.

The loop only talks to this interface, so DDP, FSDP2 (+ tensor parallel), DeepSpeed and SMP v2 are
interchangeable: `micro_step` (gradient sync and autocast), `backward`, `step` (clip, update,
schedule; returns the gradient norm as a device tensor), `save_checkpoint` / `load_checkpoint`,
and `full_state_dict` for the export.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import parallel
from .config import TrainConfig, resolve_mesh
from .lora import apply_lora, check_quantization, quantization_config
from .models import ModelSource, build_model
from .optim import build_optimizer, build_scheduler, peak_lr

ASYNC_CHECKPOINT_KINDS = ("single", "ddp", "fsdp")


@dataclass(frozen=True)
class SetupContext:
    """What every strategy needs to build itself."""

    config: TrainConfig
    source: ModelSource
    device: torch.device
    num_hosts: int

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


class TorchStrategy:
    """single, ddp, fsdp (FSDP2, optionally with tensor parallel): PyTorch-native training."""

    def __init__(self, ctx: SetupContext) -> None:
        config, par = ctx.config, ctx.config.parallel
        self.config, self.device = config, ctx.device
        self.kind = par.parallelism
        shape = resolve_mesh(par, ctx.world_size, ctx.num_hosts)
        self.topology = parallel.build_topology(shape, ctx.device, needs_mesh=self.kind == "fsdp")
        hf_model = self._build_fsdp(ctx) if self.kind == "fsdp" else self._build_replicated(ctx)
        model = hf_model
        if self.kind == "ddp" and ctx.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(hf_model, device_ids=_device_ids(ctx.device))
        self._finish(model, hf_model)

    @classmethod
    def adopt(cls, ctx: SetupContext, model: nn.Module, hf_model: nn.Module, kind: str,
              topology: parallel.Topology) -> TorchStrategy:
        """A strategy around a model another library already wrapped (SMP v2)."""
        strategy = cls.__new__(cls)
        strategy.config, strategy.device, strategy.kind = ctx.config, ctx.device, kind
        strategy.topology = topology
        strategy._finish(model, hf_model)
        return strategy

    def _finish(self, model: nn.Module, hf_model: nn.Module) -> None:
        config, shape = self.config, self.topology.shape
        self.model, self.hf_model = model, hf_model
        global_batch = shape.data_parallel * config.data.micro_batch_size * config.data.grad_accum_steps
        self.peak_lr = peak_lr(config, global_batch)
        self.optimizer = build_optimizer(hf_model, config.optim, self.peak_lr)
        self.scheduler = build_scheduler(self.optimizer, config, self.peak_lr)
        self.parameters = [p for p in hf_model.parameters() if p.requires_grad]
        precision = config.parallel.mixed_precision
        self.scaler = torch.amp.GradScaler(self.device.type) if precision == "fp16" else None

    # --- construction ---

    def _transform(self, model: nn.Module, with_fsdp: bool) -> None:
        par, mesh = self.config.parallel, self.topology.mesh
        if self.topology.shape.tensor > 1:
            parallel.apply_tensor_parallel(model, mesh["tp"])
        parallel.apply_activation_checkpointing(model, par.activation_checkpointing,
                                                par.activation_checkpointing_every)
        if par.compile:
            parallel.apply_compile(model, parallel.compile_mode(self.config, self.device))
        if with_fsdp:
            dp_mesh = mesh["replicate", "shard"] if par.fsdp_sharding == "hybrid" else mesh["shard"]
            parallel.apply_fsdp(model, dp_mesh, par, offload=par.offload_params or par.offload_optimizer)

    def _uses_fsdp(self, world_size: int) -> bool:
        par = self.config.parallel
        return self.topology.data_parallel_size > 1 or par.offload_params or world_size == 1

    def _build_fsdp(self, ctx: SetupContext) -> nn.Module:
        with_fsdp = self._uses_fsdp(ctx.world_size)
        if ctx.world_size == 1:
            model = prepare_model(ctx, materialize=True).to(ctx.device)
            self._transform(model, with_fsdp)
            return model
        # Rank 0 alone reads or initialises the weights; the others allocate only their shards.
        initial = parallel.snapshot(prepare_model(ctx, materialize=True)) if ctx.rank == 0 else None
        model = prepare_model(ctx, materialize=False)
        self._transform(model, with_fsdp)
        parallel.load_from_rank0(model, ctx.device, initial)
        return model

    def _build_replicated(self, ctx: SetupContext) -> nn.Module:
        model = prepare_model(ctx, materialize=True, load_weights=ctx.rank == 0).to(ctx.device)
        if ctx.world_size > 1:
            parallel.broadcast_module(model)
        self._transform(model, with_fsdp=False)
        return model

    # --- training ---

    @contextlib.contextmanager
    def micro_step(self, last: bool):
        """Gradient synchronisation for a micro step, and autocast where FSDP does not cast."""
        fsdp = hasattr(self.model, "set_requires_gradient_sync")
        sync = contextlib.nullcontext()
        if fsdp:
            self._fsdp_accumulation(last)
        elif hasattr(self.model, "no_sync") and not last:
            sync = self.model.no_sync()  # DDP: accumulate locally, all-reduce once
        cast = contextlib.nullcontext() if fsdp else \
            parallel.autocast_context(self.device, self.config.parallel.mixed_precision)
        with sync, cast, self._activation_offload():
            yield

    def _fsdp_accumulation(self, last: bool) -> None:
        """full: reduce-scatter every micro step, so gradients stay sharded (the point of full
        sharding); hybrid: also, but all-reduce across replicas (between nodes) only on the last;
        grad_op: keep unsharded gradients until the last micro step (more memory, less traffic)."""
        sharding = self.config.parallel.fsdp_sharding
        if sharding == "grad_op":
            self.model.set_requires_gradient_sync(last)
        elif sharding == "hybrid":
            self.model.set_requires_all_reduce(last)

    def _activation_offload(self):
        if not self.config.parallel.activation_offloading:
            return contextlib.nullcontext()
        return torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")

    def backward(self, loss: torch.Tensor, grad_accum_steps: int, last: bool) -> None:
        loss = loss / grad_accum_steps
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self) -> torch.Tensor:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = self._clip_grad_norm(self.config.optim.max_grad_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.applied_lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return norm

    def _clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        if hasattr(self.model, "clip_grad_norm_"):  # FSDP1 (SMP v2) knows its flat shards
            return self.model.clip_grad_norm_(max_norm if max_norm > 0 else float("inf"))
        return parallel.clip_grad_norm(self.parameters, max_norm)

    def current_lr(self) -> float:
        """The learning rate of the last optimizer step."""
        return getattr(self, "applied_lr", self.scheduler.get_last_lr()[0])

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    # --- state ---

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        if self.scaler:
            state["scaler"] = self.scaler.state_dict()
        return state

    @property
    def saves_asynchronously(self) -> bool:
        """DCP can write this strategy's state in the background (SMP v2's FSDP1 state: untested)."""
        return self.kind in ASYNC_CHECKPOINT_KINDS

    def save_checkpoint(self, folder: Path, background_group=None) -> Future | None:
        """Writes the state into `folder`; with a process group, in a background thread that uses
        that group (never the training's), returning once the state is copied to host memory."""
        import torch.distributed.checkpoint as dcp

        if background_group is None:
            dcp.save(self._state(), checkpoint_id=str(folder))
            return None
        return dcp.async_save(self._state(), checkpoint_id=str(folder), process_group=background_group)

    def load_checkpoint(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        if self.scaler:
            self.scaler.load_state_dict(state["scaler"])

    def load_scheduler(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)

    def full_state_dict(self) -> dict:
        """Every weight, unsharded, on rank 0 (CPU); empty elsewhere. A collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                         cpu_offload=True))

    def close(self) -> None:
        pass


def _device_ids(device: torch.device) -> list[int] | None:
    return [device.index] if device.type == "cuda" else None


def build_strategy(ctx: SetupContext):
    kind = ctx.config.parallel.parallelism
    check_quantization(ctx.config.lora, kind, has_checkpoint=ctx.source.pretrained_dir is not None)
    if kind == "deepspeed":
        from .deepspeed_strategy import DeepSpeedStrategy

        return DeepSpeedStrategy(ctx)
    if kind == "smp":
        from .smp import SmpStrategy

        return SmpStrategy(ctx)
    return TorchStrategy(ctx)
