"""Entry point of the warm-pool reaper (scheduled): ends the platform's warm pools idle beyond the
idle budget (llmtrain.operations.warm_pools; settings: llmtrain.core.function_settings.ReaperSettings). An
invocation event `{"dry_run": true}` previews a run on demand."""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import boto3

from llmtrain.core.function_settings import ReaperSettings
from llmtrain.operations.warm_pools import dry_run_from_event, reap_and_report


def handler(event: Mapping[str, Any] | None, context: Any) -> dict[str, Any]:
    """Reap (or preview), publish metrics, return the decisions."""
    settings = ReaperSettings.from_environment(os.environ)
    return reap_and_report(
        settings,
        sagemaker=boto3.client("sagemaker"),
        cloudwatch=boto3.client("cloudwatch"),
        dry_run=dry_run_from_event(event, settings.dry_run),
        now=datetime.now(UTC),
    )
