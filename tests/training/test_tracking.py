"""MLflow tracking of the training program (trainer/tracking.py): what a job logs, read back with the
mlflow package from a file store; and the program without mlflow when tracking is off."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from training_jobs.trainer import tracking
from training_jobs.trainer.errors import ContainerError
from training_jobs.trainer.metrics import MetricsLogger

REPO = Path(__file__).resolve().parents[2]


def test_a_tracked_job_logs_params_metrics_and_the_model_location(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    # A file store works with mlflow-skinny too (the container's package; make test-container).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    environ = {tracking.TRACKING_URI_ENV: uri, tracking.EXPERIMENT_ENV: "llama-pretrain-fsdp"}
    tracker = tracking.start_tracking(environ, enabled=True, job_name="local-r1-a1",
                                      params={"lr": 0.0003, "model_preset": "llama-tiny"})
    logger = MetricsLogger(tmp_path / "output", enabled=True, tensorboard=False, tracker=tracker)
    logger.train({"step": 1, "loss": 4.5, "lr": 0.0003})
    logger.train({"step": 2, "loss": 4.25, "lr": 0.0003})
    logger.eval({"step": 2, "eval_loss": 4.4})
    tracker.log_model("/opt/ml/model", "s3://artifacts/t/r1/local-r1-a1/output/model.tar.gz")
    tracker.finish("FINISHED")
    logger.close()

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("llama-pretrain-fsdp")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "local-r1-a1" and run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.0003", "model_preset": "llama-tiny"}
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 4.5), (2, 4.25)]
    assert run.data.metrics["eval_loss"] == 4.4
    assert run.data.tags["model_artifact"].endswith("/output/model.tar.gz")
    assert run.data.tags["model_dir"] == "/opt/ml/model"


def test_tracking_is_off_without_a_uri_and_on_other_ranks():
    assert tracking.start_tracking({}, enabled=True, job_name="j", params={}) is None
    assert tracking.start_tracking({tracking.TRACKING_URI_ENV: "file:///x"}, enabled=False, job_name="j",
                                   params={}) is None


def test_the_program_imports_no_mlflow_unless_configured():
    probe = ("import sys; from training_jobs.trainer import job, tracking; "
             "tracking.start_tracking({}, enabled=True, job_name='j', params={}); "
             "print('mlflow' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip().endswith("False")


def test_configured_tracking_without_mlflow_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what an environment without the package gives
    with pytest.raises(ContainerError, match="mlflow package is not installed"):
        tracking.start_tracking({tracking.TRACKING_URI_ENV: "file:///tmp/x"}, enabled=True, job_name="j",
                                params={})


def test_an_unreachable_tracking_server_stops_the_job_at_the_start(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # mlflow's own setting: fail at once
    with pytest.raises(ContainerError, match="cannot open an MLflow run"):
        tracking.start_tracking({tracking.TRACKING_URI_ENV: "http://127.0.0.1:9"}, enabled=True,
                                job_name="j", params={})
