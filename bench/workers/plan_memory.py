"""Measure what the training program holds in memory, part by part (torchrun worker).

    python -m torch.distributed.run --nproc_per_node N bench/workers/plan_memory.py SPEC.json OUT.json

SPEC.json is a list of {"name": ..., "hyperparameters": {...}}. Each configuration is built by the
training program's own code (config, model, strategy) and trained for two optimizer steps with the
program's own step (loop.train_step and the strategy's step) on random tokens; the second step is
measured on every rank:

- parameters, gradients, optimizer: the bytes of the live tensors that hold them, each storage
  counted once: the model's parameters (their local shards; FSDP2's unsharded copies while they
  exist; DeepSpeed's flat and partitioned buffers), `.grad` and the buffers gradients are reduced
  through (DDP's buckets as its reducer reports them, FSDP2's accumulated unsharded gradients,
  DeepSpeed's partitions and reduction buckets), the optimizer's state and DeepSpeed's fp32 master
  partitions. Parameters are read at the end of each forward, gradients after each block's backward
  and at the end of backward, the optimizer after the step; each part's largest value is kept.
- activations: what autograd saves for backward, read at the end of each micro batch's forward:
  every tensor a saved-tensor hook sees plus what selective activation checkpointing caches,
  counted by the storage it holds at that moment (FSDP2 and ZeRO-3 free gathered weights after
  use), excluding parameter storage.

With pipeline stages the schedule runs many micro-batches' forwards and backwards in its own order
and calls autograd itself, so every part is sampled after each stage forward and around each
backward (zero bubble's input and weight backwards too). Activations are then what is alive at that
moment: autograd's saved tensors (each in a holder the graph owns, so it dies with its node),
autocast's weight copies (its cache keeps them for the step), the stage inputs and outputs and the
last stage's logits the schedule keeps, and the receive buffers torch allocates per micro-batch
(also reported apart as "buffers").

Rank r writes OUT.json.r: {name: {"parameters": ..., "gradients": ..., "optimizer": ...,
"activations": ...}}. bench/plan.py launches this and compares with the planner.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
import weakref
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.utils.checkpoint as torch_checkpoint  # noqa: E402

from training_jobs.contract.hyperparameters import from_hyperparameters  # noqa: E402
from training_jobs.contract.parallel_dims import resolve_cluster  # noqa: E402
from training_jobs.trainer import float8  # noqa: E402
from training_jobs.trainer.faults import Faults  # noqa: E402
from training_jobs.trainer.loop import train_step  # noqa: E402
from training_jobs.trainer.models import load_tokenizer, model_source  # noqa: E402
from training_jobs.trainer.objectives.next_token import NextTokenObjective  # noqa: E402
from training_jobs.trainer.parallel import init_distributed  # noqa: E402
from training_jobs.trainer.strategies import SetupContext, build_strategy  # noqa: E402

PARTS = ("parameters", "gradients", "optimizer", "activations")
MASTER_WEIGHTS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
# DeepSpeed optimizer attributes that hold gradients (their names say so).
GRADIENT_MARKERS = ("grad", "ipg")


# --- storages ------------------------------------------------------------------------------------


def _plain(tensor: torch.Tensor):
    """The plain tensors holding the bytes: a DTensor's local shard; the result a functional
    collective wraps (tensor parallel's outputs are such wrappers, without a storage of their own);
    the inner tensors of a wrapper subclass (torchao's FP8 weights and tensors: their data and
    scales)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    if isinstance(tensor, AsyncCollectiveTensor):
        tensor = tensor.elem
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            yield from _plain(getattr(tensor, name))
    else:
        yield tensor


def storages(tensors) -> dict[int, int]:
    """data pointer -> bytes of each distinct non-empty storage behind `tensors`."""
    found: dict[int, int] = {}
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        for plain in _plain(tensor):
            storage = plain.untyped_storage()
            if storage.nbytes():
                found[storage.data_ptr()] = storage.nbytes()
    return found


def tensors_under(obj, depth: int = 3, markers: tuple[str, ...] = ()):
    """Tensors reachable from `obj` through attributes, lists, tuples and dicts; at the top level
    only through attributes whose name contains one of `markers` (when given)."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth == 0 or obj is None or isinstance(obj, str | int | float | bool):
        return
    if isinstance(obj, dict):
        children = obj.items()
    elif isinstance(obj, list | tuple):
        children = enumerate(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        children = vars(obj).items()
    else:
        return
    for name, child in children:
        if markers and not any(m in str(name).lower() for m in markers):
            continue
        yield from tensors_under(child, depth - 1)


def _fsdp_params(model):
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                yield from group.fsdp_params


def model_parts(strategy) -> list[torch.nn.Module]:
    """The modules a rank holds: its pipeline stages, or the whole model."""
    return list(getattr(strategy, "parts", None) or [strategy.hf_model])


def wrapped_parts(strategy) -> list[torch.nn.Module]:
    """The same, as the strategy wraps them (DDP around a stage or the model)."""
    return list(getattr(strategy, "modules", None) or [strategy.model])


def parameter_storages(strategy) -> dict[int, int]:
    tensors = []
    for model in model_parts(strategy):
        for param in model.parameters():
            tensors += [param, getattr(param, "ds_tensor", None)]
        for fsdp_param in _fsdp_params(model):
            tensors += [
                fsdp_param.sharded_param,
                getattr(fsdp_param, "_unsharded_param", None),
                *fsdp_param.all_gather_outputs,
            ]
    engine_optimizer = getattr(getattr(strategy, "engine", None), "optimizer", None)
    for name in ("bit16_groups_flat", "fp16_partitioned_groups_flat"):
        tensors += list(tensors_under(getattr(engine_optimizer, name, None)))
    return storages(tensors)


def optimizer_storages(strategy, params: dict[int, int]) -> dict[int, int]:
    engine = getattr(strategy, "engine", None)
    torch_optimizers = (
        [engine.optimizer.optimizer] if engine is not None else strategy.optimization.optimizers
    )
    tensors = [value for opt in torch_optimizers for state in opt.state.values() for value in state.values()]
    # DeepSpeed's fp32 master weights: the parameters of the optimizer it wraps (ZeRO-3 lends them
    # to it only during the step, and keeps them in its own flat buffers).
    tensors += [p for opt in torch_optimizers for group in opt.param_groups for p in group["params"]]
    for name in MASTER_WEIGHTS:
        tensors += list(tensors_under(getattr(engine.optimizer, name, None) if engine else None))
    return {ptr: size for ptr, size in storages(tensors).items() if ptr not in params}


def gradient_storages(strategy) -> dict[int, int]:
    tensors = []
    for model in model_parts(strategy):
        fsdp_params = list(_fsdp_params(model))
        if fsdp_params:
            # The sharded parameters' gradients, and the fp32 unsharded ones FSDP2 keeps between
            # micro steps when it does not reduce them (grad_op accumulation, pipeline stages).
            # While a block runs backward its modules hold unsharded parameters whose gradients are
            # on their way to the reduce-scatter: working memory, not counted here.
            tensors += [p.sharded_param.grad for p in fsdp_params]
            tensors += [p.unsharded_accumulated_grad for p in fsdp_params]
        else:
            tensors += [p.grad for p in model.parameters()]
    found = storages(tensors)
    for position, wrapped in enumerate(wrapped_parts(strategy)):
        reducer = getattr(wrapped, "reducer", None)
        if reducer is not None:  # DDP's buckets live in C++; the reducer reports them
            for index, bucket in enumerate(reducer._get_zeros_like_grad_buckets()):
                found[-1 - 1000 * position - index] = bucket.buffer().untyped_storage().nbytes()
    engine = getattr(strategy, "engine", None)
    if engine is not None:
        optimizer = engine.optimizer
        extra = list(tensors_under(optimizer, markers=GRADIENT_MARKERS))
        extra += [p.grad for group in optimizer.optimizer.param_groups for p in group["params"]]
        found.update(storages(extra))
    return found


# --- activations -----------------------------------------------------------------------------------


class SavedTensors:
    """Everything autograd saves during forward: saved-tensor hooks, plus the outputs selective
    checkpointing caches (they bypass the hooks)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.caches: list[dict] = []

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.tensors.append(tensor)
        return tensor

    @contextlib.contextmanager
    def recording(self):
        _CACHES.clear()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
                yield
        finally:
            self.caches = list(_CACHES)
            _CACHES.clear()

    def cached(self):
        for storage in [*self.caches, *_CACHES]:
            for entries in storage.values():
                for entry in entries.values():
                    for leaf in torch.utils._pytree.tree_leaves(entry):
                        value = getattr(leaf, "val", None)
                        if isinstance(value, torch.Tensor):
                            yield value

    def bytes_excluding(self, params: dict[int, int]) -> int:
        found = storages([*self.tensors, *self.cached()])
        return sum(size for ptr, size in found.items() if ptr not in params)

    def clear(self) -> None:
        self.tensors.clear()
        self.caches.clear()
        _CACHES.clear()


# Selective checkpointing caches the outputs it keeps in a dict made by this function; the program
# binds it when it wraps the blocks, so it is replaced before any model is built.
_CACHES: list[dict] = []
_create_contexts = torch_checkpoint.create_selective_checkpoint_contexts


def _recording_contexts(*args, **kwargs):
    caching, cached = _create_contexts(*args, **kwargs)
    _CACHES.append(caching.storage)
    return caching, cached


torch_checkpoint.create_selective_checkpoint_contexts = _recording_contexts
# FP8 (fp8=true) runs here: torch 2.13 has a CPU kernel for FP8 matmuls (torch._scaled_mm). The
# program refuses fp8 on a CPU before it touches the model; the worker lifts that refusal and
# nothing else (as tests/training/fp8_worker.py does).
float8.check_fp8_device = lambda device: None


# --- one configuration -----------------------------------------------------------------------------


class Measurement:
    def __init__(self, strategy) -> None:
        self.strategy = strategy
        self.peak = dict.fromkeys(PARTS, 0)
        self.saved = SavedTensors()

    def keep(self, part: str, value: int) -> None:
        self.peak[part] = max(self.peak[part], value)

    def end_of_forward(self) -> None:
        params = parameter_storages(self.strategy)
        self.keep("parameters", sum(params.values()))
        self.keep("activations", self.saved.bytes_excluding(params))

    def sample_gradients(self, *_) -> None:
        self.keep("gradients", sum(gradient_storages(self.strategy).values()))

    def optimizer(self) -> None:
        params = parameter_storages(self.strategy)
        self.keep("optimizer", sum(optimizer_storages(self.strategy, params).values()))

    @contextlib.contextmanager
    def instrumented(self):
        """Measure around the strategy's backward (DeepSpeed: the engine's, before its step; the
        PyTorch-native strategies: their optimization's)."""
        strategy = self.strategy
        owner = getattr(strategy, "engine", None) or strategy.optimization
        original = owner.backward

        def backward(*args, **kwargs):
            self.end_of_forward()
            self.saved.clear()
            result = original(*args, **kwargs)
            self.sample_gradients()
            return result

        # Gradients are read after each block's backward and after each parameter's gradient is
        # accumulated (where a parameter reports it), so a peak between reductions is seen.
        hooks = [
            layer.register_full_backward_hook(self.sample_gradients) for layer in _blocks(strategy.hf_model)
        ]
        hooks += [
            param.register_post_accumulate_grad_hook(self.sample_gradients)
            for param in strategy.hf_model.parameters()
            if param.requires_grad
        ]
        owner.backward = backward
        try:
            with self.saved.recording():
                yield
        finally:
            del owner.backward
            for hook in hooks:
                hook.remove()


class _Saved:
    """A tensor autograd saved for backward, in a holder its graph node owns: the holder dies when
    backward frees the node (or the graph is dropped), so the live holders are what autograd holds."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class LiveSaved:
    """Saved tensors alive now, and autocast's compute-dtype weight copies: autocast caches each
    copy from its first use until the step's autocast region ends (one copy for every micro-batch,
    alive while no micro-batch of its stage is), so they are kept here as long as the cache keeps
    them."""

    def __init__(self) -> None:
        self.holders: weakref.WeakSet[_Saved] = weakref.WeakSet()
        self.weight_copies: dict[int, torch.Tensor] = {}

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        holder = _Saved(tensor)
        self.holders.add(holder)
        base = tensor if tensor._base is None else tensor._base
        if _is_weight_copy(base):
            self.weight_copies[id(base)] = base
        return holder

    @staticmethod
    def _unpack(holder: _Saved) -> torch.Tensor:
        return holder.tensor

    def recording(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def tensors(self) -> list[torch.Tensor]:
        return [holder.tensor for holder in list(self.holders)] + list(self.weight_copies.values())


def _is_weight_copy(tensor: torch.Tensor) -> bool:
    """A cast of a parameter (autocast's copy, saved as a view of it): made by a copy op straight
    from a leaf's gradient accumulator."""
    node = tensor.grad_fn
    if node is None or type(node).__name__ != "ToCopyBackward0":
        return False
    return all(type(n).__name__ == "AccumulateGrad" for n, _ in node.next_functions if n is not None)


def _stages(schedule) -> list:
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def schedule_held(stages) -> list[torch.Tensor]:
    """Tensors the pipeline stages keep for their micro-batches' backward besides autograd's saved
    ones: each in-flight micro-batch's stage input and output (fwd_cache), what zero bubble keeps
    for the weight gradients (backward_state: the gradients of the graph's intermediates), and the
    last stage's outputs, kept for the step's result until the next step starts (output_chunks)."""
    held: list = []
    for stage in stages:
        held += list(tensors_under(stage.fwd_cache, depth=4))
        held += list(tensors_under(stage.backward_state, depth=8))
        held += list(tensors_under(stage.output_chunks, depth=3))
    return held


def receive_buffers(stages) -> list[torch.Tensor]:
    """The buffers a stage allocates once per micro-batch to receive activations (non-first
    stages) and gradients (non-last stages) into, and the input gradients backward leaves on the
    activation buffers until the next step."""
    buffers: list = []
    for stage in stages:
        for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
            for info in infos:
                buffer = info.buffer
                if isinstance(buffer, torch.Tensor):
                    buffers += [buffer, buffer.grad]
    return buffers


class PipelineMeasurement(Measurement):
    """A pipeline schedule runs the forwards and backwards of many micro-batches in its own order,
    and calls autograd itself: every part is sampled after each stage's forward and before and
    after each of its backwards (input and weight backward for zero bubble), with activations the
    saved tensors alive at that moment (LiveSaved) and the stage inputs and outputs the schedule
    keeps for backward."""

    def __init__(self, strategy) -> None:
        super().__init__(strategy)
        self.live = LiveSaved()
        self.peak["buffers"] = 0

    def sample(self, *_) -> None:
        stages = _stages(self.strategy.schedule)
        params = parameter_storages(self.strategy)
        self.keep("parameters", sum(params.values()))
        self.keep("gradients", sum(gradient_storages(self.strategy).values()))
        buffers = storages(receive_buffers(stages))
        self.keep("buffers", sum(buffers.values()))
        saved = storages(self.live.tensors())
        held = storages(schedule_held(stages))
        everything = {**held, **saved, **buffers}
        self.keep("activations", sum(size for ptr, size in everything.items() if ptr not in params))

    def _around(self, stage, name: str) -> None:
        original = getattr(stage, name)

        def sampled(*args, **kwargs):
            self.sample()
            result = original(*args, **kwargs)
            self.sample()
            return result

        setattr(stage, name, sampled)

    @contextlib.contextmanager
    def instrumented(self):
        stages = _stages(self.strategy.schedule)
        names = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
        for stage in stages:
            for name in names:
                self._around(stage, name)
        try:
            with self.live.recording():
                yield
        finally:
            for stage in stages:
                for name in names:
                    delattr(stage, name)


def _blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder blocks (the model's longest ModuleList; wrappers rename their classes)."""
    return max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)


def _batches(config, vocab: int, generator: torch.Generator, split=None):
    """Random micro-batches; under context parallel, this rank's chunks of each sequence (as the
    program's data loader hands them out)."""
    data = config.data
    batches = [
        (
            torch.randint(0, vocab, (data.micro_batch_size, data.seq_len), generator=generator),
            torch.randint(0, vocab, (data.micro_batch_size, data.seq_len), generator=generator),
        )
        for _ in range(data.grad_accum_steps)
    ]
    if split is None:
        return batches
    return [(split.shard(inputs), split.shard(targets)) for inputs, targets in batches]


def measure(hyperparameters: dict, tokenizer) -> dict[str, int]:
    config = from_hyperparameters(hyperparameters)
    device = torch.device("cpu")
    source = model_source(config.model, None, tokenizer, config.data.seq_len, "sdpa")
    config, dims = resolve_cluster(config, dist.get_world_size(), 1)  # as the job resolves them
    strategy = build_strategy(SetupContext(config, source, device, dims))
    try:
        generator = torch.Generator().manual_seed(dist.get_rank())
        batches = SimpleNamespace(samples=SimpleNamespace(manifest=SimpleNamespace(loss_mask=False)))
        ctx = SimpleNamespace(
            strategy=strategy,
            config=config,
            device=device,
            train=batches,
            dp_group=strategy.topology.data_parallel_group(),
            step=0,
            faults=Faults(),  # none injected
            router=None,  # dense models
        )
        ctx.objective = NextTokenObjective(SimpleNamespace(strategy=strategy, train=batches))
        batches.step_samples = []
        strategy.train(True)
        batches.next_step = lambda: _batches(config, source.config.vocab_size, generator,
                                             strategy.topology.sequence_split)
        train_step(ctx)
        strategy.step()
        pipelined = hasattr(strategy, "schedule")
        measurement = PipelineMeasurement(strategy) if pipelined else Measurement(strategy)
        with measurement.instrumented():
            train_step(ctx)
        measurement.optimizer()
        strategy.step()
        measurement.optimizer()
        return dict(measurement.peak)
    finally:
        strategy.close()


def main(spec_path: str, out_path: str) -> int:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    init_distributed(torch.device("cpu"), rank, world, timeout_minutes=10)
    tokenizer, _ = load_tokenizer(None, None)
    results = {}
    for entry in json.loads(Path(spec_path).read_text()):
        try:
            results[entry["name"]] = measure(entry["hyperparameters"], tokenizer)
        except Exception:  # a failed configuration is reported, the others still run
            results[entry["name"]] = {"error": traceback.format_exc()}
        dist.barrier()
    Path(f"{out_path}.{rank}").write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
