"""A run's summary: the execution's output, the SNS notification's body, and what `llmtrain status`
shows. Every summary holds the cost the last job billed (billable seconds x instances x on-demand
price) beside the plan's prediction. A run refused at Resolve gets one too (`rejection_summary`,
status `Rejected`): the execution fails with its error, after the notification. A tune's summary
(`tune_summary`, kind `tune`) holds its tuning job's counters, the best trial and the `llmtrain start`
of a full run with the best trial's values instead of one job's figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmtrain.core.failures import QUEUE_CAPACITY, QUEUE_MISCONFIGURED, TUNE_FAILED, Failure
from llmtrain.core.program_failures import HUNG_COLLECTIVE, RETRIES
from llmtrain.core.runs import RunState
from llmtrain.core.spec import TemplateSpec
from llmtrain.core.tuning import TuneSpec, start_command
from llmtrain.planner.checks import actual_cost

_SUBJECT_MAX = 100

# The error name a failed execution ends with, by the kind of the last attempt's failure.
FAILURE_ERRORS = {
    "capacity": "CapacityUnavailable",
    "plan_capacity": "TrainingPlanCapacityUnavailable",
    "quota": "QuotaExceeded",
    "job_failed": "TrainingJobFailed",
    "stopped": "TrainingJobStopped",
    "api_error": "CreateTrainingJobFailed",
    "throttled": "CreateTrainingJobFailed",
    "invalid_retry": "RetryNotPossible",
    "rule_stopped": "StoppedByRule",
    "hung": "TrainingJobHung",
    QUEUE_CAPACITY: "QueueCapacityTimeLimit",
    QUEUE_MISCONFIGURED: "QueueMisconfigured",
}
# A tune's: its attempt is a tuning job (llmtrain.lifecycle.tuning_jobs).
TUNE_FAILURE_ERRORS = {
    **FAILURE_ERRORS,
    TUNE_FAILED: "TuningJobFailed",
    "stopped": "TuningJobStopped",
    "api_error": "CreateHyperParameterTuningJobFailed",
    "throttled": "CreateHyperParameterTuningJobFailed",
}
# What to do after a failure whose advice depends on nothing but its kind.
_FIXED_ADVICE = {
    "plan_capacity": (
        "the training plan had no free capacity for the job within its pending time "
        "(max_pending_seconds); see the plan's instances with `llmtrain plans --env ENV`, then start "
        "the run again (it resumes from its checkpoints) or raise max_pending_seconds"
    ),
    "stopped": "the training job was stopped before it completed",
    QUEUE_MISCONFIGURED: (
        "Batch could not schedule the job as configured (larger than the service environment's "
        "capacity?): ask the platform team to check the environment's queues: settings"
    ),
}


def failure_summary(template: TemplateSpec, run: RunState, failure: Failure) -> dict[str, Any]:
    status = "Stopped" if failure.kind == "stopped" else "Failed"
    if run.tune is not None:
        advice = (_advice(template, run, failure) if failure.kind != TUNE_FAILED
                  else f"see the tune's trials with `llmtrain status {run.run_name}`")
        return tune_summary(run, failure.job or {}, status=status, error=TUNE_FAILURE_ERRORS[failure.kind],
                            reason=failure.reason, advice=advice)
    summary = build_summary(
        run,
        status=status,
        job=failure.job or {},
        error=FAILURE_ERRORS[failure.kind],
        reason=failure.reason,
        advice=_advice(template, run, failure),
    )
    if failure.quota is not None:
        summary["quota"] = {
            "name": failure.quota.name,
            "limit": failure.quota.limit,
            "in_use": failure.quota.in_use,
            "requested": failure.quota.requested,
        }
    return summary


def _advice(template: TemplateSpec, run: RunState, failure: Failure) -> str:
    if failure.kind in _FIXED_ADVICE:
        return _FIXED_ADVICE[failure.kind]
    if failure.kind == "capacity":
        return _capacity_advice(template, run)
    if failure.kind == QUEUE_CAPACITY:
        return (
            f"the run waited at the head of its queue for {', '.join(run.instance_types)} longer than the "
            "queue's capacity time limit (queues.capacity_wait_seconds): SageMaker had no such instances. "
            "Start the run again later (it resumes from its checkpoints), or with another instance_type"
        )
    if failure.kind == "quota":
        numbers = failure.quota.describe() if failure.quota else failure.reason
        policy = (
            ""
            if template.retry.quota_policy == "fail"
            else f" (waited {run.quota_waits} time(s) for it to free up)"
        )
        return (
            f"the account's {numbers}{policy}: request an increase in Service Quotas (service "
            "Amazon SageMaker), wait for running jobs to end, or use fewer or other instances"
        )
    if failure.kind == "job_failed":
        return f"the training job failed: read its logs with `llmtrain logs {run.run_name}`"
    if failure.kind == "rule_stopped":
        return (f"a rule of the training program stopped it: `llmtrain logs {run.run_name}` shows its [rule] "
                "lines. Starting the run again resumes from its last checkpoint: lower lr or raise "
                "warmup_steps with --set, or change the rule's rule_* setting (docs/training.md, Rules)")
    if failure.kind == "hung":
        return (f"its collectives stopped completing and the training program's hang watchdog ended it "
                f"({run.hung_jobs()} job(s) of this run hung; a run is retried {RETRIES[HUNG_COLLECTIVE]} "
                f"time(s) after a hang, from its last checkpoint): `llmtrain logs {run.run_name}` holds "
                "every rank's Python stacks (also in hang/ of the job's output); the rank that waits "
                "elsewhere than the others is the one to look at")
    if failure.kind == "throttled":
        return (f"SageMaker throttled CreateTrainingJob {run.throttle_retries + 1} time(s) in a row; start "
                "the run again in a few minutes (it continues where it stopped)")
    return "SageMaker refused the request; fix what the message names and start a new run"


def _capacity_advice(template: TemplateSpec, run: RunState) -> str:
    types = ", ".join(run.instance_types)
    advice = (
        f"SageMaker had no capacity for {types} after {len(run.history)} attempt(s) "
        f"({template.retry.capacity_retry_attempts} retries per type); start the run again later "
        "(it resumes from its checkpoints) or override instance_type"
    )
    if run.unusable_instance_types:
        skipped = "; ".join(f"{item.instance_type}: {item.reason}" for item in run.unusable_instance_types)
        advice += f". Fallback types that cannot hold this run were not tried ({skipped})"
    return advice


def build_summary(
    run: RunState,
    *,
    status: str,
    job: Mapping[str, Any],
    error: str | None = None,
    reason: str | None = None,
    advice: str | None = None,
) -> dict[str, Any]:
    """The run's outcome: the execution output, the notification and what `llmtrain status` shows."""
    history = [entry.to_dict() for entry in run.history]
    last = history[-1] if history else {}
    summary = {
        "run_name": run.run_name,
        "team": run.team,
        "template": f"{run.template}@{run.version}",
        "status": status,
        "job_name": job.get("TrainingJobName") or last.get("job_name"),
        "job_arn": job.get("TrainingJobArn"),
        "instance_type": last.get("instance_type"),
        "final_metrics": final_metrics(job),
        "model_artifacts": (job.get("ModelArtifacts") or {}).get("S3ModelArtifacts"),
        "billable_seconds": job.get("BillableTimeInSeconds"),
        "training_seconds": job.get("TrainingTimeInSeconds"),
        "attempts": len(history),
        "attempt_history": history,
        "checkpoint_s3_uri": run.checkpoint_s3_uri,
        "execution_arn": run.execution_arn,
        "actual_cost_usd": actual_cost(job),
        "predicted_cost_usd": (run.plan or {}).get("usd"),
        "plan": (run.plan or {}).get("summary"),
    }
    if error is not None:
        summary.update(error=error, failure_reason=reason, advice=advice)
    summary["subject"] = notification_subject(run.run_name, status, error)
    summary["message"] = summary_message(summary)
    return summary


def completed_summary(run: RunState, job: Mapping[str, Any]) -> dict[str, Any]:
    """The summary of a run whose job ended without failing the start step (DescribeTrainingJob, or a
    tune's DescribeHyperParameterTuningJob)."""
    if run.tune is not None:
        return tune_summary(run, job, status=job.get("HyperParameterTuningJobStatus", "Completed"))
    status = job.get("TrainingJobStatus", "Completed")
    run = run.with_attempt_ended(job.get("TrainingJobName", ""), status)
    return build_summary(run, status=status, job=job)


def tune_summary(
    run: RunState,
    description: Mapping[str, Any],
    *,
    status: str,
    error: str | None = None,
    reason: str | None = None,
    advice: str | None = None,
) -> dict[str, Any]:
    """The summary of a tune that ended (`description`: its DescribeHyperParameterTuningJob output,
    empty where none exists): its tuning job, its trials' counters, the best trial and the command
    that runs the best values in full."""
    tune = TuneSpec.from_dict(run.tune)
    best_job = description.get("BestTrainingJob") or {}
    best = None
    if best_job:
        best = {
            "training_job": best_job.get("TrainingJobName"),
            "params": best_job.get("TunedHyperParameters"),
            "objective": (best_job.get("FinalHyperParameterTuningJobObjectiveMetric") or {}).get("Value"),
        }
    summary: dict[str, Any] = {
        "run_name": run.run_name,
        "team": run.team,
        "template": f"{run.template}@{run.version}",
        "kind": "tune",
        "status": status,
        "tuning_job": description.get("HyperParameterTuningJobName")
        or (run.history[-1].job_name if run.history else None),
        "objective": tune.objective,
        "direction": "maximize" if tune.maximize else "minimize",
        "trials": description.get("TrainingJobStatusCounters"),
        "best": best,
        "attempts": len(run.history) or 1,
        "predicted_cost_usd": (run.plan or {}).get("usd"),
        "plan": (run.plan or {}).get("summary"),
        "execution_arn": run.execution_arn,
    }
    if best and best["params"]:
        summary["best_run_command"] = start_command(
            f"{run.template}@{run.version}", f"{run.run_name}-best", run.overrides, best["params"]
        )
    if error is not None:
        summary.update(error=error, failure_reason=reason, advice=advice)
    summary["subject"] = notification_subject(run.run_name, status, error)
    summary["message"] = tune_message(summary)
    return summary


def tune_message(summary: Mapping[str, Any]) -> str:
    """The human-readable text of a tune's summary."""
    lines = [f"Tune {summary['run_name']} ({summary['template']}): {summary['status']}"]
    if summary.get("error"):
        lines.append(f"Error: {summary['error']}: {summary.get('failure_reason')}")
        lines.append(f"What to do: {summary.get('advice')}")
    lines.append(
        f"Tuning job: {summary.get('tuning_job') or '-'}; objective: {summary['direction']} "
        f"{summary['objective']}"
    )
    counters = summary.get("trials") or {}
    if counters:
        lines.append("Trials: " + ", ".join(f"{k} {v}" for k, v in counters.items()))
    best = summary.get("best")
    if best:
        lines.append(
            f"Best trial: {best['training_job']}: {summary['objective']}={best['objective']} with "
            + ", ".join(f"{k}={v}" for k, v in (best["params"] or {}).items())
        )
    if summary.get("best_run_command"):
        lines.append(f"Run it in full: {summary['best_run_command']}")
    lines.append(f"Planned: up to {_usd(summary.get('predicted_cost_usd'))}")
    return "\n".join(lines)


def rejection_summary(refusal: Exception, event: Mapping[str, Any]) -> dict[str, Any]:
    """The summary of a run refused before any job: the execution fails with `error`, notified."""
    raw = event.get("input")
    name = raw.get("run_name") if isinstance(raw, Mapping) else None
    run_name = name if isinstance(name, str) and name else str(event.get("execution_name") or "?")
    error = type(refusal).__name__
    message = f"Run {run_name}: Rejected\nError: {error}: {refusal}"
    return {
        "status": "Rejected",
        "run_name": run_name,
        "error": error,
        "message": message,
        "subject": notification_subject(run_name, "rejected", None),
        "execution_arn": event.get("execution_arn"),
    }


def _usd(value: float | None) -> str:
    return "-" if value is None else f"${value:,.2f}"


def final_metrics(job: Mapping[str, Any]) -> dict[str, float]:
    return {
        metric["MetricName"]: metric["Value"]
        for metric in job.get("FinalMetricDataList") or ()
        if "MetricName" in metric and "Value" in metric
    }


def notification_subject(run_name: str, status: str, error: str | None) -> str:
    """An SNS subject: printable ASCII, at most 100 characters (SNS refuses longer ones); a long run
    name is shortened, never the outcome."""
    outcome = f" {status}" + (f" ({error})" if error else "")
    room = _SUBJECT_MAX - len("llmtrain: run ") - len(outcome)
    name = "".join(c if " " <= c <= "~" else "?" for c in run_name)
    if len(name) > room:
        name = name[: room - 3] + "..."
    return f"llmtrain: run {name}{outcome}"


def summary_message(summary: Mapping[str, Any]) -> str:
    """The human-readable text of a summary (the notification body and the failure's cause)."""
    lines = [f"Run {summary['run_name']} ({summary['template']}): {summary['status']}"]
    if summary.get("error"):
        lines.append(f"Error: {summary['error']}: {summary.get('failure_reason')}")
        lines.append(f"What to do: {summary.get('advice')}")
    lines.append(f"Training job: {summary.get('job_name') or '-'} on {summary.get('instance_type') or '-'}")
    metrics = summary.get("final_metrics") or {}
    lines.append("Final metrics: " + (", ".join(f"{k}={v:g}" for k, v in sorted(metrics.items())) or "-"))
    lines.append(f"Model artifacts: {summary.get('model_artifacts') or '-'}")
    billable = summary.get("billable_seconds")
    lines.append(f"Billable seconds: {billable if billable is not None else '-'}")
    lines.append(f"Cost: {_usd(summary.get('actual_cost_usd'))} actual (billable seconds x instances x "
                 f"on-demand price), {_usd(summary.get('predicted_cost_usd'))} predicted")
    lines.append(f"Checkpoints: {summary.get('checkpoint_s3_uri') or '-'}")
    lines.append(f"Attempts: {summary['attempts']}")
    for entry in summary.get("attempt_history", ()):
        detail = f": {entry['reason']}" if entry.get("reason") and entry["outcome"] != "Completed" else ""
        lines.append(
            f"  {entry['attempt']}. {entry['job_name']} on {entry['instance_type']}: "
            f"{entry['outcome']}{detail}"
        )
    return "\n".join(lines)
