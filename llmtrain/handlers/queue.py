"""Entry point of the launcher's Watch function, for a team whose environment has queues: between its
waits, the state machine asks it what the run's service job is doing
(llmtrain.lifecycle.queue_submission.watch;
settings: llmtrain.core.function_settings.WatchSettings).

`{"queue": {"job_id": ...}, ...}` -> `{"job_id", "phase", "position", "share_instances", ...,
"message"}` with `"wait_seconds"` while the job waits or trains, `"job"` (the training job's
description) when it succeeded, `"failure"` (`{"Error", "Cause"}`) when it failed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from llmtrain.core.function_settings import WatchSettings
from llmtrain.handlers import launcher
from llmtrain.lifecycle.queue_submission import watch as watch_run


def watch(event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
    platform = WatchSettings.from_environment(os.environ).platform
    batch, sagemaker = (launcher.service_client(service, platform) for service in ("batch", "sagemaker"))
    return watch_run(batch, sagemaker, event.get("queue") or {}, platform)
