"""A cloud data preparation started and followed from the CLI: the shards job, then `sizes.json`, the
merge job and the dataset's marker, each step once the one before it succeeded.

The steps run here, with the caller's credentials (sagemaker:CreateProcessingJob and iam:PassRole on
the team's execution role, which a deployed environment's engineers' policy does not grant: engineers
create no job): the team's launcher does not run preparations yet (docs/infrastructure.md says what
is left). A
preparation that stops (a failed or stopped job, an interrupted command) is resumed by the same
command: the shards job of the rerun skips the units complete in the prefix (all of them, after a
failed merge) and the merge follows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from llmtrain.client.aws import explained
from llmtrain.client.datasets import DATASET_MANIFEST
from llmtrain.client.preparations import (
    progress,
    removal_line,
    step_removals,
    upload_code,
    write_marker,
    write_sizes,
)
from llmtrain.core.platform import PlatformContext
from llmtrain.core.preparation import (
    Preparation,
    PreparationError,
    job_name_stem,
    merge_request,
    shards_request,
)
from llmtrain.core.s3_uris import parse_s3_uri
from llmtrain.core.spec import TemplateSpec
from llmtrain.planner import prices

ACTIVE = ("InProgress", "Stopping")
POLL_SECONDS = 30


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


def run_preparation(
    sagemaker,
    s3,
    preparation: Preparation,
    platform: PlatformContext,
    template: TemplateSpec,
    *,
    wait: bool = True,
    say: Callable[[str], None] = print,
    poll_seconds: int = POLL_SECONDS,
) -> None:
    """Start (or resume) the preparation; with `wait`, follow it to the complete dataset."""
    running = [job for job in preparation_jobs(sagemaker, platform, preparation.name) if job.status in ACTIVE]
    if running:
        raise PreparationError(
            f"job {running[0].name} of this preparation is {running[0].status}: follow it "
            f"with `llmtrain data status {preparation.name}`, or stop it first"
        )
    upload_code(s3, preparation, platform)
    if preparation.rerun:
        # The instances check each unit written before against this listing and keep the complete ones
        # (a rerun after a failed merge only checks them).
        write_sizes(s3, preparation, platform)
        say(
            f"resuming: the {progress(s3, preparation, platform)['units_done']} work unit(s) written before "
            "are checked, and the complete ones kept"
        )
    shards = shards_request(preparation, platform, template)
    _start(sagemaker, shards, say)
    if not wait:
        say(
            f"follow it with `llmtrain data status {preparation.name}`; once it completed, run the same "
            "command again to merge (the units are then all kept)"
        )
        return
    _wait(
        sagemaker,
        shards["ProcessingJobName"],
        poll_seconds,
        "run the same command again: it redoes only the work units whose shards are missing",
    )
    write_sizes(s3, preparation, platform)
    merge = merge_request(preparation, platform, template)
    _start(sagemaker, merge, say)
    _wait(
        sagemaker,
        merge["ProcessingJobName"],
        poll_seconds,
        "run the same command again: the shards are kept and only the merge runs",
    )
    write_marker(s3, preparation, platform)
    for step in step_removals(s3, platform, preparation.name) or []:
        say(removal_line(step["step"], step["removed_documents"], step["removed_tokens"]))
    say(f"dataset {preparation.dataset_uri(platform)} is complete")


def _start(sagemaker, request: Mapping[str, Any], say: Callable[[str], None]) -> None:
    with explained(f"creating processing job {request['ProcessingJobName']}"):
        sagemaker.create_processing_job(**request)
    count = request["ProcessingResources"]["ClusterConfig"]["InstanceCount"]
    say(
        f"started {request['ProcessingJobName']} ({count} x "
        f"{request['ProcessingResources']['ClusterConfig']['InstanceType']})"
    )


def _wait(sagemaker, name: str, poll_seconds: int, retry: str) -> None:
    waiter = sagemaker.get_waiter("processing_job_completed_or_stopped")
    with explained(f"waiting for processing job {name}"):
        waiter.wait(ProcessingJobName=name, WaiterConfig={"Delay": poll_seconds, "MaxAttempts": 100_000})
    job = sagemaker.describe_processing_job(ProcessingJobName=name)
    if job["ProcessingJobStatus"] != "Completed":
        reason = job.get("FailureReason") or job.get("ExitMessage") or "no reason given"
        raise PreparationError(
            f"processing job {name} ended {job['ProcessingJobStatus']} ({reason}); {retry}"
        )


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
    start, end = job.get("ProcessingStartTime"), job.get("ProcessingEndTime")
    seconds = (
        (end - start).total_seconds() if isinstance(start, datetime) and isinstance(end, datetime) else None
    )
    usd = None
    if seconds is not None:
        try:
            usd = seconds / 3600 * cluster["InstanceCount"] * prices.load().on_demand(cluster["InstanceType"])
        except prices.PriceError:
            usd = None
    return JobSummary(
        job["ProcessingJobName"],
        job["ProcessingJobStatus"],
        cluster["InstanceCount"],
        cluster["InstanceType"],
        seconds,
        usd,
        job.get("FailureReason"),
    )


def is_complete(s3, platform: PlatformContext, name: str) -> bool:
    key = f"{parse_s3_uri(platform.datasets_uri).key}{name}/{DATASET_MANIFEST}"
    return s3.list_objects_v2(Bucket=platform.datasets_bucket, Prefix=key, MaxKeys=1).get("KeyCount", 0) > 0
