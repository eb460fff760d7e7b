"""What the launcher client reports of a run (llmtrain.client.launcher), and the views it reads.

`RunStatus` is what `llmtrain status` shows, `RunListing` one line of `llmtrain runs`; they are built
from a Step Functions execution (its JSON input and output: `input_of`, `output_of`, `run_name_of`)
and a training job's description (`job_view`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

FINISHED = ("SUCCEEDED", "FAILED", "TIMED_OUT", "ABORTED")
CONTINUABLE = ("FAILED", "TIMED_OUT", "ABORTED")


@dataclass
class RunStatus:
    """What `llmtrain status` shows: the execution, the run's jobs, and the latest job's metrics."""

    run_name: str
    execution_arn: str
    execution_status: str
    started: str
    stopped: str | None
    summary: Mapping[str, Any] | None
    error: str | None
    cause: str | None
    jobs: list[dict[str, Any]] = field(default_factory=list)
    job: Mapping[str, Any] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # The run's execution input (template, version, overrides) and all its executions, oldest first.
    run_input: Mapping[str, Any] = field(default_factory=dict)
    executions: list[str] = field(default_factory=list)
    # Where the environment has queues: the run's latest service job
    # (llmtrain.lifecycle.queue_jobs.QueuedRun).
    queue: Mapping[str, Any] | None = None
    # A tune's tuning job and its trials (llmtrain.lifecycle.tuning_jobs), None for a run of one job.
    tuning: Mapping[str, Any] | None = None

    @property
    def continuable(self) -> bool:
        """A run that ended without completing can be started again under its name."""
        return self.execution_status in CONTINUABLE

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_name": self.run_name,
            "run_input": dict(self.run_input),
            "executions": self.executions,
            "execution_arn": self.execution_arn,
            "execution_status": self.execution_status,
            "started": self.started,
            "stopped": self.stopped,
            "summary": self.summary,
            "error": self.error,
            "cause": self.cause,
            "jobs": self.jobs,
            "job": dict(self.job) if self.job else None,
            "metrics": self.metrics,
            "notes": self.notes,
            "queue": dict(self.queue) if self.queue else None,
            "tuning": dict(self.tuning) if self.tuning else None,
        }


@dataclass(frozen=True)
class RunListing:
    """One line of `llmtrain runs`: a run's latest execution and its training jobs."""

    run_name: str
    status: str
    template: str
    instance_type: str | None
    instance_count: int | None
    started: str | None
    billable_seconds: int | None
    executions: int
    kind: str = "run"  # run | tune
    trials: int | None = None  # a tune's trials so far

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_name": self.run_name,
            "status": self.status,
            "template": self.template,
            "instance_type": self.instance_type,
            "instance_count": self.instance_count,
            "started": self.started,
            "billable_seconds": self.billable_seconds,
            "executions": self.executions,
            "kind": self.kind,
            "trials": self.trials,
        }


def input_of(execution: Mapping[str, Any]) -> dict[str, Any]:
    return _json_object(execution.get("input"))


def output_of(execution: Mapping[str, Any]) -> dict[str, Any]:
    return _json_object(execution.get("output"))


def _json_object(text: str | None) -> dict[str, Any]:
    try:
        data = json.loads(text or "{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def run_name_of(execution: Mapping[str, Any]) -> str | None:
    return input_of(execution).get("run_name")


def iso_time(value: Any) -> str | None:
    return value.isoformat(timespec="seconds") if value is not None else None


def job_view(job: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "name": job.get("TrainingJobName"),
        "status": job.get("TrainingJobStatus"),
        "secondary_status": job.get("SecondaryStatus"),
        "failure_reason": job.get("FailureReason"),
        "instance_type": (job.get("ResourceConfig") or {}).get("InstanceType"),
        "instance_count": (job.get("ResourceConfig") or {}).get("InstanceCount"),
        "model_artifacts": (job.get("ModelArtifacts") or {}).get("S3ModelArtifacts"),
        "tensorboard": (job.get("TensorBoardOutputConfig") or {}).get("S3OutputPath"),
        "billable_seconds": job.get("BillableTimeInSeconds"),
    }
