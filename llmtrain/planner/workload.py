"""What a run trains and how it is spread: the planner's typed input.

A `Workload` is read from the hyperparameters a rendered run passes to the training program (the
template's values after the run's overrides, plus `parallelism` and the degrees from its
distribution), with the program's own defaults for the ones left out. llmtrain never imports the
training program, so `PROGRAM_DEFAULTS` repeats the defaults the planner reads from
training_jobs/trainer/config.py; tests/llmtrain/test_planner.py keeps them equal, and
`resolve_layout` follows the program's `resolve_mesh`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmtrain.errors import LlmtrainError
from llmtrain.planner.pipeline import MULTI_STAGE_SCHEDULES, SCHEDULES, default_stages_per_rank
from llmtrain.planner.shapes import ALL_LINEAR, ModelShape, preset_shape

PROGRAM_DEFAULTS: dict[str, Any] = {
    "model_preset": "",
    "model_overrides": {},
    "seq_len": 1024,
    "micro_batch_size": 4,
    "grad_accum_steps": 1,
    "global_batch_size": 0,
    "max_steps": 1000,
    "parallelism": "ddp",
    "fsdp_sharding": "full",
    "replicate_degree": 0,
    "shard_degree": 0,
    "tensor_parallel_degree": 1,
    "pipeline_parallel_degree": 1,
    "pipeline_schedule": "1f1b",
    "pipeline_stages_per_rank": 0,
    "pipeline_split": "",
    "zero_stage": 2,
    "offload_optimizer": False,
    "offload_params": False,
    "mixed_precision": "bf16",
    "activation_checkpointing": "none",
    "activation_checkpointing_every": 1,
    "activation_offloading": False,
    "compile": False,
    "lora_r": 0,
    "lora_dropout": 0.0,
    "lora_target_modules": [ALL_LINEAR],
    "quantization": "none",
}
STRATEGIES = ("single", "ddp", "fsdp", "deepspeed", "smp")
# Strategies that replicate (ddp) or shard (fsdp) pipeline stages (the program's
# PIPELINE_DATA_PARALLELISMS).
PIPELINE_STRATEGIES = ("ddp", "fsdp")


class PlanInputError(LlmtrainError):
    """The run's settings cannot be planned; the message names the setting and what to change."""


@dataclass(frozen=True)
class Layout:
    """How the ranks are arranged: the strategy and its mesh (pipeline x replicate x shard x
    tensor, outermost first, as the program's ParallelDims), on `nodes` instances. With pipeline
    stages, `schedule` runs `stages_per_rank` stages on each pipeline rank, split as `split` says
    (decoder layers per stage; empty: balanced)."""

    strategy: str
    nodes: int
    gpus_per_node: int
    replicate: int
    shard: int
    tensor: int
    fsdp_sharding: str = "full"
    zero_stage: int = 2
    offload_params: bool = False
    offload_optimizer: bool = False
    pipeline: int = 1
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    split: tuple[int, ...] = ()

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def data_parallel(self) -> int:
        return self.replicate * self.shard

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


def hyperparameter_values(hyperparameters: Mapping[str, Any]) -> dict[str, Any]:
    """The program's defaults overlaid with the run's values (JSON strings are decoded, as the
    SageMaker toolkit decodes rendered hyperparameters)."""
    values = dict(PROGRAM_DEFAULTS)
    for name, value in hyperparameters.items():
        if (
            isinstance(value, str)
            and name in PROGRAM_DEFAULTS
            and not isinstance(PROGRAM_DEFAULTS[name], str)
        ):
            try:
                value = json.loads(value)
            except ValueError as error:
                raise PlanInputError(f"hyperparameter {name!r} is {value!r}, not JSON") from error
        values[name] = value
    return values


def workload_from_hyperparameters(
    values: Mapping[str, Any], *, model: ModelShape | None = None, vocab_size: int | None = None
) -> Workload:
    """The workload of a run's hyperparameters; `model` replaces the preset (a --model-config)."""
    seq_len = int(values["seq_len"])
    if model is None:
        if not values.get("model_preset"):
            raise PlanInputError(
                "the run sets no model_preset: pass the model's config with --model-config config.json"
            )
        model = preset_shape(values["model_preset"], seq_len, values.get("model_overrides") or {}, vocab_size)
    elif vocab_size:
        model = model.with_vocab(vocab_size)
    targets = values["lora_target_modules"]
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    return Workload(
        model=model,
        seq_len=seq_len,
        micro_batch_size=int(values["micro_batch_size"]),
        grad_accum_steps=int(values["grad_accum_steps"]),
        max_steps=int(values["max_steps"]),
        precision=str(values["mixed_precision"]),
        activation_checkpointing=str(values["activation_checkpointing"]),
        checkpoint_every=int(values["activation_checkpointing_every"]),
        activation_offloading=bool(values["activation_offloading"]),
        compile=bool(values["compile"]),
        lora_r=int(values["lora_r"]),
        lora_dropout=float(values["lora_dropout"]),
        lora_targets=tuple(targets),
        quantization=str(values["quantization"]),
    )


def resolve_layout(values: Mapping[str, Any], gpus_per_node: int, nodes: int) -> Layout:
    """The mesh the program builds for these hyperparameters on `nodes` instances of
    `gpus_per_node` processes (its ParallelDims.resolve): pipeline x replicate x shard x tensor,
    with degrees of 0 derived so that their product is the world size."""
    strategy = str(values["parallelism"])
    if strategy not in STRATEGIES:
        raise PlanInputError(f"parallelism {strategy!r} is not one of {', '.join(STRATEGIES)}")
    world = nodes * gpus_per_node
    if strategy == "single" and world != 1:
        raise PlanInputError(
            f"parallelism single runs one process, and {world} GPUs would run: "
            "use ddp, fsdp or deepspeed, or one single-GPU instance"
        )
    tensor = max(int(values["tensor_parallel_degree"]), 1)
    pipeline = max(int(values["pipeline_parallel_degree"]), 1)
    if world % (tensor * pipeline):
        degrees = f"tensor_parallel_degree {tensor}"
        if pipeline > 1:
            degrees += f" x pipeline_parallel_degree {pipeline}"
        raise PlanInputError(f"{degrees} does not divide the world size {world}")
    data_parallel = world // (tensor * pipeline)
    sharding = str(values["fsdp_sharding"])
    if strategy in ("single", "ddp"):
        replicate, shard = data_parallel, 1
    elif strategy == "deepspeed":
        replicate, shard = 1, data_parallel
    elif sharding == "hybrid":
        replicate = int(values["replicate_degree"]) or max(1, min(nodes, data_parallel))
        shard = int(values["shard_degree"]) or data_parallel // replicate
    else:
        replicate, shard = 1, int(values["shard_degree"]) or data_parallel
    if pipeline * replicate * shard * tensor != world:
        raise PlanInputError(
            f"pipeline ({pipeline}) x replicate ({replicate}) x shard ({shard}) x tensor parallel "
            f"({tensor}) degrees must equal the world size {world}"
        )
    schedule = str(values["pipeline_schedule"])
    return Layout(
        strategy=strategy,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        replicate=replicate,
        shard=shard,
        tensor=tensor,
        fsdp_sharding=sharding,
        zero_stage=int(values["zero_stage"]),
        offload_params=bool(values["offload_params"]),
        offload_optimizer=bool(values["offload_optimizer"]),
        pipeline=pipeline,
        schedule=schedule,
        stages_per_rank=int(values["pipeline_stages_per_rank"]) or default_stages_per_rank(schedule),
        split=_split(values["pipeline_split"]),
    )


def _split(text: Any) -> tuple[int, ...]:
    """pipeline_split "7,9,9,7" as decoder layers per stage; () for the balanced split."""
    parts = [part.strip() for part in str(text or "").split(",") if part.strip()]
    if not all(part.isdigit() and int(part) > 0 for part in parts):
        raise PlanInputError(
            f'pipeline_split {text!r} must list decoder layers per stage as positive integers, e.g. "7,9,9,7"'
        )
    return tuple(int(part) for part in parts)


def with_global_batch(work: Workload, values: Mapping[str, Any], layout: Layout) -> Workload:
    """The workload with grad_accum_steps derived from global_batch_size, as the program derives
    it for this data-parallel size (unchanged when global_batch_size is 0)."""
    batch = int(values["global_batch_size"])
    if not batch:
        return work
    per_micro_step = layout.data_parallel * work.micro_batch_size
    if batch % per_micro_step:
        raise PlanInputError(
            f"global_batch_size {batch} is not a multiple of data-parallel ranks x micro_batch_size "
            f"({layout.data_parallel} x {work.micro_batch_size} = {per_micro_step}): change "
            "global_batch_size, micro_batch_size or the instance count"
        )
    return dataclasses.replace(work, grad_accum_steps=batch // per_micro_step)


def check_pipeline(work: Workload, layout: Layout) -> None:
    """The program's rules for pipeline stages (config._validate_pipeline, check_splittable, the
    schedules' own), with the setting to change."""
    if not layout.pipelined:
        return
    problem = _pipeline_problem(work, layout)
    if problem:
        raise PlanInputError(problem)


def _pipeline_problem(work: Workload, layout: Layout) -> str | None:
    p, per_rank, m = layout.pipeline, layout.stages_per_rank, work.grad_accum_steps
    multi = layout.schedule in MULTI_STAGE_SCHEDULES
    checks = (
        (
            layout.strategy not in PIPELINE_STRATEGIES,
            f"pipeline_parallel_degree {p} needs parallelism ddp or fsdp (pipeline stages are replicated "
            f"or sharded), not {layout.strategy}",
        ),
        (
            layout.schedule not in SCHEDULES,
            f"pipeline_schedule {layout.schedule!r} is not one of {', '.join(SCHEDULES)}",
        ),
        (
            layout.schedule == "gpipe" and layout.strategy == "ddp" and layout.data_parallel > 1,
            "pipeline_schedule gpipe cannot run stages replicated by DDP (torch's DDP fails when "
            "every forward runs before any backward): use 1f1b, which has the same bubble and holds "
            "fewer micro-batches, or parallelism fsdp",
        ),
        (work.lora, "lora_r must be 0 with pipeline_parallel_degree > 1 (LoRA is not pipelined)"),
        (work.precision == "fp16", "mixed_precision must be bf16 or fp32 with pipeline stages"),
        (
            multi and per_rank < 2 or not multi and per_rank != 1,
            f"pipeline_stages_per_rank {per_rank} does not suit pipeline_schedule {layout.schedule}: "
            + ("2 or more" if multi else "0 or 1"),
        ),
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
            bool(layout.split) and len(layout.split) != layout.num_stages,
            f"pipeline_split {','.join(map(str, layout.split))} needs {layout.num_stages} numbers, one "
            f"per stage (pipeline_parallel_degree {p} x {per_rank} stages per rank)",
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
            m < p,
            f"{m} micro-batches (grad_accum_steps, or global_batch_size / data-parallel ranks / "
            f"micro_batch_size) leave pipeline stages idle: at least pipeline_parallel_degree ({p})",
        ),
        (
            multi and m % max(1, m // p) != 0,
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
    """The workload and the mesh of a run's hyperparameters, checked as the program checks them."""
    layout = resolve_layout(values, gpus_per_node, nodes)
    work = workload_from_hyperparameters(values, model=model, vocab_size=vocab_size)
    work = with_global_batch(work, values, layout)
    check_pipeline(work, layout)
    return work, layout
