"""AWS Batch's service jobs, simulated: moto implements no service job, service environment or
SAGEMAKER_TRAINING queue, so the tests supply them here.

`SimulatedBatch` answers the five calls a queued run makes (SubmitServiceJob, DescribeServiceJob,
ListServiceJobs, TerminateServiceJob, GetJobQueueSnapshot) with the shapes botocore's Batch model
gives them. Every request is validated against botocore's model first (types, required members,
and the max/pattern/enum constraints, `llmtrain.core.validate.input_problems`), a SubmitServiceJob's
payload against CreateTrainingJob's, and an invalid one raises botocore's ParamValidationError as a
client would. What a job does after submission is scripted per submission (`QueueOutcome`): how
many times it is seen waiting, then whether Batch hands it to SageMaker (where the harness's
simulated training job runs) or ends it at the head of its queue (a job state time limit).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import ClientError, ParamValidationError

from llmtrain.core import queue_policy as policy
from llmtrain.core.validate import input_problems

ACCOUNT, REGION = "123456789012", "us-east-1"


@dataclass
class QueueOutcome:
    """How one submitted service job goes.

    ``waits``: DescribeServiceJob calls that see it RUNNABLE before anything else happens.
    ``ahead``: jobs ahead of it in the queue while it waits (its position is ahead + 1).
    ``time_limit``: after the waits, Batch ends it at the head of its queue with this reason (e.g.
      policy.CAPACITY_REASON), FAILED and terminated, no training job created.
    ``hold``: it waits until this is set (or it is terminated), however often it is described.
    Otherwise Batch hands it to SageMaker: ``on_schedule(request)`` creates the training job and
    returns its ARN, and ``training(name)`` tells its end: None while it runs, else "Completed",
    "Failed" or "Stopped"."""

    waits: int = 0
    ahead: int = 0
    time_limit: str | None = None
    hold: threading.Event | None = None


@dataclass
class ServiceJob:
    params: dict[str, Any]
    job_id: str
    arn: str
    created_ms: int
    outcome: QueueOutcome
    status: str = "RUNNABLE"
    reason: str | None = None
    training_job_arn: str | None = None
    terminated: bool = False
    described: int = 0
    started_ms: int = 0
    stopped_ms: int | None = None

    @property
    def queue(self) -> str:
        return self.params["jobQueue"]

    @property
    def payload(self) -> dict[str, Any]:
        return json.loads(self.params["serviceRequestPayload"])


def _checked(operation: str, params: Mapping[str, Any]) -> None:
    problems = input_problems("batch", operation, params)
    if problems:
        raise ParamValidationError(report="\n".join(problems))


def _client_error(code: str, message: str, operation: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message},
                        "ResponseMetadata": {"HTTPStatusCode": 400}}, operation)


@dataclass
class SimulatedBatch:
    """The service jobs of one account's queues, scripted per submission (see the module)."""

    outcomes: list[QueueOutcome] = field(default_factory=list)
    # SageMaker's side, given by the harness: create the training job for a payload and the service
    # job's tags (its ARN; a ClientError when SageMaker refuses it), and tell how a training job
    # ended (None while running; "Completed", "Failed" or "Stopped").
    on_schedule: Callable[[dict[str, Any], dict[str, str]], str] | None = None
    training: Callable[[str], str | None] | None = None
    jobs: dict[str, ServiceJob] = field(default_factory=dict)
    # Share usage the snapshot reports, by queue ARN: {share: instances}.
    usage: dict[str, dict[str, float]] = field(default_factory=dict)
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def submitted(self) -> list[dict[str, Any]]:
        return [job.params for job in self.jobs.values()]

    # -- the API --------------------------------------------------------------------------------------

    def submit_service_job(self, **params) -> dict[str, Any]:
        _checked("SubmitServiceJob", params)
        payload_problems = input_problems("sagemaker", "CreateTrainingJob",
                                          json.loads(params["serviceRequestPayload"]))
        assert not payload_problems, payload_problems  # Batch passes it on to CreateTrainingJob as it is
        with self.lock:
            self.calls.append(("SubmitServiceJob", params))
            if not self.outcomes:
                raise AssertionError(f"no scripted outcome left for service job #{len(self.jobs) + 1}")
            job_id = str(uuid.uuid4())
            job = ServiceJob(params=dict(params), job_id=job_id,
                             arn=f"arn:aws:batch:{REGION}:{ACCOUNT}:service-job/{job_id}",
                             created_ms=int(time.time() * 1000), outcome=self.outcomes.pop(0))
            self.jobs[job_id] = job
        return {"jobArn": job.arn, "jobName": params["jobName"], "jobId": job_id}

    def describe_service_job(self, **params) -> dict[str, Any]:
        _checked("DescribeServiceJob", params)
        job = self._job(params["jobId"], "DescribeServiceJob")
        self._advance(job)
        self.calls.append(("DescribeServiceJob", params))
        return self._description(job)

    def list_service_jobs(self, **params) -> dict[str, Any]:
        _checked("ListServiceJobs", params)
        self.calls.append(("ListServiceJobs", params))
        filters = {item["name"]: item["values"] for item in params.get("filters", [])}
        found = [job for job in self.jobs.values() if job.queue in (params.get("jobQueue"), _name(job.queue))]
        if "JOB_NAME" in filters:
            [pattern] = filters["JOB_NAME"]
            found = [job for job in found if _matches(job.params["jobName"], pattern)]
        elif "jobStatus" in params:
            found = [job for job in found if job.status == params["jobStatus"]]
        if "SHARE_IDENTIFIER" in filters:
            found = [job for job in found if job.params.get("shareIdentifier") in filters["SHARE_IDENTIFIER"]]
        found.sort(key=lambda job: job.created_ms, reverse=True)  # newest first, as Batch lists them
        return {"jobSummaryList": [self._summary(job) for job in found]}

    def terminate_service_job(self, **params) -> dict[str, Any]:
        _checked("TerminateServiceJob", params)
        job = self._job(params["jobId"], "TerminateServiceJob")
        self.calls.append(("TerminateServiceJob", params))
        with self.lock:
            if job.status not in ("SUCCEEDED", "FAILED"):
                job.status, job.reason, job.terminated = "FAILED", params["reason"], True
                job.stopped_ms = int(time.time() * 1000)
        return {}

    def get_job_queue_snapshot(self, **params) -> dict[str, Any]:
        _checked("GetJobQueueSnapshot", params)
        self.calls.append(("GetJobQueueSnapshot", params))
        queue = params["jobQueue"]
        waiting = sorted((j for j in self.jobs.values() if j.queue == queue and j.status == "RUNNABLE"),
                         key=lambda job: job.created_ms)
        front = []
        for job in waiting:
            front += [{"jobArn": f"arn:aws:batch:{REGION}:{ACCOUNT}:service-job/other-{i}",
                       "earliestTimeAtPosition": job.created_ms} for i in range(job.outcome.ahead)]
            front.append({"jobArn": job.arn, "earliestTimeAtPosition": job.created_ms})
        shares = self.usage.get(queue, {})
        return {
            "frontOfQueue": {"jobs": front[:100], "lastUpdatedAt": int(time.time() * 1000)},
            "queueUtilization": {
                "totalCapacityUsage": [{"capacityUnit": "ml.p4d.24xlarge", "quantity": sum(shares.values())}],
                "fairshareUtilization": {
                    "activeShareCount": len(shares),
                    "topCapacityUtilization": [
                        {"shareIdentifier": share, "capacityUsage": [{"capacityUnit": "ml.p4d.24xlarge",
                                                                      "quantity": quantity}]}
                        for share, quantity in shares.items()
                    ],
                },
            },
        }

    # -- what happens to a job ------------------------------------------------------------------------

    def _advance(self, job: ServiceJob) -> None:
        with self.lock:
            job.described += 1
            if job.status == "RUNNABLE":
                self._leave_the_queue(job)
            elif job.status in ("SCHEDULED", "STARTING", "RUNNING") and self.training is not None:
                self._follow_training(job)

    def _leave_the_queue(self, job: ServiceJob) -> None:
        outcome = job.outcome
        if outcome.hold is not None:
            if not outcome.hold.wait(timeout=0.05) and not job.terminated:
                return
        elif job.described <= outcome.waits:
            return
        if outcome.time_limit:
            job.status, job.terminated = "FAILED", True
            job.reason = f"{policy.TIME_LIMIT_TERMINATION}{outcome.time_limit}"
            job.stopped_ms = int(time.time() * 1000)
            return
        assert self.on_schedule is not None, "a job left the queue but nothing creates its training job"
        try:
            job.training_job_arn = self.on_schedule(job.payload, job.params.get("tags", {}))
        except ClientError as refused:  # SageMaker refused CreateTrainingJob: the service job fails
            error = refused.response["Error"]
            job.status, job.stopped_ms = "FAILED", int(time.time() * 1000)
            job.reason = f"Received status from SageMaker: {error['Code']}: {error['Message']}"
            return
        job.status, job.started_ms = "RUNNING", int(time.time() * 1000)
        job.reason = None

    def _follow_training(self, job: ServiceJob) -> None:
        ended = self.training(job.training_job_arn.rsplit("/", 1)[-1])
        if ended is None:
            return
        job.status = "SUCCEEDED" if ended == "Completed" else "FAILED"
        job.reason = f"Received status from SageMaker: Training job {ended.lower()}"
        job.stopped_ms = int(time.time() * 1000)

    # -- shapes ---------------------------------------------------------------------------------------

    def _job(self, job_id: str, operation: str) -> ServiceJob:
        if job_id not in self.jobs:
            raise _client_error("ClientException", f"Job {job_id} not found", operation)
        return self.jobs[job_id]

    def _attempt(self, job: ServiceJob) -> dict[str, Any]:
        return {"serviceResourceId": {"name": "TrainingJobArn", "value": job.training_job_arn}} \
            if job.training_job_arn else {}

    def _description(self, job: ServiceJob) -> dict[str, Any]:
        description = {
            "jobId": job.job_id,
            "jobArn": job.arn,
            "jobName": job.params["jobName"],
            "jobQueue": job.queue,
            "status": job.status,
            "serviceJobType": job.params["serviceJobType"],
            "serviceRequestPayload": job.params["serviceRequestPayload"],
            "shareIdentifier": job.params.get("shareIdentifier"),
            "schedulingPriority": job.params.get("schedulingPriority", 0),
            "createdAt": job.created_ms,
            "startedAt": job.started_ms,
            "tags": job.params.get("tags", {}),
            "isTerminated": job.terminated,
        }
        if job.reason:
            description["statusReason"] = job.reason
        if job.training_job_arn:
            description["latestAttempt"] = self._attempt(job)
            description["attempts"] = [{**self._attempt(job), "startedAt": job.started_ms}]
        if job.stopped_ms:
            description["stoppedAt"] = job.stopped_ms
        return description

    def _summary(self, job: ServiceJob) -> dict[str, Any]:
        payload = job.payload
        resources = payload.get("ResourceConfig", {})
        summary = {
            "jobId": job.job_id,
            "jobArn": job.arn,
            "jobName": job.params["jobName"],
            "serviceJobType": job.params["serviceJobType"],
            "shareIdentifier": job.params.get("shareIdentifier"),
            "status": job.status,
            "createdAt": job.created_ms,
            "capacityUsage": [{"capacityUnit": resources.get("InstanceType", "?"),
                               "quantity": resources.get("InstanceCount", 1)}],
        }
        if job.started_ms:
            summary["startedAt"] = job.started_ms
        if job.reason:
            summary["statusReason"] = job.reason
        if job.terminated:
            summary["isTerminated"] = True
        if job.training_job_arn:
            summary["latestAttempt"] = self._attempt(job)
        return summary


def _name(queue_arn: str) -> str:
    return queue_arn.rsplit("/", 1)[-1]


def _matches(name: str, pattern: str) -> bool:
    """Batch's JOB_NAME filter: case-insensitive, a trailing * matches any rest."""
    if pattern.endswith("*"):
        return name.lower().startswith(pattern[:-1].lower())
    return name.lower() == pattern.lower()


def queue_arn(environment: str, queue: str) -> str:
    return policy.job_queue_arn(REGION, ACCOUNT, environment, queue)
