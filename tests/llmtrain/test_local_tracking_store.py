"""A local run's new MLflow store starts as a copy of an empty store made once in the user cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtrain.core.user_cache import CACHE_VARIABLE
from llmtrain.local import tracking
from llmtrain.local.job import LocalJob


def _plan(uri: str) -> LocalJob:
    return LocalJob(job_name="local-run-a1", hosts=("algo-1",), processes_per_host=1, instance_type="local",
                    hyperparameters={}, channels=(), metric_definitions=(), max_runtime_seconds=None,
                    checkpoint_subpath=None, environment={tracking.TRACKING_URI_ENV: uri}, adjustments=())


def _default_uri(run_dir: Path) -> str:
    return tracking.local_tracking_uri(run_dir, {})


def test_a_new_runs_store_is_the_cached_empty_store_and_mlflow_uses_it(tmp_path, monkeypatch):
    mlflow_tracking = pytest.importorskip("mlflow.tracking")
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))
    first, second = tmp_path / "first", tmp_path / "second"
    tracking.seed_store(_plan(_default_uri(first)), first)
    made = list((tmp_path / "cache" / "mlflow").glob("empty-*.db"))
    assert len(made) == 1 and (first / tracking.STORE_FILE).read_bytes() == made[0].read_bytes()
    # The empty store is made once: the next run copies it even where it could not be made now.
    monkeypatch.setattr(tracking, "_CREATE_STORE", "raise SystemExit(1)")
    tracking.seed_store(_plan(_default_uri(second)), second)
    assert (second / tracking.STORE_FILE).read_bytes() == made[0].read_bytes()
    client = mlflow_tracking.MlflowClient(tracking_uri=_default_uri(second))
    experiment = client.create_experiment("default-llama-pretrain-fsdp")
    run = client.create_run(experiment, run_name="local-run-a1")
    client.log_metric(run.info.run_id, "train:loss", 1.5)
    assert client.get_run(run.info.run_id).data.metrics == {"train:loss": 1.5}


def test_an_existing_store_a_users_own_uri_and_an_unmakeable_store_are_left_to_the_job(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))
    monkeypatch.setattr(tracking, "_CREATE_STORE", "raise SystemExit(1)")  # as without mlflow
    run_dir = tmp_path / "run"
    tracking.seed_store(_plan(_default_uri(run_dir)), run_dir)
    assert not (run_dir / tracking.STORE_FILE).exists()
    assert not list((tmp_path / "cache" / "mlflow").iterdir())  # no scratch left
    run_dir.mkdir()
    (run_dir / tracking.STORE_FILE).write_bytes(b"the run's own")
    tracking.seed_store(_plan(_default_uri(run_dir)), run_dir)
    assert (run_dir / tracking.STORE_FILE).read_bytes() == b"the run's own"
    other = tmp_path / "other"
    tracking.seed_store(_plan(f"sqlite:///{tmp_path / 'mine.db'}"), other)
    tracking.seed_store(_plan("http://localhost:5000"), other)
    assert not (tmp_path / "mine.db").exists() and not other.exists()
