"""`--suggest`: search what a template lets a run change for the fastest and the cheapest plans.

The search varies only settings the template lists under `overridable`, within their bounds:
instance type and count, micro batch size (with gradient accumulation so that the global batch,
and so the recipe and the tokens per step, stay the same; a run with a global_batch_size keeps it
and the program derives the accumulation), activation checkpointing, torch.compile, and the mesh:
pipeline degree, schedule and stages per rank, tensor-parallel degree, and context-parallel degree for
sequences of LONG_SEQUENCE tokens or more, and the expert-parallel degree of a mixture of experts
(sequence parallel comes with tensor parallel: the program
turns it on with it; with an explicit shard_degree the search moves ranks between the shard and the
context dimensions so that the mesh still covers every GPU). Every candidate is
planned like the run itself; those that do not fit are dropped. Meshes are screened first (each
with every checkpointing mode, on the run's instances), and the run's own and the best
`MESHES_KEPT` (the fastest that fit there, else the smallest) are searched with everything else,
which keeps the search to hundreds of plans.
`fit_advice` names the single change that makes a run that does not fit fit, for the launcher's
refusal.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from llmtrain.core.errors import LlmtrainError
from llmtrain.core.run_settings import coerce_override
from llmtrain.core.spec import OverrideRule, TemplateSpec
from llmtrain.planner.plan import DEFAULT_OPTIONS, Plan, PlanOptions, plan_run
from training_jobs.contract.hyperparameters import MULTI_STAGE_SCHEDULES

AC_MODES = ("none", "selective", "full")
MAX_CANDIDATES_PER_SETTING = 8
# The settings that shape the mesh, searched together (pipeline_split is kept: it names stages).
MESH_SETTINGS = (
    "pipeline_parallel_degree",
    "pipeline_schedule",
    "pipeline_stages_per_rank",
    "tensor_parallel_degree",
    "context_parallel_degree",
    # borrowed from the data-sharding ranks (the data-parallel size stays), searched for a mixture
    # of experts only: more ranks per expert set gather fewer experts but send more tokens
    "expert_parallel_degree",
)
MESHES_KEPT = 3
# Context parallel is searched from this sequence length on: below it each rank's attention is too
# short a share of the step for splitting the sequence to pay for its key/value all-gathers.
LONG_SEQUENCE = 16384


@dataclass(frozen=True)
class Suggestions:
    current: Plan
    fastest: Plan | None
    cheapest: Plan | None  # the cheapest that finishes within max_hours (when given), else overall
    candidates: int
    fitting: int
    max_hours: float | None = None


def _allowed(template: TemplateSpec, name: str) -> OverrideRule | None:
    return template.overridable.get(name)


def _powers_of_two(rule: OverrideRule, current: int) -> list[int]:
    if rule.choices is not None:
        return sorted({int(c) for c in rule.choices})
    low, high = int(rule.min or 1), int(rule.max or max(current, 1))
    values, value = {current}, 1
    while value <= high and len(values) < 2 * MAX_CANDIDATES_PER_SETTING:
        if value >= low:
            values.add(value)
        value *= 2
    return sorted(values)


def _choices(template: TemplateSpec, name: str, current: Any) -> list[Any]:
    rule = _allowed(template, name)
    if rule is None:
        return [current]
    if name in ("activation_checkpointing",):
        return [c for c in (rule.choices or AC_MODES) if c in AC_MODES]
    if rule.type == "bool":
        return [False, True]
    if rule.type == "int":
        return _powers_of_two(rule, int(current))
    return list(rule.choices or [current])


def _batch_settings(
    template: TemplateSpec, base: Plan, gpus: int, model_parallel: int, global_batch: bool
) -> Iterator[dict[str, int]]:
    """(micro_batch_size, grad_accum_steps) pairs that keep the run's global batch on `gpus` GPUs
    of which `model_parallel` (tensor x pipeline degrees) hold one model replica; with a
    global_batch_size, micro batch sizes that divide it (the program derives the accumulation)."""
    work = base.workload
    samples = work.samples_per_micro_batch * work.grad_accum_steps * base.layout.data_parallel
    data_parallel = gpus // model_parallel
    for micro in _choices(template, "micro_batch_size", work.samples_per_micro_batch):
        per_step = micro * data_parallel
        if per_step == 0 or samples % per_step:
            continue
        accum = samples // per_step
        if global_batch:
            yield {"micro_batch_size": micro}
        elif accum == work.grad_accum_steps or _accepts(template, "grad_accum_steps", accum):
            yield {"micro_batch_size": micro, "grad_accum_steps": accum}


def _accepts(template: TemplateSpec, name: str, value: Any) -> bool:
    if _allowed(template, name) is None:
        return False
    try:
        coerce_override(template, name, value)
    except LlmtrainError:
        return False
    return True


def _mesh(plan: Plan) -> dict[str, Any]:
    layout = plan.layout
    return {
        "pipeline_parallel_degree": layout.pipeline,
        "pipeline_schedule": layout.schedule,
        "pipeline_stages_per_rank": layout.stages_per_rank,
        "tensor_parallel_degree": layout.tensor,
        "context_parallel_degree": layout.context,
        "expert_parallel_degree": layout.dims.expert,
    }


def _mesh_choices(template: TemplateSpec, base: Plan, current: Mapping[str, Any]) -> list[list[Any]]:
    """Each mesh setting's candidate values; context parallel only for long sequences."""
    choices = []
    for name in MESH_SETTINGS:
        long = base.workload.seq_len >= LONG_SEQUENCE
        searched = ((name != "context_parallel_degree" or long)
                    and (name != "expert_parallel_degree" or base.workload.model.moe))
        choices.append(_choices(template, name, current[name]) if searched else [current[name]])
    return choices


def _shard_for_context(template: TemplateSpec, base: Plan, changes: dict[str, Any]) -> dict[str, Any] | None:
    """`changes` with the shard degree that keeps the mesh's size when the context degree moves
    (the program derives it unless the template sets it); None when no shard degree does."""
    context = changes.get("context_parallel_degree")
    explicit = template.distribution.shard_degree
    if context is None or not explicit:
        return changes
    ranks = base.layout.dims.shard * base.layout.context
    if ranks % context or _allowed(template, "shard_degree") is None:
        return None
    return {**changes, "shard_degree": ranks // context}


def mesh_changes(template: TemplateSpec, base: Plan) -> list[dict[str, Any]]:
    """Every mesh the template lets a run choose, as the settings that differ from the run's
    (the run's own first, as {}): pipeline degree, schedule with its stages per rank, tensor
    degree, context degree (long sequences), expert degree (mixtures of experts)."""
    current = _mesh(base)
    found: list[dict[str, Any]] = [{}]
    for pp, schedule, per_rank, tp, cp, ep in itertools.product(*_mesh_choices(template, base, current)):
        if pp > 1 and (schedule in MULTI_STAGE_SCHEDULES) != (per_rank > 1):
            continue  # the program's rule: several stages per rank exactly for the interleaved ones
        if pp == 1 and (schedule, per_rank) != (
            current["pipeline_schedule"],
            current["pipeline_stages_per_rank"],
        ):
            continue  # without pipeline stages the schedule does not matter
        mesh = dict(zip(MESH_SETTINGS, (pp, schedule, per_rank, tp, cp, ep), strict=True))
        changes = {name: value for name, value in mesh.items() if value != current[name]}
        if not changes or not all(_allowed(template, name) is not None for name in changes):
            continue
        changes = _shard_for_context(template, base, changes)
        if changes is not None and changes not in found:
            found.append(changes)
    return found


def candidate_overrides(
    template: TemplateSpec, base: Plan, meshes: list[dict[str, Any]] | None = None, global_batch: bool = False
) -> Iterator[dict[str, Any]]:
    """Every combination of the searched settings the template allows (the run's own included),
    on each of `meshes` (the run's own by default)."""
    work = base.workload
    types = _choices(template, "instance_type", base.instance.name)
    counts = _choices(template, "instance_count", base.instance_count)
    modes = _choices(template, "activation_checkpointing", work.activation_checkpointing)
    compiles = _choices(template, "compile", work.compile)
    from llmtrain.core.instances import instance_type

    for mesh in meshes or [{}]:
        chosen = {**_mesh(base), **mesh}
        model_parallel = (chosen["pipeline_parallel_degree"] * chosen["tensor_parallel_degree"]
                          * chosen["context_parallel_degree"])
        for kind, count, mode, compiled in itertools.product(types, counts, modes, compiles):
            gpus = instance_type(kind).processes_per_host * count
            for batch in _batch_settings(template, base, gpus, model_parallel, global_batch):
                changes = {
                    "instance_type": kind,
                    "instance_count": count,
                    "activation_checkpointing": mode,
                    "compile": compiled,
                    **batch,
                }
                yield {
                    **mesh,
                    **{
                        name: value
                        for name, value in changes.items()
                        if _allowed(template, name) is not None and _differs(base, name, value)
                    },
                }


def _differs(base: Plan, name: str, value: Any) -> bool:
    current = {
        "instance_type": base.instance.name,
        "instance_count": base.instance_count,
        "activation_checkpointing": base.workload.activation_checkpointing,
        "compile": base.workload.compile,
        "micro_batch_size": base.workload.samples_per_micro_batch,
        "grad_accum_steps": base.workload.grad_accum_steps,
    }
    return current[name] != value


def _plans(
    template: TemplateSpec,
    overrides: Mapping[str, Any],
    base: Plan,
    options: PlanOptions,
    candidates: Iterator[dict[str, Any]] | None = None,
) -> Iterator[Plan]:
    seen = set()
    for changes in candidates if candidates is not None else candidate_overrides(template, base):
        key = tuple(sorted(changes.items()))
        if key in seen:
            continue
        seen.add(key)
        try:
            yield plan_run(template, {**overrides, **changes}, options)
        except LlmtrainError:
            continue  # a combination the template or the program refuses (e.g. degrees)


def _search(
    template: TemplateSpec, overrides: Mapping[str, Any], base: Plan, options: PlanOptions
) -> list[Plan]:
    """Meshes screened (each checkpointing mode, on the run's instances), then the run's own mesh
    and the `MESHES_KEPT` fastest that fit (or, when none fits there, the smallest) searched with
    everything else."""
    global_batch = bool({**template.hyperparameters, **overrides}.get("global_batch_size"))
    meshes = mesh_changes(template, base)
    if len(meshes) == 1:
        return list(
            _plans(
                template,
                overrides,
                base,
                options,
                candidate_overrides(template, base, global_batch=global_batch),
            )
        )
    modes = _choices(template, "activation_checkpointing", base.workload.activation_checkpointing)
    screening = (
        {
            **mesh,
            **({"activation_checkpointing": mode} if mode != base.workload.activation_checkpointing else {}),
        }
        for mesh in meshes[1:]
        for mode in modes
    )
    screened = list(_plans(template, overrides, base, options, screening))
    # The fastest that fit; when none fits on the run's instances, those that need the least memory.
    ranked = sorted(screened, key=lambda p: (not p.fits, p.training_seconds if p.fits else p.memory.per_gpu))
    kept: list[dict[str, Any]] = [{}]
    for plan in ranked:
        names = (*MESH_SETTINGS, "shard_degree")
        mesh = {name: plan.settings[name] for name in names if name in plan.settings}
        if mesh not in kept:
            kept.append(mesh)
        if len(kept) > MESHES_KEPT:
            break
    searched = _plans(
        template, overrides, base, options, candidate_overrides(template, base, kept, global_batch)
    )
    return screened + list(searched)


def suggest(
    template: TemplateSpec,
    overrides: Mapping[str, Any],
    options: PlanOptions = DEFAULT_OPTIONS,
    max_hours: float | None = None,
) -> Suggestions:
    base = plan_run(template, overrides, options)
    plans = _search(template, overrides, base, options)
    fitting = [p for p in plans if p.fits]
    fastest = min(fitting, key=lambda p: (p.training_seconds, p.usd, len(p.settings)), default=None)
    in_time = [p for p in fitting if max_hours is None or p.hours <= max_hours]
    cheapest = min(in_time, key=lambda p: (p.usd, p.training_seconds, len(p.settings)), default=None)
    return Suggestions(base, fastest, cheapest, len(plans), len(fitting), max_hours)


def set_flags(plan: Plan) -> str:
    """The --set flags that select a suggested plan (on top of the run's own)."""
    return " ".join(f"--set {name}={_text(value)}" for name, value in plan.settings.items())


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def single_changes(
    template: TemplateSpec, overrides: Mapping[str, Any], base: Plan
) -> Iterator[dict[str, Any]]:
    """Each change of one setting the search varies (micro batch with its accumulation, and the
    mesh's settings together, count as one)."""
    global_batch = bool({**template.hyperparameters, **overrides}.get("global_batch_size"))
    work = base.workload
    for name, current in (
        ("instance_type", base.instance.name),
        ("instance_count", base.instance_count),
        ("activation_checkpointing", work.activation_checkpointing),
        ("compile", work.compile),
    ):
        for value in _choices(template, name, current):
            if value != current:
                yield {name: value}
    gpus = base.layout.world_size
    for batch in _batch_settings(
        template, base, gpus, base.layout.pipeline * base.layout.tensor * base.layout.context, global_batch
    ):
        yield {name: value for name, value in batch.items() if _differs(base, name, value)}
    yield from mesh_changes(template, base)[1:]


def fit_advice(
    template: TemplateSpec, overrides: Mapping[str, Any], options: PlanOptions = DEFAULT_OPTIONS
) -> str:
    """The cheapest change of one setting (micro batch with its accumulation, and the mesh's
    settings, counting as one) the template allows that makes the run fit, as words; or where to
    look when none does."""
    base = plan_run(template, overrides, options)
    candidates = (changes for changes in single_changes(template, overrides, base) if changes)
    fitting = [plan for plan in _plans(template, overrides, base, options, candidates) if plan.fits]
    if not fitting:
        return (
            f"no single setting {template.ref} lets a run change makes it fit; see "
            f"`llmtrain plan {template.ref} --suggest` for combinations"
        )
    best = min(fitting, key=lambda p: (p.usd, p.training_seconds))
    changed = {k: v for k, v in best.settings.items() if overrides.get(k) != v}
    words = ", ".join(f"{k}={_text(v)}" for k, v in changed.items())
    return (
        f"set {words} (predicted {best.memory.per_gpu / 1024**3:.1f} of "
        f"{best.memory.capacity / 1024**3:.1f} GiB per GPU, ${best.usd:,.0f})"
    )
