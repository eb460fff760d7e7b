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

from llmtrain.core.errors import LlmtrainError
from llmtrain.planner.objective_load import ObjectiveLoad, objective_load
from llmtrain.planner.shapes import ALL_LINEAR, ModelShape, preset_shape
from training_jobs.contract import ConfigError
from training_jobs.contract.capabilities import CAPABILITIES
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
class Behaviour:
    """What the code a template version runs does, from its contract's capability table
    (training_jobs/contract/capabilities.py; llmtrain.core.program_contract.LEGACY_CAPABILITIES for code
    frozen before the table): the planner plans a run of a published version with its frozen
    code's behaviour, not today's."""

    sequence_parallel: bool  # tensor parallel may shard the residual stream on the sequence
    loss_parallel: bool  # embedding and head split on the vocabulary, the loss on the shards
    chunked_loss: bool  # no fp32 copy of the logits
    context_parallel: bool
    selective_policy: str  # "torchtitan_op" or "every_matmul"
    fp8: bool  # the code ships torchao
    # FSDP2 shards an expert slice over the ranks holding the same experts (older code: whole on each)
    expert_copies_sharded: bool = True

    @classmethod
    def of(cls, capabilities: Mapping[str, object]) -> Behaviour:
        return cls(
            sequence_parallel=bool(capabilities.get("sequence_parallel")),
            loss_parallel=bool(capabilities.get("loss_parallel")),
            chunked_loss=bool(capabilities.get("chunked_loss")),
            context_parallel=bool(capabilities.get("context_parallel")),
            selective_policy=str(capabilities.get("selective_policy") or "every_matmul"),
            fp8=bool(capabilities.get("fp8")),
            expert_copies_sharded=capabilities.get("expert_copies") == "sharded",
        )


# The installed program's (the working tree's: code that is not frozen).
CURRENT = Behaviour.of(CAPABILITIES)


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
    # Tensor parallel shards the residual stream on the sequence (the run's sequence_parallel, where
    # the code has it).
    sequence_parallel: bool = False

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
    def context(self) -> int:
        return self.dims.context

    @property
    def sequence_shards(self) -> int:
        """How many ranks split each token of a rank's sequence part between the tensor-parallel
        regions: the tensor-parallel ranks with sequence parallel, else 1."""
        return self.tensor if self.sequence_parallel else 1

    @property
    def shard(self) -> int:
        """Ranks that partition one copy of the model's states: DeepSpeed ZeRO partitions over every
        data-parallel rank (the program's mesh replicates it, DeepSpeed shards inside); FSDP2 shards
        over the shard and context ranks."""
        if self.strategy == "deepspeed":
            return self.data_parallel
        return self.dims.shard * self.dims.context

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
        sharded_ranks = self.data_parallel * self.context
        if self.pipelined:
            return self.strategy == "fsdp" and (sharded_ranks > 1 or self.offload_params)
        return self.strategy == "fsdp" and (
            sharded_ranks > 1 or self.offload_params or self.offload_optimizer or self.world_size == 1
        )

    def describe(self) -> str:
        if self.strategy in ("fsdp", "smp"):
            parts = [f"{self.strategy} {self.fsdp_sharding}", f"shard {self.shard}"]
            if self.replicate > 1:
                parts.append(f"replicate {self.replicate}")
            if self.context > 1:
                parts.append(f"cp {self.context}")
            if self.tensor > 1:
                parts.append(f"tp {self.tensor}" + (" sp" if self.sequence_parallel else ""))
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
    """One optimizer step's work per data-parallel rank, and the run's length. `seq_len` and
    `micro_batch_size` are the rows the policy trains on (a DPO pair is two rows, a GRPO prompt
    grpo_group_size rows of prompt and completion: `objective`, llmtrain.planner.objective_load)."""

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
    fp8: bool = False
    fp8_recipe: str = "tensorwise"
    behaviour: Behaviour = CURRENT
    # Ranks each mixture-of-experts layer's experts are split over (expert_parallel_degree).
    expert_parallel: int = 1
    objective: ObjectiveLoad = ObjectiveLoad()

    @property
    def samples_per_micro_batch(self) -> int:
        """The micro batch in the run's samples (pairs, prompts), not rows."""
        return self.micro_batch_size // self.objective.rows_per_sample

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
    values: Mapping[str, Any],
    *,
    model: ModelShape | None = None,
    vocab_size: int | None = None,
    behaviour: Behaviour = CURRENT,
) -> Workload:
    """The workload of a run's hyperparameters; `model` replaces the preset (a --model-config)."""
    return workload_of(program_config(values), model=model, vocab_size=vocab_size, behaviour=behaviour)


def workload_of(
    config: TrainConfig,
    *,
    model: ModelShape | None = None,
    vocab_size: int | None = None,
    behaviour: Behaviour = CURRENT,
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
    load = objective_load(config)
    return Workload(
        model=model,
        seq_len=data.seq_len + load.sampled_tokens,
        micro_batch_size=data.micro_batch_size * load.rows_per_sample,
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
        fp8=par.fp8,
        fp8_recipe=par.fp8_recipe,
        behaviour=behaviour,
        expert_parallel=max(par.expert_parallel_degree, 1),
        objective=load,
    )


def resolve_layout(
    values: Mapping[str, Any], gpus_per_node: int, nodes: int, behaviour: Behaviour = CURRENT
) -> Layout:
    """The mesh the program builds for these hyperparameters on `nodes` instances of
    `gpus_per_node` processes (its ParallelDims.resolve)."""
    config = program_config(values)
    dims = _program(ParallelDims.resolve, config.parallel, nodes * gpus_per_node, nodes)
    return layout_of(config, dims, gpus_per_node, nodes, behaviour)


def layout_of(
    config: TrainConfig, dims: ParallelDims, gpus_per_node: int, nodes: int, behaviour: Behaviour = CURRENT
) -> Layout:
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
        sequence_parallel=dims.tensor > 1 and par.sequence_parallel and behaviour.sequence_parallel,
    )


def check_model(work: Workload, layout: Layout) -> None:
    """The program's rules that need the model: for pipeline stages (its check_splittable and stage
    split, and torch's schedules' own), for tensor and context parallel (its check_supported and
    check_context_parallel), with the setting to change."""
    problem = _expert_problem(work, layout) or _model_parallel_problem(work, layout)
    if problem is None and layout.pipelined:
        problem = _pipeline_problem(work, layout)
    if problem:
        raise PlanInputError(problem)


def _expert_problem(work: Workload, layout: Layout) -> str | None:
    """The program's expert rules (training_jobs/contract/moe.py: check_model) for a model it reads
    from a config.json, which the planner reads with --model-config."""
    m, degree = work.model, work.expert_parallel
    if degree > 1 and not m.moe:
        return (f"invalid hyperparameter 'expert_parallel_degree': got {degree}, expected 1: the model is "
                "dense, without experts to split")
    if degree > 1 and m.num_experts % degree:
        return (f"invalid hyperparameter 'expert_parallel_degree': got {degree}, expected a divisor of the "
                f"model's {m.num_experts} experts")
    if not m.moe:
        return None
    for name, what, value in (("tensor_parallel_degree", "tensor parallel", layout.tensor),
                              ("context_parallel_degree", "context parallel", layout.context)):
        if value > 1:
            return (f"invalid hyperparameter {name!r}: got {value}, expected 1 for the model, a mixture of "
                    f"experts: {what} splits dense Llama-layout models only (use expert_parallel_degree "
                    "and fsdp)")
    if work.fp8:
        return ("invalid hyperparameter 'fp8': got True, expected false for the model, a mixture of experts: "
                "FP8 converts linear layers only, so the routed experts would stay in bf16")
    return None


def _model_parallel_problem(work: Workload, layout: Layout) -> str | None:
    """Tensor and context parallel split Llama-layout models only, by heads, columns and vocabulary
    (trainer/tensor_parallel.py check_supported, trainer/parallel.py check_context_parallel)."""
    m, t = work.model, layout.tensor
    if m.family != "llama":
        for name, degree in (("tensor_parallel_degree", t), ("context_parallel_degree", layout.context)):
            if degree > 1:
                return (f"invalid hyperparameter {name!r}: {m.family} models have no supported plan for "
                        f"it (Llama-layout ones do); use {name}=1")
        return None
    if t <= 1:
        return None
    for name, value in (("num_attention_heads", m.num_heads), ("num_key_value_heads", m.num_kv_heads),
                        ("intermediate_size", m.intermediate_size), ("vocab_size", m.vocab_size)):
        if value % t:
            return (f"invalid hyperparameter 'tensor_parallel_degree': {t} does not divide the model's "
                    f"{name} ({value})")
    return None


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
    behaviour: Behaviour = CURRENT,
) -> tuple[Workload, Layout]:
    """The workload and the mesh of a run's hyperparameters, checked as the program checks them
    (grad_accum_steps derived from global_batch_size on this cluster), planned with the behaviour
    of the code that runs them."""
    config, dims = _program(resolve_cluster, program_config(values), nodes * gpus_per_node, nodes)
    layout = layout_of(config, dims, gpus_per_node, nodes, behaviour)
    work = workload_of(config, model=model, vocab_size=vocab_size, behaviour=behaviour)
    check_model(work, layout)
    return work, layout
