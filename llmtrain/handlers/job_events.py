"""Entry point of the job-events function (EventBridge: a platform job reached an end state):
metrics per outcome and failure class, a notification, the job's final metrics per template
(llmtrain.operations.job_events; settings: llmtrain.core.function_settings.JobEventSettings)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import boto3

from llmtrain.core.function_settings import JobEventSettings
from llmtrain.operations.job_events import handle_event


def handler(event: Mapping[str, Any], context: Any) -> dict[str, Any]:
    settings = JobEventSettings.from_environment(os.environ)
    session = boto3.session.Session()
    return handle_event(
        event,
        settings,
        cloudwatch=session.client("cloudwatch"),
        sns=session.client("sns"),
        sagemaker=session.client("sagemaker"),
        region=event.get("region") or session.region_name or "",
    )
