"""Hyperparameter tuning of a template: the ranges, the objective, and the SageMaker tuning request.

`llmtrain tune` searches some of a template's hyperparameters for the best value of one of its
metrics. Locally (llmtrain.local.trials) Optuna drives `llmtrain run --local` trials; in the cloud a
SageMaker Automatic Model Tuning job (CreateHyperParameterTuningJob) runs the trials, started
through the team's launcher. Both take the same `TuneSpec`, checked here against the template:

- a range names a hyperparameter the template lets a run override, and lies within its bounds
  (`--param lr=1e-5..1e-3:log`, `--param warmup_steps=10..200:int`, `--param attention=sdpa,eager`),
  and within the training program's own: each end of a range (each value of a list) passes the
  contract of the code the version runs, with the run's other settings (`check_tune_program`);
- the objective is one of the template's metric definitions (`eval:loss`), minimised unless
  `maximize`.

The cloud request is built from the rendered CreateTrainingJob request of the run (llmtrain.core.render),
so the tuning job's trials get exactly what a run gets: the team's role, prefixes, instance type,
VPC, KMS keys and inter-container encryption. Its static hyperparameters are the request's minus the
tuned ones. SageMaker passes tuned values as plain strings (`0.0001`, `50`, `sdpa`, not JSON), which
the training toolkit decodes where they are JSON and the training program's config coerces to each
setting's type. Pure functions: no AWS calls.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmtrain.core.distribution import DEGREE_NAMES
from llmtrain.core.errors import (
    LlmtrainError,
    OverrideError,
    ProgramSettingError,
    did_you_mean,
)
from llmtrain.core.platform import PlatformContext
from llmtrain.core.program_contract import ProgramContract
from llmtrain.core.render import check_program
from llmtrain.core.run_settings import RunInput, coerce_override, resolve_settings
from llmtrain.core.spec import (
    CHANNEL_SETTING_PREFIX,
    PLATFORM_RUN_OPTIONS,
    RESOURCE_SETTINGS,
    TemplateSpec,
)

# `--strategy` -> SageMaker's HyperParameterTuningJobConfig.Strategy.
SEARCH_STRATEGIES = {"bayesian": "Bayesian", "random": "Random", "hyperband": "Hyperband"}
DEFAULT_STRATEGY = "bayesian"
# SageMaker's limits of a tuning job (parallel jobs; the hyperparameters it searches).
MAX_PARALLEL_TRIALS = 100
MAX_TUNED_PARAMETERS = 30
MAX_TUNE_ATTEMPTS = 9
_RANGE = re.compile(r"^(?P<low>[^.:]+(?:\.[^.:]+)?)\.\.(?P<high>[^:]+)(?P<flags>(?::[a-z]+)*)$")
_PARAM_FORMS = "NAME=LOW..HIGH[:log][:int] or NAME=A,B,C"


class TuneError(LlmtrainError):
    """A tune that cannot start as asked; nothing was started. The message says what to fix."""


@dataclass(frozen=True)
class ParamRange:
    """One searched hyperparameter: a continuous or integer range (linear or log scale), or a
    list of values."""

    name: str
    kind: str  # continuous | integer | categorical
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    values: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> ParamRange:
        """`lr=1e-5..1e-3:log`, `warmup_steps=10..200:int`, `attention=sdpa,eager`."""
        name, sep, spec = text.partition("=")
        name, spec = name.strip(), spec.strip()
        if not sep or not name or not spec:
            raise TuneError(f"--param {text!r}: write {_PARAM_FORMS}")
        match = _RANGE.match(spec)
        if match is None:
            values = tuple(v.strip() for v in spec.split(","))
            if len(values) < 2 or not all(values):
                raise TuneError(
                    f"--param {text!r}: a list needs two or more values (A,B); a range is "
                    f"LOW..HIGH; write {_PARAM_FORMS}"
                )
            return cls(name, "categorical", values=values)
        flags = [flag for flag in match["flags"].split(":") if flag]
        unknown = sorted(set(flags) - {"log", "int"})
        if unknown:
            raise TuneError(
                f"--param {text!r}: unknown flag(s) {', '.join(unknown)}; flags are :log and :int"
            )
        kind = "integer" if "int" in flags else "continuous"
        try:
            low, high = (int(v) if kind == "integer" else float(v) for v in (match["low"], match["high"]))
        except ValueError as error:
            what = "integers" if kind == "integer" else "numbers"
            raise TuneError(f"--param {text!r}: LOW and HIGH must be {what}") from error
        if not low < high:
            raise TuneError(f"--param {text!r}: LOW must be below HIGH")
        if "log" in flags and low <= 0:
            raise TuneError(f"--param {text!r}: a log scale needs LOW above 0")
        return cls(name, kind, low=low, high=high, log="log" in flags)

    def describe(self) -> str:
        if self.kind == "categorical":
            return f"{self.name}={','.join(self.values)}"
        flags = (":int" if self.kind == "integer" else "") + (":log" if self.log else "")
        return f"{self.name}={self.low!r}..{self.high!r}{flags}"  # repr: exact, and parsed back as it was

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.kind == "categorical":
            data["values"] = list(self.values)
        else:
            data.update(low=self.low, high=self.high, log=self.log)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParamRange:
        if not isinstance(data, Mapping) or data.get("kind") not in ("continuous", "integer", "categorical"):
            raise TuneError(
                f"a tune parameter must be an object with kind continuous, integer or "
                f"categorical, got {data!r:.120}"
            )
        if data["kind"] == "categorical":
            return cls(str(data["name"]), "categorical", values=tuple(str(v) for v in data["values"]))
        return ParamRange(
            str(data["name"]),
            data["kind"],
            low=data["low"],
            high=data["high"],
            log=bool(data.get("log", False)),
        )

    def sagemaker_range(self) -> tuple[str, dict[str, Any]]:
        """(ParameterRanges member, the range) as CreateHyperParameterTuningJob takes it."""
        if self.kind == "categorical":
            return "CategoricalParameterRanges", {"Name": self.name, "Values": list(self.values)}
        member = "IntegerParameterRanges" if self.kind == "integer" else "ContinuousParameterRanges"
        return member, {
            "Name": self.name,
            "MinValue": _plain_number(self.low),
            "MaxValue": _plain_number(self.high),
            "ScalingType": "Logarithmic" if self.log else "Linear",
        }


def _plain_number(value: float | int | None) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))


@dataclass(frozen=True)
class TuneSpec:
    """What a tune searches and how: the ranges, the objective metric and its direction, the number
    of trials and how many run at once, the strategy, early stopping of poor trials, and the earlier
    tunes (their run names) whose trials a cloud tune starts from (warm start)."""

    params: tuple[ParamRange, ...]
    objective: str
    maximize: bool = False
    trials: int = 8
    parallel: int = 1
    strategy: str = DEFAULT_STRATEGY
    early_stopping: bool = True
    warm_start_from: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(self.params))
        object.__setattr__(self, "warm_start_from", tuple(self.warm_start_from))
        problem = self._problem()
        if problem:
            raise TuneError(problem)

    def _problem(self) -> str | None:
        if not self.params:
            return "name at least one --param to tune"
        if len(self.params) > MAX_TUNED_PARAMETERS:
            return f"SageMaker tunes at most {MAX_TUNED_PARAMETERS} hyperparameters; got {len(self.params)}"
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            return f"--param names a hyperparameter twice: {sorted({n for n in names if names.count(n) > 1})}"
        if self.strategy not in SEARCH_STRATEGIES:
            return f"--strategy {self.strategy!r}: use one of {', '.join(SEARCH_STRATEGIES)}"
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 1:
            return f"--trials must be a whole number of at least 1, got {self.trials!r}"
        if (
            isinstance(self.parallel, bool)
            or not isinstance(self.parallel, int)
            or not (1 <= self.parallel <= min(self.trials, MAX_PARALLEL_TRIALS))
        ):
            return (
                f"--parallel must be a whole number from 1 to --trials ({self.trials}) and at most "
                f"{MAX_PARALLEL_TRIALS}, got {self.parallel!r}"
            )
        return None

    @property
    def tuned_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def options(self) -> list[str]:
        """The `llmtrain tune` options that ask for this search."""
        options = [item for p in self.params for item in ("--param", p.describe())]
        options += ["--objective", self.objective, "--trials", str(self.trials),
                    "--parallel", str(self.parallel)]
        options += ["--maximize"] if self.maximize else []
        options += ["--strategy", self.strategy] if self.strategy != DEFAULT_STRATEGY else []
        options += [] if self.early_stopping else ["--no-early-stopping"]
        options += [item for name in self.warm_start_from for item in ("--warm-start", name)]
        options += ["--seed", str(self.seed)] if self.seed is not None else []
        return options

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "params": [p.to_dict() for p in self.params],
            "objective": self.objective,
            "maximize": self.maximize,
            "trials": self.trials,
            "parallel": self.parallel,
            "strategy": self.strategy,
            "early_stopping": self.early_stopping,
        }
        if self.warm_start_from:
            data["warm_start_from"] = list(self.warm_start_from)
        if self.seed is not None:
            data["seed"] = self.seed
        return data

    @classmethod
    def from_dict(cls, data: Any) -> TuneSpec:
        if not isinstance(data, Mapping):
            raise TuneError(f"'tune' must be an object, got {data!r:.80}")
        known = {
            "params",
            "objective",
            "maximize",
            "trials",
            "parallel",
            "strategy",
            "early_stopping",
            "warm_start_from",
            "seed",
        }
        unknown = sorted(set(data) - known)
        if unknown:
            raise TuneError(
                f"'tune' has unknown field(s) {', '.join(unknown)}; it has {', '.join(sorted(known))}"
            )
        if not isinstance(data.get("params"), list) or not isinstance(data.get("objective"), str):
            raise TuneError("'tune' needs 'params' (a list) and 'objective' (a metric name)")
        values = dict(data)
        values["params"] = tuple(ParamRange.from_dict(item) for item in data["params"])
        values["warm_start_from"] = tuple(data.get("warm_start_from") or ())
        return cls(**values)


# --- checks against the template ----------------------------------------------------------------


def check_tune(template: TemplateSpec, tune: TuneSpec, overrides: Mapping[str, Any]) -> None:
    """Refuse a tune the template cannot run: a parameter it does not let a run override, a range
    outside its bounds (naming the bound), a parameter also set with --set, an objective that is not
    one of its metrics."""
    both = sorted(set(tune.tuned_names) & set(overrides))
    if both:
        raise TuneError(f"{', '.join(both)}: tuned with --param and set with --set; drop one")
    for param in tune.params:
        _check_tunable(template, param.name)
        rule = template.overridable[param.name]
        if param.kind == "categorical":
            for value in param.values:
                coerce_override(template, param.name, value)
            continue
        if rule.type not in ("int", "float"):
            raise OverrideError(
                param.name,
                f"is a {rule.type} setting: tune it with a list of values "
                f"({param.name}=A,B), not a range; allowed: {rule.describe()}",
            )
        if rule.type == "int" and param.kind != "integer":
            raise OverrideError(
                param.name,
                f"is an integer setting: write its range with :int "
                f"({param.name}={param.low:g}..{param.high:g}:int)",
            )
        coerce_override(template, param.name, param.low)
        coerce_override(template, param.name, param.high)
    check_objective(template, tune.objective)


def check_tune_program(
    template: TemplateSpec,
    tune: TuneSpec,
    run: RunInput,
    platform: PlatformContext,
    program: ProgramContract | None = None,
) -> None:
    """Refuse a tune whose trials the training program would refuse: the contract of the code the
    version runs (`program`, `Catalog.program_contract`; None: the installed one), on the run as it
    renders (`run`: its other settings). First the trial with every range at its low end (every list
    at its first value), then each range's high end and each list's other values, one at a time with
    the rest low: the program's bounds (the hyperparameters' minimum and maximum, e.g. lr above 0)
    hold over a range when they hold at its ends, and its rules between settings (e.g. min_lr at most
    lr, warmup_steps within the decay horizon) are checked there too. A template's overridable bounds
    may reach past the program's, and a trial beyond them would fail."""
    lows = {p.name: p.values[0] if p.kind == "categorical" else p.low for p in tune.params}
    first = ", ".join(f"{name}={_plain(value)}" for name, value in lows.items())
    _program_refusal(template, run, lows, platform, program, f"the first trial ({first})")
    for param in tune.params:
        for value in param.values[1:] if param.kind == "categorical" else (param.high,):
            what = f"--param {param.describe()}: {param.name}={_plain(value)}"
            _program_refusal(template, run, {**lows, param.name: value}, platform, program, what)


def _program_refusal(
    template: TemplateSpec,
    run: RunInput,
    values: Mapping[str, Any],
    platform: PlatformContext,
    program: ProgramContract | None,
    what: str,
) -> None:
    trial = dataclasses.replace(run, overrides={**run.overrides, **values})
    try:
        check_program(template, resolve_settings(template, trial, platform), program)
    except ProgramSettingError as error:
        raise TuneError(f"{what}: the training program of {template.ref} refuses it: {error}; keep the "
                        "ranges within what it accepts with the run's settings") from None


def _check_tunable(template: TemplateSpec, name: str) -> None:
    not_hyperparameter = (
        name in RESOURCE_SETTINGS
        or name in DEGREE_NAMES
        or name in PLATFORM_RUN_OPTIONS
        or name.startswith(CHANNEL_SETTING_PREFIX)
    )
    if not_hyperparameter:
        raise OverrideError(
            name,
            "is not a hyperparameter of the training program: a tune searches "
            "hyperparameters only (set it for every trial with --set)",
        )
    if name not in template.overridable:
        tunable = sorted(
            n
            for n in template.overridable
            if n not in RESOURCE_SETTINGS
            and n not in DEGREE_NAMES
            and not n.startswith(CHANNEL_SETTING_PREFIX)
        )
        raise OverrideError(
            name,
            f"{template.ref} does not let a run set it{did_you_mean(name, tunable)}; "
            f"it lets a run set (and so tune): {', '.join(tunable)}",
        )


def check_objective(template: TemplateSpec, objective: str) -> None:
    names = [m.name for m in template.metrics]
    if objective not in names:
        raise TuneError(
            f"--objective {objective!r} is not one of {template.ref}'s metrics"
            f"{did_you_mean(objective, names)}: {', '.join(names) or 'none'}"
        )


_EVALUATION = re.compile(r"(^|[^a-z])(eval|val|validation)([^a-z]|$)", re.IGNORECASE)


def is_evaluation_metric(name: str) -> bool:
    """A metric of the evaluation pass (eval:loss), which the program prints only with a
    validation channel."""
    return _EVALUATION.search(name) is not None


def objective_reports(objective: str, hyperparameters: Mapping[str, Any]) -> int:
    """How many values of the objective a trial reports (Hyperband's resource): one per evaluation,
    or per logging step for a training metric, and at the end."""
    max_steps = int(hyperparameters.get("max_steps") or 1)
    every_name = "eval_every_steps" if is_evaluation_metric(objective) else "log_every_steps"
    every = int(hyperparameters.get(every_name) or max_steps) or max_steps
    return max(1, math.ceil(max_steps / every))


# --- results --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trial:
    """One trial of a tune, local or cloud: its values, its objective (None if it reported none),
    and how it ended."""

    number: int
    params: Mapping[str, Any]
    objective: float | None
    status: str  # Completed | Pruned | Failed | Stopped | InProgress | ...
    name: str = ""
    detail: str = ""
    values: Sequence[tuple[int, float]] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "name": self.name,
            "params": dict(self.params),
            "objective": self.objective,
            "status": self.status,
            "detail": self.detail,
        }


def best_trial(trials: Iterable[Trial], *, maximize: bool) -> Trial | None:
    scored = [t for t in trials if t.objective is not None and t.status == "Completed"]
    if not scored:
        return None
    return (max if maximize else min)(scored, key=lambda t: t.objective)


def best_so_far(trials: Sequence[Trial], *, maximize: bool) -> list[float | None]:
    """The best completed objective after each trial, in trial order (the plot's line)."""
    best: float | None = None
    line = []
    for trial in trials:
        if trial.objective is not None and trial.status == "Completed":
            better = best is None or (trial.objective > best if maximize else trial.objective < best)
            best = trial.objective if better else best
        line.append(best)
    return line


def start_command(
    template_ref: str, run_name: str, overrides: Mapping[str, Any], params: Mapping[str, Any], where: str = ""
) -> str:
    """The `llmtrain start` of a full run with the best trial's values."""
    sets = {**{k: _plain(v) for k, v in overrides.items()}, **{k: _plain(v) for k, v in params.items()}}
    options = "".join(f" --set {shlex.quote(f'{k}={v}')}" for k, v in sets.items())
    return f"llmtrain start {template_ref} --run-name {run_name}{options}{where}"


# What a local tune's --set values usually shrink the trials with (their length, their hosts, the
# evaluation cadence scaled to that length): a full run takes the template's own values instead.
TRIAL_ONLY_SETTINGS = ("max_steps", "instance_count", "eval_every_steps", "eval_steps")


def full_run_command(
    template_ref: str, run_name: str, overrides: Mapping[str, Any], params: Mapping[str, Any]
) -> tuple[str, dict[str, Any]]:
    """The `llmtrain start` of a full run after a local tune: the best trial's values and the tune's
    overrides less TRIAL_ONLY_SETTINGS; returns it with the overrides it left out."""
    dropped = {k: v for k, v in overrides.items() if k in TRIAL_ONLY_SETTINGS and k not in params}
    kept = {k: v for k, v in overrides.items() if k not in dropped}
    return start_command(template_ref, run_name, kept, params), dropped


def _plain(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def check_tune_budget(
    plan: Mapping[str, Any], tune: TuneSpec, *, budget_usd: float | None, team: str
) -> dict:
    """A tune costs at most one trial's planned cost times its maximum number of trials; refuse one
    planned above the team's budget. Returns the plan with the tune's figures added."""
    one = plan.get("usd")
    if one is None:
        return dict(plan)
    total = one * tune.trials
    if budget_usd is not None and total > budget_usd:
        raise TuneError(
            f"the tune is planned to cost up to ${total:,.0f} ({tune.trials} trials x ${one:,.0f} per trial, "
            f"{plan.get('summary') or ''}), above team {team!r}'s budget of ${budget_usd:,.0f} per run "
            f"(teams.{team}.max_run_cost_usd, else budgets.max_run_cost_usd): fewer --trials, a lower "
            "max_steps per trial, or a cheaper configuration (`llmtrain plan --suggest`)"
        )
    return {
        **plan,
        "usd_per_trial": one,
        "usd": total,
        "trials": tune.trials,
        "summary": f"{plan.get('summary')}; tune: up to {tune.trials} trials, up to ${total:,.0f}",
    }
