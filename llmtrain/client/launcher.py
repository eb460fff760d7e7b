"""Start and follow launcher runs from the command line: what `llmtrain start|status|stop|logs|runs` call.

Finding the launcher: the deployed environment's record (llmtrain.core.deployed, in SSM Parameter Store)
names each team's launcher state machine and job-name prefix; nothing comes from the repository.
A run is one or more executions of that state machine whose input names the run (`run_name`). The
CLI names them `<run_name>-<n>` (n = 1, 2, ...): Step Functions keeps an execution name for 90
days, so a run rejected before any job, or a failed run continued under its name, starts its next
execution as `<run_name>-<n+1>`. Runs started by other means, whatever their
execution names, are found by the input's `run_name` among the latest executions. The run's
training jobs are `<team's job_name_prefix>-<run_name>-a<attempt>`, i.e.
`<environment prefix>-<team>-<run_name>-a<attempt>`. The execution input is the launcher's own
record, `llmtrain.core.runs.ExecutionInput`.

What the client reports is in llmtrain.client.run_views (`RunStatus`, `RunListing`); a job's logs and
metrics are read by llmtrain.client.job_telemetry.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import boto3
from botocore.exceptions import ClientError

from llmtrain.client.aws import explain, explained
from llmtrain.client.job_telemetry import job_log_events, latest_metrics
from llmtrain.client.run_views import (
    RunListing,
    RunStatus,
    input_of,
    iso_time,
    job_view,
    output_of,
    run_name_of,
)
from llmtrain.core.catalog import LATEST, parse_ref
from llmtrain.core.deployed import DeployedEnvironment, TeamAccess
from llmtrain.core.errors import LlmtrainError, did_you_mean
from llmtrain.core.queue_context import TeamQueues
from llmtrain.core.runs import ExecutionInput
from llmtrain.lifecycle import queue_jobs
from llmtrain.lifecycle.jobs import attempt_name_stem, run_jobs, tuning_jobs
from llmtrain.lifecycle.summaries import final_metrics
from llmtrain.lifecycle.tuning_jobs import tune_trials

# Executions scanned by the input's run_name (runs whose executions are not named after them).
_EXECUTIONS_SCANNED = 100
# Execution names scanned for a run's `<run>-<n>` executions (ListExecutions returns 1000 a page).
_NAMES_SCANNED = 10_000
_START_TRIES = 5
# How long `stop` waits for a stopped execution to end before it cancels the run's queued jobs.
STOP_WAIT_SECONDS = 30.0
_OWNER = re.compile(r"[\w .:/=+\-@]{1,256}")


class LauncherError(LlmtrainError):
    """The launcher cannot be reached or the run cannot be found; the message says what to do."""


class LauncherClient:
    """One team's launcher in a deployed environment, through the caller's AWS credentials."""

    def __init__(
        self,
        *,
        session: boto3.Session,
        region: str,
        state_machine_arn: str,
        job_name_prefix: str,
        identity: Mapping[str, Any] | None = None,
        queues: TeamQueues | None = None,
    ):
        self.session = session
        self.identity = dict(identity or {})
        self.region = region
        self.state_machine_arn = state_machine_arn
        self.job_name_prefix = job_name_prefix
        self.queues = queues
        self._clients: dict[str, Any] = {}

    @classmethod
    def for_team(
        cls,
        deployed: DeployedEnvironment,
        team: TeamAccess,
        *,
        session: boto3.Session,
        identity: Mapping[str, Any] | None = None,
    ) -> LauncherClient:
        return cls(
            session=session,
            region=deployed.region,
            state_machine_arn=team.state_machine_arn,
            job_name_prefix=team.job_name_prefix,
            identity=identity,
            queues=team.platform.queues,
        )

    def client(self, service: str):
        if service not in self._clients:
            self._clients[service] = self.session.client(service, region_name=self.region)
        return self._clients[service]

    # -- a run's executions ---------------------------------------------------------------------------

    def execution_arn(self, execution_name: str) -> str:
        prefix, _, name = self.state_machine_arn.rpartition(":stateMachine:")
        return f"{prefix}:execution:{name}:{execution_name}"

    def run_executions(self, run_name: str) -> list[dict[str, Any]]:
        """The run's executions (described), oldest first: those named `<run>` or `<run>-<n>` whose
        input names the run, else any of the latest executions whose input names it."""
        own = _execution_name_pattern(run_name)
        candidates = [item for item in self._list_executions(_NAMES_SCANNED) if own.fullmatch(item["name"])]
        found = [e for e in map(self._describe_item, candidates) if e and run_name_of(e) == run_name]
        if not found:
            latest = self._list_executions(_EXECUTIONS_SCANNED)
            found = [e for e in map(self._describe_item, latest) if e and run_name_of(e) == run_name]
        return sorted(found, key=lambda e: e["startDate"])

    def find_execution(self, run_name: str) -> dict[str, Any]:
        """The run's latest execution."""
        executions = self.run_executions(run_name)
        if executions:
            return executions[-1]
        recent = {item["name"].rsplit("-", 1)[0] for item in self._list_executions(_EXECUTIONS_SCANNED)}
        raise LauncherError(
            f"no run named {run_name!r}{did_you_mean(run_name, recent)} in launcher "
            f"{self.state_machine_arn}; "
            "`llmtrain runs` lists the latest runs"
        )

    def _list_executions(self, most: int) -> list[dict[str, Any]]:
        try:
            pages = (
                self.client("stepfunctions")
                .get_paginator("list_executions")
                .paginate(stateMachineArn=self.state_machine_arn, PaginationConfig={"MaxItems": most})
            )
            return [item for page in pages for item in page["executions"]]
        except ClientError as error:
            raise _launcher_error(error, "listing the launcher's executions") from error

    def _describe_item(self, item: Mapping[str, Any]) -> dict[str, Any] | None:
        return self._describe(item["executionArn"])

    def _describe(self, execution_arn: str) -> dict[str, Any] | None:
        try:
            return self.client("stepfunctions").describe_execution(executionArn=execution_arn)
        except ClientError as error:
            if error.response["Error"]["Code"] == "ExecutionDoesNotExist":
                return None
            raise _launcher_error(error, "reading the run's execution") from error

    # -- starting -------------------------------------------------------------------------------------

    def start(
        self,
        *,
        template_ref: str,
        run_name: str,
        overrides: Mapping[str, Any],
        owner: str | None = None,
        skip_plan_check: bool = False,
        queue: str | None = None,
        priority: int | None = None,
        tune: Mapping[str, Any] | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Start the run's next execution; returns it and the run's previous execution (or None).

        Refuses a run that is running or has completed; a run whose executions all failed (or were
        rejected, stopped, timed out) is continued: the launcher gives its next job the next attempt
        number and the run's checkpoints. `skip_plan_check` lets the launcher start a run the planner
        predicts will not fit its GPUs."""
        name, version = parse_ref(template_ref)
        # The launcher's own record, checked before any AWS call exactly as its Resolve checks it.
        execution_input = ExecutionInput(
            template=name,
            version=version or LATEST,
            run_name=run_name,
            overrides=overrides,
            owner=owner,
            skip_plan_check=skip_plan_check,
            queue=queue,
            priority=priority,
            tune=tune,
        )
        executions = self.run_executions(run_name)
        previous = executions[-1] if executions else None
        _refuse_to_restart(run_name, executions)
        number = 1 + max((_execution_number(e["name"], run_name) for e in executions), default=0)
        for _ in range(_START_TRIES):
            try:
                started = self.client("stepfunctions").start_execution(
                    stateMachineArn=self.state_machine_arn,
                    name=f"{run_name}-{number}",
                    input=json.dumps(execution_input.to_dict()),
                )
                return started, previous
            except ClientError as error:
                if error.response["Error"]["Code"] != "ExecutionAlreadyExists":
                    raise _launcher_error(error, f"starting run {run_name!r}") from error
                number += 1  # an execution of that name exists (started meanwhile, or older than we scan)
        raise LauncherError(f"could not find a free execution name for run {run_name!r}; try again")

    # -- following ------------------------------------------------------------------------------------

    def jobs(self, run_name: str) -> list[dict[str, Any]]:
        """The run's training jobs, oldest attempt first: `{"attempt", "job_name", "status"}`. Where
        the environment has queues, an attempt is its service job: `job_name` is the training job
        Batch created for it (None while it waits), `service_job` the service job's."""
        with explained("listing the run's training jobs"):
            found = run_jobs(self.client("sagemaker"), self.job_name_prefix, run_name)
        if self.queues is None:
            return found
        by_attempt = {job["attempt"]: job for job in found}
        for job in self._service_jobs(run_name):
            arn = job["training_job_arn"]
            by_attempt[job["attempt"]] = {
                "attempt": job["attempt"],
                "job_name": arn.rsplit("/", 1)[-1] if arn else None,
                "status": job["status"],
                "service_job": job["job_name"],
                "batch_status": job["batch_status"],
            }
        return [by_attempt[attempt] for attempt in sorted(by_attempt)]

    def _service_jobs(self, run_name: str) -> list[dict[str, Any]]:
        with explained("listing the run's jobs in the environment's queues"):
            return queue_jobs.run_service_jobs(self.client("batch"), list(self.queues.queue_arns.values()),
                                               attempt_name_stem(self.job_name_prefix, run_name))

    def queued(self, run_name: str) -> queue_jobs.QueuedRun | None:
        """The run's latest service job as the run's state shows it (None without queues or jobs)."""
        if self.queues is None:
            return None
        found = self._service_jobs(run_name)
        if not found:
            return None
        latest = found[-1]
        with explained("reading the run's place in its queue"):
            return queue_jobs.queued_run_of(self.client("batch"), latest["summary"], latest["queue_arn"],
                                            share=self.queues.share_identifier)

    def status(self, run_name: str) -> RunStatus:
        executions = self.run_executions(run_name)
        if not executions:
            self.find_execution(run_name)  # raises, with suggestions
        execution = executions[-1]
        if input_of(execution).get("tune") is not None:
            return self._tune_status(run_name, execution, executions)
        jobs = self.jobs(run_name)
        job = self._describe_job(jobs[-1]["job_name"]) if jobs and jobs[-1]["job_name"] else None
        queued = self.queued(run_name)
        metrics, notes = final_metrics(job) if job else {}, []
        if job and not metrics:
            try:
                metrics = self.latest_metrics(job["TrainingJobName"])
            except ClientError as error:
                # The engineers' policy may not grant CloudWatch reads: show the rest of the status.
                notes.append(f"latest metrics unavailable: {_launcher_error(error, 'reading CloudWatch')}")
        output = json.loads(execution["output"]) if execution.get("output") else None
        return RunStatus(
            run_name=run_name,
            execution_arn=execution["executionArn"],
            execution_status=execution["status"],
            started=iso_time(execution.get("startDate")),
            stopped=iso_time(execution.get("stopDate")),
            summary=output,
            error=execution.get("error"),
            cause=execution.get("cause"),
            jobs=jobs,
            job=job_view(job) if job else None,
            metrics=metrics,
            notes=notes,
            run_input=input_of(execution),
            executions=[e["name"] for e in executions],
            queue={**queued.to_dict(), "message": queued.describe()} if queued else None,
        )

    def tuning(self, run_name: str) -> dict[str, Any] | None:
        """A tune's latest tuning job and its trials (`{"name", "status", "trials"}`), or None
        before it has one."""
        sagemaker = self.client("sagemaker")
        with explained("listing the tune's tuning jobs"):
            jobs = tuning_jobs(sagemaker, self.job_name_prefix, run_name)
            if not jobs:
                return None
            latest = jobs[-1]
            trials = tune_trials(sagemaker, latest["job_name"])
        return {"name": latest["job_name"], "status": latest["status"],
                "trials": [t.to_dict() for t in trials]}

    def _tune_status(self, run_name: str, execution: Mapping[str, Any],
                     executions: Sequence[Mapping[str, Any]]) -> RunStatus:
        output = json.loads(execution["output"]) if execution.get("output") else None
        return RunStatus(
            run_name=run_name, execution_arn=execution["executionArn"], execution_status=execution["status"],
            started=iso_time(execution.get("startDate")), stopped=iso_time(execution.get("stopDate")),
            summary=output,
            error=execution.get("error"), cause=execution.get("cause"), run_input=input_of(execution),
            executions=[e["name"] for e in executions], tuning=self.tuning(run_name),
        )

    def _describe_job(self, job_name: str) -> dict[str, Any]:
        with explained(f"reading training job {job_name}"):
            return self.client("sagemaker").describe_training_job(TrainingJobName=job_name)

    def latest_metrics(self, job_name: str) -> dict[str, float]:
        """The latest value of each metric a running job published; empty when there are none yet."""
        return latest_metrics(self.client, job_name)

    def stop(self, run_name: str, *, by: str | None = None) -> dict[str, Any]:
        """Stop the run's execution. Where the environment has queues, its service jobs still queued
        or running are terminated next (stopping an execution does not end them; Batch stops the
        training job of one that runs): `execution["cancelled"]` names them. The execution stops
        first, so that its Watch step never reads the cancelled job as the run's failure."""
        execution = self.find_execution(run_name)
        if execution["status"] != "RUNNING":
            raise LauncherError(f"run {run_name!r} is not running (its execution is {execution['status']})")
        reason = f"llmtrain stop {run_name}" + (f" by {by}" if by else "")
        try:
            self.client("stepfunctions").stop_execution(
                executionArn=execution["executionArn"],
                error="StoppedByUser",
                cause=reason,
            )
        except ClientError as error:
            raise _launcher_error(error, f"stopping run {run_name!r}") from error
        if self.queues is not None:
            self._wait_until_ended(execution["executionArn"])
            with explained(f"cancelling run {run_name!r}'s queued job (its execution is stopped)"):
                execution["cancelled"] = queue_jobs.cancel_run(
                    self.client("batch"), list(self.queues.queue_arns.values()),
                    attempt_name_stem(self.job_name_prefix, run_name), reason)
        return execution

    def _wait_until_ended(self, execution_arn: str, seconds: float = STOP_WAIT_SECONDS) -> None:
        """Until the stopped execution reports it has ended: Step Functions ends it at once, an
        emulator once its step in flight returns (which must not see its job cancelled yet)."""
        stepfunctions = self.client("stepfunctions")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with explained("reading the stopped execution's status"):
                status = stepfunctions.describe_execution(executionArn=execution_arn)["status"]
            if status != "RUNNING":
                return
            time.sleep(0.2)

    def logs(self, run_name: str, *, attempt: int | None = None, limit: int = 200) -> list[dict[str, Any]]:
        """The last `limit` log events of one attempt's job (default: the latest), oldest first."""
        jobs = self.jobs(run_name)
        if attempt is not None:
            jobs = [job for job in jobs if job["attempt"] == attempt]
        if not jobs:
            which = f"attempt {attempt} of run" if attempt is not None else "run"
            raise LauncherError(
                f"{which} {run_name!r} has no training job yet; see `llmtrain status {run_name}`"
            )
        job_name = jobs[-1]["job_name"]
        if job_name is None:
            raise LauncherError(f"run {run_name!r} waits in its queue: it has no training job yet; see "
                                f"`llmtrain status {run_name}`")
        return job_log_events(self.client("logs"), job_name, limit)

    # -- listing runs ---------------------------------------------------------------------------------

    def runs(self, limit: int = 20) -> list[RunListing]:
        """The latest `limit` runs, newest first: each run's latest execution and its jobs."""
        latest: dict[str, list[dict[str, Any]]] = {}
        for item in self._list_executions(_NAMES_SCANNED):
            execution = self._describe_item(item)
            run_name = execution and run_name_of(execution)
            if not run_name:
                continue
            if run_name not in latest and len(latest) == limit:
                break  # older executions only belong to older runs from here on, or add to counts
            latest.setdefault(run_name, []).append(execution)
        return [self._listing(name, executions) for name, executions in latest.items()]

    def _listing(self, run_name: str, executions: Sequence[Mapping[str, Any]]) -> RunListing:
        execution = executions[0]  # ListExecutions returns the newest first
        if input_of(execution).get("tune") is not None:
            tuning = self.tuning(run_name)
            return RunListing(run_name=run_name, status=execution["status"],
                              template=self._template_of(execution, None), instance_type=None,
                              instance_count=None,
                              started=iso_time(executions[-1].get("startDate")), billable_seconds=None,
                              executions=len(executions), kind="tune",
                              trials=len(tuning["trials"]) if tuning else 0)
        jobs = [self._describe_job(job["job_name"]) for job in self.jobs(run_name) if job["job_name"]]
        resources = (jobs[-1].get("ResourceConfig") or {}) if jobs else {}
        billable = [
            job["BillableTimeInSeconds"] for job in jobs if job.get("BillableTimeInSeconds") is not None
        ]
        return RunListing(
            run_name=run_name,
            status=execution["status"],
            template=self._template_of(execution, jobs[-1] if jobs else None),
            instance_type=resources.get("InstanceType"),
            instance_count=resources.get("InstanceCount"),
            started=iso_time(executions[-1].get("startDate")),
            billable_seconds=sum(billable) if billable else None,
            executions=len(executions),
        )

    def _template_of(self, execution: Mapping[str, Any], job: Mapping[str, Any] | None) -> str:
        """`name@version`: from the run's summary, else the job's tags, else the input."""
        summary = output_of(execution)
        if summary.get("template"):
            return summary["template"]
        run_input = input_of(execution)
        name, version = run_input.get("template", "?"), run_input.get("version") or LATEST
        if version == LATEST and job is not None:
            with explained("reading the training job's tags"):
                tags = self.client("sagemaker").list_tags(ResourceArn=job["TrainingJobArn"]).get("Tags", [])
            version = next((t["Value"] for t in tags if t["Key"] == "llmtrain:template-version"), version)
        return f"{name}@{version}"


def owner_from_identity(identity: Mapping[str, Any]) -> str | None:
    """The caller's ARN as the runs' owner tag, when it fits a tag value."""
    arn = str(identity.get("Arn", ""))
    return arn if _OWNER.fullmatch(arn) else None


def _refuse_to_restart(run_name: str, executions: Sequence[Mapping[str, Any]]) -> None:
    running = [e for e in executions if e["status"] == "RUNNING"]
    if running:
        raise LauncherError(
            f"run {run_name!r} is running (execution {running[-1]['name']}, started "
            f"{running[-1]['startDate']:%Y-%m-%d %H:%M}); follow it with `llmtrain status {run_name}`, or "
            "choose a new --run-name for a new run"
        )
    succeeded = [e for e in executions if e["status"] == "SUCCEEDED"]
    if succeeded:
        raise LauncherError(
            f"run {run_name!r} already completed (execution {succeeded[-1]['name']}); a run name identifies "
            "one run: choose a new --run-name"
        )


def _execution_name_pattern(run_name: str) -> re.Pattern:
    return re.compile(re.escape(run_name) + r"(-\d+)?")


def _execution_number(execution_name: str, run_name: str) -> int:
    """n of `<run>-<n>`; 0 for an execution named `<run>` or otherwise."""
    match = re.fullmatch(re.escape(run_name) + r"-(\d+)", execution_name)
    return int(match.group(1)) if match else 0


def _launcher_error(error: ClientError, doing: str) -> LlmtrainError:
    return explain(error, doing)
