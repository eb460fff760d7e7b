"""MLflow for local runs: every local job logs to MLflow, by default to a store in the run's folder.

The training program logs to MLflow when its environment has MLFLOW_TRACKING_URI (in the cloud the
request's MlflowConfig and Environment name the environment's SageMaker tracking server). Locally the
runner points it at `<run folder>/mlflow.db`, an SQLite store (MLflow's own local default; `mlflow ui
--backend-store-uri sqlite:///<run folder>/mlflow.db` shows the run's jobs and nothing else), or at
the tracking URI the user set in their own MLFLOW_TRACKING_URI (a local `mlflow server`, say). The
experiment is `<team>-<template>`, as in the cloud (llmtrain.core.render.mlflow_experiment_name); each job
(attempt) is one MLflow run named after the job.

A new run's store starts as a copy of an empty one kept in the user's cache (`seed_store`): MLflow
creates an SQLite store by running each of its schema migrations, seconds of every first job.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from llmtrain.core.render import MLFLOW_EXPERIMENT_ENV as EXPERIMENT_ENV
from llmtrain.core.render import MLFLOW_TRACKING_URI_ENV as TRACKING_URI_ENV
from llmtrain.core.render import MODEL_ARTIFACT_ENV, TAG_PREFIX, mlflow_experiment_name
from llmtrain.core.user_cache import cached_file, content_key, installed_version
from llmtrain.local.job import Adjustment, LocalJob

STORE_FILE = "mlflow.db"
# Creates an empty store (every migration run, the Default experiment) at the path it is given.
_CREATE_STORE = ("import sys; from mlflow.tracking import MlflowClient; "
                 "MlflowClient(tracking_uri='sqlite:///' + sys.argv[1]).search_experiments()")


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


def seed_store(plan: LocalJob, run_dir: Path) -> None:
    """Start the run's own new SQLite store as a copy of an empty one from the user's cache, made once
    per MLflow version by the job's interpreter. Where that cannot be made (no mlflow, no cache), the
    job creates its store itself, as it would anyway. A store of the user's (their
    MLFLOW_TRACKING_URI) is left alone."""
    store = (run_dir / STORE_FILE).resolve()
    if plan.environment.get(TRACKING_URI_ENV) != f"sqlite:///{store}" or store.exists():
        return
    key = content_key([], os.path.realpath(sys.executable), installed_version("mlflow"),
                      installed_version("mlflow-skinny"))
    empty = cached_file("mlflow", f"empty-{key}.db", _create_empty_store)
    if empty is None:
        return
    store.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(empty, store)


def _create_empty_store(path: Path) -> bool:
    try:
        return subprocess.run([sys.executable, "-c", _CREATE_STORE, str(path)], capture_output=True,
                              cwd=path.parent, timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
