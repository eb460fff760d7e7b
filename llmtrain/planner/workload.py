"""What a run trains and how it is spread: the planner's typed input.

A `Workload` is read from the hyperparameters a rendered run passes to the training program (the
template's values after the run's overrides, plus `parallelism` and the degrees from its
distribution), parsed by the program's own contract (training_jobs/contract: its defaults, types and
rules), and its `Layout` holds the program's `ParallelDims` as `resolve_cluster` resolves them on the
run's cluster. The program's refusals become PlanInputError, in the program's words.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from llmtrain.errors import LlmtrainError
from llmtrain.planner.shapes import ALL_LINEAR, ModelShape, preset_shape
from training_jobs.contract import ConfigError
from training_jobs.contract.hyperparameters import (
    MULTI_STAGE_SCHEDULES,
    TrainConfig,
    from_hyperparameters,
    hyperparameter_fields,
    pipeline_split,
    pipeline_stages_per_rank,
)
from training_jobs.contract.parallel_dims import ParallelDims, resolve_cluster


class PlanInputError(LlmtrainError):
    """The run's settings cannot be planned; the message names the setting and what to change."""


@dataclass(frozen=True)
class Layout:
    """How the ranks are arranged: the strategy and the program's mesh (`dims`: pipeline x replicate
    x shard x tensor, outermost first), on `nodes` instances. With pipeline stages, `schedule` runs
    `stages_per_rank` stages on each pipeline rank, split as `split` says (decoder layers per stage;
    empty: balanced)."""

    strategy: str
    nodes: int
    gpus_per_node: int
    dims: ParallelDims
    fsdp_sharding: str = "full"
    zero_stage: int = 2
    offload_params: bool = False
    offload_optimizer: bool = False
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    split: tuple[int, ...] = ()

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def pipeline(self) -> int:
        return self.dims.pipeline

    @property
    def tensor(self) -> int:
        return self.dims.tensor

    @property
    def data_parallel(self) -> int:
        return self.dims.data_parallel

    @property
    def shard(self) -> int:
        """Ranks that partition one copy of the model's states: DeepSpeed ZeRO partitions over every
        data-parallel rank (the program's mesh replicates it, DeepSpeed shards inside)."""
        return self.data_parallel if self.strategy == "deepspeed" else self.dims.shard

    @property
    def replicate(self) -> int:
        return 1 if self.strategy == "deepspeed" else self.dims.replicate

    @property
    def pipelined(self) -> bool:
        return self.pipeline > 1

    @property
    def num_stages(self) -> int:
        return self.pipeline * self.stages_per_rank

    @property
    def fsdp_wrapped(self) -> bool:
        """Whether FSDP wraps the model: the program applies it with more than one data-parallel
        rank, with offloading, or alone on one GPU; tensor parallel over the whole world runs
        without it (its weights stay fp32 and autocast computes in bf16, like DDP). Pipeline
        stages are sharded with more than one data-parallel rank or with offloaded parameters."""
        if self.strategy == "smp":
            return True
        if self.pipelined:
            return self.strategy == "fsdp" and (self.data_parallel > 1 or self.offload_params)
        return self.strategy == "fsdp" and (
            self.data_parallel > 1 or self.offload_params or self.offload_optimizer or self.world_size == 1
        )

    def describe(self) -> str:
        if self.strategy in ("fsdp", "smp"):
            parts = [f"{self.strategy} {self.fsdp_sharding}", f"shard {self.shard}"]
            if self.replicate > 1:
                parts.append(f"replicate {self.replicate}")
            if self.tensor > 1:
                parts.append(f"tp {self.tensor}")
            text = ", ".join(parts)
        elif self.strategy == "deepspeed":
            text = f"deepspeed zero-{self.zero_stage} over {self.shard}"
        else:
            text = f"{self.strategy} x{self.replicate}"
        if self.pipelined:
            per_rank = f", {self.stages_per_rank} stages per rank" if self.stages_per_rank > 1 else ""
            text += f", pp {self.pipeline} {self.schedule}{per_rank}"
        offload = [
            name
            for name, on in (("params", self.offload_params), ("optimizer", self.offload_optimizer))
            if on
        ]
        return text + (f", offload {'+'.join(offload)}" if offload else "")


@dataclass(frozen=True)
class Workload:
    """One optimizer step's work per data-parallel rank, and the run's length."""

    model: ModelShape
    seq_len: int
    micro_batch_size: int
    grad_accum_steps: int
    max_steps: int
    precision: str
    activation_checkpointing: str = "none"
    checkpoint_every: int = 1
    activation_offloading: bool = False
    compile: bool = False
    lora_r: int = 0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = (ALL_LINEAR,)
    quantization: str = "none"

    @property
    def micro_batch_tokens(self) -> int:
        return self.seq_len * self.micro_batch_size

    @property
    def lora(self) -> bool:
        return self.lora_r > 0

    @property
    def checkpointed_layers(self) -> int:
        if self.activation_checkpointing == "none":
            return 0
        return len(range(0, self.model.num_layers, self.checkpoint_every))


def program_config(hyperparameters: Mapping[str, Any]) -> TrainConfig:
    """The training program's configuration of a run's hyperparameters, as its contract parses them
    (its defaults, types, bounds and rules); names it does not know (a template's own script's) are
    left out."""
    known = hyperparameter_fields()
    return _program(from_hyperparameters, {name: v for name, v in hyperparameters.items() if name in known})


def hyperparameter_values(hyperparameters: Mapping[str, Any]) -> dict[str, Any]:
    """Every hyperparameter of the program by name: the run's, in their declared types, and the
    program's defaults for the others."""
    return program_config(hyperparameters).flat()


def _program(rule: Callable[..., Any], *args: Any) -> Any:
    """A rule of the program's contract, its refusal as PlanInputError (the program's message)."""
    try:
        return rule(*args)
    except ConfigError as error:
        raise PlanInputError(str(error)) from None


def workload_from_hyperparameters(
    values: Mapping[str, Any], *, model: ModelShape | None = None, vocab_size: int | None = None
) -> Workload:
    """The workload of a run's hyperparameters; `model` replaces the preset (a --model-config)."""
    return workload_of(program_config(values), model=model, vocab_size=vocab_size)


def workload_of(
    config: TrainConfig, *, model: ModelShape | None = None, vocab_size: int | None = None
) -> Workload:
    """The workload of the program's configuration; `model` replaces the preset."""
    data, par, lora, chosen = config.data, config.parallel, config.lora, config.model
    if model is None:
        if not chosen.model_preset:
            raise PlanInputError(
                "the run sets no model_preset: pass the model's config with --model-config config.json"
            )
        model = preset_shape(chosen.model_preset, data.seq_len, chosen.model_overrides, vocab_size)
    elif vocab_size:
        model = model.with_vocab(vocab_size)
    return Workload(
        model=model,
        seq_len=data.seq_len,
        micro_batch_size=data.micro_batch_size,
        grad_accum_steps=data.grad_accum_steps,
        max_steps=config.run.max_steps,
        precision=par.mixed_precision,
        activation_checkpointing=par.activation_checkpointing,
        checkpoint_every=par.activation_checkpointing_every,
        activation_offloading=par.activation_offloading,
        compile=par.compile,
        lora_r=lora.lora_r,
        lora_dropout=lora.lora_dropout,
        lora_targets=tuple(lora.lora_target_modules),
        quantization=lora.quantization,
    )


def resolve_layout(values: Mapping[str, Any], gpus_per_node: int, nodes: int) -> Layout:
    """The mesh the program builds for these hyperparameters on `nodes` instances of
    `gpus_per_node` processes (its ParallelDims.resolve)."""
    config = program_config(values)
    dims = _program(ParallelDims.resolve, config.parallel, nodes * gpus_per_node, nodes)
    return layout_of(config, dims, gpus_per_node, nodes)


def layout_of(config: TrainConfig, dims: ParallelDims, gpus_per_node: int, nodes: int) -> Layout:
    par = config.parallel
    return Layout(
        strategy=par.parallelism,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        dims=dims,
        fsdp_sharding=par.fsdp_sharding,
        zero_stage=par.zero_stage,
        offload_params=par.offload_params,
        offload_optimizer=par.offload_optimizer,
        schedule=par.pipeline_schedule,
        stages_per_rank=pipeline_stages_per_rank(par),
        split=pipeline_split(par.pipeline_split),
    )


def check_pipeline(work: Workload, layout: Layout) -> None:
    """The program's rules for pipeline stages that need the model (its check_splittable and stage
    split) and torch's schedules' own, with the setting to change."""
    if not layout.pipelined:
        return
    problem = _pipeline_problem(work, layout)
    if problem:
        raise PlanInputError(problem)


def _pipeline_problem(work: Workload, layout: Layout) -> str | None:
    """What the program refuses only once it sees the model (its stage_model and strategy), and
    torch's interleaved schedules' rounds; the contract checked the settings themselves."""
    p, m = layout.pipeline, work.grad_accum_steps
    checks = (
        (
            work.model.family != "llama",
            f"{work.model.family} models cannot be split into pipeline stages (Llama-style ones can)",
        ),
        (
            work.model.tie_embeddings,
            "the model ties its input and output embeddings, which would sit on the first and the last "
            'stage: set model_overrides {"tie_word_embeddings": false} or pipeline_parallel_degree=1',
        ),
        (
            bool(layout.split) and sum(layout.split) != work.model.num_layers,
            f"pipeline_split places {sum(layout.split)} decoder layers and the model has "
            f"{work.model.num_layers}",
        ),
        (
            work.model.num_layers < layout.num_stages,
            f"{layout.num_stages} pipeline stages need at least as many decoder layers, and the model "
            f"has {work.model.num_layers}: lower pipeline_parallel_degree or pipeline_stages_per_rank",
        ),
        (
            layout.schedule in MULTI_STAGE_SCHEDULES and m % max(1, m // p) != 0,
            f"pipeline_schedule {layout.schedule} runs the {m} micro-batches in rounds of about {p}: "
            f"choose a number of micro-batches divisible by {max(1, m // p)}",
        ),
    )
    return next((message for failed, message in checks if failed), None)


def workload_and_layout(
    values: Mapping[str, Any],
    gpus_per_node: int,
    nodes: int,
    *,
    model: ModelShape | None = None,
    vocab_size: int | None = None,
) -> tuple[Workload, Layout]:
    """The workload and the mesh of a run's hyperparameters, checked as the program checks them
    (grad_accum_steps derived from global_batch_size on this cluster)."""
    config, dims = _program(resolve_cluster, program_config(values), nodes * gpus_per_node, nodes)
    layout = layout_of(config, dims, gpus_per_node, nodes)
    work = workload_of(config, model=model, vocab_size=vocab_size)
    check_pipeline(work, layout)
    return work, layout
