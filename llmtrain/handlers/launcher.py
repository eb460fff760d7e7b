"""Entry points of the launcher state machine's three functions; the run's lifecycle is
`llmtrain.lifecycle`, their settings `llmtrain.core.function_settings.LauncherSettings`.

- `resolve`: `{"input": execution input, "execution_arn", "execution_name"}` -> `{"run", "request",
  ...}` (the attempt's state, `submission`), or `{"summary": ...}` of a run refused before any job
  (status `Rejected`).
- `next_attempt`: `{"run", "request", "failure": {"Error", "Cause"}}` -> a retry plan or a failure
  summary; before a hung job's retry it ends the hung job's warm pool.
- `summarize`: `{"run", "job": DescribeTrainingJob output}` -> `{"summary": ...}` for a completed job
  (a tune's: DescribeHyperParameterTuningJob output).

Between states the execution carries `{"run": RunState, "request": CreateTrainingJob request}` and
what the deployment's start step reads besides: `"layout"` (a training job's CreateTrainingJob state)
or `"submission"` (a queued run's SubmitServiceJob request); a tune's request is its
CreateHyperParameterTuningJob request, and its layout one of the tuning states'. The registry is the
templates bundled beside the `llmtrain` package in the function's code
(`templates/<name>/<version>.yaml`), unless the settings name another folder.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import boto3
from botocore.exceptions import ClientError

from llmtrain.core.catalog import Catalog
from llmtrain.core.errors import LauncherStateError
from llmtrain.core.function_settings import LauncherSettings
from llmtrain.core.platform import PlatformContext
from llmtrain.core.runs import RunState
from llmtrain.lifecycle.queue_submission import QueueSubmission
from llmtrain.lifecycle.resolve import REJECTIONS, resolve_run
from llmtrain.lifecycle.retries import plan_next_attempt
from llmtrain.lifecycle.submission import Submission, TrainingJobSubmission
from llmtrain.lifecycle.summaries import completed_summary, rejection_summary
from llmtrain.lifecycle.tuning_jobs import TuningSubmission
from llmtrain.operations.warm_pools import end_warm_pool

LOGGER = logging.getLogger(__name__)

# In the Lambda bundle, templates/ sits next to llmtrain/ (see training_constructs.lambda_code).
BUNDLED_TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "templates"


def resolve(event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
    settings = LauncherSettings.from_environment(os.environ)
    platform = settings.platform
    try:
        return resolve_run(
            event.get("input"),
            platform=platform,
            submission=submission(settings),
            catalog=registry(settings),
            sagemaker=service_client("sagemaker", platform),
            s3=service_client("s3", platform),
            execution_arn=event.get("execution_arn"),
        )
    except REJECTIONS as refusal:
        return {"summary": rejection_summary(refusal, event)}


def next_attempt(event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
    settings = LauncherSettings.from_environment(os.environ)
    run, request = _state(event)
    catalog = registry(settings)
    template = catalog.get(run.template, run.version)
    return plan_next_attempt(
        template,
        run,
        request,
        event.get("failure") or {},
        settings.platform,
        submission(settings, run),
        catalog.program_contract(template),
        end_warm_pool=lambda job_name: _end_warm_pool(settings.platform, job_name),
    )


def _end_warm_pool(platform: PlatformContext, job_name: str) -> None:
    try:
        end_warm_pool(service_client("sagemaker", platform), job_name)
    except ClientError as error:
        # Ended, reused or never kept (a queued job, which Batch names): the retry goes on either way.
        LOGGER.warning("the warm pool of %s was not ended: %s", job_name, error)


def summarize(event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
    run, _ = _state(event, need_request=False)
    return {"summary": completed_summary(run, event.get("job") or {})}


def submission(settings: LauncherSettings, run: RunState | None = None) -> Submission:
    """How this deployment starts an attempt: a CreateTrainingJob state per request layout, or where
    the team's environment has queues a service job in its queue; a tune's (`run.tune`) attempt is a
    tuning job (Resolve picks it from the input the same way)."""
    platform = settings.platform
    if run is not None and run.tune is not None:
        return TuningSubmission.for_tune(run.tune, platform, service_client("sagemaker", platform))
    if platform.queues is None:
        return TrainingJobSubmission(settings.request_layouts)
    return QueueSubmission.for_platform(platform, service_client("batch", platform))


def registry(settings: LauncherSettings) -> Catalog:
    """The template versions this launcher was deployed with."""
    return _load_registry(settings.templates_dir or str(BUNDLED_TEMPLATES_DIR))


@cache
def _load_registry(root: str) -> Catalog:
    folder = Path(root)
    return Catalog.load(root=folder, repo_root=folder.parent)


def service_client(service: str, platform: PlatformContext):
    """A boto3 client of the platform's region (SageMaker; Batch for queued runs; S3 for JumpStart's
    catalogue)."""
    return boto3.client(service, region_name=platform.region)


def _state(event: Mapping[str, Any], *, need_request: bool = True) -> tuple[RunState, dict]:
    run, request = event.get("run"), event.get("request")
    if not isinstance(run, Mapping) or (need_request and not isinstance(request, Mapping)):
        raise LauncherStateError(
            "the state lacks 'run' or 'request': the state machine and the functions "
            "disagree (deploy them together)"
        )
    return RunState.from_dict(run), dict(request or {})
