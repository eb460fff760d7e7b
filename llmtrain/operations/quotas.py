"""SageMaker training instances in use, against their Service Quotas (the quota-usage function's work,
and `llmtrain quotas`).

SageMaker publishes no training-instance usage to `AWS/Usage`, so this function computes it. For each
instance type the environment's enabled templates use, and for each kind of usage that has its own
quota (on-demand training jobs, spot training jobs, warm pools), it counts the instances held now:

- training / spot: the `ResourceConfig` instance counts of InProgress jobs (spot jobs apart);
- warm-pool: the instance counts of ended jobs whose warm pool is Available.

It reads the matching quotas from Service Quotas (names like "ml.p4d.24xlarge for training job
usage"), listed once and kept for a TTL across warm invocations, and publishes, per instance type and
usage kind, `InstancesInUse`, `Quota`, `Utilization` (percent) and `QuotaUnreadable` (1 when the quota
could not be read), and, without dimensions, `UnreadableQuotas` (how many could not be read). An
unreadable quota is reported in the metrics, the log and the result; it never stops the others from
being published.

The function's settings are `llmtrain.core.function_settings.QuotaSettings`; its entry point is
`llmtrain.handlers.quotas.handler`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from llmtrain.core.function_settings import UsageKind
from llmtrain.operations import fleet
from llmtrain.operations.metrics import Metric, put_metrics

SERVICE_CODE = "sagemaker"


def quota_name(instance_type: str, kind: UsageKind) -> str:
    """The Service Quotas name of the quota on `instance_type` for `kind` of usage."""
    return f"{instance_type} {kind.quota_suffix}"


class QuotaListingError(Exception):
    """Service Quotas could not be listed (no permission, throttled, unreachable)."""


class QuotaCache:
    """SageMaker's quotas by name, listed once and kept for `ttl_seconds`.

    Applied values (ListServiceQuotas) win; AWS defaults (ListAWSDefaultServiceQuotas) fill in the
    quotas that were never changed, which ListServiceQuotas may leave out. A failed listing is not
    kept, so the next invocation tries again.
    """

    def __init__(self, ttl_seconds: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_seconds = ttl_seconds
        self._clock = clock
        self._quotas: dict[str, dict[str, Any]] | None = None
        self._listed_at = 0.0

    def quotas(self, service_quotas: Any) -> dict[str, dict[str, Any]]:
        if self._quotas is None or self._clock() - self._listed_at >= self._ttl_seconds:
            self._quotas = _list_sagemaker_quotas(service_quotas)
            self._listed_at = self._clock()
        return self._quotas


def _list_sagemaker_quotas(service_quotas: Any) -> dict[str, dict[str, Any]]:
    try:
        quotas = _paginate_quotas(service_quotas, "list_aws_default_service_quotas")
        quotas.update(_paginate_quotas(service_quotas, "list_service_quotas"))
    except (ClientError, BotoCoreError) as error:
        raise QuotaListingError(
            f"Service Quotas for '{SERVICE_CODE}' could not be listed: {error}"
        ) from error
    return quotas


def _paginate_quotas(service_quotas: Any, operation: str) -> dict[str, dict[str, Any]]:
    quotas = {}
    for page in service_quotas.get_paginator(operation).paginate(ServiceCode=SERVICE_CODE):
        for quota in page["Quotas"]:
            quotas[quota["QuotaName"]] = quota
    return quotas


@dataclass(frozen=True)
class QuotaUsage:
    """Instances of one type held for one kind of usage, against its quota (None when unreadable)."""

    instance_type: str
    kind: UsageKind
    in_use: int
    quota: float | None
    error: str | None = None

    @property
    def quota_name(self) -> str:
        return quota_name(self.instance_type, self.kind)

    @property
    def utilization_percent(self) -> float | None:
        if self.quota is None:
            return None
        if self.quota <= 0:
            # No instance may be used at all: any use is at the limit (CloudWatch takes no infinity).
            return 0.0 if self.in_use == 0 else 100.0
        return 100.0 * self.in_use / self.quota

    def metrics(self) -> list[Metric]:
        dimensions = {"InstanceType": self.instance_type, "UsageKind": self.kind.value}
        metrics = [
            Metric("InstancesInUse", self.in_use, "Count", dimensions),
            Metric("QuotaUnreadable", 0 if self.error is None else 1, "Count", dimensions),
        ]
        if self.quota is not None:
            metrics.append(Metric("Quota", self.quota, "Count", dimensions))
            metrics.append(Metric("Utilization", self.utilization_percent or 0.0, "Percent", dimensions))
        return metrics

    def to_dict(self) -> dict[str, Any]:
        return {
            "instance_type": self.instance_type,
            "usage_kind": self.kind.value,
            "quota_name": self.quota_name,
            "in_use": self.in_use,
            "quota": self.quota,
            "utilization_percent": self.utilization_percent,
            "error": self.error,
        }


def count_instances_in_use(sagemaker: Any) -> Counter[tuple[str, UsageKind]]:
    """Instances held now in the account and region, by (instance type, usage kind)."""
    counts: Counter[tuple[str, UsageKind]] = Counter()
    for job in fleet.in_progress_jobs(sagemaker):
        kind = UsageKind.SPOT if job.spot else UsageKind.TRAINING
        for allocation in job.allocations:
            counts[allocation.instance_type, kind] += allocation.count
    for job in fleet.available_warm_pools(sagemaker):
        for allocation in job.allocations:
            counts[allocation.instance_type, UsageKind.WARM_POOL] += allocation.count
    return counts


def collect_usage(
    *, sagemaker: Any, service_quotas: Any, instance_types: Iterable[str], cache: QuotaCache
) -> list[QuotaUsage]:
    """Usage against quota for every instance type in `instance_types` and every usage kind."""
    counts = count_instances_in_use(sagemaker)
    try:
        quotas = cache.quotas(service_quotas)
        listing_error = None
    except QuotaListingError as error:
        quotas, listing_error = {}, str(error)
    usages = []
    for instance_type in instance_types:
        for kind in UsageKind:
            quota, error = _quota_value(quotas, quota_name(instance_type, kind), listing_error)
            usages.append(QuotaUsage(instance_type, kind, counts[instance_type, kind], quota, error))
    return usages


def _quota_value(
    quotas: Mapping[str, dict[str, Any]], name: str, listing_error: str | None
) -> tuple[float | None, str | None]:
    if listing_error is not None:
        return None, listing_error
    quota = quotas.get(name)
    if quota is None:
        return None, f"no quota named {name!r} in Service Quotas for '{SERVICE_CODE}' in this region"
    if quota.get("ErrorReason"):
        reason = quota["ErrorReason"]
        return None, f"quota {name!r} is unreadable: {reason.get('ErrorCode')}: {reason.get('ErrorMessage')}"
    if "Value" not in quota:
        return None, f"quota {name!r} has no value in Service Quotas"
    return float(quota["Value"]), None


def publish(cloudwatch: Any, namespace: str, usages: Sequence[QuotaUsage], timestamp: datetime) -> None:
    metrics = [metric for usage in usages for metric in usage.metrics()]
    # One series for "some quota is unreadable", so a single alarm covers every instance type.
    metrics.append(Metric("UnreadableQuotas", sum(usage.error is not None for usage in usages), "Count"))
    put_metrics(cloudwatch, namespace, metrics, timestamp)
