"""A run's plan: will it fit, how fast, how long and how much, from what the run would launch.

`plan_request(template, request)` plans a rendered CreateTrainingJob request (what the launcher,
`llmtrain render` and the local runner hold); `plan_run(template, overrides)` plans a template
with a run's overrides. Both return a `Plan`: the memory and speed estimates, the run's hours and
cost, `summary_line()` for one-line reports and `to_dict()` for `--json`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmtrain.core.errors import RequestValidationError
from llmtrain.core.instances import InstanceType, instance_type
from llmtrain.core.program_contract import ProgramContract, request_hyperparameters
from llmtrain.core.spec import CHANNEL_SETTING_PREFIX, TemplateSpec
from llmtrain.core.team_context import placeholder_context
from llmtrain.planner import memory, pipeline_memory, prices, speed
from llmtrain.planner.experts import expert_report
from llmtrain.planner.shapes import ModelShape
from llmtrain.planner.workload import (
    CURRENT,
    Behaviour,
    Layout,
    PlanInputError,
    Workload,
    workload_and_layout,
)

GIB = 1024**3
# SageMaker bills a job from its start (image download, data download) to the upload of its
# model; the planner adds this much to the training time (an assumption, docs/planning.md).
BILLED_STARTUP_SECONDS = 600


@dataclass(frozen=True)
class Plan:
    template: str
    instance: InstanceType
    instance_count: int
    spot: bool
    workload: Workload
    layout: Layout
    memory: memory.MemoryEstimate
    speed: speed.SpeedEstimate
    usd_per_hour: float
    price_source: str
    settings: Mapping[str, Any] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def training_seconds(self) -> float:
        return self.workload.max_steps * self.speed.step_seconds

    @property
    def hours(self) -> float:
        """Billed hours: training plus the job's start-up."""
        return (self.training_seconds + BILLED_STARTUP_SECONDS) / 3600

    @property
    def usd(self) -> float:
        return self.usd_per_hour * self.hours

    def summary_line(self) -> str:
        m, s = self.memory, self.speed
        verdict = "fits" if self.fits else "DOES NOT FIT"
        price = "spot" if self.spot else "on-demand"
        bubble = f", bubble {s.bubble_fraction:.0%}" if self.layout.pipelined else ""
        added = ", ".join(f"{name.replace('_', ' ')} {seconds:.2f} s" for name, seconds in
                          s.objective.named().items())
        added = f" ({added})" if added else ""
        return (
            f"plan: {verdict} ({m.per_gpu / GIB:.1f} of {m.capacity / GIB:.1f} GiB per GPU), "
            f"{s.tokens_per_second:,.0f} tokens/s ({s.tokens_per_second_per_gpu:,.0f}/GPU, "
            f"MFU {s.mfu:.0%}{bubble}), {s.step_seconds:.2f} s/step{added}, "
            f"{self.workload.max_steps:,} steps in "
            f"{self.hours:.1f} h, ${self.usd:,.0f} {price} ({self.instance_count} x "
            f"{self.instance.name} at ${self.usd_per_hour / self.instance_count:,.2f}/h)"
        )

    def pipeline_dict(self) -> dict[str, Any] | None:
        """The pipeline's shape (None without pipeline stages): stages and their layers, the
        micro-batches, the bubble, and which rank holds the most memory (the one reported)."""
        layout = self.layout
        if not layout.pipelined:
            return None
        details = self.memory.details
        return {
            "degree": layout.pipeline,
            "schedule": layout.schedule,
            "stages_per_rank": layout.stages_per_rank,
            "layers_per_stage": list(pipeline_memory.stage_layer_counts(self.workload, layout)),
            "micro_batches": self.workload.grad_accum_steps,
            "bubble_seconds": self.speed.bubble_seconds,
            "bubble_fraction": self.speed.bubble_fraction,
            "fullest_rank": details.get("pipeline_rank"),
            "micro_batches_in_flight": details.get("pipeline_micro_batches_in_flight"),
        }

    def to_dict(self) -> dict[str, Any]:
        work = self.workload
        return {
            "template": self.template,
            "fits": self.fits,
            "instance_type": self.instance.name,
            "instance_count": self.instance_count,
            "gpus": self.layout.world_size,
            "layout": self.layout.describe(),
            "model": {
                "parameters": work.model.num_parameters,
                "active_parameters": work.model.active_parameters,
                "layers": work.model.num_layers,
                "hidden_size": work.model.hidden_size,
                "vocab_size": work.model.vocab_size,
            },
            "workload": {
                "objective": work.objective.name,
                "seq_len": work.seq_len,
                "micro_batch_size": work.micro_batch_size,
                "rows_per_sample": work.objective.rows_per_sample,
                "reference": work.objective.reference,
                "grad_accum_steps": work.grad_accum_steps,
                "global_batch_size": work.samples_per_micro_batch
                * work.grad_accum_steps
                * self.layout.data_parallel,
                "max_steps": work.max_steps,
                "mixed_precision": work.precision,
                "activation_checkpointing": work.activation_checkpointing,
                "compile": work.compile,
                "lora_r": work.lora_r,
            },
            "experts": expert_report(work, self.layout, self.speed),
            "pipeline": self.pipeline_dict(),
            "memory": self.memory.to_dict(),
            "throughput": self.speed.to_dict(),
            "cost": {
                "usd_per_hour": self.usd_per_hour,
                "hours": self.hours,
                "usd": self.usd,
                "spot": self.spot,
                "training_seconds": self.training_seconds,
                "billed_startup_seconds": BILLED_STARTUP_SECONDS,
                "prices": self.price_source,
            },
            "settings": dict(self.settings),
            "summary": self.summary_line(),
        }


@dataclass(frozen=True)
class PlanOptions:
    """What the planner cannot read from a run: the model when it comes from a checkpoint (a
    config.json), the tokenizer's vocabulary, hyperparameters for code other than the platform's
    program (`assume`), the price table, and the training program's contract of the code the
    template version runs (`Catalog.program_contract`; None: the installed program's), which
    `plan_run` checks the run's hyperparameters with, as render does."""

    model: ModelShape | None = None
    vocab_size: int | None = None
    assume: Mapping[str, Any] = field(default_factory=dict)
    price_table: prices.PriceTable | None = None
    program: ProgramContract | None = None

    @property
    def behaviour(self) -> Behaviour:
        """What the version's code does (its contract's capability table), planned with."""
        return CURRENT if self.program is None else Behaviour.of(self.program.capabilities)


DEFAULT_OPTIONS = PlanOptions()


def plan(
    template: TemplateSpec,
    hyperparameters: Mapping[str, Any],
    instance: InstanceType,
    count: int,
    spot: bool,
    options: PlanOptions = DEFAULT_OPTIONS,
    settings: Mapping[str, Any] | None = None,
) -> Plan:
    """Plan the platform's training program with these hyperparameters on `count` instances."""
    if not template.code.is_platform and not options.assume and options.model is None:
        raise PlanInputError(
            f"{template.ref} runs its own training code, which the planner does not know: plan it as "
            "the platform's program with --model-config config.json and --assume KEY=VALUE "
            "(seq_len, micro_batch_size, ...)"
        )
    if instance.gpu_model is None:
        raise PlanInputError(
            f"{instance.name} has no GPU: the planner plans GPU training; choose a GPU instance type"
        )
    given = {**hyperparameters, **options.assume}
    given.setdefault("parallelism", template.distribution.strategy)
    work, layout = workload_and_layout(
        given, instance.gpus, count, model=options.model, vocab_size=options.vocab_size,
        behaviour=options.behaviour,
    )
    table = options.price_table or prices.load()
    return build(template.ref, work, layout, instance, count, spot, table, settings or {})


def build(
    ref: str,
    work: Workload,
    layout: Layout,
    instance: InstanceType,
    count: int,
    spot: bool,
    table: prices.PriceTable,
    settings: Mapping[str, Any],
) -> Plan:
    gpu = instance.gpu_model
    estimate = memory.estimate(work, layout, gpu.memory_bytes)
    rate = speed.estimate(work, layout, speed.Cluster.of(instance, count))
    return Plan(
        template=ref,
        instance=instance,
        instance_count=count,
        spot=spot,
        workload=work,
        layout=layout,
        memory=estimate,
        speed=rate,
        usd_per_hour=table.per_hour(instance.name, spot=spot) * count,
        price_source=table.describe(),
        settings=dict(settings),
    )


def plan_request(
    template: TemplateSpec, request: Mapping[str, Any], options: PlanOptions = DEFAULT_OPTIONS
) -> Plan:
    """Plan a rendered CreateTrainingJob request of `template`."""
    resources = request["ResourceConfig"]
    return plan(
        template,
        request_hyperparameters(request),
        instance_type(resources["InstanceType"]),
        int(resources["InstanceCount"]),
        bool(request.get("EnableManagedSpotTraining")),
        options,
    )


def plan_run(
    template: TemplateSpec, overrides: Mapping[str, Any], options: PlanOptions = DEFAULT_OPTIONS
) -> Plan:
    """Plan a run of `template` with these overrides (validated as the launcher validates them).

    Channels do not change a plan, and where they may read is the team's to say (its datasets
    prefix, which this stand-in context does not know): they are left out here."""
    from llmtrain.core.render import capability_problems, check_program
    from llmtrain.core.run_settings import RunInput, resolve_settings

    platform = placeholder_context(
        environment="plan",
        account="000000000000",
        region="us-east-1",
        resource_prefix="plan",
        warm_pool_cap_seconds=0,
    )
    planned = {k: v for k, v in overrides.items() if not k.startswith(CHANNEL_SETTING_PREFIX)}
    settings = resolve_settings(template, RunInput(run_name="plan", overrides=planned), platform)
    check_program(template, settings, options.program)
    problems = capability_problems(template, settings, options.program)
    if problems:
        raise RequestValidationError(problems)
    hyperparameters = dict(settings.hyperparameters)
    if template.code.is_platform:
        hyperparameters.update(parallelism=template.distribution.strategy, **settings.degrees)
    return plan(
        template,
        hyperparameters,
        instance_type(settings.instance_type),
        settings.instance_count,
        settings.spot,
        options,
        settings=overrides,
    )
