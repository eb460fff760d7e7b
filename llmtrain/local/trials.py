"""`llmtrain tune --local`: Optuna searches a template's hyperparameters with `llmtrain run --local` trials.

Each trial is a local run of the template (llmtrain.local.runner, exactly as `llmtrain run --local`
runs it) with the run's `--set` values and the trial's values for the tuned hyperparameters. The
trial's metrics are read with the template's own metric definitions; every value of the objective
that names its step (each `[eval] step=N eval_loss=...` line for `eval:loss`) is reported to Optuna,
whose pruner may stop a poor trial early (the trial's job is stopped like StopTrainingJob). The
objective of a trial is its last value, as SageMaker's tuning reads a training job's final metric.

The study lives in SQLite under the tune's folder, so a tune that was interrupted (Ctrl-C, a killed
terminal) continues when started again under its name: its finished trials are kept, an interrupted
trial is run again with the same values, and trials are added until the tune has `--trials`.

```
<workdir>/<run-name>/
  tune.json            what is searched (a rerun must search the same)
  study.db             the Optuna study (SQLite)
  trials/t<N>/         trial N's run folder, as `llmtrain run --local` lays it out
  trials/t<N>.log      trial N's output
  results.json         {"best": {"params", "objective"}, "trials": [...]}
  tune.png             the objective per trial and the best so far
```

With `--parallel K`, K trials run at once, each on one emulated host with this machine's cores
shared between them (cores // K training processes each, at least one, and as many threads).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from llmtrain.core.errors import LlmtrainError
from llmtrain.core.platform import PlatformContext
from llmtrain.core.program_contract import ProgramContract
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.spec import TemplateSpec
from llmtrain.core.tuning import Trial, TuneError, TuneSpec, best_so_far, best_trial, objective_reports
from llmtrain.local import data as local_data
from llmtrain.local.job import LocalLimits
from llmtrain.local.metric_lines import MetricPoint
from llmtrain.local.runner import LocalRunOptions, run_local

STUDY_FILE = "study.db"
SPEC_FILE = "tune.json"
RESULTS_FILE = "results.json"
PLOT_FILE = "tune.png"
TRIALS_DIR = "trials"
_INTERRUPTED = "interrupted"
# Trials the Bayesian sampler draws at random before it models the results.
_MAX_STARTUP_TRIALS = 10


@dataclass(frozen=True)
class LocalTuneOptions:
    run_name: str
    workdir: Path = Path("runs")
    # channel -> local folder (--data); default: the shipped tiny corpus for train and validation.
    data: Mapping[str, Path] = field(default_factory=dict)
    # Channels of `data` taken from a prepared dataset's folders: left out where the template lacks them.
    optional_data: frozenset[str] = frozenset()
    # The run's --set values, the same for every trial.
    settings: Mapping[str, str] = field(default_factory=dict)
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)

    @property
    def tune_dir(self) -> Path:
        return (self.workdir / self.run_name).resolve()


@dataclass(frozen=True)
class LocalTuneResult:
    tune: TuneSpec
    trials: tuple[Trial, ...]
    folder: Path
    plot: Path | None

    @property
    def best(self) -> Trial | None:
        return best_trial(self.trials, maximize=self.tune.maximize)

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {
            "best": {"params": dict(best.params), "objective": best.objective, "trial": best.number}
            if best
            else None,
            "objective": self.tune.objective,
            "direction": "maximize" if self.tune.maximize else "minimize",
            "trials": [trial.to_dict() for trial in self.trials],
        }


class TuneInterrupted(LlmtrainError):
    """Ctrl-C (or SIGTERM) stopped the tune; its study continues when it is started again."""


def run_local_tune(
    template: TemplateSpec,
    code_archive: bytes,
    tune: TuneSpec,
    options: LocalTuneOptions,
    platform: PlatformContext,
    *,
    program: ProgramContract | None = None,
    console: Console | None = None,
) -> LocalTuneResult:
    """Run the tune's missing trials (all of them the first time); returns every trial. Each trial's
    request is rendered with `program`, the training program's contract of the code the version runs
    (`Catalog.program_contract`), as a run's is."""
    import optuna  # the [local] extra's: `llmtrain tune --local` checks it is installed

    console = console or Console(soft_wrap=True)
    folder = options.tune_dir
    _check_same_search(folder, template, tune, options.settings)
    data = _trial_data(template, options, console)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(f"sqlite:///{folder / STUDY_FILE}")
    study = optuna.create_study(
        storage=storage,
        study_name=options.run_name,
        load_if_exists=True,
        direction="maximize" if tune.maximize else "minimize",
        sampler=_sampler(optuna, tune),
        pruner=_pruner(optuna, tune, template, options.settings),
    )
    _requeue_interrupted(optuna, study, storage, console)
    if not study.trials:
        _warm_start(optuna, study, tune, options, console)
    runner = _TrialRunner(template, code_archive, tune, options, platform, data, console, program)
    missing = tune.trials - _counted(optuna, study)
    if missing > 0:
        console.print(
            f"[bold cyan]llmtrain[/] tune {options.run_name!r}: {missing} trial(s) to run of "
            f"{tune.trials}, {tune.parallel} at a time; study {folder / STUDY_FILE}"
        )
        with _threads_per_trial(options.cores, tune.parallel):
            _run_trials(study, runner, missing, tune.parallel)
    trials = tuple(
        _trial_record(optuna, t, tune.objective)
        for t in study.trials
        if t.state != optuna.trial.TrialState.WAITING
    )
    plot = plot_tune(trials, tune, folder / PLOT_FILE)
    result = LocalTuneResult(tune, trials, folder, plot)
    (folder / RESULTS_FILE).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return result


# --- the study ------------------------------------------------------------------------------------


def _sampler(optuna, tune: TuneSpec):
    if tune.strategy == "random":
        return optuna.samplers.RandomSampler(seed=tune.seed)
    startup = max(1, min(_MAX_STARTUP_TRIALS, tune.trials // 3))
    # constant_liar: trials running at once are told apart while their results are pending.
    return optuna.samplers.TPESampler(
        seed=tune.seed, n_startup_trials=startup, constant_liar=tune.parallel > 1
    )


def _pruner(optuna, tune: TuneSpec, template: TemplateSpec, settings: Mapping[str, str]):
    if tune.strategy == "hyperband":
        hps = {**template.hyperparameters, **settings}
        reports = objective_reports(tune.objective, hps)
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=reports)
    if not tune.early_stopping:
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=max(1, min(5, tune.trials // 4)))


def _check_same_search(
    folder: Path, template: TemplateSpec, tune: TuneSpec, settings: Mapping[str, str]
) -> None:
    """A tune continued under its name must search what it searched before (the study's trials
    would not be comparable otherwise); it may ask for more trials."""
    record = {
        "template": template.ref,
        "settings": dict(settings),
        "tune": {**tune.to_dict(), "trials": None, "parallel": None},
    }
    path = folder / SPEC_FILE
    if path.is_file():
        earlier = json.loads(path.read_text())
        if earlier != record:
            raise TuneError(
                f"tune {folder.name!r} in {folder} searched {_describe_record(earlier)}; this command "
                f"searches {_describe_record(record)}. Continue it with the same template, --set and "
                "--param values (more --trials is fine), or choose a new --run-name"
            )
        return
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def _describe_record(record: Mapping[str, Any]) -> str:
    tune = TuneSpec.from_dict({**record["tune"], "trials": 1, "parallel": 1})
    params = " ".join(p.describe() for p in tune.params)
    sets = " ".join(f"{k}={v}" for k, v in record["settings"].items())
    return (
        f"{record['template']} {params} for {'max' if tune.maximize else 'min'} {tune.objective} "
        f"({tune.strategy}){' with ' + sets if sets else ''}"
    )


def _requeue_interrupted(optuna, study, storage, console: Console) -> None:
    """A trial left running by a killed tune is failed as interrupted and queued again with its
    values (a trial interrupted by Ctrl-C was queued again when it stopped)."""
    running = optuna.trial.TrialState.RUNNING
    study_id = storage.get_study_id_from_name(study.study_name)
    for trial in study.get_trials(deepcopy=False, states=(running,)):
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        storage.set_trial_user_attr(trial_id, _INTERRUPTED, True)
        storage.set_trial_state_values(trial_id, optuna.trial.TrialState.FAIL)
        study.enqueue_trial(trial.params)
        console.print(
            Text(
                f"llmtrain trial {trial.number} was interrupted (its tune was killed): it runs "
                "again with the same values"
            )
        )


def _warm_start(optuna, study, tune: TuneSpec, options: LocalTuneOptions, console: Console) -> None:
    """A new study starts from the finished trials of earlier local tunes (`--warm-start NAME`, in the
    same --workdir) whose values lie within this tune's ranges."""
    distributions = {param.name: _distribution(optuna, param) for param in tune.params}
    for name in tune.warm_start_from:
        path = options.workdir.resolve() / name / STUDY_FILE
        if not path.is_file():
            raise TuneError(f"--warm-start {name}: no local tune {name!r} in {options.workdir} (no {path})")
        parent = optuna.load_study(study_name=name, storage=f"sqlite:///{path}")
        finished = parent.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        usable = [trial for trial in finished if _within(tune, trial.params)]
        for trial in usable:
            study.add_trial(
                optuna.trial.create_trial(
                    params=dict(trial.params),
                    distributions=distributions,
                    value=trial.value,
                    user_attrs={"warm_start": name},
                )
            )
        console.print(
            Text(
                f"llmtrain warm start: {len(usable)} finished trial(s) of tune {name!r} within "
                "this tune's ranges"
            )
        )


def _within(tune: TuneSpec, values: Mapping[str, Any]) -> bool:
    if set(values) != set(tune.tuned_names):
        return False
    for param in tune.params:
        value = values[param.name]
        inside = value in param.values if param.kind == "categorical" else param.low <= value <= param.high
        if not inside:
            return False
    return True


def _distribution(optuna, param):
    if param.kind == "categorical":
        return optuna.distributions.CategoricalDistribution(list(param.values))
    if param.kind == "integer":
        return optuna.distributions.IntDistribution(int(param.low), int(param.high), log=param.log)
    return optuna.distributions.FloatDistribution(float(param.low), float(param.high), log=param.log)


def _counted(optuna, study) -> int:
    """Trials that count towards --trials: finished ones, not those interrupted (they run again)."""
    states = optuna.trial.TrialState
    return sum(
        1
        for t in study.get_trials(deepcopy=False)
        if t.state in (states.COMPLETE, states.PRUNED)
        or (t.state == states.FAIL and not t.user_attrs.get(_INTERRUPTED))
        if "warm_start" not in t.user_attrs
    )


def _run_trials(study, runner: _TrialRunner, count: int, parallel: int) -> None:
    """Ask for and run `count` trials, `parallel` at a time; Ctrl-C stops the running ones (their
    jobs save checkpoints), queues them again, and raises TuneInterrupted."""
    if parallel == 1:
        for _ in range(count):
            runner.run(study, study.ask())
        return
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        pending: set[Future] = set()
        started = 0
        try:
            while started < count or pending:
                while started < count and len(pending) < parallel:
                    pending.add(pool.submit(runner.run, study, study.ask()))
                    started += 1
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    future.result()
        except KeyboardInterrupt:
            runner.interrupt.set()
            wait(pending)
            raise TuneInterrupted("interrupted: the running trials were stopped and will run again") from None


# --- one trial ------------------------------------------------------------------------------------


class _TrialRunner:
    """Runs one trial as a local run and tells the study how it ended."""

    def __init__(
        self,
        template: TemplateSpec,
        code_archive: bytes,
        tune: TuneSpec,
        options: LocalTuneOptions,
        platform: PlatformContext,
        data: Mapping[str, Path],
        console: Console,
        program: ProgramContract | None = None,
    ):
        self.template, self.code_archive, self.tune, self.program = template, code_archive, tune, program
        self.options, self.platform, self.data, self.console = options, platform, data, console
        self.interrupt = threading.Event()
        self._print = threading.Lock()
        self.processes = max(1, min(LocalLimits().max_processes_per_host, options.cores // tune.parallel))

    def run(self, study, trial) -> None:
        import optuna

        values = {param.name: _suggest(trial, param) for param in self.tune.params}
        shown = ", ".join(f"{name}={_shown(value)}" for name, value in values.items())
        self._say(f"trial {trial.number} started: {shown}")
        watcher = _TrialWatcher(trial, self.tune.objective, self.interrupt)
        try:
            summary = self._run_job(trial.number, values, watcher)
        except KeyboardInterrupt:
            self.interrupt.set()
            summary = None
        if summary is None or watcher.interrupted or _stopped_by_user(summary, watcher):
            self._interrupted(study, trial, values)
            if threading.current_thread() is threading.main_thread():
                raise TuneInterrupted(
                    f"interrupted during trial {trial.number}; it runs again with the same "
                    "values when the tune is started again under its name"
                )
            return
        objective = _final_value(summary, self.tune.objective)
        if watcher.pruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            self._say(f"trial {trial.number} pruned: {watcher.pruned}")
        elif summary["TrainingJobStatus"] != "Completed" or objective is None:
            reason = summary.get("FailureReason") or f"the job reported no {self.tune.objective}"
            trial.set_user_attr("detail", reason[:500])
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            self._say(f"trial {trial.number} failed ({summary['TrainingJobStatus']}): {reason[:300]}")
        else:
            study.tell(trial, objective)
            self._say(f"trial {trial.number} completed: {self.tune.objective}={objective:g}")

    def _run_job(self, number: int, values: Mapping[str, Any], watcher: _TrialWatcher) -> dict[str, Any]:
        name = f"t{number}"
        overrides = {**self.options.settings, **{k: _plain(v) for k, v in values.items()}}
        run_input = RunInput(run_name=name, overrides=overrides, owner="local")
        request = render(self.template, run_input, self.platform, self.program)
        trials_dir = self.options.tune_dir / TRIALS_DIR
        trials_dir.mkdir(parents=True, exist_ok=True)
        run_options = LocalRunOptions(
            run_name=name,
            workdir=trials_dir,
            data=self.data,
            optional_data=self.options.optional_data,
            user_settings=frozenset(overrides),
            limits=LocalLimits(max_hosts=1, max_processes_per_host=self.processes),
        )
        with (trials_dir / f"{name}.log").open("w") as log:
            trial_console = Console(file=log, width=160, soft_wrap=True, force_terminal=False)
            return run_local(
                request,
                self.code_archive,
                run_options,
                console=trial_console,
                watcher=watcher,
                template_channels=self.template.inputs.channels,
                token_channels=self.template.code.is_platform,
            )

    def _interrupted(self, study, trial, values: Mapping[str, Any]) -> None:
        import optuna

        trial.set_user_attr(_INTERRUPTED, True)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        study.enqueue_trial(dict(values))
        self._say(
            f"trial {trial.number} interrupted: it runs again with the same values when the tune continues"
        )

    def _say(self, message: str) -> None:
        with self._print:
            self.console.print(Text(f"llmtrain {message}"))


class _TrialWatcher:
    """Reports each value of the objective to Optuna; stops the trial's job when the pruner says so,
    or when the tune is interrupted."""

    def __init__(self, trial, objective: str, interrupt: threading.Event):
        self.trial, self.objective, self.interrupt = trial, objective, interrupt
        self.pruned: str | None = None
        self.interrupted = False
        self._reported: set[int] = set()

    def stop_reason(self, new_points: Sequence[MetricPoint]) -> str | None:
        if self.interrupt.is_set():
            self.interrupted = True
            return "the tune was interrupted"
        for point in new_points:
            if point.name != self.objective or point.step is None or point.step in self._reported:
                continue  # every host prints the metric: report each step once
            self._reported.add(point.step)
            self.trial.report(point.value, point.step)
            if self.trial.should_prune():
                self.pruned = f"{self.objective}={point.value:g} at step {point.step}"
                return f"pruned by the tune: {self.pruned}"
        return None


def _stopped_by_user(summary: Mapping[str, Any], watcher: _TrialWatcher) -> bool:
    """Ctrl-C or SIGTERM stopped the trial's job (its StopTrainingJob), not the pruner or its
    maximum runtime."""
    return (
        summary.get("TrainingJobStatus") == "Stopped"
        and summary.get("SecondaryStatus") == "Stopped"
        and not watcher.pruned
    )


def _suggest(trial, param) -> Any:
    if param.kind == "categorical":
        return trial.suggest_categorical(param.name, list(param.values))
    if param.kind == "integer":
        return trial.suggest_int(param.name, int(param.low), int(param.high), log=param.log)
    return trial.suggest_float(param.name, float(param.low), float(param.high), log=param.log)


def _final_value(summary: Mapping[str, Any], objective: str) -> float | None:
    for metric in summary.get("FinalMetricDataList") or ():
        if metric["MetricName"] == objective:
            return float(metric["Value"])
    return None


def _trial_record(optuna, trial, objective: str) -> Trial:
    states = optuna.trial.TrialState
    status = {
        states.COMPLETE: "Completed",
        states.PRUNED: "Pruned",
        states.FAIL: "Failed",
        states.RUNNING: "InProgress",
    }.get(trial.state, trial.state.name.title())
    if trial.user_attrs.get(_INTERRUPTED):
        status = "Interrupted"
    values = sorted(trial.intermediate_values.items())
    last_reported = values[-1][1] if values else None
    return Trial(
        number=trial.number,
        name=f"t{trial.number}",
        params=dict(trial.params),
        objective=trial.value if trial.state == states.COMPLETE else last_reported,
        status=status,
        detail=str(trial.user_attrs.get("detail", "")),
        values=tuple(values),
    )


def _trial_data(template: TemplateSpec, options: LocalTuneOptions, console: Console) -> dict[str, Path]:
    """The trials' channels: --data, else the shipped tiny corpus (train, and validation where the
    template has that channel), prepared once before any trial starts."""
    data = dict(options.data)
    if "train" in data:
        return data
    with_validation = "validation" in template.inputs.channels and "validation" not in data
    wanted = ["train", "validation"] if with_validation else ["train"]
    log: Callable[[str], None] = lambda message: console.print(Text(f"llmtrain {message}"))  # noqa: E731
    objective = str(template.hyperparameters.get("objective", "next_token"))
    data.update(local_data.tiny_corpus_channels(options.workdir.resolve(), wanted, log=log,
                                                objective=objective))
    return data


@contextmanager
def _threads_per_trial(cores: int, parallel: int) -> Iterator[None]:
    """Trials running at once share the cores: each one's training processes get their share of
    threads (unless OMP_NUM_THREADS is set already)."""
    if parallel == 1 or "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // parallel))
    try:
        yield
    finally:
        del os.environ["OMP_NUM_THREADS"]


def _plain(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def _shown(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# --- the plot -------------------------------------------------------------------------------------


def plot_tune(trials: Sequence[Trial], tune: TuneSpec, path: Path) -> Path | None:
    """The objective of each trial (pruned trials at their last reported value) and the best so far."""
    if not trials:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4))
    for status, marker in (("Completed", "o"), ("Pruned", "x")):
        shown = [t for t in trials if t.status == status and t.objective is not None]
        axes.scatter(
            [t.number for t in shown],
            [t.objective for t in shown],
            marker=marker,
            label=f"{status.lower()} trials",
        )
    line = best_so_far(trials, maximize=tune.maximize)
    axes.step(
        [t.number for t in trials],
        [v if v is not None else float("nan") for v in line],
        where="post",
        label="best so far",
    )
    axes.set_xlabel("trial")
    axes.set_ylabel(tune.objective)
    axes.set_title(f"{'maximize' if tune.maximize else 'minimize'} {tune.objective}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)
    return path


__all__ = ["LocalTuneOptions", "LocalTuneResult", "TuneInterrupted", "plot_tune", "run_local_tune"]
