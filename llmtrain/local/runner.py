"""Run a rendered CreateTrainingJob request on this machine, the way the SageMaker container would.

The run folder (`<workdir>/<run-name>/`) plays the part of the run's S3 prefixes:

```
<workdir>/<run-name>/
  checkpoints/                  CheckpointConfig.S3Uri: every job of the run resumes from it
  jobs/<job-name>/              one folder per job, fresh every time
    request.json                the rendered CreateTrainingJob request
    sourcedir.tar.gz            the code, packaged as for the code bucket
    algo-1/, algo-2/ ...        each host's job root (SAGEMAKER_BASE_DIR, the container's /opt/ml)
    logs/algo-1.log ...         each host's log (CloudWatch's log streams)
    output/model.tar.gz         ModelArtifacts
    metrics.json, summary.json
  summary.json                  the latest job's summary
  metrics.png                   loss and throughput over steps, all jobs of the run
```
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from queue import Empty
from typing import Any, Protocol

from rich.console import Console
from rich.text import Text

from llmtrain.core.program_contract import contract_files_of_archive, manifest_versions
from llmtrain.core.render import TAG_PREFIX
from llmtrain.local import data as local_data
from llmtrain.local.display import JobDisplay
from llmtrain.local.job import (
    SUBMIT_DIRECTORY_HP,
    Adjustment,
    LocalChannel,
    LocalJob,
    LocalLimits,
    LocalRunError,
    local_job,
)
from llmtrain.local.jobroot import HostRoot, upload_from_hosts, write_host_roots
from llmtrain.local.metric_lines import MetricExtractor, MetricPoint
from llmtrain.local.packages import explain_failure, with_local_packages
from llmtrain.local.report import (
    FAILURE_REASON_CHARS,
    METRICS_FILE,
    PLOT_FILE,
    SUMMARY_FILE,
    JobRecord,
    JobTimes,
    Outcome,
    build_summary,
    package_model,
    plot_run,
    print_summary,
    save_metrics,
    write_json,
)
from llmtrain.local.toolkit import ToolkitProcesses, free_port, host_environment
from llmtrain.local.tracking import seed_store, with_local_tracking

JOBS_DIR = "jobs"
CHECKPOINTS_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"  # the run's TensorBoardOutputConfig.S3OutputPath, locally
VALIDATION = "validation"
# In a job folder: where its hosts keep what SageMaker would sync to S3, and whether that went to the
# run's folders. A job whose llmtrain was killed never uploads; the next job of the run does it.
SYNC_FILE = "sync.json"
# SageMaker gives a stopped job 120 seconds between SIGTERM and SIGKILL.
STOP_GRACE_SECONDS = 120.0
# The toolkit logs this when it swallows a gloo error and reports success anyway.
_KNOWN_EXCEPTION = "Known exception:"
# Channels the training program can do without: what it uses instead.
DROPPABLE_CHANNELS = {
    "model": "the program builds the model from model_preset instead of the cloud checkpoint",
    "tokenizer": "the program uses its shipped tokenizer (the local data is checked against it)",
}
EXIT_CODES = {"Completed": 0, "Failed": 1, "Stopped": 130}
# The training program's committed checkpoints: step_<8 digits>/ with COMPLETE written last
# (training_jobs/trainer/checkpoint.py).
_COMMITTED_CHECKPOINTS = "step_*/COMPLETE"


class RunAlreadyTrained(LocalRunError):
    """The run's checkpoints already reach max_steps: a job would only load and export them."""


class JobWatcher(Protocol):
    """Follows a running local job's metrics and may stop it (a tune's pruner, or the tune being
    interrupted). Called from the thread that runs the job, after each batch of log lines."""

    def stop_reason(self, new_points: Sequence[MetricPoint]) -> str | None:
        """Why the job must stop now (its StopTrainingJob), or None to let it run."""


@dataclass(frozen=True)
class LocalRunOptions:
    run_name: str
    workdir: Path = Path("runs")
    # channel -> local folder (--data); the tiny corpus fills train/validation when not given.
    data: Mapping[str, Path] = field(default_factory=dict)
    # Channels of `data` taken from a prepared dataset's folders: left out where the template lacks them.
    optional_data: frozenset[str] = frozenset()
    # Hyperparameters the user set (--set): kept as given, never scaled down.
    user_settings: frozenset[str] = frozenset()
    limits: LocalLimits = LocalLimits()
    stop_grace_seconds: float = STOP_GRACE_SECONDS

    @property
    def run_dir(self) -> Path:
        return (self.workdir / self.run_name).resolve()


def next_attempt(options: LocalRunOptions) -> int:
    """Jobs of a run are its attempts: each gets a new job name, all share the checkpoints."""
    jobs = options.run_dir / JOBS_DIR
    return 1 + (sum(1 for p in jobs.iterdir() if p.is_dir()) if jobs.is_dir() else 0)


def run_owner(options: LocalRunOptions) -> tuple[str, str] | None:
    """The template and version a local run's earlier jobs ran (their requests' llmtrain tags), or
    None for a new run."""
    jobs = options.run_dir / JOBS_DIR
    requests = sorted(jobs.glob("*/request.json"), key=lambda path: path.stat().st_mtime) \
        if jobs.is_dir() else []
    for path in reversed(requests):
        try:
            tags = {tag["Key"]: tag["Value"] for tag in json.loads(path.read_text()).get("Tags", [])}
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if f"{TAG_PREFIX}template" in tags:
            return tags[f"{TAG_PREFIX}template"], tags.get(f"{TAG_PREFIX}template-version", "")
    return None


@dataclass(frozen=True)
class _PreparedJob:
    plan: LocalJob
    job_dir: Path
    roots: list[HostRoot]
    channel_dirs: dict[str, Path]
    checkpoints_dir: Path | None
    tensorboard_dir: Path | None  # the run's TensorBoard events (TensorBoardOutputConfig)


def run_local(
    request: Mapping[str, Any],
    code_archive: bytes,
    options: LocalRunOptions,
    *,
    template_channels: Iterable[str] = (),
    console: Console | None = None,
    token_channels: bool = False,
    watcher: JobWatcher | None = None,
) -> dict[str, Any]:
    """Run `request` locally; returns summary.json's content (TrainingJobStatus says how it ended).

    `code_archive` is the sourcedir the job runs, as the JobTemplate construct uploads it (for a
    catalog version, `Catalog.sourcedir`: a published version's frozen code); `template_channels`
    are the channels the template declares. With `token_channels` (the platform's training program)
    the train and validation channels are checked as the program will load them before anything
    starts (llmtrain.core.token_data). `watcher` may stop the job as its metrics arrive (the job then
    ends Stopped, with the watcher's reason as its status message)."""
    console = console or Console(soft_wrap=True)
    created = _now()
    job = _prepare(request, code_archive, options, template_channels, console, token_channels)
    processes = _start(job.plan, job.roots, job.job_dir)
    metrics = MetricExtractor(job.plan.metric_definitions)
    training_start = _now()
    try:
        stop_reason = _supervise(processes, job.plan, metrics, console, options.stop_grace_seconds, watcher)
    finally:
        processes.kill_if_running()
        processes.release_reaper()
        _upload_job_outputs(job.roots, job.plan, job.job_dir, job.checkpoints_dir, job.tensorboard_dir)
    times = JobTimes(created, training_start, _now())
    outcome = decide_outcome(job.roots, processes.returncodes(), stop_reason, processes.log_paths)
    record = JobRecord(
        run_name=options.run_name, run_dir=options.run_dir, job_dir=job.job_dir,
        checkpoints_dir=job.checkpoints_dir, channel_dirs=job.channel_dirs, model_dir=job.roots[0].model_dir,
        tensorboard_dir=job.tensorboard_dir,
        logs=processes.log_paths, exit_codes=processes.returncodes(),
    )
    return _report(request, job.plan, outcome, metrics, times, record, console)


def _prepare(
    request: Mapping[str, Any],
    code_archive: bytes,
    options: LocalRunOptions,
    template_channels: Iterable[str],
    console: Console,
    token_channels: bool = False,
) -> _PreparedJob:
    """Everything before the toolkit starts. A request that fails here leaves no job folder behind,
    as a rejected CreateTrainingJob leaves no job."""
    job_dir = options.run_dir / JOBS_DIR / request["TrainingJobName"]
    if job_dir.exists():
        raise LocalRunError(f"{job_dir} already exists: a job name is used once (run again for a new "
                            "attempt)")
    sourcedir = job_dir / "sourcedir.tar.gz"
    plan = local_job(request, limits=options.limits, user_settings=options.user_settings)
    plan = _with_local_code(plan, request, sourcedir)
    plan = with_local_tracking(with_local_packages(plan), request, run_dir=options.run_dir,
                               model_artifact=job_dir / "output" / "model.tar.gz", parent_env=os.environ)
    plan, channel_dirs = _with_channels(plan, request, options, template_channels, console)
    if token_channels:
        local_data.check_token_channels(plan, channel_dirs,
                                        manifest_versions(contract_files_of_archive(code_archive)))
    checkpoints_dir = options.run_dir / CHECKPOINTS_DIR if plan.checkpoint_subpath else None
    tensorboard_dir = options.run_dir / TENSORBOARD_DIR if plan.tensorboard_subpath else None
    for recovered in recover_unsynced_jobs(options.run_dir):
        console.print(Text(f"llmtrain {recovered.name} ended without syncing its checkpoints (its llmtrain "
                           "process was killed): synced them now", style="yellow"))
    _check_steps_left(plan, options.run_name, checkpoints_dir)
    _print_plan(console, plan, options.run_dir, checkpoints_dir)
    try:
        job_dir.mkdir(parents=True)
        write_json(job_dir / SYNC_FILE, _sync_record(plan, checkpoints_dir, tensorboard_dir, synced=False))
        write_json(job_dir / "request.json", request)
        sourcedir.write_bytes(code_archive)
        if checkpoints_dir is not None:
            checkpoints_dir.mkdir(parents=True, exist_ok=True)
        roots = write_host_roots(plan, job_dir, channel_dirs=channel_dirs, checkpoints_dir=checkpoints_dir)
        seed_store(plan, options.run_dir)
    except BaseException:
        shutil.rmtree(job_dir, ignore_errors=True)
        raise
    return _PreparedJob(plan, job_dir, roots, channel_dirs, checkpoints_dir, tensorboard_dir)


def latest_checkpoint_step(checkpoints_dir: Path | None) -> int | None:
    """The step of the run's newest committed checkpoint, if any."""
    if checkpoints_dir is None or not checkpoints_dir.is_dir():
        return None
    markers = checkpoints_dir.glob(_COMMITTED_CHECKPOINTS)
    steps = [int(marker.parent.name.removeprefix("step_")) for marker in markers]
    return max(steps, default=None)


def _check_steps_left(plan: LocalJob, run_name: str, checkpoints_dir: Path | None) -> None:
    trained = latest_checkpoint_step(checkpoints_dir)
    max_steps = plan.hyperparameter("max_steps")
    if trained is not None and isinstance(max_steps, int) and trained >= max_steps:
        raise RunAlreadyTrained(
            f"run {run_name!r} is already trained to step {trained} (max_steps={max_steps}; checkpoints in "
            f"{checkpoints_dir}): nothing to train. --set max_steps=N with N > {trained} trains it further; "
            "a new --run-name starts over")


def _sync_record(plan: LocalJob, checkpoints_dir: Path | None, tensorboard_dir: Path | None, *,
                 synced: bool) -> dict[str, Any]:
    pairs = [(plan.checkpoint_subpath, checkpoints_dir), (plan.tensorboard_subpath, tensorboard_dir)]
    return {"synced": synced, "hosts": list(plan.hosts),
            "folders": [{"host_subpath": sub, "run_folder": str(folder)} for sub, folder in pairs
                        if sub is not None and folder is not None]}


def _upload_job_outputs(roots: list[HostRoot], plan: LocalJob, job_dir: Path, checkpoints_dir: Path | None,
                        tensorboard_dir: Path | None) -> None:
    """What SageMaker syncs to S3 during the job (checkpoints, TensorBoard events), into the run's
    folders; then the job is marked synced."""
    record = _sync_record(plan, checkpoints_dir, tensorboard_dir, synced=True)
    for folder in record["folders"]:
        upload_from_hosts(roots, folder["host_subpath"], Path(folder["run_folder"]))
    write_json(job_dir / SYNC_FILE, record)


def recover_unsynced_jobs(run_dir: Path) -> list[Path]:
    """Sync the folders of earlier jobs of the run that ended without it (their llmtrain was
    killed), oldest first so that newer files win, as S3 would hold them; returns those jobs."""
    jobs_dir = run_dir / JOBS_DIR
    pending = []
    for job_dir in jobs_dir.iterdir() if jobs_dir.is_dir() else ():
        sync_file = job_dir / SYNC_FILE
        if sync_file.is_file() and not json.loads(sync_file.read_text())["synced"]:
            pending.append(job_dir)
    for job_dir in sorted(pending, key=lambda path: (path / SYNC_FILE).stat().st_mtime):
        record = json.loads((job_dir / SYNC_FILE).read_text())
        roots = [HostRoot(host, job_dir / host) for host in record["hosts"]]
        for folder in record["folders"]:
            upload_from_hosts(roots, folder["host_subpath"], Path(folder["run_folder"]))
        write_json(job_dir / SYNC_FILE, {**record, "synced": True})
    return pending


def _now() -> datetime:
    return datetime.now(UTC)


def _with_local_code(plan: LocalJob, request: Mapping[str, Any], sourcedir: Path) -> LocalJob:
    """The toolkit downloads sagemaker_submit_directory from S3; it also takes a local tarball."""
    hps = dict(plan.hyperparameters)
    cloud = json.loads(request["HyperParameters"][SUBMIT_DIRECTORY_HP])
    hps[SUBMIT_DIRECTORY_HP] = json.dumps(str(sourcedir))
    adjustment = Adjustment(f"HyperParameters.{SUBMIT_DIRECTORY_HP}", cloud, str(sourcedir),
                            "the same sourcedir.tar.gz, packaged locally instead of uploaded")
    return replace(plan, hyperparameters=hps, adjustments=(*plan.adjustments, adjustment))


def _with_channels(
    plan: LocalJob,
    request: Mapping[str, Any],
    options: LocalRunOptions,
    template_channels: Iterable[str],
    console: Console,
) -> tuple[LocalJob, dict[str, Path]]:
    """Local folders for the request's channels, plus channels the template declares that the user
    supplied with --data (a cloud run would supply them with --set channels.NAME=s3://...)."""
    requested = [c.name for c in plan.channels]
    declared = set(template_channels) | set(requested)
    unknown = sorted(set(options.data) - declared - options.optional_data)
    if unknown:
        raise LocalRunError(
            f"--data names channel(s) {', '.join(unknown)}, which the template does not have; "
            f"its channels: {', '.join(sorted(declared))}"
        )
    dirs = {name: path for name, path in options.data.items() if name in declared}
    missing = [name for name in requested if name not in dirs]
    # With the shipped corpus as training data, its validation split lets the run evaluate, as a
    # cloud run does when it is given a validation channel.
    shipped_validation = "train" in missing and VALIDATION in declared - set(requested) - set(dirs)
    defaults = local_data.tiny_corpus_channels(
        options.workdir.resolve(), missing + [VALIDATION] * shipped_validation,
        log=lambda message: console.print(Text(f"llmtrain {message}")),
        objective=str(plan.hyperparameter("objective", "next_token")),
    )
    dirs.update(defaults)
    dropped = [_drop_channel(name, request) for name in missing if name not in defaults]
    added = [name for name in dirs if name not in requested]
    channels = tuple(c for c in plan.channels if c.name in dirs) + tuple(
        LocalChannel(name, {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated",
                            "RecordWrapperType": "None"}, sharded=False)
        for name in added
    )
    notes = [f"channel '{name}': the shipped tiny corpus ({path})" for name, path in defaults.items()]
    if shipped_validation:
        notes.append("the cloud run evaluates only when given a validation channel "
                     "(--set channels.validation=s3://...)")
    return replace(plan, channels=channels, adjustments=(*plan.adjustments, *dropped),
                   notes=(*plan.notes, *notes)), dirs


def _drop_channel(name: str, request: Mapping[str, Any]) -> Adjustment:
    """A channel with no local data: the model and tokenizer channels are optional to the program."""
    reason = DROPPABLE_CHANNELS.get(name)
    if reason is None:
        raise LocalRunError(f"no local folder for channel '{name}': pass --data {name}=DIR")
    uri = next((item["DataSource"]["S3DataSource"]["S3Uri"] for item in request.get("InputDataConfig", [])
                if item["ChannelName"] == name), "")
    return Adjustment(f"InputDataConfig.{name}", uri, "(not provided)",
                      f"{reason}; --data {name}=DIR provides it")


def _print_plan(console: Console, plan: LocalJob, run_dir: Path, checkpoints_dir: Path | None) -> None:
    console.print(f"[bold cyan]llmtrain[/] local training job [bold]{plan.job_name}[/] in {run_dir}")
    console.print(
        f"[bold cyan]llmtrain[/] {len(plan.hosts)} emulated host(s) ({', '.join(plan.hosts)}) x "
        f"{plan.processes_per_host} process(es), CPU + gloo, world size {plan.world_size}"
    )
    if plan.adjustments:
        console.print("[bold cyan]llmtrain[/] scaled for this machine "
                      "(the cloud job keeps the template's values):")
        for adjustment in plan.adjustments:
            console.print(Text(f"  - {adjustment.describe()}", style="yellow"), soft_wrap=True)
    for note in plan.notes:
        console.print(Text(f"  - {note}"), soft_wrap=True)
    if checkpoints_dir is not None:
        existing = any(checkpoints_dir.iterdir()) if checkpoints_dir.is_dir() else False
        state = "resuming from the checkpoints there" if existing else "empty: starting from scratch"
        console.print(f"[bold cyan]llmtrain[/] checkpoints: {checkpoints_dir} ({state})")


def _start(plan: LocalJob, roots: list[HostRoot], job_dir: Path) -> ToolkitProcesses:
    port = free_port() if len(roots) > 1 else None
    # The toolkit subprocesses inherit this process's environment (PATH, HOME, ...), minus any
    # SageMaker or torchrun variables of an outer job; see toolkit.host_environment.
    parent_env = dict(os.environ)
    envs = {
        root.host: host_environment(root, job_name=plan.job_name, container_env=dict(plan.environment),
                                    rendezvous_port=port, parent_env=parent_env)
        for root in roots
    }
    processes = ToolkitProcesses(roots, envs, job_dir / "logs")
    processes.start()
    return processes


class _StopRequests:
    """Ctrl-C or SIGTERM to llmtrain asks the job to stop (StopTrainingJob); a second one kills it."""

    def __init__(self) -> None:
        self.count = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopRequests:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.count += 1

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _supervise(
    processes: ToolkitProcesses, plan: LocalJob, metrics: MetricExtractor, console: Console, grace: float,
    watcher: JobWatcher | None = None,
) -> str | None:
    """Stream the logs until every host ends; returns why the job was stopped, or None."""
    deadline = time.monotonic() + plan.max_runtime_seconds if plan.max_runtime_seconds else None
    stop_reason: str | None = None
    stop_started = 0.0
    max_steps = plan.hyperparameter("max_steps")
    names = [d.name for d in plan.metric_definitions]
    with _StopRequests() as stops, JobDisplay(console, max_steps=max_steps, metric_names=names,
                                              hosts=plan.hosts) as display:
        while True:
            running = processes.running()
            points = _show_lines(processes, metrics, display)
            if not running:
                break
            watched = watcher.stop_reason(points) if watcher is not None and stop_reason is None else None
            if stop_reason is None and (stops.count or watched or (deadline and time.monotonic() > deadline)):
                stop_reason = "Stopped" if stops.count or watched else "MaxRuntimeExceeded"
                stop_started = time.monotonic()
                display.note(f"stopping the job ({watched or stop_reason}): SIGTERM to the training "
                             f"processes, which save a checkpoint; SIGKILL after {grace:.0f} s "
                             "(Ctrl-C again: now)")
            if stop_reason is not None:
                processes.terminate_training()
                if stops.count > 1 or time.monotonic() - stop_started > grace:
                    processes.kill()
        processes.finish()
        _show_lines(processes, metrics, display)
        logs = ", ".join(map(str, processes.log_paths.values()))
        if display.hidden_lines:
            display.note(f"{display.hidden_lines} lines of library warnings and toolkit messages are "
                         f"only in the log file(s): {logs}")
        if display.launcher_lines:
            display.note(f"torchrun's traceback and report of the failed processes, and the toolkit's "
                         f"restatement of the failure ({display.launcher_lines} lines), are only in "
                         f"the log file(s): {logs}")
    return stop_reason


def _show_lines(processes: ToolkitProcesses, metrics: MetricExtractor,
                display: JobDisplay) -> list[MetricPoint]:
    """Show the lines that arrive within 0.2 s; returns the metric values they held."""
    deadline = time.monotonic() + 0.2
    found: list[MetricPoint] = []
    while True:
        try:
            host, line = processes.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except Empty:
            return found
        points = metrics.feed(line, host=host)
        found.extend(points)
        display.line(host, line, points)


def _known_exception(log: Path | None) -> str | None:
    """The error the toolkit swallowed, when it logged its gloo 'known exception'."""
    if log is None or not log.is_file():
        return None
    text = log.read_text(errors="replace")
    at = text.find(_KNOWN_EXCEPTION)
    return None if at < 0 else text[at + len(_KNOWN_EXCEPTION):].strip()


def decide_outcome(
    roots: list[HostRoot],
    returncodes: Mapping[str, int | None],
    stop_reason: str | None,
    logs: Mapping[str, Path],
) -> Outcome:
    """Completed only when every host exited 0 and wrote output/success (never on a swallowed error)."""
    if stop_reason is not None:
        message = ("Training job stopped" if stop_reason == "Stopped"
                   else "Training job stopped: MaxRuntimeInSeconds reached")
        return Outcome("Stopped", stop_reason, None, message)
    for root in roots:
        if root.failure_file.is_file():
            text = explain_failure(root.failure_file.read_text(errors="replace"), logs.get(root.host))
            return _failed("AlgorithmError: " + text[:FAILURE_REASON_CHARS])
    for root in roots:
        code = returncodes.get(root.host)
        if code != 0:
            return _failed(f"AlgorithmError: the toolkit on {root.host} exited with code {code} without "
                           f"writing output/failure; see {logs.get(root.host)}")
    for root in roots:
        swallowed = _known_exception(logs.get(root.host))
        if swallowed is not None:
            return _failed(f"AlgorithmError: the training toolkit on {root.host} reported success after an "
                           f"error it treats as harmless (a gloo 'known exception'): "
                           f"{swallowed[:FAILURE_REASON_CHARS]}")
    for root in roots:
        if not root.success_file.is_file():
            return _failed(f"AlgorithmError: {root.host} exited 0 but wrote no output/success; "
                           f"see {logs.get(root.host)}")
    return Outcome("Completed", "Completed", None, "Training job completed")


def _failed(reason: str) -> Outcome:
    return Outcome("Failed", "Failed", reason, "Training job failed")


def _report(
    request: Mapping[str, Any],
    plan: LocalJob,
    outcome: Outcome,
    metrics: MetricExtractor,
    times: JobTimes,
    record: JobRecord,
    console: Console,
) -> dict[str, Any]:
    job_dir, run_dir = record.job_dir, record.run_dir
    model_artifact = package_model(record.model_dir, job_dir / "output" / "model.tar.gz")
    save_metrics(metrics, job_dir / METRICS_FILE)
    job_dirs = sorted((p for p in (run_dir / JOBS_DIR).iterdir() if (p / METRICS_FILE).is_file()),
                      key=lambda p: (p / METRICS_FILE).stat().st_mtime)
    plot = plot_run(run_dir, job_dirs, run_dir / PLOT_FILE)
    summary = build_summary(request=request, plan=plan, outcome=outcome, metrics=metrics, times=times,
                            record=record, model_artifact=model_artifact, plot=plot)
    write_json(job_dir / SUMMARY_FILE, summary)
    shutil.copyfile(job_dir / SUMMARY_FILE, run_dir / SUMMARY_FILE)
    print_summary(console, summary)
    return summary
