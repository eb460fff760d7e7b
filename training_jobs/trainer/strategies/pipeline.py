"""Pipeline parallelism (torch.distributed.pipelining), alone or with DDP or FSDP2 (and tensor
parallel) inside each stage: 2-D and 3-D training on one device mesh (contract/parallel_dims.py).

The decoder layers are split into contiguous stages, balanced by compute (the head counts as the
layers' worth of matmul work it does: contract/stage_split.py) or as `pipeline_split` says; the
first stage also holds the embedding, the last the final norm, the head and the loss. Each pipeline
rank holds one stage (gpipe, 1f1b) or several (interleaved_1f1b, zero_bubble: stages r, r + degree,
...). An optimizer step's `grad_accum_steps` micro-batches of `micro_batch_size` samples, the very
samples the other strategies train on, flow through the schedule; each micro-batch's loss is divided
by their number before its backward (as gradient accumulation does), so the step computes the same
gradient as training the whole model on one rank. Every stage is transformed like a whole model
elsewhere (tensor parallel, FP8, activation checkpointing, compile, FSDP) and then wrapped in DDP
when it is replicated; the pipelining stage itself defers the gradient reduction of DDP and FSDP to
the last micro-batch.
"""

from __future__ import annotations

import contextlib
import weakref
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ...contract.hyperparameters import ParallelConfig, pipeline_split, pipeline_stages_per_rank
from ...contract.stage_split import balanced_split, stage_indices
from .. import parallel
from ..errors import ConfigError
from ..float8 import precompute_scales, precomputes_scales
from ..loss import causal_lm_loss_sum, trained_targets
from ..models import decoder_layers, non_embedding_parameters, parameter_count
from ..stage_model import CausalLMStage, check_splittable, stage_of_parameter
from .optimization import Optimization, read_state, write_state
from .protocol import LossFn, MicroBatch, ModelSummary, UpdateGate
from .setup import SetupContext, device_ids, prepare_model


def schedule_class(name: str):
    from torch.distributed.pipelining import schedules

    return {"gpipe": schedules.ScheduleGPipe, "1f1b": schedules.Schedule1F1B,
            "interleaved_1f1b": schedules.ScheduleInterleaved1F1B,
            "zero_bubble": schedules.ScheduleInterleavedZeroBubble}[name]


def layer_counts(par: ParallelConfig, skeleton: nn.Module, num_stages: int) -> tuple[int, ...]:
    """`pipeline_split` when set (checked against the model), else the balanced split."""
    num_layers = len(decoder_layers(skeleton))
    manual = pipeline_split(par.pipeline_split)
    if manual:
        if sum(manual) != num_layers:
            raise ConfigError(f"invalid hyperparameter 'pipeline_split': {par.pipeline_split!r} places "
                              f"{sum(manual)} decoder layers and the model has {num_layers}")
        return manual
    layer = sum(map(parameter_count, decoder_layers(skeleton)[0].parameters()))
    head = sum(map(parameter_count, skeleton.lm_head.parameters()))
    return balanced_split(num_layers, num_stages, head / layer)


def layer_stages(counts: tuple[int, ...]) -> list[int]:
    """The stage of each decoder layer."""
    return [stage for stage, count in enumerate(counts) for _ in range(count)]


class PipelineStrategy:
    saves_asynchronously = True

    def __init__(self, ctx: SetupContext) -> None:
        config, par = ctx.config, ctx.config.parallel
        self.config, self.device, self.kind = config, ctx.device, par.parallelism
        self.topology = parallel.build_topology(ctx.dims, ctx.device, needs_mesh=True)
        self.eval_micro_batches = 1  # _forward_only passes one batch at a time
        degree, per_rank = ctx.dims.pipeline, pipeline_stages_per_rank(par)
        self.num_stages = degree * per_rank
        skeleton = prepare_model(ctx, materialize=False)
        check_splittable(skeleton)
        self.layer_stages = layer_stages(layer_counts(par, skeleton, self.num_stages))
        self.stage_ids = stage_indices(self.topology.pipeline_rank, degree, per_rank)
        self.sharded = self.kind == "fsdp" and (ctx.dims.data_parallel * ctx.dims.context > 1
                                                or par.offload_params)
        self.parts = self._build_parts(ctx)
        self.hf_model = self.parts[0]
        self.modules = [self._wrap(part) for part in self.parts]
        self.optimization = Optimization(config, self.modules, ctx.device,
                                         self.topology.data_parallel_size, keyed_by_name=True)
        self.schedule = self._build_schedule(par)
        if precomputes_scales(par, self.sharded):
            self.optimization.after_update.append(lambda: precompute_scales(self.parts))
        self._loss_fn: LossFn = causal_lm_loss_sum
        self._losses: list[torch.Tensor] = []

    # --- construction ---

    def _build_parts(self, ctx: SetupContext) -> list[CausalLMStage]:
        """This rank's stages, transformed and holding rank 0's initial weights."""
        initial = parallel.snapshot(prepare_model(ctx, materialize=True)) if ctx.rank == 0 else None
        split = self.topology.sequence_split
        positions = None if split is None else \
            split.positions(self.config.data.seq_len // split.degree, self.device)
        parts = []
        for position, stage in enumerate(self.stage_ids):
            layers = [index for index, owner in enumerate(self.layer_stages) if owner == stage]
            part = CausalLMStage(prepare_model(ctx, materialize=False), layers, first=stage == 0,
                                 last=stage == self.num_stages - 1, positions=positions)
            parallel.transform(part, self.config, self.topology, self.device, with_fsdp=self.sharded)
            parallel.load_from_rank0(part, self.device, self._weights_at(position, initial), part=True)
            parts.append(part)
        return parts

    def _weights_at(self, position: int, initial: tuple[dict, dict] | None) -> tuple[dict, dict] | None:
        """Rank 0's weights of the stages held at `position` on every pipeline rank, so that each
        weight is sent once, not once per stage a rank holds."""
        if initial is None:
            return None
        degree = self.topology.dims.pipeline
        wanted = {stage_indices(rank, degree, len(self.stage_ids))[position] for rank in range(degree)}
        state, buffers = initial
        return ({name: value for name, value in state.items()
                 if stage_of_parameter(name, self.layer_stages) in wanted}, buffers)

    def _wrap(self, part: nn.Module) -> nn.Module:
        if self.kind != "ddp" or self.topology.data_parallel_size == 1:
            return part
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(part, device_ids=device_ids(self.device),
                                       process_group=self.topology.data_parallel_group())

    def _build_schedule(self, par: ParallelConfig):
        from torch.distributed.pipelining import PipelineStage

        group = self.topology.pipeline_group()
        stages = [PipelineStage(module, stage, self.num_stages, self.device, group=group)
                  for module, stage in zip(self.modules, self.stage_ids, strict=True)]
        single = par.pipeline_schedule in ("gpipe", "1f1b")
        try:
            # scale_grads=False: _pipeline_loss already divides by the number of micro-batches, as
            # the other strategies do before backward (the same rounding, the same gradient).
            return schedule_class(par.pipeline_schedule)(
                stages[0] if single else stages, self.config.data.grad_accum_steps,
                loss_fn=self._pipeline_loss, scale_grads=False)
        except ValueError as error:  # the schedule's own rule on micro-batches and stages
            raise ConfigError(f"invalid hyperparameter 'pipeline_schedule': {par.pipeline_schedule} "
                              f"with {self.config.data.grad_accum_steps} micro-batches "
                              f"(grad_accum_steps) and {self.num_stages} stages: {error}") from error

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def model_summary(self) -> ModelSummary:
        totals = torch.tensor([sum(sum(map(parameter_count, part.parameters())) for part in self.parts),
                               sum(non_embedding_parameters(part) for part in self.parts)],
                              device=self.device)
        dist.all_reduce(totals, group=self.topology.pipeline_group())
        return ModelSummary(self.hf_model.config, int(totals[0]), int(totals[1]))

    # --- training ---

    def _pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.requires_grad:
            logits.register_hook(_release_when_differentiated(logits))
        loss = self._loss_fn(self.topology.vocabulary_logits(logits), targets)
        self._losses.append(loss.detach())
        return loss / self.config.data.grad_accum_steps

    def _autocast(self):
        """Sharded stages compute in FSDP's parameter dtype; replicated ones under autocast."""
        if self.sharded:
            return contextlib.nullcontext()
        return parallel.autocast_context(self.device, self.config.parallel.mixed_precision)

    def _run(self, run_schedule, micro_batches: list[MicroBatch], loss_fn: LossFn) -> list[torch.Tensor]:
        """One pass of the schedule over the micro-batches; the last stage's micro-batch losses."""
        self._loss_fn, self._losses = loss_fn, []
        inputs = torch.cat([batch[0] for batch in micro_batches])
        targets = torch.cat([batch[1] for batch in micro_batches])
        with self._autocast(), parallel.activation_offload(self.config.parallel, self.device):
            run_schedule(*([inputs] if self.has_first else []), target=targets if self.has_last else None)
        # The first pass also runs the loss once on placeholder data (the schedule's shape
        # inference): the micro-batches' losses are the last ones.
        return self._losses[len(self._losses) - len(micro_batches):] if self.has_last else []

    def forward_backward(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> torch.Tensor:
        losses = self._run(self.schedule.step, micro_batches, loss_fn)
        total = torch.zeros((), device=self.device)
        for loss in losses:
            total += loss
        return total / len(micro_batches)

    def evaluate(self, batches: list[MicroBatch]) -> torch.Tensor:
        sums = self._forward_only(batches)
        total = torch.zeros(2, device=self.device)
        for loss_sum, (_, targets) in zip(sums, batches, strict=False):  # none off the last stage
            total += torch.stack([loss_sum, trained_targets(targets)])
        return total

    def _forward_only(self, batches: list[MicroBatch]) -> list[torch.Tensor]:
        """The last stage's loss sum of each batch, without the schedule: each batch passes the
        stages in order, its activations sent point to point between their ranks. The schedules'
        own forward-only pass does not exist in every torch a container runs (2.8 has none), and
        evaluation is rare enough that overlapping its micro-batches gains little."""
        group = self.topology.pipeline_group()
        me, degree = dist.get_rank(group), dist.get_world_size(group)
        owner = {stage: rank for rank in range(degree)
                 for stage in stage_indices(rank, degree, len(self.stage_ids))}
        modules = dict(zip(self.stage_ids, self.modules, strict=True))
        sums = []
        with torch.no_grad(), self._autocast():
            for inputs, targets in batches:
                hidden = inputs
                for stage in sorted(modules):
                    if stage > 0 and owner[stage - 1] != me:
                        hidden = _receive_activation(owner[stage - 1], group, self.device)
                    hidden = modules[stage](hidden)
                    if stage == self.num_stages - 1:
                        sums.append(causal_lm_loss_sum(self.topology.vocabulary_logits(hidden), targets))
                    elif owner[stage + 1] != me:
                        _send_activation(hidden, owner[stage + 1], group)
        return sums

    def step(self, gate: UpdateGate | None = None) -> torch.Tensor:
        group = self.topology.pipeline_group()
        return self.optimization.step(
            lambda max_norm: parallel.clip_grad_norm(self.optimization.parameters, max_norm, group), gate)

    def current_lr(self) -> float:
        return self.optimization.current_lr()

    def train(self, mode: bool = True) -> None:
        for module in self.modules:
            module.train(mode)

    def scheduler_state(self) -> dict:
        return self.optimization.scheduler_state()

    def load_scheduler(self, state: dict) -> None:
        self.optimization.load_scheduler(state)

    # --- state ---

    def save_checkpoint(self, folder: Path, background_group=None) -> Future | None:
        return write_state(self.optimization.state(self.modules), folder, background_group)

    def load_checkpoint(self, folder: Path) -> None:
        state = self.optimization.state(self.modules)
        read_state(state, folder)
        self.optimization.load_state(self.modules, state)

    def full_state_dict(self) -> dict:
        """Each stage's weights gathered on its first rank (data-parallel and tensor coordinate 0)
        and sent to rank 0 one tensor at a time; rank 0 is the first rank of stage 0."""
        mesh = self.topology.mesh
        leader = all(coordinate == 0 for coordinate in mesh.get_coordinate()[1:])
        gathered: dict[str, torch.Tensor] = {}
        for module in self.modules:
            for name, tensor in _full_tensors(module):
                if leader:
                    gathered[name] = tensor
        if not leader:
            return {}
        return _collect_on_first(gathered, self.topology.pipeline_group(), self.device)

    def close(self) -> None:
        pass


def _release_when_differentiated(logits: torch.Tensor):
    """A hook that frees a micro-batch's logits once their gradient exists.

    The last stage keeps every micro-batch's output until the step ends, to merge them for the
    caller (torch 2.8 always does; later versions unless told not to): with a large vocabulary
    that is the biggest tensor of the step, held for every micro-batch at once. Backward needs the
    logits only until their gradient is computed (the loss saves its own softmax, the head its
    input), so the hook swaps their storage for an empty one; what the schedule merges is empty."""
    reference = weakref.ref(logits)

    def release(gradient: torch.Tensor) -> torch.Tensor:
        kept = reference()
        if kept is not None:
            kept.data = torch.empty(0, dtype=kept.dtype, device=kept.device)
        return gradient

    return release


# Activations between stages are [batch, sequence, hidden]; a header says their dtype (autocast
# decides it) and shape.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _send_activation(tensor: torch.Tensor, destination: int, group) -> None:
    header = torch.tensor([_DTYPES.index(tensor.dtype), *tensor.shape], dtype=torch.int64)
    dist.send(header.to(tensor.device), group_dst=destination, group=group)
    dist.send(tensor.contiguous(), group_dst=destination, group=group)


def _receive_activation(source: int, group, device: torch.device) -> torch.Tensor:
    header = torch.empty(4, dtype=torch.int64, device=device)
    dist.recv(header, group_src=source, group=group)
    dtype, *shape = header.tolist()
    received = torch.empty(shape, dtype=_DTYPES[dtype], device=device)
    dist.recv(received, group_src=source, group=group)
    return received


def _full_tensors(module: nn.Module):
    """(name, unsharded CPU tensor) of every weight of a stage, one at a time (a collective within
    the stage's data-parallel and tensor-parallel ranks)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    for name, tensor in get_model_state_dict(module).items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        yield name, full.detach().cpu()


def _collect_on_first(gathered: dict[str, torch.Tensor], group, device: torch.device) -> dict:
    """The stages' weights, from their first ranks (one pipeline group), on its rank 0 (CPU); each
    tensor travels through the device the group's collectives run on."""
    names: list[dict | None] = [None] * dist.get_world_size(group)
    shapes = {name: (tensor.shape, tensor.dtype) for name, tensor in gathered.items()}
    dist.all_gather_object(names, shapes, group=group)
    if dist.get_rank(group) != 0:
        for name in sorted(gathered):
            dist.send(gathered[name].to(device), group_dst=0, group=group)
        return {}
    state = dict(gathered)
    for sender, listed in enumerate(names[1:], start=1):
        for name in sorted(listed):
            shape, dtype = listed[name]
            received = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(received, group_src=sender, group=group)
            state[name] = received.cpu()
    return state
