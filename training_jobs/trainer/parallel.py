"""How the model is spread over processes: DDP, FSDP2, tensor parallel, and their helpers.

No model math lives here. The functions apply PyTorch's own building blocks (DistributedDataParallel,
fully_shard on a DeviceMesh, parallelize_module with the model's tensor-parallel plan, activation
checkpoint wrappers, torch.compile) in the order torchtitan uses: tensor parallel (its plan names the
unwrapped modules), activation checkpointing, compile, FSDP. DeepSpeed and SMP v2 live in their own
modules.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from .config import MeshShape, ParallelConfig, TrainConfig, cuda_graphs_apply
from .cpu_collectives import prefetch_forward, use_fast_cpu_collectives
from .errors import ConfigError
from .models import decoder_layers

MESH_DIMS = ("replicate", "shard", "tp")
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# --- processes ----------------------------------------------------------------------------------

def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: torch.device, rank: int, world_size: int, timeout_minutes: float) -> None:
    """One process group per job (also for a single process, so every code path is the same)."""
    if dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ:  # plain `python train.py`: a group of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                            timeout=timedelta(minutes=timeout_minutes))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Topology:
    """Where this process sits: data-parallel coordinates and the device mesh."""

    shape: MeshShape
    mesh: object | None  # DeviceMesh with MESH_DIMS, None for DDP/single/DeepSpeed
    data_parallel_rank: int
    device: torch.device

    @property
    def data_parallel_size(self) -> int:
        return self.shape.data_parallel

    def data_parallel_group(self):
        """Process group of the data-parallel ranks that hold this rank's tensor-parallel slice."""
        if self.mesh is None or self.shape.tensor == 1:
            return dist.group.WORLD
        return self.mesh["replicate", "shard"]._flatten("dp").get_group()


def build_topology(shape: MeshShape, device: torch.device, needs_mesh: bool) -> Topology:
    rank = dist.get_rank()
    if not needs_mesh:
        return Topology(shape, None, rank, device)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (shape.replicate, shape.shard, shape.tensor),
                            mesh_dim_names=MESH_DIMS)
    coordinate = mesh.get_coordinate()
    return Topology(shape, mesh, coordinate[0] * shape.shard + coordinate[1], device)


# --- model transformations ----------------------------------------------------------------------

def _selective_policy():
    """Keep the outputs of matmuls and attention (expensive), recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    keep = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int) -> int:
    """Wrap decoder layers 0, k, 2k, ... in a (non-reentrant) checkpoint wrapper; returns how many."""
    if mode == "none":
        return 0
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    options = {"checkpoint_impl": CheckpointImpl.NO_REENTRANT, "preserve_rng_state": True}
    if mode == "selective":
        options["context_fn"] = partial(create_selective_checkpoint_contexts, _selective_policy())
    layers = decoder_layers(model)
    chosen = range(0, len(layers), every)
    for index in chosen:
        layers[index] = checkpoint_wrapper(layers[index], **options)
    return len(chosen)


def compile_mode(config: TrainConfig, device: torch.device) -> str | None:
    """torch.compile's mode for the `compile_mode` hyperparameter (None: inductor's default).

    CUDA graphs pay where launching kernels costs more than running them: a 20M-parameter model at
    16K tokens per step trains ~1.8x faster on an H100 with them (docs/benchmarks.md, GPU mode).
    """
    choice = config.parallel.compile_mode
    if choice == "auto":
        choice = "cuda_graphs" if device.type == "cuda" and cuda_graphs_apply(config) else "default"
    if choice == "cuda_graphs" and device.type != "cuda":
        raise ConfigError("compile_mode=cuda_graphs needs a CUDA GPU and this process has none: "
                          "use compile_mode=auto or default")
    return "reduce-overhead" if choice == "cuda_graphs" else None


def apply_compile(model: nn.Module, mode: str | None = None) -> None:
    """Compile each decoder layer in place (same parameter names, smaller graphs than the model)."""
    for layer in decoder_layers(model):
        layer.compile(mode=mode)


def tensor_parallel_plan(model: nn.Module) -> dict[str, object]:
    """The model's own TP plan (HF config.base_model_tp_plan) as PyTorch parallel styles."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    unsupported = sorted({style for style in plan.values() if style not in styles})
    if not plan or unsupported:
        raise ConfigError(f"invalid hyperparameter 'tensor_parallel_degree': {model.config.model_type} "
                          "models have no supported tensor-parallel plan (Llama-style models do); "
                          "use tensor_parallel_degree=1")
    return {pattern: styles[style]() for pattern, style in plan.items()}


def _check_divisible(model: nn.Module, degree: int) -> None:
    config = model.config
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name, None)
        if value is not None and value % degree:
            raise ConfigError(f"invalid hyperparameter 'tensor_parallel_degree': {degree} does not "
                              f"divide the model's {name} ({value})")


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    _check_divisible(model, tp_mesh.size())
    base = model.base_model
    plan = tensor_parallel_plan(model)
    matched = {name for name, _ in base.named_modules()
               if any(fnmatch.fnmatchcase(name, pattern) for pattern in plan)}
    if not matched:
        raise ConfigError("invalid hyperparameter 'tensor_parallel_degree': the model's "
                          "tensor-parallel plan matches none of its modules")
    parallelize_module(base, tp_mesh, plan)


def apply_fsdp(model: nn.Module, mesh, par: ParallelConfig, offload: bool) -> None:
    """fully_shard every decoder layer, then the root (embeddings, final norm, head)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    compute = COMPUTE_DTYPES[par.mixed_precision]
    options = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload
        else OffloadPolicy(),
    }
    reshard = par.fsdp_sharding != "grad_op"
    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        # The last layer's parameters are needed again right away by backward.
        fully_shard(layer, reshard_after_forward=reshard and index < len(layers) - 1, **options)
    # So are the root's (the head starts backward): PyTorch's own default for the root.
    fully_shard(model, reshard_after_forward=False, **options)
    if mesh.device_type == "cpu":
        # HSDP all-reduces the reduce-scatter output at once, so only a 1-D mesh may defer it.
        use_fast_cpu_collectives([*layers, model], overlap_reductions=mesh.ndim == 1 and not offload)
        prefetch_forward(layers, model)


# --- weights ------------------------------------------------------------------------------------

def snapshot(model: nn.Module) -> tuple[dict, dict]:
    """(state dict, all buffers) of the materialized model, to send from rank 0 to the others."""
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    return model.state_dict(), buffers


def load_from_rank0(model: nn.Module, device: torch.device, initial: tuple[dict, dict] | None) -> None:
    """Allocate a meta-initialized, parallelized model and fill it with rank 0's weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    state, buffers = initial if initial is not None else ({}, {})
    for name, buffer in model.named_buffers():  # non-persistent buffers are not in the state dict
        if dist.get_rank() == 0:
            buffer.copy_(buffers[name])
        dist.broadcast(buffer, src=0)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True,
                                                                broadcast_from_rank0=True))


def broadcast_module(model: nn.Module) -> None:
    """Make every rank's full replica equal to rank 0's (parameters and buffers)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)


# --- gradients ----------------------------------------------------------------------------------

def _sharded_dims(grad: torch.Tensor) -> tuple[str, ...]:
    placements = getattr(grad, "placements", None)
    if placements is None:
        return ()
    names = grad.device_mesh.mesh_dim_names
    return tuple(names[i] for i, placement in enumerate(placements) if placement.is_shard())


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (DTensor shards summed over the dims they are sharded on),
    then scale them to at most `max_norm` (0 = measure only). No host synchronisation."""
    buckets: dict[tuple[str, ...], tuple[object, list[torch.Tensor]]] = {}
    grads = [p.grad for p in parameters if p.grad is not None]
    for grad in grads:
        key = _sharded_dims(grad)
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        mesh = getattr(grad, "device_mesh", None)
        buckets.setdefault(key, (mesh, []))[1].append(local)
    total = None
    for dims, (mesh, tensors) in buckets.items():
        squares = torch.stack(torch._foreach_norm(tensors, 2.0)).float().pow(2).sum()
        for dim in dims:
            dist.all_reduce(squares, group=mesh.get_group(dim))
        total = squares if total is None else total + squares
    if total is None:
        return torch.zeros(())
    norm = total.sqrt()
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        locals_ = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        torch._foreach_mul_(locals_, scale.to(locals_[0].device))
    return norm


def autocast_context(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=COMPUTE_DTYPES[precision])
