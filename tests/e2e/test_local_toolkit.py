"""The local runner around a tiny training program of the tests' own (tests/e2e/toy_program).

These run the real SageMaker training toolkit and torchrun; only the training program is a toy, so
that each job takes seconds and can misbehave on purpose.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from local_e2e_support import E2E_DIR, toy_template
from rich.console import Console

from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.sourcedir import package_code
from llmtrain.core.team_context import local_context
from llmtrain.local import LocalRunOptions, next_attempt, run_local

pytestmark = pytest.mark.slow


def run_toy(tmp_path: Path, run_name: str, template=None, **overrides):
    template = template or toy_template()
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "part-0.txt").write_text("toy data\n")
    options = LocalRunOptions(run_name=run_name, workdir=tmp_path / "runs", data={"train": data})
    run = RunInput(run_name=run_name, overrides=overrides, attempt=next_attempt(options))
    request = render(template, run, local_context())
    console = Console(record=True, width=200)
    code = package_code(template.code, E2E_DIR)
    summary = run_local(request, code, options, template_channels=template.inputs.channels, console=console)
    return summary, console.export_text()


def test_a_metric_regex_that_matches_nothing_is_reported(tmp_path):
    template = toy_template(metrics=[
        {"name": "train:loss", "regex": r"\[metrics\].* loss=([0-9.]+)"},
        # The program writes "loss=", not "loss:": in the cloud this metric would stay empty.
        {"name": "train:loss_typo", "regex": r"\[metrics\] loss: ([0-9.]+)"},
    ])
    summary, output = run_toy(tmp_path, "regex", template)

    assert summary["TrainingJobStatus"] == "Completed"
    # The toy's loss is world_size/step: 1 process, 3 steps.
    final = {m["MetricName"]: m["Value"] for m in summary["FinalMetricDataList"]}
    assert final == {"train:loss": pytest.approx(1 / 3)}
    assert summary["LocalRun"]["UnmatchedMetricDefinitions"] == [
        {"Name": "train:loss_typo", "Regex": r"\[metrics\] loss: ([0-9.]+)"}]
    assert "train:loss_typo" in output and "no log line matched" in output
    # The model the program wrote, packaged as SageMaker uploads it.
    assert summary["ModelArtifacts"]["S3ModelArtifacts"].endswith("/output/model.tar.gz")


def test_the_toolkits_swallowed_gloo_error_is_not_reported_as_success(tmp_path):
    # The PyTorch toolkit treats a gloo::EnforceNotMet abort as harmless: it writes output/success
    # and exits 0 although the training program failed.
    template = toy_template(overridable={"max_steps": {"type": "int"}, "gloo_quirk": {"type": "bool"}})
    summary, output = run_toy(tmp_path, "gloo", template, gloo_quirk="true")
    root = Path(summary["LocalRun"]["JobFolder"]) / "algo-1"

    assert (root / "output" / "success").is_file()
    assert summary["LocalRun"]["ExitCodes"] == {"algo-1": 0}
    assert summary["TrainingJobStatus"] == "Failed"
    assert "known exception" in summary["FailureReason"]
    assert "RuntimeError: a peer closed the connection" in summary["FailureReason"]
    assert "Failed" in output


def test_max_runtime_stops_the_job_like_sagemaker(tmp_path):
    template = toy_template(stopping={"max_runtime_seconds": 10},
                            hyperparameters={"max_steps": 10000, "step_seconds": 0.2, "fail": False,
                                             "gloo_quirk": False})
    summary, output = run_toy(tmp_path, "timeout", template)

    assert (summary["TrainingJobStatus"], summary["SecondaryStatus"]) == ("Stopped", "MaxRuntimeExceeded")
    assert "stopping the job (MaxRuntimeExceeded)" in output
    assert summary["TrainingTimeInSeconds"] < 10 + 120


def test_a_failed_job_shows_the_programs_error_and_keeps_torchruns_traceback_in_the_log(tmp_path):
    """The console of a failed local run shows the program's own error; torchrun's traceback and its
    report of the failed processes, and the toolkit's restatement, stay in the log file it names."""
    template = toy_template(overridable={"max_steps": {"type": "int"}, "fail": {"type": "bool"}})
    summary, output = run_toy(tmp_path, "fails", template, fail="true")

    assert summary["TrainingJobStatus"] == "Failed"
    assert "ValueError: hyperparameter 'fail' is true: set it to false to train" in output
    log = Path(summary["LocalRun"]["Logs"]["algo-1"]).read_text()
    launcher_lines = ("ChildFailedError", "Root Cause (first observed failure)", "ExecuteUserScriptError")
    for launcher_line in launcher_lines:
        assert launcher_line not in output
        assert launcher_line in log
    assert "torchrun's traceback and report of the failed processes" in output
