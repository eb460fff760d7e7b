"""What a local job leaves behind: summary.json shaped like DescribeTrainingJob, a plot, a terminal summary.

summary.json uses DescribeTrainingJob's field names, so whatever reads a cloud job's description
(status, failure reason, final metrics, artifacts, timings) reads a local one the same way. S3 URIs
become file:// URIs of the run folder. What only a local run has sits under the `LocalRun` key.
"""

from __future__ import annotations

import json
import re
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from llmtrain.local.job import DEFAULT_CHECKPOINT_PATH, DEFAULT_TENSORBOARD_PATH, LocalJob
from llmtrain.local.metric_lines import MetricExtractor, eval_loss_metric, loss_metric, throughput_metric

SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.json"
PLOT_FILE = "metrics.png"
STATUS_STYLE = {"Completed": "bold green", "Stopped": "bold yellow", "Failed": "bold red"}
# DescribeTrainingJob returns the first 1024 characters of output/failure as FailureReason.
FAILURE_REASON_CHARS = 1024


@dataclass(frozen=True)
class Outcome:
    status: str  # Completed | Failed | Stopped
    secondary_status: str  # Completed | Failed | Stopped | MaxRuntimeExceeded
    failure_reason: str | None = None
    status_message: str = ""


@dataclass(frozen=True)
class JobTimes:
    created: datetime
    training_start: datetime
    training_end: datetime

    @property
    def training_seconds(self) -> int:
        return max(0, round((self.training_end - self.training_start).total_seconds()))


@dataclass(frozen=True)
class JobRecord:
    """Where one job's pieces are, for the summary."""

    run_name: str
    run_dir: Path
    job_dir: Path
    checkpoints_dir: Path | None
    channel_dirs: Mapping[str, Path]
    model_dir: Path
    logs: Mapping[str, Path]
    exit_codes: Mapping[str, int | None]
    tensorboard_dir: Path | None = None


# A line that names an error: the training program's "[error] ..." lines and Python's "XError: ...".
_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?(\[error\] .+|[\w.]*(?:Error|Exception): .+)$")
MAX_ERROR_LINES = 5


# An exception's name alone on its line: the toolkit ends a line wherever its read of the output
# ends, and unbuffered Python writes "XError", ": " and the message separately (display.py).
_SPLIT_ERROR_NAME = re.compile(r"^(?:\[rank\d+\]:\s*)?[\w.]*(?:Error|Exception):?$")
_RULE = re.compile(r"^[=-]{5,}$")  # torchrun's report after "ChildFailedError:" is no message


def joined_error_lines(lines: list[str]) -> list[str]:
    """`lines` with an exception's name, a lone colon and its message, split over lines by the
    toolkit's reads, joined again into one "XError: message" line."""
    joined: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index].strip()
        if _SPLIT_ERROR_NAME.match(line):
            following = index + 1
            if following < len(lines) and lines[following].strip() == ":":
                following += 1
            message = lines[following].strip() if following < len(lines) else ""
            if message and not _SPLIT_ERROR_NAME.match(message) and not _RULE.match(message):
                joined.append(f"{line.rstrip(':')}: {message}")
                index = following + 1
                continue
        joined.append(lines[index])
        index += 1
    return joined


def error_lines(logs: Mapping[str, Path]) -> list[str]:
    """The distinct error lines of the job's logs, in order (what a person reads first)."""
    found: list[str] = []
    for path in logs.values():
        if not path.is_file():
            continue
        for line in joined_error_lines(path.read_text(errors="replace").splitlines()):
            match = _ERROR_LINE.match(line.strip())
            if match and "ExecuteUserScriptError" not in line and match.group(1) not in found:
                found.append(match.group(1))
                if len(found) == MAX_ERROR_LINES:
                    return found
    return found


def file_uri(path: Path) -> str:
    return path.resolve().as_uri()


def package_model(model_dir: Path, destination: Path) -> Path | None:
    """model.tar.gz of the model folder, as SageMaker uploads it at the end of a job."""
    if not model_dir.is_dir() or not any(model_dir.iterdir()):
        return None
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(destination, "w:gz") as tar:
        for path in sorted(model_dir.rglob("*")):
            tar.add(path, arcname=path.relative_to(model_dir).as_posix(), recursive=False)
    return destination


def build_summary(
    *,
    request: Mapping[str, Any],
    plan: LocalJob,
    outcome: Outcome,
    metrics: MetricExtractor,
    times: JobTimes,
    record: JobRecord,
    model_artifact: Path | None,
    plot: Path | None,
) -> dict[str, Any]:
    resource = dict(request.get("ResourceConfig", {}))
    resource.update({"InstanceType": "local", "InstanceCount": len(plan.hosts)})
    summary: dict[str, Any] = {
        "TrainingJobName": plan.job_name,
        "TrainingJobArn": f"arn:aws:sagemaker:local:000000000000:training-job/{plan.job_name}",
        "TrainingJobStatus": outcome.status,
        "SecondaryStatus": outcome.secondary_status,
        "HyperParameters": dict(plan.hyperparameters),
        "AlgorithmSpecification": request.get("AlgorithmSpecification", {}),
        "RoleArn": request.get("RoleArn"),
        "InputDataConfig": _local_channels(request, record.channel_dirs),
        "OutputDataConfig": {"S3OutputPath": file_uri(record.job_dir / "output")},
        "ResourceConfig": resource,
        "StoppingCondition": request.get("StoppingCondition", {}),
        "CreationTime": times.created.isoformat(),
        "TrainingStartTime": times.training_start.isoformat(),
        "TrainingEndTime": times.training_end.isoformat(),
        "LastModifiedTime": times.training_end.isoformat(),
        "SecondaryStatusTransitions": _transitions(outcome, times),
        "FinalMetricDataList": [
            {"MetricName": p.name, "Value": p.value, "Timestamp": p.timestamp.isoformat()}
            for p in metrics.final_values().values()
        ],
        "ModelArtifacts": {"S3ModelArtifacts": file_uri(model_artifact) if model_artifact else None},
        "TrainingTimeInSeconds": times.training_seconds,
        "BillableTimeInSeconds": times.training_seconds,
    }
    if outcome.failure_reason:
        summary["FailureReason"] = outcome.failure_reason
    if record.checkpoints_dir is not None:
        summary["CheckpointConfig"] = {
            "S3Uri": file_uri(record.checkpoints_dir),
            "LocalPath": request.get("CheckpointConfig", {}).get("LocalPath", DEFAULT_CHECKPOINT_PATH),
        }
    if record.tensorboard_dir is not None:
        summary["TensorBoardOutputConfig"] = {
            "S3OutputPath": file_uri(record.tensorboard_dir),
            "LocalPath": request["TensorBoardOutputConfig"].get("LocalPath", DEFAULT_TENSORBOARD_PATH),
        }
    summary["LocalRun"] = {
        "RunName": record.run_name,
        "RunFolder": str(record.run_dir),
        "JobFolder": str(record.job_dir),
        "Hosts": list(plan.hosts),
        "ProcessesPerHost": plan.processes_per_host,
        "CloudInstanceType": plan.instance_type,
        "Adjustments": [a.to_dict() for a in plan.adjustments],
        "Notes": list(plan.notes),
        "ModelDir": str(record.model_dir),
        "Logs": {host: str(path) for host, path in record.logs.items()},
        "ExitCodes": dict(record.exit_codes),
        "ErrorLines": error_lines(record.logs) if outcome.status == "Failed" else [],
        "UnmatchedMetricDefinitions": [{"Name": d.name, "Regex": d.regex} for d in metrics.unmatched()],
        "Plot": str(plot) if plot else None,
        "Request": str(record.job_dir / "request.json"),
    }
    return summary


def _local_channels(request: Mapping[str, Any], channel_dirs: Mapping[str, Path]) -> list[dict]:
    channels = []
    for item in request.get("InputDataConfig", []):
        item = json.loads(json.dumps(item))
        s3 = item.get("DataSource", {}).get("S3DataSource")
        if s3 is not None and item["ChannelName"] in channel_dirs:
            s3["S3Uri"] = file_uri(channel_dirs[item["ChannelName"]])
        channels.append(item)
    return channels


def _transitions(outcome: Outcome, times: JobTimes) -> list[dict[str, str]]:
    return [
        {"Status": "Starting", "StartTime": times.created.isoformat(),
         "EndTime": times.training_start.isoformat(),
         "StatusMessage": "Preparing the job roots and the input data"},
        {"Status": "Training", "StartTime": times.training_start.isoformat(),
         "EndTime": times.training_end.isoformat(), "StatusMessage": "Training the model"},
        {"Status": outcome.secondary_status, "StartTime": times.training_end.isoformat(),
         "EndTime": times.training_end.isoformat(), "StatusMessage": outcome.status_message},
    ]


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def save_metrics(metrics: MetricExtractor, path: Path) -> None:
    write_json(path, [
        {"name": p.name, "value": p.value, "step": p.step, "timestamp": p.timestamp.isoformat(),
         "host": p.host}
        for p in metrics.points
    ])


def plot_run(run_dir: Path, job_dirs: list[Path], destination: Path) -> Path | None:
    """Loss and throughput over steps for every job of the run (a resumed job continues the line)."""
    jobs = []
    for job_dir in job_dirs:
        metrics_path = job_dir / METRICS_FILE
        if metrics_path.is_file():
            jobs.append((job_dir.name, json.loads(metrics_path.read_text())))
    names = {p["name"] for _, points in jobs for p in points}
    panels = [(name, label) for name, label in ((loss_metric(names), "loss"),
                                                (throughput_metric(names), "throughput")) if name]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    eval_loss = eval_loss_metric(names)
    figure, axes = pyplot.subplots(len(panels), 1, figsize=(8, 3.2 * len(panels)), sharex=True, squeeze=False)
    for axis, (metric, label) in zip(axes[:, 0], panels, strict=True):
        shown = [metric, eval_loss] if label == "loss" and eval_loss else [metric]
        for job_name, points in jobs:
            for name in shown:
                series = sorted((p["step"], p["value"]) for p in points
                                if p["name"] == name and p["step"] is not None)
                if series:
                    axis.plot(*zip(*series, strict=True), marker="o" if name == eval_loss else ".",
                              linestyle="--" if name == eval_loss else "-", label=f"{job_name} {name}")
        axis.set_ylabel(label)
        axis.set_title(f"{label}: {', '.join(shown)}")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    axes[-1, 0].set_xlabel("step")
    figure.suptitle(f"run {run_dir.name}")
    figure.tight_layout()
    figure.savefig(destination, dpi=100)
    pyplot.close(figure)
    return destination


def print_summary(console: Console, summary: Mapping[str, Any]) -> None:
    """A panel on a terminal; elsewhere (a pipe, a CI log) one `label: value` line per row, never
    wrapped, so paths and messages stay whole for copy and paste and grep."""
    rows: list[tuple[str, str, str]] = []
    _summary_rows(summary, lambda label, value, style="": rows.append((label, value, style)))
    title = f"training job {summary['TrainingJobName']}"
    if not console.is_terminal:
        console.print(Text(title, style="bold"), soft_wrap=True)
        for label, value, style in rows:
            for index, line in enumerate(value.splitlines() or [""]):
                shown = f"{label}:" if index == 0 and label.strip() else ""
                console.print(Text(f"  {shown:<24}{line}", style=style), soft_wrap=True)
        return
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for label, value, style in rows:
        # Text, not markup: paths, regexes and error messages hold square brackets.
        table.add_row(Text(label), Text(value, style=style))
    console.print(Panel(table, title=title, expand=False))


def _summary_rows(summary: Mapping[str, Any], row) -> None:
    local = summary["LocalRun"]
    status, secondary = summary["TrainingJobStatus"], summary["SecondaryStatus"]

    shown = status if secondary == status else f"{status} ({secondary})"
    row("Status", shown, STATUS_STYLE.get(status, "bold"))
    if summary.get("FailureReason"):
        _failure_rows(row, summary["FailureReason"], local["ErrorLines"])
    row("Training time", f"{summary['TrainingTimeInSeconds']} s")
    for item in summary["FinalMetricDataList"]:
        row(f"  {item['MetricName']}", f"{item['Value']:g}")
    # A job that failed before its first metric line says nothing about the regexes.
    if summary["FinalMetricDataList"] or status != "Failed":
        for item in local["UnmatchedMetricDefinitions"]:
            row(f"  {item['Name']}", f"no log line matched {item['Regex']}: in the cloud this metric would "
                "stay empty", "yellow")
    row("Model", summary["ModelArtifacts"]["S3ModelArtifacts"] or "(no model was written)")
    if "CheckpointConfig" in summary:
        row("Checkpoints", summary["CheckpointConfig"]["S3Uri"])
    if "TensorBoardOutputConfig" in summary:
        row("TensorBoard", summary["TensorBoardOutputConfig"]["S3OutputPath"])
    row("Logs", "\n".join(local["Logs"].values()))
    row("Summary", str(Path(local["JobFolder"]) / SUMMARY_FILE))
    if local["Plot"]:
        row("Plot", local["Plot"])


def _failure_rows(row, reason: str, log_errors: list[str]) -> None:
    named = _named_error(reason)
    if named:
        row("Failure reason", named, "red")
        return
    row("Failure reason", reason[:300], "red")
    if log_errors:
        row("The log says", "\n".join(log_errors), "red")
        row("", "output/failure does not say why the job failed, so in the cloud FailureReason would not "
            "either: the training program should write its error there", "yellow")


def _named_error(reason: str) -> str | None:
    """The line of the failure text that names the error, if any."""
    for line in joined_error_lines(reason.splitlines()):
        stripped = line.strip().removeprefix("ErrorMessage").strip().lstrip('"')
        match = _ERROR_LINE.match(stripped)
        if match and "ExecuteUserScriptError" not in stripped:
            return match.group(1)
    return None
