"""`--suggest`: search what a template lets a run change for the fastest and the cheapest plans.

The search varies only settings the template lists under `overridable`, within their bounds:
instance type and count, micro batch size (with gradient accumulation so that the global batch,
and so the recipe and the tokens per step, stay the same), activation checkpointing and
torch.compile. Every candidate is planned like the run itself; those that do not fit are dropped.
`fit_advice` names the single change that makes a run that does not fit fit, for the launcher's
refusal.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from llmtrain.errors import LlmtrainError
from llmtrain.planner.plan import DEFAULT_OPTIONS, Plan, PlanOptions, plan_run
from llmtrain.render import coerce_override
from llmtrain.spec import OverrideRule, TemplateSpec

AC_MODES = ("none", "selective", "full")
MAX_CANDIDATES_PER_SETTING = 8


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


def _batch_settings(template: TemplateSpec, base: Plan, gpus: int, tensor: int) -> Iterator[dict[str, int]]:
    """(micro_batch_size, grad_accum_steps) pairs that keep the run's global batch on `gpus` GPUs."""
    work = base.workload
    samples = work.micro_batch_size * work.grad_accum_steps * base.layout.data_parallel
    data_parallel = gpus // tensor
    for micro in _choices(template, "micro_batch_size", work.micro_batch_size):
        per_step = micro * data_parallel
        if per_step == 0 or samples % per_step:
            continue
        accum = samples // per_step
        if accum == work.grad_accum_steps or _accepts(template, "grad_accum_steps", accum):
            yield {"micro_batch_size": micro, "grad_accum_steps": accum}


def _accepts(template: TemplateSpec, name: str, value: Any) -> bool:
    if _allowed(template, name) is None:
        return False
    try:
        coerce_override(template, name, value)
    except LlmtrainError:
        return False
    return True


def candidate_overrides(template: TemplateSpec, base: Plan) -> Iterator[dict[str, Any]]:
    """Every combination of the searched settings the template allows (the run's own included)."""
    work = base.workload
    types = _choices(template, "instance_type", base.instance.name)
    counts = _choices(template, "instance_count", base.instance_count)
    modes = _choices(template, "activation_checkpointing", work.activation_checkpointing)
    compiles = _choices(template, "compile", work.compile)
    from llmtrain.instances import instance_type

    for kind, count, mode, compiled in itertools.product(types, counts, modes, compiles):
        gpus = instance_type(kind).processes_per_host * count
        for batch in _batch_settings(template, base, gpus, base.layout.tensor):
            changes = {
                "instance_type": kind,
                "instance_count": count,
                "activation_checkpointing": mode,
                "compile": compiled,
                **batch,
            }
            yield {
                name: value
                for name, value in changes.items()
                if _allowed(template, name) is not None and _differs(base, name, value)
            }


def _differs(base: Plan, name: str, value: Any) -> bool:
    current = {
        "instance_type": base.instance.name,
        "instance_count": base.instance_count,
        "activation_checkpointing": base.workload.activation_checkpointing,
        "compile": base.workload.compile,
        "micro_batch_size": base.workload.micro_batch_size,
        "grad_accum_steps": base.workload.grad_accum_steps,
    }
    return current[name] != value


def _plans(
    template: TemplateSpec, overrides: Mapping[str, Any], base: Plan, options: PlanOptions
) -> Iterator[Plan]:
    seen = set()
    for changes in candidate_overrides(template, base):
        key = tuple(sorted(changes.items()))
        if key in seen:
            continue
        seen.add(key)
        try:
            yield plan_run(template, {**overrides, **changes}, options)
        except LlmtrainError:
            continue  # a combination the template or the program refuses (e.g. degrees)


def suggest(
    template: TemplateSpec,
    overrides: Mapping[str, Any],
    options: PlanOptions = DEFAULT_OPTIONS,
    max_hours: float | None = None,
) -> Suggestions:
    base = plan_run(template, overrides, options)
    plans = list(_plans(template, overrides, base, options))
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


def fit_advice(
    template: TemplateSpec, overrides: Mapping[str, Any], options: PlanOptions = DEFAULT_OPTIONS
) -> str:
    """The cheapest change of one setting (micro batch with its accumulation counting as one) the
    template allows that makes the run fit, as words; or where to look when none does."""
    base = plan_run(template, overrides, options)
    single = [
        p
        for p in _plans(template, overrides, base, options)
        if p.fits and len(set(p.settings) - set(overrides)) <= 2 and _one_change(p, overrides)
    ]
    if not single:
        return (
            f"no single setting {template.ref} lets a run change makes it fit; see "
            f"`llmtrain plan {template.ref} --suggest` for combinations"
        )
    best = min(single, key=lambda p: (p.usd, p.training_seconds))
    changed = {k: v for k, v in best.settings.items() if overrides.get(k) != v}
    words = ", ".join(f"{k}={_text(v)}" for k, v in changed.items())
    return (
        f"set {words} (predicted {best.memory.per_gpu / 1024**3:.1f} of "
        f"{best.memory.capacity / 1024**3:.1f} GiB per GPU, ${best.usd:,.0f})"
    )


def _one_change(plan: Plan, overrides: Mapping[str, Any]) -> bool:
    changed = {k for k, v in plan.settings.items() if overrides.get(k) != v}
    return len(changed) == 1 or changed == {"micro_batch_size", "grad_accum_steps"}
