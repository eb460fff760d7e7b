"""A queued run's calls to AWS Batch, shared by the launcher's functions and the CLI.

- `submit_request`: the SubmitServiceJob parameters of a rendered CreateTrainingJob request (the
  payload is that request as JSON; its tags become the service job's, as the SageMaker Python SDK's
  `TrainingQueue` does), checked against botocore's models of both operations.
- `queued_run`: a service job as the run's state shows it: QUEUED (its place in the queue and the
  team's share usage), STARTING, TRAINING, SUCCEEDED or FAILED, with the training job Batch created.
- `run_service_jobs`, `cancel_run`: a run's service jobs (found by their names, the run's job names)
  and cancelling the ones still active (`llmtrain stop`).
- `queue_listing`: what `llmtrain queue` prints: every queued and running job of the queues.

`batch` is a boto3 Batch client (or anything with its methods).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from llmtrain.core import queue_policy as policy
from llmtrain.core.errors import RequestValidationError
from llmtrain.core.queue_context import TeamQueues
from llmtrain.core.validate import input_problems

WAITING = ("SUBMITTED", "PENDING", "RUNNABLE")
ACTIVE = (*WAITING, "SCHEDULED", "STARTING", "RUNNING")
# What a run's state shows for each service job status.
PHASES = {
    "SUBMITTED": "QUEUED",
    "PENDING": "QUEUED",
    "RUNNABLE": "QUEUED",
    "SCHEDULED": "STARTING",  # handed to SageMaker, which is acquiring the instances
    "STARTING": "STARTING",
    "RUNNING": "TRAINING",
    "SUCCEEDED": "SUCCEEDED",
    "FAILED": "FAILED",
}
# A service job's status in SageMaker's words, for the launcher's view of a run's attempts.
TRAINING_JOB_STATUS = {**dict.fromkeys(ACTIVE, "InProgress"), "SUCCEEDED": "Completed", "FAILED": "Failed"}
_ATTEMPT = re.compile(r"-a(\d+)$")


def submit_request(
    request: Mapping[str, Any], queues: TeamQueues, *, queue: str | None = None, priority: int | None = None
) -> dict[str, Any]:
    """SubmitServiceJob's parameters for a rendered CreateTrainingJob request, in the team's queue
    (its default without one), with its share identifier and the run's priority (0 without one).
    RequestValidationError lists every problem botocore's models find in either."""
    problems = input_problems("sagemaker", "CreateTrainingJob", request)
    payload = dict(request)
    tags = {tag["Key"]: tag["Value"] for tag in payload.pop("Tags", [])}
    params = {
        "jobName": request.get("TrainingJobName", ""),
        "jobQueue": queues.queue_arn(queue),
        "serviceJobType": policy.SERVICE_JOB_TYPE,
        "serviceRequestPayload": json.dumps(payload, separators=(",", ":"), sort_keys=True),
        "shareIdentifier": queues.share_identifier,
        "schedulingPriority": priority or 0,
        "tags": tags,
    }
    problems += input_problems("batch", "SubmitServiceJob", params)
    if problems:
        raise RequestValidationError(problems)
    return params


@dataclass(frozen=True)
class QueuedRun:
    """One service job of a run, as the run's state and `llmtrain status` show it."""

    job_id: str
    job_name: str
    queue_arn: str
    status: str  # Batch's
    phase: str  # QUEUED, STARTING, TRAINING, SUCCEEDED, FAILED
    status_reason: str | None
    position: int | None  # 1 = next to start; None when not waiting, or beyond the first 100
    share_instances: float | None  # instances the team's share runs in the queue now
    queue_instances: float | None  # instances the whole queue runs now
    waited_seconds: int  # since submission
    training_job_arn: str | None
    terminated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line: `QUEUED: 3rd in llmtrain-prod-standard (waiting 1h05m); pretrain runs 24 instances`."""
        queue = self.queue_arn.rsplit("/", 1)[-1]
        if self.phase == "QUEUED":
            place = f"#{self.position}" if self.position else "not yet at the front"
            line = f"QUEUED: {place} in {queue}, waiting {duration(self.waited_seconds)}"
            if self.share_instances is not None:
                line += f"; the team's share runs {self.share_instances:g} instance(s) of the queue's "
                line += f"{self.queue_instances or 0:g}"
        else:
            line = f"{self.phase} ({self.status} in {queue})"
        return line + (f": {self.status_reason}" if self.status_reason else "")


def queued_run(
    batch, job_id: str, *, share: str, now: float | None = None
) -> tuple[QueuedRun, dict[str, Any]]:
    """The run's service job now (DescribeServiceJob, the launcher's view), and that description."""
    job = batch.describe_service_job(jobId=job_id)
    job.pop("ResponseMetadata", None)
    return queued_run_of(batch, job, job["jobQueue"], share=share, now=now), job


def queued_run_of(
    batch, job: Mapping[str, Any], queue_arn: str, *, share: str, now: float | None = None
) -> QueuedRun:
    """A service job as the run's state shows it, from its description or its ListServiceJobs summary
    (what engineers may read): a waiting job's place and the share's usage from the queue's snapshot."""
    status = job["status"]
    position = share_instances = queue_instances = None
    if status in WAITING:
        snapshot = batch.get_job_queue_snapshot(jobQueue=queue_arn)
        position = queue_position(snapshot, job.get("jobArn", ""))
        share_instances, queue_instances = share_usage(snapshot, share)
    return QueuedRun(
        job_id=job["jobId"],
        job_name=job["jobName"],
        queue_arn=queue_arn,
        status=status,
        phase=PHASES[status],
        status_reason=job.get("statusReason"),
        position=position,
        share_instances=share_instances,
        queue_instances=queue_instances,
        waited_seconds=_seconds_since(job.get("createdAt"), now),
        training_job_arn=training_job_arn(job),
        terminated=bool(job.get("isTerminated")),
    )


def training_job_arn(job: Mapping[str, Any]) -> str | None:
    """The ARN of the training job Batch created for a service job (its latest attempt's), if any."""
    resource = (job.get("latestAttempt") or {}).get("serviceResourceId") or {}
    return resource.get("value") if resource.get("name") == "TrainingJobArn" else None


def queue_position(snapshot: Mapping[str, Any], job_arn: str) -> int | None:
    """1-based place of a job among the first 100 RUNNABLE jobs of its queue, in Batch's order."""
    jobs = (snapshot.get("frontOfQueue") or {}).get("jobs") or []
    for index, item in enumerate(jobs, start=1):
        if item.get("jobArn") == job_arn:
            return index
    return None


def share_usage(snapshot: Mapping[str, Any], share: str) -> tuple[float, float]:
    """Instances the share runs in the queue, and the whole queue (Batch's queue utilization)."""
    utilization = snapshot.get("queueUtilization") or {}
    total = sum(item.get("quantity", 0) for item in utilization.get("totalCapacityUsage") or [])
    shares = (utilization.get("fairshareUtilization") or {}).get("topCapacityUtilization") or []
    own = sum(
        usage.get("quantity", 0)
        for item in shares
        if item.get("shareIdentifier") == share
        for usage in item.get("capacityUsage") or []
    )
    return float(own), float(total)


def run_service_jobs(batch, queue_arns: Sequence[str], attempt_stem: str) -> list[dict[str, Any]]:
    """A run's service jobs in the queues, oldest attempt first: those named `<stem><attempt>`
    (`{"attempt", "job_name", "job_id", "job_arn", "queue_arn", "status", "batch_status",
    "training_job_arn", "summary"}`, status in SageMaker's words, summary ListServiceJobs')."""
    own = re.compile(re.escape(attempt_stem) + r"(\d+)", re.IGNORECASE)
    found = []
    by_name = [{"name": "JOB_NAME", "values": [f"{attempt_stem}*"]}]
    for queue_arn in queue_arns:
        for summary in _list(batch, jobQueue=queue_arn, filters=by_name):
            match = own.fullmatch(summary["jobName"])
            if match:
                found.append({
                    "attempt": int(match.group(1)),
                    "job_name": summary["jobName"],
                    "job_id": summary["jobId"],
                    "job_arn": summary.get("jobArn"),
                    "queue_arn": queue_arn,
                    "status": TRAINING_JOB_STATUS.get(summary.get("status", ""), "InProgress"),
                    "batch_status": summary.get("status"),
                    "training_job_arn": training_job_arn(summary),
                    "summary": summary,
                })
    return sorted(found, key=lambda job: job["attempt"])


def cancel_run(batch, queue_arns: Sequence[str], attempt_stem: str, reason: str) -> list[str]:
    """Terminate the run's active service jobs (queued, or whose training job runs); their names."""
    cancelled = []
    for job in run_service_jobs(batch, queue_arns, attempt_stem):
        if job["batch_status"] in ACTIVE:
            batch.terminate_service_job(jobId=job["job_id"], reason=reason[:256])
            cancelled.append(job["job_name"])
    return cancelled


@dataclass(frozen=True)
class QueueEntry:
    """One line of `llmtrain queue`."""

    queue: str
    team: str
    run: str
    job_name: str
    status: str
    instances: float | None
    seconds: int  # waiting since submission (queued), or running since its start
    position: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def queue_listing(
    batch,
    queue_arns: Mapping[str, str],
    prefixes: Mapping[str, str],
    *,
    share: str | None = None,
    now: float | None = None,
) -> tuple[list[QueueEntry], dict[str, dict[str, Any]]]:
    """The queued and running jobs of the queues (name -> ARN), running first, then by their place;
    and per queue the instances it runs, in all (`total`) and per share (`shares`). ``prefixes``
    maps each team (share identifier) to its job-name prefix, to name the run."""
    entries, usage = [], {}
    for name, arn in queue_arns.items():
        snapshot = batch.get_job_queue_snapshot(jobQueue=arn)
        usage[name] = {"total": share_usage(snapshot, "")[1], "shares": shares_usage(snapshot)}
        for status in ACTIVE:
            arguments: dict[str, Any] = {"jobQueue": arn, "jobStatus": status}
            if share:
                arguments["filters"] = [{"name": "SHARE_IDENTIFIER", "values": [share]}]
            for summary in _list(batch, **arguments):
                entries.append(_entry(name, summary, snapshot, prefixes, now))
    entries.sort(key=lambda e: (e.status in WAITING, e.queue, e.position or 10**6, -e.seconds))
    return entries, usage


def shares_usage(snapshot: Mapping[str, Any]) -> dict[str, float]:
    """Instances each share runs in the queue (the shares Batch's snapshot lists: its top 20)."""
    shares = ((snapshot.get("queueUtilization") or {}).get("fairshareUtilization") or {}).get(
        "topCapacityUtilization") or []
    return {item["shareIdentifier"]: share_usage(snapshot, item["shareIdentifier"])[0] for item in shares}


def _entry(queue: str, summary: Mapping[str, Any], snapshot: Mapping[str, Any],
           prefixes: Mapping[str, str], now: float | None) -> QueueEntry:
    team = summary.get("shareIdentifier") or "-"
    status = summary.get("status", "")
    waiting = status in WAITING
    usage = summary.get("capacityUsage") or []
    return QueueEntry(
        queue=queue,
        team=team,
        run=run_name_of(summary["jobName"], prefixes.get(team)),
        job_name=summary["jobName"],
        status=status,
        instances=sum(item.get("quantity", 0) for item in usage) if usage else None,
        seconds=_seconds_since(summary.get("createdAt") if waiting else summary.get("startedAt"), now),
        position=queue_position(snapshot, summary.get("jobArn", "")) if waiting else None,
    )


def run_name_of(job_name: str, job_name_prefix: str | None) -> str:
    """The run of a job named `<team prefix>-<run>-a<attempt>` (the job name if it is not one)."""
    if not job_name_prefix or not job_name.lower().startswith(f"{job_name_prefix}-"):
        return job_name
    return _ATTEMPT.sub("", job_name[len(job_name_prefix) + 1:])


def duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m"
    hours, minutes = divmod(seconds // 60, 60)
    return f"{hours}h{minutes:02d}m" if hours < 48 else f"{hours // 24}d{hours % 24:02d}h"


def _list(batch, **arguments) -> list[dict[str, Any]]:
    summaries, token = [], None
    while True:
        page = batch.list_service_jobs(**arguments, **({"nextToken": token} if token else {}))
        summaries += page.get("jobSummaryList", [])
        token = page.get("nextToken")
        if not token:
            return summaries


def _seconds_since(milliseconds: float | None, now: float | None) -> int:
    if not milliseconds:
        return 0
    return max(0, int((now if now is not None else time.time()) - milliseconds / 1000))


__all__ = [
    "ACTIVE",
    "PHASES",
    "WAITING",
    "QueueEntry",
    "QueuedRun",
    "cancel_run",
    "duration",
    "queue_listing",
    "queue_position",
    "queued_run",
    "queued_run_of",
    "run_name_of",
    "run_service_jobs",
    "share_usage",
    "shares_usage",
    "submit_request",
    "training_job_arn",
]
