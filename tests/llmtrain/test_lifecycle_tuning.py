"""A tune's lifecycle (llmtrain.lifecycle.tuning_jobs) through the launcher's functions, called directly as
test_launcher_handlers.py calls them; the tunes' tuning jobs live in moto's SageMaker. Resolve starts a
tune's attempt as a tuning job (`TuningSubmission`), refuses a duplicate tune as it refuses a duplicate
run, and NextAttempt and Summarize give a tune's summary. The state machine around them runs in
test_launcher_tune.py."""

from __future__ import annotations

import json
import os

import pytest
import test_launcher_handlers as handlers_test
from moto.sagemaker.models import sagemaker_backends
from test_launcher_handlers import ACCOUNT, CATALOG, PLATFORM, REGION, _resolve

from llmtrain.core.function_settings import LauncherSettings
from llmtrain.core.platform import PlatformContext
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.runs import InvalidRunInput, RunState
from llmtrain.core.tuning import ParamRange, TuneError, TuneSpec
from llmtrain.core.tuning_request import tuning_job_name
from llmtrain.handlers import launcher
from llmtrain.lifecycle.jobs import tuning_name_stem
from llmtrain.lifecycle.resolve import RunAlreadyCompleted, RunAlreadyInProgress
from llmtrain.lifecycle.tuning_jobs import TuningSubmission, render_tune

deployed = handlers_test.deployed  # moto, and the functions' environment as the construct writes it
TUNE = TuneSpec(params=(ParamRange.parse("lr=1e-5..1e-3:log"),), objective="train:loss", trials=4)
OVERRIDES = {"max_steps": "50"}


def _tune_input(**changes) -> dict:
    return {"overrides": OVERRIDES, "tune": TUNE.to_dict(), **changes}


def _tuning_job(sagemaker, run_name: str, attempt: int, status: str) -> None:
    """A tune's tuning job in moto with the given status."""
    run = RunInput(run_name=run_name, overrides=OVERRIDES, attempt=attempt, owner="launcher")
    template = CATALOG.get("gpt2-ddp")
    request, _ = render_tune(template, run, TUNE, PLATFORM, CATALOG.program_contract(template))
    sagemaker.create_hyper_parameter_tuning_job(**request)
    name = request["HyperParameterTuningJobName"]
    tuning_jobs = sagemaker_backends[ACCOUNT][REGION].hyper_parameter_tuning_jobs
    tuning_jobs[name].hyper_parameter_tuning_job_status = status


def test_the_tuning_jobs_are_named_as_the_lifecycle_lists_them():
    assert tuning_job_name(PLATFORM, "lr", 3) == tuning_name_stem(PLATFORM.job_name_prefix, "lr") + "3"


def test_resolve_starts_a_tune_as_its_tuning_job_rendered_with_the_versions_program(deployed):
    state = _resolve("lr", **_tune_input())
    template = CATALOG.get("gpt2-ddp")
    run_input = RunInput(run_name="lr", overrides=OVERRIDES, owner="launcher")
    expected, plan = render_tune(template, run_input, TUNE, PLATFORM, CATALOG.program_contract(template))
    assert state["request"] == expected and state["layout"] == "tune"
    run = RunState.from_dict(state["run"])
    assert run.tune == TUNE.to_dict() and run.attempt == 1 and run.plan == plan
    assert run.instance_types == (expected["TrainingJobDefinition"]["ResourceConfig"]["InstanceType"],)


def test_a_failed_tune_started_again_gets_its_next_tuning_job_and_a_finished_one_warm_starts(deployed):
    _tuning_job(deployed, "lr", 1, "Failed")
    state = _resolve("lr", **_tune_input())
    assert state["request"]["HyperParameterTuningJobName"] == tuning_job_name(PLATFORM, "lr", 2)
    _tuning_job(deployed, "base", 1, "Stopped")
    warm = TuneSpec(params=TUNE.params, objective=TUNE.objective, warm_start_from=("base",))
    state = _resolve("lr-2", **_tune_input(tune=warm.to_dict()))
    assert state["layout"] == "tune-warm-start"
    assert state["request"]["WarmStartConfig"]["ParentHyperParameterTuningJobs"] == [
        {"HyperParameterTuningJobName": tuning_job_name(PLATFORM, "base", 1)}
    ]


@pytest.mark.parametrize(
    ("status", "refusal", "message"),
    [
        ("InProgress", RunAlreadyInProgress, "already has tuning job llmtrain-test-lr-t1 in progress"),
        ("Completed", RunAlreadyCompleted, "`llmtrain tune --warm-start` builds on its trials"),
    ],
)
def test_resolve_refuses_a_tune_in_progress_or_completed_as_it_refuses_a_run(
    deployed, status, refusal, message
):
    _tuning_job(deployed, "lr", 1, status)
    with pytest.raises(refusal, match=message):
        _resolve("lr", **_tune_input())


def test_a_tune_may_not_take_the_name_of_a_training_run(deployed):
    request = render(CATALOG.get("gpt2-ddp"), RunInput(run_name="taken"), PLATFORM)
    deployed.create_training_job(**request)
    with pytest.raises(InvalidRunInput, match="already names a training run"):
        _resolve("taken", **_tune_input())


def _tune_run() -> tuple[RunState, dict]:
    state = _resolve("lr", **_tune_input())
    return RunState.from_dict(state["run"]), state["request"]


def test_next_attempt_calls_a_throttled_tuning_job_again_and_ends_a_failed_one_with_its_summary(deployed):
    run, request = _tune_run()
    throttled = {"Error": "SageMaker.AmazonSageMakerException",
                 "Cause": "Rate exceeded (ThrottlingException)"}
    retry = launcher.next_attempt({"run": run.to_dict(), "request": request, "failure": throttled})
    assert retry["decision"] == "retry" and retry["layout"] == "tune"
    assert retry["request"] == request  # the same attempt: no tuning job was created
    description = {"HyperParameterTuningJobName": request["HyperParameterTuningJobName"],
                   "HyperParameterTuningJobStatus": "Failed", "FailureReason": "No training job succeeded",
                   "TrainingJobStatusCounters": {"Completed": 0, "NonRetryableError": 4}}
    caught = {"Error": "States.TaskFailed", "Cause": json.dumps(description)}
    failed = launcher.next_attempt({"run": run.to_dict(), "request": request, "failure": caught})
    summary = failed["summary"]
    assert failed["decision"] == "fail" and summary["kind"] == "tune"
    assert summary["error"] == "TuningJobFailed" and summary["failure_reason"] == "No training job succeeded"
    assert "llmtrain status lr" in summary["advice"]
    assert summary["tuning_job"] == request["HyperParameterTuningJobName"]
    assert summary["trials"] == {"Completed": 0, "NonRetryableError": 4}
    stopped = launcher.next_attempt({"run": run.to_dict(), "request": request, "failure": {
        "Error": "States.TaskFailed",
        "Cause": json.dumps({**description, "HyperParameterTuningJobStatus": "Stopped"})}})
    assert stopped["summary"]["error"] == "TuningJobStopped" and stopped["summary"]["status"] == "Stopped"


def test_summarize_names_the_best_trial_and_the_start_of_a_full_run(deployed):
    run, request = _tune_run()
    description = {
        "HyperParameterTuningJobName": request["HyperParameterTuningJobName"],
        "HyperParameterTuningJobStatus": "Completed",
        "TrainingJobStatusCounters": {"Completed": 4},
        "BestTrainingJob": {
            "TrainingJobName": f"{request['HyperParameterTuningJobName']}-003-abcdef03",
            "TunedHyperParameters": {"lr": "0.0004"},
            "FinalHyperParameterTuningJobObjectiveMetric": {"MetricName": "train:loss", "Value": 2.75},
        },
    }
    summary = launcher.summarize({"run": run.to_dict(), "job": description})["summary"]
    assert summary["status"] == "Completed" and summary["kind"] == "tune"
    assert summary["best"] == {"training_job": description["BestTrainingJob"]["TrainingJobName"],
                               "params": {"lr": "0.0004"}, "objective": 2.75}
    assert summary["best_run_command"] == (
        "llmtrain start gpt2-ddp@1.3.0 --run-name lr-best --set max_steps=50 --set lr=0.0004"
    )
    assert "Run it in full: llmtrain start" in summary["message"]


def test_the_deployments_submission_is_a_tunes_for_a_tune_and_refused_where_runs_are_queued(deployed):
    settings = LauncherSettings.from_environment(os.environ)
    run, _ = _tune_run()
    assert isinstance(launcher.submission(settings, run), TuningSubmission)
    queued = PLATFORM.to_dict() | {"queues": {
        "queue_arns": {"standard": f"arn:aws:batch:{REGION}:{ACCOUNT}:job-queue/q"},
        "default_queue": "standard",
        "share_identifier": "nlp", "max_priority": 0, "max_instances": 4, "capacity_wait_seconds": 3600}}
    with pytest.raises(TuneError, match="tuning jobs cannot be queued"):
        TuningSubmission.for_tune(TUNE.to_dict(), PlatformContext.from_dict(queued), deployed)
