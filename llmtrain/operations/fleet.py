"""What the account's SageMaker training fleet holds right now: jobs in progress and warm pools.

Shared by the quota-usage function and the warm-pool reaper. ListTrainingJobs summaries carry no
ResourceConfig, so every job found is described once to learn its instance types and counts; the
warm-pool status is read from that description too, because a pool listed as Available a moment ago
may have been reused or terminated by the time it is described.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from botocore.exceptions import ClientError

LOGGER = logging.getLogger(__name__)

WARM_POOL_AVAILABLE = "Available"
_VANISHED_JOB_ERRORS = ("ValidationException", "ResourceNotFound")


@dataclass(frozen=True)
class InstanceAllocation:
    """Instances of one type that a job (or its warm pool) holds."""

    instance_type: str
    count: int


@dataclass(frozen=True)
class TrainingJob:
    """The parts of a DescribeTrainingJob answer that usage and warm-pool policy need."""

    name: str
    status: str
    spot: bool
    allocations: tuple[InstanceAllocation, ...]
    keep_alive_seconds: int
    end_time: datetime | None
    warm_pool_status: str | None
    warm_pool_retained_billable_seconds: int

    @classmethod
    def from_description(cls, description: dict[str, Any]) -> TrainingJob:
        resource_config = description.get("ResourceConfig", {})
        warm_pool = description.get("WarmPoolStatus") or {}
        return cls(
            name=description["TrainingJobName"],
            status=description["TrainingJobStatus"],
            spot=bool(description.get("EnableManagedSpotTraining", False)),
            allocations=_allocations(resource_config),
            keep_alive_seconds=int(resource_config.get("KeepAlivePeriodInSeconds", 0)),
            end_time=description.get("TrainingEndTime"),
            warm_pool_status=warm_pool.get("Status"),
            warm_pool_retained_billable_seconds=int(
                warm_pool.get("ResourceRetainedBillableTimeInSeconds", 0)
            ),
        )

    @property
    def instance_count(self) -> int:
        return sum(allocation.count for allocation in self.allocations)

    @property
    def has_available_warm_pool(self) -> bool:
        return self.warm_pool_status == WARM_POOL_AVAILABLE


def _allocations(resource_config: dict[str, Any]) -> tuple[InstanceAllocation, ...]:
    # A heterogeneous cluster lists InstanceGroups instead of one InstanceType/InstanceCount.
    groups = resource_config.get("InstanceGroups") or []
    if groups:
        return tuple(
            InstanceAllocation(group["InstanceType"], int(group["InstanceCount"])) for group in groups
        )
    if "InstanceType" not in resource_config:
        return ()
    return (
        InstanceAllocation(resource_config["InstanceType"], int(resource_config.get("InstanceCount", 1))),
    )


def in_progress_jobs(sagemaker: Any) -> list[TrainingJob]:
    """Every training job of the account and region whose status is InProgress."""
    jobs = _describe_all(sagemaker, _job_names(sagemaker, StatusEquals="InProgress"))
    return [job for job in jobs if job.status == "InProgress"]


def available_warm_pools(sagemaker: Any, *, name_prefix: str = "") -> list[TrainingJob]:
    """Ended jobs whose warm pool is Available now, optionally only those named with `name_prefix`."""
    names = (
        name
        for name in _job_names(sagemaker, WarmPoolStatusEquals=WARM_POOL_AVAILABLE)
        if name.startswith(name_prefix)
    )
    return [job for job in _describe_all(sagemaker, names) if job.has_available_warm_pool]


def _job_names(sagemaker: Any, **filters: str) -> Iterator[str]:
    paginator = sagemaker.get_paginator("list_training_jobs")
    for page in paginator.paginate(**filters, PaginationConfig={"PageSize": 100}):
        for summary in page["TrainingJobSummaries"]:
            yield summary["TrainingJobName"]


def _describe_all(sagemaker: Any, names: Iterator[str]) -> list[TrainingJob]:
    jobs = []
    for name in names:
        try:
            description = sagemaker.describe_training_job(TrainingJobName=name)
        except ClientError as error:
            # A job listed a moment ago can be gone (e.g. deleted); it then holds no instances.
            if error.response["Error"]["Code"] not in _VANISHED_JOB_ERRORS:
                raise
            LOGGER.warning("training job %s could not be described (%s); skipped", name, error)
            continue
        jobs.append(TrainingJob.from_description(description))
    return jobs
