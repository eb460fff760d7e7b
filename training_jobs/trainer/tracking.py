"""Experiment tracking with MLflow, when the job's environment names a tracking server.

`MLFLOW_TRACKING_URI` set (a SageMaker managed MLflow tracking server's ARN in the cloud, which the
`sagemaker-mlflow` plugin resolves; a local store or server for `llmtrain run --local`): rank 0
opens one MLflow run named after the training job in the experiment `MLFLOW_EXPERIMENT_NAME`, logs
every hyperparameter, every metrics line the job prints, and where the final model went. Unset:
nothing happens and mlflow is never imported, so the program runs without the package.

Tracking never stops training once it runs: a tracking server that fails mid-job is reported once and
left alone. Failing to open the run at the start, though, stops the job, since a run that was meant to
be tracked and is not would go unnoticed.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from .errors import ContainerError

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
EXPERIMENT_ENV = "MLFLOW_EXPERIMENT_NAME"
# Where the job's model.tar.gz ends up (set by the platform: the S3 output path in the cloud, the
# local run's folder locally); logged as a tag beside the model folder inside the container.
MODEL_ARTIFACT_ENV = "LLMTRAIN_MODEL_ARTIFACT_URI"
DEFAULT_EXPERIMENT = "llmtrain"
_MAX_PARAM_VALUE = 6000  # MLflow's limit on a parameter value
_BATCH = 100  # MLflow accepts at most 100 parameters per log_batch call


class MlflowTracker:
    """One MLflow run of this job (rank 0 only)."""

    def __init__(self, client: Any, run_id: str, entities: Any) -> None:
        self._client = client
        self.run_id = run_id
        self._entities = entities
        self._failed = False
        self._status: str | None = None

    def log_metrics(self, values: Mapping[str, float]) -> None:
        step = int(values.get("step", 0))
        now = int(time.time() * 1000)
        metrics = [self._entities.Metric(key, float(value), now, step)
                   for key, value in values.items() if key != "step"]
        self._call(self._client.log_batch, self.run_id, metrics=metrics)

    def log_model(self, model_dir: str, artifact_uri: str | None) -> None:
        self._call(self._client.set_tag, self.run_id, "model_dir", model_dir)
        if artifact_uri:
            self._call(self._client.set_tag, self.run_id, "model_artifact", artifact_uri)

    def finish(self, status: str) -> None:
        """FINISHED, KILLED (stopped: SIGTERM) or FAILED; `close` ends the run with it."""
        self._status = status

    def close(self) -> None:
        self._call(self._client.set_terminated, self.run_id, self._status or "FAILED")

    def _call(self, method, *args, **kwargs) -> None:
        if self._failed:
            return
        try:
            method(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - any tracking failure leaves training alone
            self._failed = True
            print(f"[train] MLflow tracking stopped after an error (training goes on): {error}",
                  file=sys.stderr, flush=True)


def start_tracking(
    environ: Mapping[str, str], *, enabled: bool, job_name: str, params: Mapping[str, Any]
) -> MlflowTracker | None:
    """The job's MLflow run, or None when tracking is off (no tracking URI, or not rank 0)."""
    uri = environ.get(TRACKING_URI_ENV, "")
    if not enabled or not uri:
        return None
    client_module, entities = _import_mlflow(uri)
    try:
        client = client_module.MlflowClient(tracking_uri=uri)
        experiment_name = environ.get(EXPERIMENT_ENV) or DEFAULT_EXPERIMENT
        experiment = client.get_experiment_by_name(experiment_name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else client.create_experiment(experiment_name))
        run = client.create_run(experiment_id, run_name=job_name,
                                tags={"sagemaker.training_job": job_name})
        tracker = MlflowTracker(client, run.info.run_id, entities)
        items = [entities.Param(key, _param_value(value)) for key, value in sorted(params.items())]
        for start in range(0, len(items), _BATCH):
            client.log_batch(run.info.run_id, params=items[start:start + _BATCH])
    except Exception as error:
        raise ContainerError(
            f"cannot open an MLflow run at {TRACKING_URI_ENV}={uri!r}: {error}; check that the tracking "
            "server exists and that the job can reach it"
        ) from error
    return tracker


def _import_mlflow(uri: str):
    try:
        from mlflow import entities
        from mlflow import tracking as client_module
    except ImportError as error:
        raise ContainerError(
            f"{TRACKING_URI_ENV} is set ({uri!r}) but the mlflow package is not installed: add "
            "mlflow-skinny to the sourcedir's requirements.txt, or unset the variable"
        ) from error
    if uri.startswith("arn:"):
        try:
            import sagemaker_mlflow  # noqa: F401 - registers the tracking-server ARN scheme
        except ImportError as error:
            raise ContainerError(
                f"{TRACKING_URI_ENV} is a SageMaker MLflow tracking server ARN, which needs the "
                "sagemaker-mlflow package: add it to the sourcedir's requirements.txt"
            ) from error
    return client_module, entities


def _param_value(value: Any) -> str:
    text = str(value)
    return text if len(text) <= _MAX_PARAM_VALUE else text[:_MAX_PARAM_VALUE - 3] + "..."


def job_name() -> str:
    """SageMaker (and the local runner) name the job in TRAINING_JOB_NAME."""
    return os.environ.get("TRAINING_JOB_NAME") or "training-job"
