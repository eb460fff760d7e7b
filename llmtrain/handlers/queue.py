"""The launcher's Watch function, for a team whose environment has queues: between its waits, the
state machine asks it what the run's service job is doing (llmtrain.queues.launch.watch).

`{"queue": {"job_id": ...}, ...}` -> `{"job_id", "phase", "position", "share_instances", ...,
"message"}` with `"wait_seconds"` while the job waits or trains, `"job"` (the training job's
description) when it succeeded, `"failure"` (`{"Error", "Cause"}`) when it failed. The function reads
its platform context as the other launcher functions do (`LLMTRAIN_PLATFORM_CONTEXT`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmtrain.handlers import launcher
from llmtrain.queues import launch


def watch(event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
    platform = launcher.platform_from_environment()
    queue_state = event.get("queue") or {}
    batch, sagemaker = (launcher.service_client(service, platform) for service in ("batch", "sagemaker"))
    return launch.watch(batch, sagemaker, queue_state, platform)
