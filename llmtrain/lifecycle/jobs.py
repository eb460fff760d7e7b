"""A run's jobs in SageMaker: one per attempt, named `<team's job-name prefix>-<run>-a<n>` for a
training job, `<team's job-name prefix>-<run>-t<n>` for a tune's tuning job.

Resolve reads them to refuse a second job of a run in progress and to keep a run on the template
version its earlier jobs ran; the CLI (`llmtrain status|logs|runs|debug`) reads them to follow a run.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from llmtrain.core.render import TAG_PREFIX

ACTIVE_JOB_STATUSES = ("InProgress", "Stopping")
TRAINING_JOB = "training job"
TUNING_JOB = "tuning job"


def attempt_name_stem(job_name_prefix: str, run_name: str) -> str:
    """The job name of every attempt of a run without the attempt number; agrees with
    `llmtrain.core.render.job_name` (tests check it)."""
    return f"{job_name_prefix}-{run_name}-a"


def tuning_name_stem(job_name_prefix: str, run_name: str) -> str:
    """The name of every tuning job of a tune without the attempt number; agrees with
    `llmtrain.core.tuning_request.tuning_job_name` (tests check it)."""
    return f"{job_name_prefix}-{run_name}-t"


def run_jobs(sagemaker, job_name_prefix: str, run_name: str) -> list[dict[str, Any]]:
    """The run's training jobs (any status), oldest attempt first:
    `{"attempt", "job_name", "job_arn", "status", "kind"}`."""
    return _numbered_jobs(sagemaker.get_paginator("list_training_jobs"), "TrainingJob",
                          attempt_name_stem(job_name_prefix, run_name), TRAINING_JOB)


def tuning_jobs(sagemaker, job_name_prefix: str, run_name: str) -> list[dict[str, Any]]:
    """A tune's tuning jobs (any status), oldest attempt first, as `run_jobs` lists a run's."""
    return _numbered_jobs(sagemaker.get_paginator("list_hyper_parameter_tuning_jobs"),
                          "HyperParameterTuningJob", tuning_name_stem(job_name_prefix, run_name), TUNING_JOB)


def _numbered_jobs(paginator, shape: str, stem: str, kind: str) -> list[dict[str, Any]]:
    """The jobs SageMaker lists under `<stem><attempt>` (`shape`: the List call's summaries'
    TrainingJob or HyperParameterTuningJob fields)."""
    own = re.compile(re.escape(stem) + r"(\d+)", re.IGNORECASE)
    found = []
    for page in paginator.paginate(NameContains=stem):
        for job in page[f"{shape}Summaries"]:
            match = own.fullmatch(job[f"{shape}Name"])
            if match:
                found.append(
                    {
                        "attempt": int(match.group(1)),
                        "job_name": job[f"{shape}Name"],
                        "job_arn": job.get(f"{shape}Arn"),
                        "status": job[f"{shape}Status"],
                        "kind": kind,
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
