"""How the model is spread over processes: the device mesh, DDP, FSDP2, tensor parallel, and helpers.

No model math lives here. The functions apply PyTorch's own building blocks (DistributedDataParallel,
fully_shard on a DeviceMesh, parallelize_module with the model's tensor-parallel plan, activation
checkpoint wrappers, torch.compile) in the order torchtitan uses: tensor parallel (its plan names the
unwrapped modules), activation checkpointing, compile, FSDP. The strategies (trainer/strategies/)
decide which to apply; pipeline stages get the same transformations one stage at a time.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ..contract.hyperparameters import ParallelConfig, TrainConfig, cuda_graphs_apply
from ..contract.parallel_dims import MESH_DIMS, ParallelDims
from .context_parallel import SequenceSplit, apply_context_parallel
from .cpu_collectives import prefetch_forward, use_fast_cpu_collectives
from .errors import ConfigError, ContainerError
from .expert_parallel import apply_expert_parallel, expert_mesh, shard_experts
from .models import decoder_layers
from .tensor_parallel import apply_tensor_parallel

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# --- processes ----------------------------------------------------------------------------------

def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: torch.device, rank: int, world_size: int, timeout_minutes: float,
                     collective_backend: str = "nccl") -> None:
    """One process group per job (also for a single process, so every code path is the same):
    gloo for CPU tensors, and NCCL or SMDDP for GPU tensors."""
    if dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ:  # plain `python train.py`: a group of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    backend = f"cpu:gloo,cuda:{gpu_backend(device, collective_backend)}" if device.type == "cuda" \
        else gpu_backend(device, collective_backend)
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                            timeout=timedelta(minutes=timeout_minutes))


def gpu_backend(device: torch.device, collective_backend: str) -> str:
    """The process-group backend for device tensors; SMDDP registers "smddp" when imported."""
    if collective_backend == "nccl":
        return "nccl" if device.type == "cuda" else "gloo"
    if device.type != "cuda":
        raise ConfigError("invalid hyperparameter 'collective_backend': smddp runs its collectives on "
                          "NVIDIA GPUs and this process has none; use collective_backend=nccl")
    try:
        import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401
    except ImportError as error:
        raise ContainerError(
            "collective_backend=smddp needs SageMaker's distributed data parallel library "
            "(smdistributed.dataparallel), which ships in the SageMaker PyTorch GPU containers; this "
            "container has none: use a SageMaker PyTorch training image or collective_backend=nccl"
        ) from error
    return "smddp"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Topology:
    """Where this process sits: the mesh degrees, the device mesh, and its coordinates on it."""

    dims: ParallelDims
    mesh: object | None  # DeviceMesh with MESH_DIMS; None without one (DDP, single, DeepSpeed, SMP)
    data_parallel_rank: int
    device: torch.device
    pipeline_rank: int = 0
    context_rank: int = 0
    expert_mesh: object | None = None  # (copies, expert ranks) under expert parallelism

    @property
    def data_parallel_size(self) -> int:
        return self.dims.data_parallel

    @property
    def sequence_split(self) -> SequenceSplit | None:
        """This rank's part of every sequence under context parallel; None without it."""
        return SequenceSplit(self.context_rank, self.dims.context) if self.dims.context > 1 else None

    def positions(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """Position ids of `inputs` (this rank's tokens) where they are not 0, 1, ...: under context
        parallel, its two chunks of the sequence."""
        split = self.sequence_split
        return None if split is None else split.positions(inputs.shape[1], inputs.device)

    def vocabulary_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The output head's logits as the loss takes them: under this program's tensor parallel,
        this rank's vocabulary shard as a DTensor sharded on the last dimension (loss parallel)."""
        if self.mesh is None or self.dims.tensor == 1:
            return logits
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(logits, self.mesh["tp"], [Shard(logits.ndim - 1)], run_check=False)

    def _group(self, dims: tuple[str, ...]):
        """The process group of this rank's neighbours along `dims` (the world when that is all)."""
        if self.mesh is None or self.dims.world_size == _size(self.dims, dims):
            return dist.group.WORLD
        return self.mesh[dims]._flatten("_".join(dims)).get_group()

    def data_parallel_group(self):
        """Process group of the data-parallel ranks that hold this rank's stage, tensor slice and
        sequence part."""
        return self._group(("replicate", "shard"))

    def batch_group(self):
        """The ranks that share one optimizer step's tokens and average their gradients: the
        data-parallel ranks and the context-parallel ranks (each holding part of every sequence)."""
        return self._group(("replicate", "shard", "cp"))

    def pipeline_group(self):
        return self.mesh["pp"].get_group()

    def loss_group(self):
        """The ranks whose summed losses, divided by the number of batch ranks, are the global
        loss: the batch ranks, and with pipeline stages every stage of them (only the last stage
        holds losses, the others add zeros). Tensor-parallel ranks hold copies and reduce apart."""
        if self.dims.pipeline == 1:
            return self.batch_group()
        return self._group(("pp", "replicate", "shard", "cp"))

    def mean_loss(self, values: torch.Tensor) -> torch.Tensor:
        """`values` (losses of this rank) averaged over the batch ranks; in place."""
        group = self.loss_group()
        dist.all_reduce(values, group=group)
        return values.div_(dist.get_world_size(group) // self.dims.pipeline)

    def sum_loss(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over the data-parallel replicas (and stages); in place."""
        dist.all_reduce(values, group=self.loss_group())
        return values


def build_topology(dims: ParallelDims, device: torch.device, needs_mesh: bool) -> Topology:
    rank = dist.get_rank()
    if not needs_mesh:
        return Topology(dims, None, rank, device)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, dims.mesh_shape, mesh_dim_names=MESH_DIMS)
    pipeline, replicate, shard, context, _ = mesh.get_coordinate()
    experts = expert_mesh(dims, device) if dims.expert > 1 else None
    return Topology(dims, mesh, replicate * dims.shard + shard, device, pipeline, context, experts)


def _size(dims: ParallelDims, names: tuple[str, ...]) -> int:
    sizes = dict(zip(MESH_DIMS, dims.mesh_shape, strict=True))
    product = 1
    for name in names:
        product *= sizes[name]
    return product


# --- model transformations ----------------------------------------------------------------------

def _saved_ops() -> set:
    """Operators whose outputs the selective policy always keeps: attention (every SDPA kernel),
    the reduce-scatters that end sequence-parallel regions (recomputing them would repeat the
    communication) and max (float8 scales), as torchtitan's op-level policy keeps them."""
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_attention_math", "_efficient_attention_forward", "max")
    ops = {getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)}
    ops.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    return ops


MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def selective_policy():
    """torchtitan's op-level policy: in each checkpointed layer keep the outputs of `_saved_ops` and
    of every other matmul (the 1st, 3rd, ...: of a Llama layer's q, k, v, o, gate, up, down
    projections, q, v, gate and down), recompute everything else (norms, rotary embeddings,
    activations, the other matmuls, all-gathers). Counted apart in the forward and the recompute,
    which see the same matmuls in the same order."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy

    saved = _saved_ops()
    counts: dict[bool, int] = defaultdict(int)

    def policy(ctx, op, *args, **kwargs):
        if op in MATMULS:
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] % 2 == 1
        else:
            keep = op in saved
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_contexts():
    """A fresh policy (and count) for each forward of a checkpointed layer."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(selective_policy())


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int) -> int:
    """Wrap decoder layers 0, k, 2k, ... in a (non-reentrant) checkpoint wrapper; returns how many."""
    if mode == "none":
        return 0
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    options = {"checkpoint_impl": CheckpointImpl.NO_REENTRANT, "preserve_rng_state": True}
    if mode == "selective":
        options["context_fn"] = _selective_contexts
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


def transform(model: nn.Module, config: TrainConfig, topology: Topology, device: torch.device, *,
              with_fsdp: bool) -> None:
    """FP8, tensor parallel (with sequence and loss parallel), context parallel, activation
    checkpointing, compile and FSDP, in that order (each later step wraps what the earlier ones
    produced; torchao's float8 tensor-parallel styles take converted layers)."""
    par, mesh, dims = config.parallel, topology.mesh, topology.dims
    if par.fp8:
        from .float8 import apply_float8

        apply_float8(model, device, par, with_fsdp=with_fsdp)
    if dims.tensor > 1:
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=par.sequence_parallel,
                              float8=par.fp8 and par.fp8_recipe == "tensorwise")
    if dims.context > 1:
        check_context_parallel(model)
        apply_context_parallel(model, topology.sequence_split, mesh["cp"].get_group(), config.data.seq_len)
    if dims.expert > 1:
        apply_expert_parallel(model, topology.expert_mesh)
    apply_activation_checkpointing(model, par.activation_checkpointing, par.activation_checkpointing_every)
    if par.compile:
        apply_compile(model, compile_mode(config, device))
    if with_fsdp:
        apply_fsdp(model, fsdp_mesh(mesh, dims, par), par,
                   offload=par.offload_params or par.offload_optimizer, experts=topology.expert_mesh)


def check_context_parallel(model: nn.Module) -> None:
    from .tensor_parallel import TENSOR_PARALLEL_MODEL_TYPES

    if model.config.model_type not in TENSOR_PARALLEL_MODEL_TYPES:
        raise ConfigError(f"invalid hyperparameter 'context_parallel_degree': {model.config.model_type} "
                          "models cannot split their sequences (these can: "
                          f"{', '.join(TENSOR_PARALLEL_MODEL_TYPES)}: rotary positions and "
                          "transformers' attention interface); use context_parallel_degree=1")


def fsdp_mesh(mesh, dims: ParallelDims, par: ParallelConfig):
    """The mesh FSDP shards over: shard x context ranks (replicated over `replicate` when hybrid)."""
    shard = mesh["shard", "cp"]._flatten("shard_cp") if dims.context > 1 else mesh["shard"]
    if par.fsdp_sharding != "hybrid":
        return shard
    return mesh["replicate", "shard_cp"] if dims.context > 1 else mesh["replicate", "shard"]


def activation_offload(par: ParallelConfig, device: torch.device):
    """Where autograd keeps saved activations: on the CPU with activation_offloading."""
    if not par.activation_offloading:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")


def apply_fsdp(model: nn.Module, mesh, par: ParallelConfig, offload: bool,
               experts: object | None = None) -> None:
    """fully_shard every decoder layer, then the root (embeddings, final norm, head); under expert
    parallelism (`experts`: the expert mesh) each layer's routed experts first, over the ranks
    holding the same expert slice (trainer/expert_parallel.py)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    compute = COMPUTE_DTYPES[par.mixed_precision]
    options = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload
        else OffloadPolicy(),
    }
    reshard = par.fsdp_sharding != "grad_op"
    layers = decoder_layers(model)
    sharded_experts = []
    for index, layer in enumerate(layers):
        # The last layer's parameters are needed again right away by backward.
        resharded = reshard and index < len(layers) - 1
        if experts is not None:
            sharded_experts += shard_experts(layer, experts, options, reshard=resharded,
                                             mean_over=mesh.size())
        fully_shard(layer, mesh=mesh, reshard_after_forward=resharded, **options)
    # So are the root's (the head starts backward): PyTorch's own default for the root.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, **options)
    if mesh.device_type == "cpu":
        # HSDP all-reduces the reduce-scatter output at once, so only a 1-D mesh may defer it.
        use_fast_cpu_collectives([*sharded_experts, *layers, model],
                                 overlap_reductions=mesh.ndim == 1 and not offload)
        prefetch_forward(layers, model)


# --- weights ------------------------------------------------------------------------------------

def snapshot(model: nn.Module) -> tuple[dict, dict]:
    """(state dict, all buffers) of the materialized model, to send from rank 0 to the others."""
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    return model.state_dict(), buffers


def load_from_rank0(model: nn.Module, device: torch.device, initial: tuple[dict, dict] | None, *,
                    part: bool = False) -> None:
    """Allocate a meta-initialized, parallelized model and fill it with rank 0's weights. With
    `part` (a pipeline stage), rank 0's weights may hold more than the model: each rank takes its
    own (every rank's model holds the same buffers)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    state, buffers = initial if initial is not None else ({}, {})
    for name, buffer in model.named_buffers():  # non-persistent buffers are not in the state dict
        if dist.get_rank() == 0:
            buffer.copy_(buffers[name])
        dist.broadcast(buffer, src=0)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True,
                                                                broadcast_from_rank0=True,
                                                                strict=not part))


def gathered_state_dict(model: nn.Module) -> dict:
    """Every weight of `model`, unsharded, on rank 0 (CPU); empty elsewhere. A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def broadcast_module(model: nn.Module) -> None:
    """Make every rank's full replica equal to rank 0's (parameters and buffers)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)


# --- gradients ----------------------------------------------------------------------------------

def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _sharded_dims(grad: torch.Tensor) -> tuple[tuple[str, ...], object]:
    """The mesh dims a DTensor gradient is sharded over (its squares are summed over them)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return (), None
    names = grad.device_mesh.mesh_dim_names
    # not is_shard(): FSDP2's _StridedShard (its dimension under tensor parallel) is no Shard in
    # newer torch, and its squares must be summed all the same
    dims = tuple(names[i] for i, placement in enumerate(grad.placements)
                 if not placement.is_replicate() and not placement.is_partial())
    return dims, grad.device_mesh


def _reduce_partial_gradients(parameters: list[nn.Parameter]) -> None:
    """Sum the gradients DTensor left as pending partial sums (sequence parallel's norm weights:
    each tensor-parallel rank holds its sequence shard's part), as the optimizer would before using
    them; the norm needs the sums."""
    from torch.distributed.tensor import DTensor, Replicate

    for param in parameters:
        grad = param.grad
        if isinstance(grad, DTensor) and any(placement.is_partial() for placement in grad.placements):
            summed = [Replicate() if placement.is_partial() else placement for placement in grad.placements]
            param.grad = grad.redistribute(grad.device_mesh, summed)


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float, stage_group=None) -> torch.Tensor:
    """Global L2 norm of all gradients (DTensor shards summed over the dims they are sharded on,
    pipeline stages summed over `stage_group`), then scale them to at most `max_norm` (0 = measure
    only). No host synchronisation."""
    buckets: dict[tuple[str, ...], tuple[object, list[torch.Tensor]]] = {}
    _reduce_partial_gradients(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    for grad in grads:
        dims, mesh = _sharded_dims(grad)
        buckets.setdefault(dims, (mesh, []))[1].append(_local(grad))
    total = torch.zeros((), device=parameters[0].device if parameters else None)
    for dims, (mesh, tensors) in buckets.items():
        squares = torch.stack(torch._foreach_norm(tensors, 2.0)).float().pow(2).sum()
        for dim in dims:
            dist.all_reduce(squares, group=mesh.get_group(dim))
        total = total + squares
    if stage_group is not None:
        dist.all_reduce(total, group=stage_group)
    norm = total.sqrt()
    if max_norm > 0 and grads:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        locals_ = [_local(g) for g in grads]
        torch._foreach_mul_(locals_, scale.to(locals_[0].device))
    return norm


def autocast_context(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=COMPUTE_DTYPES[precision])
