"""A cloud data preparation started and followed from the CLI, through the team's preparation state
machine (`training_constructs.preparation_launcher.PreparationLauncher`, found in the deployed
environment's record): the engineer uploads the program's code into the dataset's folder and starts an
execution (`llmtrain.core.preparation.PreparationInput`); the state machine checks it again, runs the
shards job, writes `sizes.json`, runs the merge job and writes the dataset's marker, with its own role
(engineers create no job and pass no role). A preparation that stops (a failed or stopped job) is
resumed by the same command: its shards job skips the units complete in the prefix (all of them, after
a failed merge) and the merge follows.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from llmtrain.client.aws import explained
from llmtrain.client.preparations import progress, upload_code
from llmtrain.core.platform import PlatformContext
from llmtrain.core.preparation import (
    Preparation,
    PreparationError,
    PreparationInput,
    execution_name,
    job_name_stem,
)
from llmtrain.core.spec import TemplateSpec
from llmtrain.lifecycle.preparation_steps import job_cost

POLL_SECONDS = 30


class PreparationFailed(PreparationError):
    """The preparation ran and failed (or was stopped, or refused by the state machine); the message is
    the state machine's: its error and what to do."""


@dataclass(frozen=True)
class JobSummary:
    name: str
    status: str
    instances: int
    instance_type: str
    seconds: float | None
    usd: float | None
    failure: str | None

    def line(self) -> str:
        cost = f"${self.usd:,.2f}" if self.usd is not None else "-"
        took = f"{self.seconds / 3600:.2f} h" if self.seconds is not None else "-"
        why = f": {self.failure}" if self.failure else ""
        return f"{self.name}  {self.status}{why}  {self.instances} x {self.instance_type}  {took}  {cost}"


@dataclass(frozen=True)
class ExecutionSummary:
    """One attempt of a preparation: an execution of the team's preparation state machine."""

    name: str
    arn: str
    status: str  # RUNNING, SUCCEEDED, FAILED, TIMED_OUT, ABORTED
    started: Any

    def line(self) -> str:
        return f"preparation {self.name}  {self.status}"


def preparation_state_machine(team) -> str:
    """The team's preparation state machine, from the deployed environment's record."""
    arn = team.preparation_state_machine_arn
    if not arn:
        raise PreparationError(
            f"team {team.name!r}'s environment has no preparation state machine (its record was written "
            "by an older platform): ask the platform team to deploy the current one"
        )
    return arn


def start_preparation(
    sfn,
    s3,
    state_machine_arn: str,
    preparation: Preparation,
    platform: PlatformContext,
    template: TemplateSpec,
    *,
    wait: bool = True,
    say: Callable[[str], None] = print,
    poll_seconds: float | None = None,
) -> dict[str, Any] | None:
    """Start (or resume) the preparation; with `wait`, follow it to the complete dataset and return its
    summary (PreparationFailed when it failed or was refused, with the state machine's reason)."""
    running = [
        e
        for e in preparation_executions(sfn, state_machine_arn, platform, preparation.name)
        if e.status == "RUNNING"
    ]
    if running:
        raise PreparationError(
            f"preparation {running[0].name} of this dataset is running: follow it with `llmtrain data status "
            f"{preparation.name}`, or stop it first"
        )
    upload_code(s3, preparation, platform)
    name = execution_name(platform, preparation)
    with explained(f"starting preparation {name}"):
        arn = sfn.start_execution(
            stateMachineArn=state_machine_arn,
            name=name,
            input=json.dumps(PreparationInput(preparation, template.ref).to_dict()),
        )["executionArn"]
    if preparation.rerun:
        say(
            f"resuming: the {progress(s3, preparation, platform)['units_done']} work unit(s) written before "
            "are checked, and the complete ones kept"
        )
    say(f"started preparation {name}")
    if not wait:
        say(f"follow it with `llmtrain data status {preparation.name}`")
        return None
    return follow(sfn, arn, poll_seconds=poll_seconds)


def follow(sfn, execution_arn: str, *, poll_seconds: float | None = None) -> dict[str, Any]:
    """Wait for the execution to end; its summary, or PreparationFailed with its error and cause."""
    while True:
        with explained("following the preparation"):
            described = sfn.describe_execution(executionArn=execution_arn)
        if described["status"] != "RUNNING":
            break
        time.sleep(poll_seconds if poll_seconds is not None else POLL_SECONDS)
    if described["status"] == "SUCCEEDED":
        return json.loads(described.get("output") or "{}")
    error, cause = described.get("error") or described["status"], described.get("cause") or ""
    raise PreparationFailed(f"the preparation ended {described['status']}: {error}: {cause}")


def preparation_executions(
    sfn, state_machine_arn: str, platform: PlatformContext, name: str
) -> list[ExecutionSummary]:
    """The dataset's preparations (executions named `<job name stem>-<stamp>`), oldest first."""
    stem = job_name_stem(platform, name)
    found = []
    with explained(f"listing the preparations of {name}"):
        for page in sfn.get_paginator("list_executions").paginate(stateMachineArn=state_machine_arn):
            found += [
                ExecutionSummary(e["name"], e["executionArn"], e["status"], e.get("startDate"))
                for e in page["executions"]
                if e["name"].startswith(f"{stem}-")
            ]
    return sorted(found, key=lambda e: e.name[-14:])


def preparation_jobs(sagemaker, platform: PlatformContext, name: str) -> list[JobSummary]:
    """The dataset's preparation jobs, oldest first, with what each cost."""
    stem = job_name_stem(platform, name)
    summaries = []
    with explained(f"listing the processing jobs of {name}"):
        pages = sagemaker.get_paginator("list_processing_jobs").paginate(NameContains=stem)
        names = [
            job["ProcessingJobName"]
            for page in pages
            for job in page["ProcessingJobSummaries"]
            if job["ProcessingJobName"].startswith(f"{stem}-")
        ]
        for job_name in names:
            summaries.append(_summary(sagemaker.describe_processing_job(ProcessingJobName=job_name)))
    return sorted(summaries, key=lambda job: job.name[-14:])


def _summary(job: Mapping[str, Any]) -> JobSummary:
    cluster = job["ProcessingResources"]["ClusterConfig"]
    seconds, usd = job_cost(job)
    return JobSummary(
        job["ProcessingJobName"],
        job["ProcessingJobStatus"],
        cluster["InstanceCount"],
        cluster["InstanceType"],
        seconds,
        usd,
        job.get("FailureReason"),
    )
