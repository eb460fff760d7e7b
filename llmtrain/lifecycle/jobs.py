"""A run's training jobs in SageMaker: one per attempt, named `<team's job-name prefix>-<run>-a<n>`.

Resolve reads them to refuse a second job of a run in progress and to keep a run on the template
version its earlier jobs ran; the CLI (`llmtrain status|logs|runs|debug`) reads them to follow a run.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from llmtrain.render import TAG_PREFIX

ACTIVE_JOB_STATUSES = ("InProgress", "Stopping")


def attempt_name_stem(job_name_prefix: str, run_name: str) -> str:
    """The job name of every attempt of a run without the attempt number; agrees with
    `llmtrain.render.job_name` (tests check it)."""
    return f"{job_name_prefix}-{run_name}-a"


def run_jobs(sagemaker, job_name_prefix: str, run_name: str) -> list[dict[str, Any]]:
    """The run's training jobs (any status), oldest attempt first:
    `{"attempt", "job_name", "job_arn", "status"}`."""
    stem = attempt_name_stem(job_name_prefix, run_name)
    own = re.compile(re.escape(stem) + r"(\d+)", re.IGNORECASE)
    found = []
    for page in sagemaker.get_paginator("list_training_jobs").paginate(NameContains=stem):
        for job in page["TrainingJobSummaries"]:
            match = own.fullmatch(job["TrainingJobName"])
            if match:
                found.append(
                    {
                        "attempt": int(match.group(1)),
                        "job_name": job["TrainingJobName"],
                        "job_arn": job.get("TrainingJobArn"),
                        "status": job["TrainingJobStatus"],
                    }
                )
    return sorted(found, key=lambda job: job["attempt"])


def pinned_template(sagemaker, previous: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
    """The template and version a run's earlier jobs ran (their `llmtrain:` tags), if any."""
    if not previous or not previous[-1].get("job_arn"):
        return None
    tags = {
        tag["Key"]: tag["Value"]
        for page in sagemaker.get_paginator("list_tags").paginate(ResourceArn=previous[-1]["job_arn"])
        for tag in page["Tags"]
    }
    name, version = tags.get(TAG_PREFIX + "template"), tags.get(TAG_PREFIX + "template-version")
    return (name, version) if name and version else None
