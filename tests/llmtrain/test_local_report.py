"""Metrics from the log, the job's outcome, and summary.json against DescribeTrainingJob's own shape."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta
from pathlib import Path

import botocore.session
import pytest
from rich.console import Console

from llmtrain.core.catalog import Catalog
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.team_context import local_context
from llmtrain.local.job import local_job
from llmtrain.local.jobroot import HostRoot
from llmtrain.local.metric_lines import MetricDefinition, MetricExtractor
from llmtrain.local.report import (
    JobRecord,
    JobTimes,
    Outcome,
    build_summary,
    plot_run,
    print_summary,
    save_metrics,
)
from llmtrain.local.runner import decide_outcome

LINES = [
    "2026-01-01 sagemaker-training-toolkit INFO     Invoking user training script.",
    "[metrics] step=1 loss=4.500000 lr=1.000e-04 grad_norm=2.0 tokens_per_sec=1000.5 mfu=0.0 step_time=0.5",
    "[metrics] step=2 loss=4.250000 lr=2.000e-04 grad_norm=1.5 tokens_per_sec=1100.0 mfu=0.0 step_time=0.4",
    "[eval] step=2 eval_loss=4.400000",
]


@pytest.fixture(scope="module")
def request_and_plan():
    template = Catalog.load().resolve("llama-pretrain-fsdp")
    request = render(template, RunInput(run_name="report"), local_context())
    return request, local_job(request)


def extractor(request) -> MetricExtractor:
    metrics = MetricExtractor(MetricDefinition.from_request(request))
    metrics.feed_all(LINES, host="algo-1")
    return metrics


def test_template_regexes_extract_values_with_their_steps(request_and_plan):
    metrics = extractor(request_and_plan[0])
    assert metrics.series("train:loss") == [(1, 4.5), (2, 4.25)]
    assert metrics.series("eval:loss") == [(2, 4.4)]
    final = metrics.final_values()
    assert final["train:tokens_per_sec"].value == 1100.0
    # The template defines memory_gb, which these lines lack: reported, not silently empty.
    assert [d.name for d in metrics.unmatched()] == ["train:memory_gb"]


def test_a_capture_that_is_not_a_number_is_dropped_like_sagemaker_does():
    metrics = MetricExtractor((MetricDefinition("word", r"status=(\w+)"),))
    metrics.feed("status=ok step=3", host="algo-1")
    assert metrics.points == []
    assert [d.name for d in metrics.unmatched()] == ["word"]


def make_roots(tmp_path: Path, hosts=("algo-1", "algo-2")) -> list[HostRoot]:
    roots = []
    for host in hosts:
        root = HostRoot(host, tmp_path / host)
        root.output_dir.mkdir(parents=True)
        roots.append(root)
    return roots


def test_completed_needs_every_host_to_exit_0_and_write_success(tmp_path):
    roots = make_roots(tmp_path)
    for root in roots:
        root.success_file.write_text("")
    outcome = decide_outcome(roots, {"algo-1": 0, "algo-2": 0}, None, {})
    assert (outcome.status, outcome.failure_reason) == ("Completed", None)
    roots[1].success_file.unlink()
    outcome = decide_outcome(roots, {"algo-1": 0, "algo-2": 0}, None, {"algo-2": tmp_path / "algo-2.log"})
    assert outcome.status == "Failed"
    assert "algo-2 exited 0 but wrote no output/success" in outcome.failure_reason


def test_failure_reason_is_the_failure_file_like_describe_training_job(tmp_path):
    roots = make_roots(tmp_path)
    roots[1].failure_file.write_text("ExecuteUserScriptError:\n" + "x" * 5000)
    outcome = decide_outcome(roots, {"algo-1": 0, "algo-2": 1}, None, {})
    assert outcome.status == "Failed"
    assert outcome.failure_reason.startswith("AlgorithmError: ExecuteUserScriptError:")
    assert len(outcome.failure_reason) == len("AlgorithmError: ") + 1024


def test_a_nonzero_exit_without_failure_file_still_fails(tmp_path):
    roots = make_roots(tmp_path, ("algo-1",))
    roots[0].success_file.write_text("")
    outcome = decide_outcome(roots, {"algo-1": 137}, None, {"algo-1": tmp_path / "algo-1.log"})
    assert outcome.status == "Failed" and "exited with code 137" in outcome.failure_reason


def test_the_toolkits_swallowed_gloo_error_is_a_failure(tmp_path):
    roots = make_roots(tmp_path, ("algo-1",))
    roots[0].success_file.write_text("")
    log = tmp_path / "algo-1.log"
    log.write_text("... WARNING  Known exception: ExecuteUserScriptError:\nRuntimeError: peer closed\n")
    outcome = decide_outcome(roots, {"algo-1": 0}, None, {"algo-1": log})
    assert outcome.status == "Failed" and "RuntimeError: peer closed" in outcome.failure_reason


def test_a_stopped_job_is_stopped_whatever_the_processes_did(tmp_path):
    roots = make_roots(tmp_path, ("algo-1",))
    roots[0].failure_file.write_text("SignalException")
    assert decide_outcome(roots, {"algo-1": 1}, "Stopped", {}).status == "Stopped"
    outcome = decide_outcome(roots, {"algo-1": 1}, "MaxRuntimeExceeded", {})
    assert (outcome.status, outcome.secondary_status) == ("Stopped", "MaxRuntimeExceeded")


def test_summary_uses_describe_training_job_fields_and_values(request_and_plan, tmp_path):
    request, plan = request_and_plan
    metrics = extractor(request)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    record = JobRecord(run_name="report", run_dir=tmp_path, job_dir=tmp_path / "jobs" / plan.job_name,
                       checkpoints_dir=tmp_path / "checkpoints", channel_dirs={"train": tmp_path / "data"},
                       model_dir=tmp_path / "model", logs={"algo-1": tmp_path / "algo-1.log"},
                       exit_codes={"algo-1": 1})
    outcome = Outcome("Failed", "Failed", "AlgorithmError: ValueError: bad seq_len", "Training job failed")
    summary = build_summary(request=request, plan=plan, outcome=outcome, metrics=metrics,
                            times=JobTimes(start, start + timedelta(seconds=3),
                                           start + timedelta(seconds=93)),
                            record=record, model_artifact=None, plot=None)

    shape = botocore.session.get_session().get_service_model("sagemaker") \
        .operation_model("DescribeTrainingJob").output_shape
    assert set(summary) - {"LocalRun"} <= set(shape.members)
    assert summary["TrainingJobStatus"] in shape.members["TrainingJobStatus"].enum
    assert summary["SecondaryStatus"] in shape.members["SecondaryStatus"].enum
    transition_status = shape.members["SecondaryStatusTransitions"].member.members["Status"]
    assert all(t["Status"] in transition_status.enum for t in summary["SecondaryStatusTransitions"])
    assert summary["FailureReason"] == "AlgorithmError: ValueError: bad seq_len"
    assert summary["TrainingTimeInSeconds"] == 90
    assert {m["MetricName"]: m["Value"] for m in summary["FinalMetricDataList"]}["train:loss"] == 4.25
    channel = summary["InputDataConfig"][0]["DataSource"]["S3DataSource"]
    assert channel["S3Uri"] == (tmp_path / "data").as_uri()
    assert summary["CheckpointConfig"]["S3Uri"] == (tmp_path / "checkpoints").as_uri()
    assert summary["LocalRun"]["UnmatchedMetricDefinitions"][0]["Name"] == "train:memory_gb"

    console = Console(record=True, width=200)
    print_summary(console, summary)
    text = console.export_text()
    assert "Failed" in text and "ValueError: bad seq_len" in text
    assert "train:memory_gb" in text and "no log line matched" in text


def test_plot_shows_every_job_of_the_run(request_and_plan, tmp_path):
    request, _ = request_and_plan
    jobs = []
    for name in ("local-report-a1", "local-report-a2"):
        job = tmp_path / "jobs" / name
        job.mkdir(parents=True)
        save_metrics(extractor(request), job / "metrics.json")
        jobs.append(job)
    plot = plot_run(tmp_path, jobs, tmp_path / "metrics.png")
    assert plot == tmp_path / "metrics.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_summary_stays_whole_when_the_output_is_not_a_terminal(request_and_plan, tmp_path):
    """In a pipe or a CI log a panel would wrap paths mid-word; there it is one line per value."""
    request, plan = request_and_plan
    deep = tmp_path / ("a-very-long-folder-name-" * 4) / "run"
    record = JobRecord(run_name="report", run_dir=deep, job_dir=deep / "jobs" / plan.job_name,
                       checkpoints_dir=deep / "checkpoints", channel_dirs={"train": tmp_path / "data"},
                       model_dir=deep / "model", logs={"algo-1": deep / "algo-1.log"},
                       exit_codes={"algo-1": 0})
    start = datetime(2026, 1, 1, tzinfo=UTC)
    completed = Outcome("Completed", "Completed", None, "done")
    summary = build_summary(request=request, plan=plan, outcome=completed,
                            metrics=extractor(request), times=JobTimes(start, start, start), record=record,
                            model_artifact=None, plot=None)
    piped = io.StringIO()
    print_summary(Console(file=piped, width=60), summary)
    lines = piped.getvalue().splitlines()
    assert f"  Checkpoints:            {(deep / 'checkpoints').as_uri()}" in lines
    assert f"  Logs:                   {deep / 'algo-1.log'}" in lines
    assert not any("│" in line or "╭" in line for line in lines)
    terminal = io.StringIO()
    print_summary(Console(file=terminal, width=60, force_terminal=True), summary)
    assert "╭" in terminal.getvalue()


def test_an_error_line_the_toolkit_split_is_named_whole(tmp_path):
    """The toolkit ends a line wherever its read of the output ends: the exception's name, a lone
    colon and the message come on separate lines (the log as CI saw it; the toolkit's restatement in
    output/failure drops the colon). Both are named as one "XError: message"; torchrun's
    "ChildFailedError:" before its report's rule is no message."""
    from llmtrain.local.report import _named_error, error_lines

    log = tmp_path / "algo-1.log"
    log.write_text("Traceback (most recent call last):\n  raise ValueError(\"bad\")\n\nValueError\n:\n"
                   "hyperparameter 'fail' is true\n\ntorch.distributed.ChildFailedError: \n"
                   + "=" * 60 + "\n")
    assert error_lines({"algo-1": log}) == ["ValueError: hyperparameter 'fail' is true"]
    restatement = ("ExecuteUserScriptError:\nExitCode 1\nErrorMessage \"raise ValueError(\"bad\")\n \n"
                   " ValueError\n hyperparameter 'fail' is true\n E1128 12:00:00 failed (exitcode: 1)")
    assert _named_error(restatement) == "ValueError: hyperparameter 'fail' is true"
