"""The warm-pool reaper's work: end the platform's warm pools idle beyond the idle budget.

A warm pool keeps a finished job's instances for `KeepAlivePeriodInSeconds` so a matching job can
start on them at once. Every retained second is billed. Templates set a keep-alive, render and an IAM
condition cap it at the environment's cap; this reaper adds the environment's *idle budget*: a pool
of one of the platform's jobs (name starting with the job-name prefix) that has been Available for
longer than the budget is ended now, with UpdateTrainingJob(ResourceConfig.KeepAlivePeriodInSeconds=0).

In dry-run mode the reaper decides the same way and ends nothing. The setting comes from the
environment (`DRY_RUN`); an invocation event `{"dry_run": true}` previews a run on demand.

Metrics (namespace `METRIC_NAMESPACE`, default `LLMTrain/WarmPools`), per `Environment` and
`InstanceType`: `WarmPoolsAvailable`, `WarmPoolInstancesAvailable`, `RetainedBillableSeconds`
(the pools' retained billable time multiplied by their instance count, i.e. what is billed); per
`Environment`: the same `RetainedBillableSeconds` total, `WarmPoolsOverBudget`, `WarmPoolsEnded`.

The function's settings are `llmtrain.core.function_settings.ReaperSettings` (its `instance_types` are
published
as 0 when they hold no pool); its entry point is `llmtrain.handlers.warm_pools.handler`.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from botocore.exceptions import ClientError

from llmtrain.core.function_settings import ReaperSettings
from llmtrain.operations import fleet
from llmtrain.operations.metrics import Metric, put_metrics

LOGGER = logging.getLogger(__name__)
LOGGER.setLevel(logging.INFO)


@dataclass(frozen=True)
class WarmPoolDecision:
    """What the reaper found for one Available pool and what it did."""

    job: fleet.TrainingJob
    idle_seconds: int
    over_budget: bool
    ended: bool
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "training_job_name": self.job.name,
            "instances": {a.instance_type: a.count for a in self.job.allocations},
            "keep_alive_seconds": self.job.keep_alive_seconds,
            "idle_seconds": self.idle_seconds,
            "retained_billable_seconds": self.job.warm_pool_retained_billable_seconds,
            "over_budget": self.over_budget,
            "ended": self.ended,
            "error": self.error,
        }


def idle_seconds(job: fleet.TrainingJob, now: datetime) -> int:
    """How long the pool has waited for a job: since its own job ended."""
    if job.end_time is None:
        # Not expected for an ended job; the retained billable time measures the same wait.
        return job.warm_pool_retained_billable_seconds
    return max(0, int((now - job.end_time).total_seconds()))


def end_warm_pool(sagemaker: Any, job_name: str) -> None:
    """Release the pool's instances now: a keep-alive of 0 ends it."""
    sagemaker.update_training_job(TrainingJobName=job_name, ResourceConfig={"KeepAlivePeriodInSeconds": 0})


def reap(
    sagemaker: Any, *, job_name_prefix: str, idle_budget_seconds: int, dry_run: bool, now: datetime
) -> list[WarmPoolDecision]:
    """Decide for every Available pool of the platform's jobs; end those over budget unless `dry_run`."""
    decisions = []
    for job in fleet.available_warm_pools(sagemaker, name_prefix=job_name_prefix):
        idle = idle_seconds(job, now)
        over_budget = idle > idle_budget_seconds
        ended, error = False, None
        if over_budget and not dry_run:
            try:
                end_warm_pool(sagemaker, job.name)
                ended = True
            except ClientError as caught:
                # The pool may have been reused or ended since it was listed; the next run sees it.
                error = f"UpdateTrainingJob failed: {caught}"
        decisions.append(WarmPoolDecision(job, idle, over_budget, ended, error))
    return decisions


def decision_metrics(
    decisions: Sequence[WarmPoolDecision], *, environment: str, instance_types: Sequence[str] = ()
) -> list[Metric]:
    """Per instance type and per environment totals (see the module docstring)."""
    pools: dict[str, int] = defaultdict(int, dict.fromkeys(instance_types, 0))
    instances: dict[str, int] = defaultdict(int, dict.fromkeys(instance_types, 0))
    retained: dict[str, int] = defaultdict(int, dict.fromkeys(instance_types, 0))
    for decision in decisions:
        billable = decision.job.warm_pool_retained_billable_seconds
        for allocation in decision.job.allocations:
            pools[allocation.instance_type] += 1
            instances[allocation.instance_type] += allocation.count
            retained[allocation.instance_type] += billable * allocation.count
    metrics = []
    for instance_type in sorted(pools):
        dimensions = {"Environment": environment, "InstanceType": instance_type}
        metrics += [
            Metric("WarmPoolsAvailable", pools[instance_type], "Count", dimensions),
            Metric("WarmPoolInstancesAvailable", instances[instance_type], "Count", dimensions),
            Metric("RetainedBillableSeconds", retained[instance_type], "Seconds", dimensions),
        ]
    totals = {"Environment": environment}
    return metrics + [
        Metric("RetainedBillableSeconds", sum(retained.values()), "Seconds", totals),
        Metric("WarmPoolsOverBudget", sum(d.over_budget for d in decisions), "Count", totals),
        Metric("WarmPoolsEnded", sum(d.ended for d in decisions), "Count", totals),
    ]


def dry_run_from_event(event: Mapping[str, Any] | None, default: bool) -> bool:
    if not event or "dry_run" not in event:
        return default
    value = event["dry_run"]
    if not isinstance(value, bool):
        raise ValueError(f"dry_run: must be true or false (a JSON boolean), got {value!r}")
    return value


def reap_and_report(
    settings: ReaperSettings, *, sagemaker: Any, cloudwatch: Any, dry_run: bool, now: datetime
) -> dict[str, Any]:
    """Reap (or preview, with `dry_run`), publish the metrics, log what was over budget; returns the
    decisions."""
    decisions = reap(
        sagemaker,
        job_name_prefix=settings.job_name_prefix,
        idle_budget_seconds=settings.idle_budget_seconds,
        dry_run=dry_run,
        now=now,
    )
    metrics = decision_metrics(
        decisions, environment=settings.environment, instance_types=settings.instance_types
    )
    put_metrics(cloudwatch, settings.namespace, metrics, now)
    for decision in decisions:
        if decision.over_budget:
            LOGGER.info(
                "%s warm pool of %s: idle %ss > budget %ss%s",
                "ended" if decision.ended else "would end" if dry_run else "could not end",
                decision.job.name,
                decision.idle_seconds,
                settings.idle_budget_seconds,
                f" ({decision.error})" if decision.error else "",
            )
    return {
        "dry_run": dry_run,
        "idle_budget_seconds": settings.idle_budget_seconds,
        "warm_pools": [decision.to_dict() for decision in decisions],
    }
