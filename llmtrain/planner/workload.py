"""What a run trains and how it is spread: the planner's typed input.

A `Workload` is read from the hyperparameters a rendered run passes to the training program (the
template's values after the run's overrides, plus `parallelism` and the degrees from its
distribution), with the program's own defaults for the ones left out. llmtrain never imports the
training program, so `PROGRAM_DEFAULTS` repeats the defaults the planner reads from
training_jobs/trainer/config.py; tests/llmtrain/test_planner.py keeps them equal, and
`resolve_layout` follows the program's `resolve_mesh`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmtrain.errors import LlmtrainError
from llmtrain.planner.shapes import ALL_LINEAR, ModelShape, preset_shape

PROGRAM_DEFAULTS: dict[str, Any] = {
    "model_preset": "",
    "model_overrides": {},
    "seq_len": 1024,
    "micro_batch_size": 4,
    "grad_accum_steps": 1,
    "max_steps": 1000,
    "parallelism": "ddp",
    "fsdp_sharding": "full",
    "replicate_degree": 0,
    "shard_degree": 0,
    "tensor_parallel_degree": 1,
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


class PlanInputError(LlmtrainError):
    """The run's settings cannot be planned; the message names the setting and what to change."""


@dataclass(frozen=True)
class Layout:
    """How the ranks are arranged: the strategy and its mesh, on `nodes` instances."""

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

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def data_parallel(self) -> int:
        return self.replicate * self.shard

    @property
    def fsdp_wrapped(self) -> bool:
        """Whether FSDP wraps the model: the program applies it with more than one data-parallel
        rank, with offloading, or alone on one GPU; tensor parallel over the whole world runs
        without it (its weights stay fp32 and autocast computes in bf16, like DDP)."""
        if self.strategy == "smp":
            return True
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
    # Under selective checkpointing, the share of the blocks' matmuls recomputed in backward: 0 for
    # the program's policy (it keeps every matmul output); torchtitan's op-level policy keeps every
    # other one (0.5).
    selective_recompute: float = 0.0

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
    `gpus_per_node` processes (its config.resolve_mesh): degrees of 0 are derived so that their
    product is the world size."""
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
    if world % tensor:
        raise PlanInputError(f"tensor_parallel_degree {tensor} does not divide the world size {world}")
    data_parallel = world // tensor
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
    if replicate * shard * tensor != world:
        raise PlanInputError(
            f"replicate ({replicate}) x shard ({shard}) x tensor parallel ({tensor}) "
            f"degrees must equal the world size {world}"
        )
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
    )
