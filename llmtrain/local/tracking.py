"""MLflow for local runs: every local job logs to MLflow, by default to a store in the run's folder.

The training program logs to MLflow when its environment has MLFLOW_TRACKING_URI (in the cloud the
request's MlflowConfig and Environment name the environment's SageMaker tracking server). Locally the
runner points it at `<run folder>/mlflow.db`, an SQLite store (MLflow's own local default; `mlflow ui
--backend-store-uri sqlite:///<run folder>/mlflow.db` shows the run's jobs and nothing else), or at
the tracking URI the user set in their own MLFLOW_TRACKING_URI (a local `mlflow server`, say). The
experiment is `<team>-<template>`, as in the cloud (llmtrain.core.render.mlflow_experiment_name); each job
(attempt) is one MLflow run named after the job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from llmtrain.core.render import MLFLOW_EXPERIMENT_ENV as EXPERIMENT_ENV
from llmtrain.core.render import MLFLOW_TRACKING_URI_ENV as TRACKING_URI_ENV
from llmtrain.core.render import MODEL_ARTIFACT_ENV, TAG_PREFIX, mlflow_experiment_name
from llmtrain.local.job import Adjustment, LocalJob

STORE_FILE = "mlflow.db"


def local_tracking_uri(run_dir: Path, parent_env: Mapping[str, str]) -> str:
    """The user's MLFLOW_TRACKING_URI, else the SQLite store in the run's folder."""
    return parent_env.get(TRACKING_URI_ENV) or f"sqlite:///{(run_dir / STORE_FILE).resolve()}"


def with_local_tracking(
    plan: LocalJob, request: Mapping[str, Any], *, run_dir: Path, model_artifact: Path,
    parent_env: Mapping[str, str],
) -> LocalJob:
    """The plan with the program's MLflow environment pointing at the local tracking URI."""
    uri = local_tracking_uri(run_dir, parent_env)
    environment = dict(plan.environment)
    cloud = environment.get(TRACKING_URI_ENV)
    environment[TRACKING_URI_ENV] = uri
    environment.setdefault(EXPERIMENT_ENV, _experiment(request) or plan.job_name)
    environment[MODEL_ARTIFACT_ENV] = model_artifact.resolve().as_uri()
    if cloud is not None:
        adjustment = Adjustment("MlflowConfig.MlflowResourceArn", cloud, uri,
                                "local jobs log to a local MLflow store (or your MLFLOW_TRACKING_URI)")
        return replace(plan, environment=environment, adjustments=(*plan.adjustments, adjustment))
    note = f"MLflow: experiment {environment[EXPERIMENT_ENV]!r} at {uri}"
    if uri.startswith("sqlite:"):
        note += f" (mlflow ui --backend-store-uri {uri})"
    return replace(plan, environment=environment, notes=(*plan.notes, note))


def _experiment(request: Mapping[str, Any]) -> str | None:
    tags = {tag.get("Key"): tag.get("Value") for tag in request.get("Tags", [])}
    template, team = tags.get(f"{TAG_PREFIX}template"), tags.get(f"{TAG_PREFIX}team")
    return mlflow_experiment_name(template, team) if template and team else template
