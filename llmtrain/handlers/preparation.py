"""The entry point of a team's preparation state machine's function (`llmtrain data prepare --cloud`);
the steps are `llmtrain.lifecycle.preparation_steps`, the settings
`llmtrain.core.function_settings.PreparationSettings`. One function, one step per call (`step`):

- `validate`: `{"input": execution input, "execution_name"}` -> `{"preparation", "template", "rerun",
  "shards", "merge"}` (the two CreateProcessingJob requests), or `{"summary": ...}` of a preparation
  refused before any job (status `Rejected`).
- `sizes`: `{"preparation"}` -> `{}`, once `sizes.json` is written (before a rerun's shards job and
  before the merge job).
- `complete`: `{"preparation", "shards_job", "merge_job"}` (DescribeProcessingJob outputs) ->
  `{"summary": ...}` (with each quality step's removals), once the files the dataset does not use
  are removed (the shards a deduplicating merge replaced, `.dedup/`) and its marker is written.
- `failed`: `{"preparation", "stage", "failure": {"Error", "Cause"}}` -> `{"summary": ...}` of a
  failed, stopped or refused job: no marker, so nothing half-written is listed as a dataset.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import boto3

from llmtrain.core.catalog import Catalog
from llmtrain.core.errors import LauncherStateError, LlmtrainError
from llmtrain.core.function_settings import PreparationSettings
from llmtrain.core.platform import PlatformContext
from llmtrain.core.preparation import Preparation
from llmtrain.lifecycle.preparation_steps import (
    completed_summary,
    failed_summary,
    rejection_summary,
    validate_preparation,
    write_sizes,
)

# In the Lambda bundle, templates/ sits next to llmtrain/ (see training_constructs.lambda_code).
BUNDLED_TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "templates"
STEPS = ("validate", "sizes", "complete", "failed")


def handler(event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
    step = event.get("step")
    if step not in STEPS:
        raise LauncherStateError(
            f"step {step!r} is not one of {', '.join(STEPS)}: the state machine and the function disagree "
            "(deploy them together)"
        )
    settings = PreparationSettings.from_environment(os.environ)
    platform = settings.platform
    if step == "validate":
        try:
            return validate_preparation(
                event.get("input"),
                platform=platform,
                catalog=_registry(settings.templates_dir or str(BUNDLED_TEMPLATES_DIR)),
                sagemaker=service_client("sagemaker", platform),
                s3=service_client("s3", platform),
            )
        except LlmtrainError as refusal:
            return {"summary": rejection_summary(refusal, event.get("input"), event.get("execution_name"))}
    if step == "failed":
        return {
            "summary": failed_summary(
                event.get("preparation") or {}, str(event.get("stage")), event.get("failure") or {}
            )
        }
    preparation = Preparation.from_dict(event.get("preparation"))
    s3 = service_client("s3", platform)
    if step == "sizes":
        write_sizes(s3, preparation, platform)
        return {}
    jobs = [event.get("shards_job") or {}, event.get("merge_job") or {}]
    return {"summary": completed_summary(preparation, platform, jobs, s3)}


@cache
def _registry(root: str) -> Catalog:
    """The template versions this deployment's launcher was given (their images run preparations)."""
    folder = Path(root)
    return Catalog.load(root=folder, repo_root=folder.parent)


def service_client(service: str, platform: PlatformContext):
    """A boto3 client of the platform's region (S3, SageMaker)."""
    return boto3.client(service, region_name=platform.region)
