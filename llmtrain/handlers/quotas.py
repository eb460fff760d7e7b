"""Entry point of the quota-usage function (scheduled): training instances in use against their
Service Quotas, published as metrics (llmtrain.operations.quotas; settings:
llmtrain.core.function_settings.QuotaSettings)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import boto3

from llmtrain.core.function_settings import QuotaSettings
from llmtrain.operations.quotas import QuotaCache, collect_usage, publish

LOGGER = logging.getLogger(__name__)
LOGGER.setLevel(logging.INFO)

# Kept across warm invocations of one Lambda execution environment; created on first use.
_CACHE: QuotaCache | None = None


def _cache(ttl_seconds: int) -> QuotaCache:
    global _CACHE
    if _CACHE is None:
        _CACHE = QuotaCache(ttl_seconds)
    return _CACHE


def handler(event: Mapping[str, Any] | None, context: Any) -> dict[str, Any]:
    """Compute, publish and return usage against quota."""
    settings = QuotaSettings.from_environment(os.environ)
    usages = collect_usage(
        sagemaker=boto3.client("sagemaker"),
        service_quotas=boto3.client("service-quotas"),
        instance_types=settings.instance_types,
        cache=_cache(settings.cache_ttl_seconds),
    )
    publish(boto3.client("cloudwatch"), settings.namespace, usages, datetime.now(UTC))
    unreadable = [usage for usage in usages if usage.error is not None]
    for usage in unreadable:
        LOGGER.warning("quota unreadable: %s: %s", usage.quota_name, usage.error)
    return {
        "usages": [usage.to_dict() for usage in usages],
        "unreadable_quotas": [usage.quota_name for usage in unreadable],
    }
