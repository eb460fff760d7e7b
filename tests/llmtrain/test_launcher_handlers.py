"""The launcher's functions: their entry points (llmtrain.handlers.launcher) and the run lifecycle they
call (llmtrain.lifecycle), called directly; their AWS calls (ListTrainingJobs) go to moto.

The handlers run with the environment the construct gives them (`LauncherSettings.to_environment`:
platform context, request layouts) and the repository's template catalog as their registry.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import UTC, datetime

import boto3
import pytest
from moto import mock_aws
from moto.sagemaker.models import sagemaker_backends
from sagemaker_fleet_support import TrainingFleet, install_update_training_job

from llmtrain.core.catalog import Catalog
from llmtrain.core.errors import LauncherStateError, LlmtrainError
from llmtrain.core.failures import Failure, classify_failure
from llmtrain.core.function_settings import ENV_PLATFORM_CONTEXT, LauncherSettings
from llmtrain.core.render import job_name, render
from llmtrain.core.request_layouts import request_layout, request_layouts
from llmtrain.core.run_settings import RunInput
from llmtrain.core.runs import ExecutionInput, InvalidRunInput, RunState
from llmtrain.core.team_context import PlatformResources, TeamSettings, team_context
from llmtrain.handlers import launcher
from llmtrain.lifecycle.jobs import attempt_name_stem
from llmtrain.lifecycle.resolve import RunAlreadyCompleted, RunAlreadyInProgress, check_fallbacks, resolve_run
from llmtrain.lifecycle.retries import backoff_seconds, plan_retry
from llmtrain.lifecycle.submission import TrainingJobSubmission

ACCOUNT, REGION = "123456789012", "us-east-1"
CATALOG = Catalog.load()
PLATFORM = team_context(
    environment="test",
    region=REGION,
    account=ACCOUNT,
    resources=PlatformResources(
        execution_role_arn=f"arn:aws:iam::{ACCOUNT}:role/execution",
        datasets_bucket="datasets-bucket",
        checkpoints_bucket="checkpoints-bucket",
        artifacts_bucket="artifacts-bucket",
        code_bucket="code-bucket",
        kms_key_arn=f"arn:aws:kms:{REGION}:{ACCOUNT}:key/1234abcd-12ab-34cd-56ef-1234567890ab",
        subnet_ids=("subnet-0123456789abcdef0",),
        security_group_ids=("sg-0123456789abcdef0",),
    ),
    team=TeamSettings(name="nlp", job_name_prefix="llmtrain-test", warm_pool_cap_seconds=3600),
)
LAYOUTS = request_layouts([render(t, RunInput(run_name="layout"), PLATFORM) for t in CATALOG.all()])
CAPACITY = {
    "Error": "States.TaskFailed",
    "Cause": json.dumps(
        {
            "TrainingJobName": "llmtrain-test-r-a1",
            "TrainingJobStatus": "Failed",
            "FailureReason": "CapacityError: Unable to provision requested ML compute capacity.",
        }
    ),
}
QUOTA = {
    "Error": "SageMaker.AmazonSageMakerException",
    "Cause": (
        "The account-level service limit 'ml.g5.12xlarge for training job usage' is 1 Instances, with "
        "current utilization of 1 Instances and a request delta of 1 Instances. Please use AWS Service "
        "Quotas to request an increase for this quota. (Service: AmazonSageMaker; Status Code: 400; "
        "Error Code: ResourceLimitExceeded; Request ID: 1; Proxy: null)"
    ),
}


@pytest.fixture
def deployed(monkeypatch, tmp_path):
    """moto, and the handlers' environment as the construct sets it."""
    settings = LauncherSettings(
        platform_context=PLATFORM.to_dict(), request_layouts=LAYOUTS, templates_dir=str(CATALOG.root)
    )
    for name, value in settings.to_environment().items():
        monkeypatch.setenv(name, value)
    with mock_aws():
        yield boto3.client("sagemaker", region_name=REGION)


def _job(sagemaker, name: str, status: str) -> None:
    """A training job in moto with the given status (moto creates them Completed)."""
    request = render(CATALOG.get("gpt2-ddp"), RunInput(run_name="other"), PLATFORM)
    sagemaker.create_training_job(**{**request, "TrainingJobName": name})
    sagemaker_backends[ACCOUNT][REGION].training_jobs[name].training_job_status = status


def _event(run_name: str, **fields) -> dict:
    return {
        "input": {"template": "gpt2-ddp", "run_name": run_name, **fields},
        "execution_arn": "arn:aws:states:us-east-1:123456789012:execution:l:" + run_name,
        "execution_name": run_name,
    }


def _resolve(run_name: str, **fields) -> dict:
    """Resolve as the function runs it (its settings from the environment), raising its refusals."""
    settings, event = LauncherSettings.from_environment(os.environ), _event(run_name, **fields)
    return resolve_run(
        event["input"],
        platform=settings.platform,
        submission=launcher.submission(settings),
        catalog=launcher.registry(settings),
        sagemaker=boto3.client("sagemaker", region_name=REGION),
        execution_arn=event["execution_arn"],
    )


# -- resolve ------------------------------------------------------------------------------------------


def test_resolve_renders_attempt_one_of_the_pinned_version(deployed):
    state = _resolve("fresh", overrides={"max_steps": "50"})
    latest = CATALOG.latest("gpt2-ddp")
    assert state["request"] == render(
        latest,
        RunInput(run_name="fresh", overrides={"max_steps": "50"}, owner="launcher"),
        PLATFORM,
    )
    run = state["run"]
    assert (run["template"], run["version"], run["attempt"]) == ("gpt2-ddp", latest.version, 1)
    assert run["instance_types"] == ["ml.g5.12xlarge", "ml.g5.24xlarge"]
    assert run["checkpoint_s3_uri"] == "s3://checkpoints-bucket/teams/nlp/gpt2-ddp/fresh/"
    assert run["team"] == "nlp" and run["unusable_instance_types"] == []
    assert state["layout"] in LAYOUTS and set(LAYOUTS[state["layout"]]) == set(state["request"])


def test_resolve_refuses_a_run_in_progress(deployed):
    _job(deployed, "llmtrain-test-busy-a1", "InProgress")
    with pytest.raises(RunAlreadyInProgress, match="llmtrain-test-busy-a1 in progress, so no second job"):
        _resolve("busy")


def test_resolve_refuses_a_completed_run(deployed):
    _job(deployed, "llmtrain-test-done-a1", "Completed")
    with pytest.raises(RunAlreadyCompleted, match="choose a new run_name"):
        _resolve("done")


def test_a_failed_run_started_again_continues_with_the_next_attempt(deployed):
    _job(deployed, "llmtrain-test-again-a1", "Failed")
    _job(deployed, "llmtrain-test-again-a2", "Stopped")
    # Another run whose name extends this one's is not mistaken for it.
    _job(deployed, "llmtrain-test-again-2-a1", "InProgress")
    state = _resolve("again")
    assert state["run"]["attempt"] == 3
    assert state["request"]["TrainingJobName"] == "llmtrain-test-again-a3"
    assert state["request"]["CheckpointConfig"]["S3Uri"] == "s3://checkpoints-bucket/teams/nlp/gpt2-ddp/again/"


def test_the_lambda_entry_point_turns_a_refusal_into_a_rejection_summary(deployed):
    _job(deployed, "llmtrain-test-busy2-a1", "InProgress")
    summary = launcher.resolve(_event("busy2"))["summary"]
    assert (summary["status"], summary["error"]) == ("Rejected", "RunAlreadyInProgress")
    assert summary["run_name"] == "busy2"
    assert summary["subject"] == "llmtrain: run busy2 rejected"
    assert "llmtrain-test-busy2-a1 in progress" in summary["message"]


def test_a_run_keeps_its_template_and_version_for_life(deployed):
    old = render(CATALOG.get("gpt2-ddp", "1.0.0"), RunInput(run_name="kept"), PLATFORM)
    deployed.create_training_job(**old)
    sagemaker_backends[ACCOUNT][REGION].training_jobs[old["TrainingJobName"]].training_job_status = "Failed"
    # "latest" continues on the version the run's jobs ran, not today's latest.
    state = _resolve("kept")
    assert (state["run"]["version"], state["run"]["attempt"]) == ("1.0.0", 2)
    for fields, asked in (({"version": "1.1.0"}, "gpt2-ddp@1.1.0"),
                          ({"template": "llama-pretrain-fsdp"}, "llama-pretrain-fsdp@latest")):
        with pytest.raises(InvalidRunInput) as error:
            _resolve("kept", **fields)
        assert f"run 'kept' runs gpt2-ddp@1.0.0 (its earlier jobs), not {asked}" in str(error.value)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"version": "2.0.0"}, "has no version '2.0.0'; available: 1.0.0, 1.1.0, 1.2.0, 1.3.0"),
        ({"overrides": {"max_steps": "lots"}}, "override 'max_steps': 'lots' is not a valid int"),
        ({"overrides": {"instance_type": "ml.t3.medium"}}, "override 'instance_type'"),
        ({"overrides": ["max_steps=1"]}, "'overrides' must be an object"),
        ({"overrides": {"lr": 10**400}}, "override 'lr'"),
        ({"version": ""}, "'version' must be a published version"),
        ({"template": "llama-pretrain-fsdp"}, "team 'nlp': template 'llama-pretrain-fsdp' is not one of"),
    ],
)
def test_resolve_rejects_bad_input_naming_what_to_fix(deployed, monkeypatch, fields, message):
    team = dataclasses.replace(PLATFORM, allowed_templates=("gpt2-ddp",))
    monkeypatch.setenv(ENV_PLATFORM_CONTEXT, json.dumps(team.to_dict()))
    with pytest.raises(InvalidRunInput, match="rejected before any training job was created") as error:
        _resolve("bad", **fields)
    assert message in str(error.value)


def test_fallback_types_that_cannot_hold_the_run_are_found_up_front(deployed):
    # Two nodes need EFA; gpt2-ddp's fallback ml.g5.24xlarge has none, ml.p4d.24xlarge (chosen) has.
    state = _resolve("efa", overrides={"instance_count": 2, "instance_type": "ml.p4d.24xlarge"})
    run = state["run"]
    assert run["instance_types"] == ["ml.p4d.24xlarge"]
    [skipped] = run["unusable_instance_types"]
    assert skipped["instance_type"] == "ml.g5.24xlarge" and "EFA" in skipped["reason"]


def test_a_fallback_with_another_gpu_count_holds_a_run_whose_checkpoints_reshard(deployed):
    # gpt2-ddp on one ml.p4d.24xlarge (8 GPUs) falls back to ml.g5.24xlarge (4 GPUs): the next
    # attempt resumes on 4 data-parallel ranks (DCP reshards DDP's state).
    run = _resolve("reshape", overrides={"instance_type": "ml.p4d.24xlarge"})["run"]
    assert run["instance_types"] == ["ml.p4d.24xlarge", "ml.g5.24xlarge"]
    assert run["unusable_instance_types"] == []


def test_a_fallback_with_another_gpu_count_cannot_hold_a_deepspeed_run():
    from llmtrain.core.spec import TemplateSpec

    data = CATALOG.resolve("llama-finetune-deepspeed").to_dict()
    data["retry"]["fallback_instance_types"] = ["ml.p5.48xlarge", "ml.g5.12xlarge"]
    spec = TemplateSpec.from_dict(data)
    first = render(spec, RunInput(run_name="zero"), PLATFORM)
    submission = TrainingJobSubmission(request_layouts([first]))
    usable, unusable = check_fallbacks(spec, ExecutionInput(template=spec.name, run_name="zero"),
                                       first, PLATFORM, submission)
    assert usable == ["ml.p5.48xlarge"]  # 8 GPUs, like the run's ml.p4d.24xlarge
    [skipped] = unusable
    assert skipped.instance_type == "ml.g5.12xlarge"
    assert "runs 4 processes where the run's ml.p4d.24xlarge runs 8, and deepspeed checkpoints do " \
           "not reshard" in skipped.reason


def test_resolve_rejects_a_run_name_sagemaker_cannot_use(deployed):
    with pytest.raises(InvalidRunInput, match="run_name"):
        _resolve("not a name")
    with pytest.raises(InvalidRunInput, match="may be at most"):
        _resolve("x" * 60)


def test_handlers_need_the_environment_the_construct_sets(monkeypatch):
    monkeypatch.delenv(ENV_PLATFORM_CONTEXT, raising=False)
    with pytest.raises(LauncherStateError, match="LLMTRAIN_PLATFORM_CONTEXT is not set"):
        launcher.resolve({"input": {"template": "gpt2-ddp", "run_name": "r"}})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (None, "must be a JSON object like {\"template\": NAME"),
        ([1, 2], "got a list"),
        ("gpt2-ddp", "got a string ('gpt2-ddp')"),
        (7, "got a number"),
        ({"template": "gpt2-ddp"}, "'run_name' is required"),
        ({"run_name": "r"}, "'template' is required"),
        ({"template": "gpt2-ddp", "run_name": "r", "extra": 1}, "unknown input field(s) extra"),
        ({"template": "gpt2-ddp", "run_name": "r", "version": 1}, "'version' must be a published version"),
        ({"template": "gpt2-ddp", "run_name": "r", "version": ""}, "got ''"),
        ({"template": "gpt2-ddp", "run_name": "r", "skip_plan_check": "yes"}, "'skip_plan_check' must be"),
        (
            {"template": "gpt2-ddp", "run_name": "Big-Run"},
            "has upper-case letters; SageMaker job names ignore case, so it would share its jobs with "
            "'big-run'",
        ),
    ],
)
def test_execution_input_is_checked(data, message):
    with pytest.raises(InvalidRunInput) as error:
        ExecutionInput.parse(data)
    assert message in str(error.value)


def test_execution_input_defaults_and_round_trip():
    parsed = ExecutionInput.parse({"template": "t", "run_name": "r"})
    assert parsed == ExecutionInput(template="t", run_name="r", version="latest", overrides={}, owner=None)
    assert ExecutionInput.parse(parsed.to_dict()) == parsed
    assert parsed.to_dict() == {"template": "t", "version": "latest", "run_name": "r", "overrides": {}}
    assert not parsed.skip_plan_check
    forced = ExecutionInput.parse({"template": "t", "run_name": "r", "skip_plan_check": True})
    assert forced.skip_plan_check and ExecutionInput.parse(forced.to_dict()) == forced


def test_the_job_name_stem_agrees_with_render():
    assert (
        job_name(PLATFORM, RunInput(run_name="abc", attempt=7))
        == attempt_name_stem("llmtrain-test", "abc") + "7"
    )


# -- classifying failures -------------------------------------------------------------------------------


def test_failures_are_classified():
    assert classify_failure(CAPACITY).kind == "capacity"
    insufficient = {
        "Error": "States.TaskFailed",
        "Cause": json.dumps(
            {"TrainingJobStatus": "Failed", "FailureReason": "InsufficientInstanceCapacity: none left"}
        ),
    }
    assert classify_failure(insufficient).kind == "capacity"
    quota = classify_failure(QUOTA)
    assert quota.kind == "quota"
    assert (quota.quota.name, quota.quota.limit, quota.quota.in_use, quota.quota.requested) == (
        "ml.g5.12xlarge for training job usage",
        1,
        1,
        1,
    )
    algorithm = classify_failure(
        {
            "Error": "States.TaskFailed",
            "Cause": json.dumps(
                {"TrainingJobStatus": "Failed", "FailureReason": "AlgorithmError: exit code 1"}
            ),
        }
    )
    assert (algorithm.kind, algorithm.reason) == ("job_failed", "AlgorithmError: exit code 1")
    stopped = classify_failure(
        {"Error": "States.TaskFailed", "Cause": json.dumps({"TrainingJobStatus": "Stopped"})}
    )
    assert stopped.kind == "stopped"
    validation = classify_failure(
        {
            "Error": "SageMaker.AmazonSageMakerException",
            "Cause": "Training job names must be unique (Error Code: ValidationException)",
        }
    )
    assert validation.kind == "api_error" and "must be unique" in validation.reason


# -- retry planning ---------------------------------------------------------------------------------------


def _run(**state) -> RunState:
    return RunState(
        run_name="r",
        team="nlp",
        template="llama-pretrain-fsdp",
        version="1.1.0",
        overrides={},
        owner="launcher",
        execution_arn=None,
        **{"attempt": 1, "instance_types": ("ml.p4d.24xlarge", "ml.p5.48xlarge"), **state},
    )


def test_the_run_state_round_trips_and_refuses_a_state_from_another_deployment():
    run = _run().with_attempt_ended("job-a1", "capacity", "CapacityError")
    again = RunState.from_dict(json.loads(json.dumps(run.to_dict())))
    assert again == run and again.history[0].outcome == "capacity"
    with pytest.raises(LauncherStateError, match="different deployments"):
        RunState.from_dict({**run.to_dict(), "surprise": 1})
    with pytest.raises(LauncherStateError, match="deploy the state machine and the functions together"):
        RunState.from_dict({k: v for k, v in run.to_dict().items() if k != "attempt"})


def test_backoff_is_exponential_and_capped():
    retry = CATALOG.get("llama-pretrain-fsdp").retry  # 600 s, x2, at most 7200 s
    assert [backoff_seconds(retry, n) for n in range(1, 7)] == [600, 1200, 2400, 4800, 7200, 7200]


def test_capacity_retries_on_the_same_type_then_the_fallbacks_then_gives_up():
    retry = CATALOG.get("llama-pretrain-fsdp").retry  # 6 retries, fallback ml.p5.48xlarge
    capacity = Failure(kind="capacity", reason="CapacityError")
    plan = plan_retry(retry, _run(), capacity)
    assert (plan.wait_seconds, plan.type_index, plan.capacity_retries) == (600, 0, 1)
    plan = plan_retry(retry, _run(capacity_retries=6), capacity)
    assert (plan.wait_seconds, plan.type_index, plan.capacity_retries) == (0, 1, 0)
    assert plan_retry(retry, _run(type_index=1, capacity_retries=6), capacity) is None


def test_quota_fails_fast_or_waits_by_policy():
    quota = Failure(kind="quota", reason="ResourceLimitExceeded")
    assert plan_retry(CATALOG.get("llama-pretrain-fsdp").retry, _run(), quota) is None  # policy fail
    waiting = CATALOG.get("llama-pretrain-hsdp-tp").retry  # policy wait, 900 s backoff
    plan = plan_retry(waiting, _run(), quota)
    assert (plan.wait_seconds, plan.type_index, plan.quota_waits) == (900, 0, 1)
    assert plan_retry(waiting, _run(quota_waits=waiting.capacity_retry_attempts), quota) is None


def test_a_throttled_call_is_made_again_for_the_same_attempt_then_given_up():
    retry = CATALOG.get("llama-pretrain-fsdp").retry
    throttled = classify_failure(
        {
            "Error": "SageMaker.AmazonSageMakerException",
            "Cause": "Rate exceeded (Service: AmazonSageMaker; Status Code: 400; "
            "Error Code: ThrottlingException)",
        }
    )
    assert throttled.kind == "throttled"
    plan = plan_retry(retry, _run(), throttled)
    assert (plan.wait_seconds, plan.new_attempt, plan.throttle_retries) == (10, False, 1)
    assert plan_retry(retry, _run(throttle_retries=4), throttled).wait_seconds == 160
    assert plan_retry(retry, _run(throttle_retries=5), throttled) is None


def test_other_failures_are_never_retried_and_attempts_are_bounded():
    retry = CATALOG.get("llama-pretrain-fsdp").retry
    assert plan_retry(retry, _run(), Failure(kind="job_failed", reason="AlgorithmError")) is None
    assert plan_retry(retry, _run(), Failure(kind="api_error", reason="ValidationException")) is None
    assert plan_retry(retry, _run(attempt=99), Failure(kind="capacity", reason="CapacityError")) is None


def _program_failure(reason: str) -> dict:
    """A job the training program ended with `reason` (in output/failure), as Step Functions reports it."""
    return {"Error": "States.TaskFailed",
            "Cause": json.dumps({"TrainingJobName": "llmtrain-test-r-a1", "TrainingJobStatus": "Failed",
                                 "FailureReason": f"AlgorithmError: {reason}"})}


RULE_STOP = _program_failure("RuleTriggered: loss_spike at step 120: loss 9.1 is above 3 x its running "
                             "mean 2.9 (action stop). Starting the run again resumes from step_00000100")
HANG = _program_failure("HungCollective: nothing finished for 20 minutes on rank 3 (host algo-1) after "
                        "step 1200: a collective never completed")


def test_the_programs_rule_stops_and_hangs_are_classified_and_a_hang_is_retried_once():
    retry = CATALOG.get("llama-pretrain-fsdp").retry
    rule, hang = classify_failure(RULE_STOP), classify_failure(HANG)
    assert (rule.kind, hang.kind) == ("rule_stopped", "hung")
    assert rule.reason.startswith("AlgorithmError: RuleTriggered: loss_spike at step 120")
    assert plan_retry(retry, _run(), rule) is None  # the same checkpoint, the same fault
    plan = plan_retry(retry, _run(), hang)
    assert (plan.wait_seconds, plan.new_attempt, plan.type_index) == (0, True, 0)
    hung_once = _run(attempt=2).with_attempt_ended("r-a1", "hung", hang.reason)
    assert plan_retry(retry, hung_once, hang) is None
    # a hang after an attempt that failed otherwise still gets its one retry
    assert plan_retry(retry, _run(attempt=2).with_attempt_ended("r-a1", "capacity"), hang) is not None


def test_a_hung_job_is_retried_as_a_new_job_from_the_same_checkpoints(deployed):
    state = _resolve("hung")
    planned = launcher.next_attempt({**state, "failure": HANG})
    assert planned["decision"] == "retry" and planned["wait_seconds"] == 0
    assert planned["request"]["TrainingJobName"] == "llmtrain-test-hung-a2"
    assert planned["request"]["CheckpointConfig"] == state["request"]["CheckpointConfig"]
    assert planned["run"]["history"][0]["outcome"] == "hung"
    again = launcher.next_attempt({"run": planned["run"], "request": planned["request"], "failure": HANG})
    assert again["decision"] == "fail"
    summary = again["summary"]
    assert summary["error"] == "TrainingJobHung"
    assert summary["subject"] == "llmtrain: run hung Failed (TrainingJobHung)"
    assert "2 job(s) of this run hung; a run is retried 1 time(s) after a hang" in summary["advice"]
    assert "llmtrain logs hung" in summary["advice"]


def _hang_of(job_name: str) -> dict:
    """The hang as Step Functions (or a queued run's Watch step) reports it: the job's description."""
    cause = json.loads(HANG["Cause"])
    return {**HANG, "Cause": json.dumps({**cause, "TrainingJobName": job_name})}


def test_a_hung_jobs_warm_pool_is_ended_before_its_retry(deployed, monkeypatch):
    """The retry starts at once with the same resources: it would reuse the hung job's warm pool, the
    instances that may have hung it. A queued run's job is named by AWS Batch: the failure's job
    description names it. A pool already gone, or none kept, does not stop the retry."""
    updates = install_update_training_job(monkeypatch)
    fleet, now = TrainingFleet(deployed), datetime.now(UTC)
    warm = {"spot": "false", "keep_alive_seconds": "600"}
    pooled, queued, gone = (_resolve(name, overrides=warm) for name in ("pooled", "queued", "gone"))
    pooled_job = pooled["request"]["TrainingJobName"]
    batch_job = f"AWSBatch{queued['request']['TrainingJobName'][:23]}{'7' * 32}"
    gone_job = gone["request"]["TrainingJobName"]
    fleet.with_available_warm_pool(pooled_job, ended_at=now, now=now)
    fleet.with_available_warm_pool(batch_job, ended_at=now, now=now)
    fleet.with_ended_warm_pool(gone_job, ended_at=now)
    no_pool = _resolve("no-pool")

    planned = [launcher.next_attempt({**state, "failure": _hang_of(state["request"]["TrainingJobName"])})
               for state in (pooled, gone, no_pool)]
    planned.append(launcher.next_attempt({**queued, "failure": _hang_of(batch_job)}))
    capacity = launcher.next_attempt({**pooled, "failure": CAPACITY})

    assert [p["decision"] for p in planned] == ["retry"] * 4 and capacity["decision"] == "retry"
    assert fleet.warm_pool_status(pooled_job) == fleet.warm_pool_status(batch_job) == "Terminated"
    ended = {"KeepAlivePeriodInSeconds": 0}
    assert updates == [{"TrainingJobName": name, "ResourceConfig": ended}
                       for name in (pooled_job, gone_job, batch_job)]


def test_a_rule_stop_ends_the_run_with_what_the_rule_saw(deployed):
    state = _resolve("spiky")
    given_up = launcher.next_attempt({**state, "failure": RULE_STOP})
    assert given_up["decision"] == "fail"
    summary = given_up["summary"]
    assert (summary["error"], summary["status"]) == ("StoppedByRule", "Failed")
    assert summary["failure_reason"].startswith("AlgorithmError: RuleTriggered: loss_spike at step 120")
    assert [entry["outcome"] for entry in summary["attempt_history"]] == ["rule_stopped"]
    assert "Error: StoppedByRule: AlgorithmError: RuleTriggered: loss_spike at step 120" in summary["message"]
    assert "`llmtrain logs spiky` shows its [rule] lines" in summary["message"]


def test_next_attempt_renders_a_new_job_with_the_same_checkpoints(deployed):
    state = _resolve("retry")
    planned = launcher.next_attempt({**state, "failure": CAPACITY})
    assert planned["decision"] == "retry" and planned["wait_seconds"] == 120
    assert planned["request"]["TrainingJobName"] == "llmtrain-test-retry-a2"
    assert planned["request"]["CheckpointConfig"] == state["request"]["CheckpointConfig"]
    assert planned["run"]["history"][0]["outcome"] == "capacity"
    # After the retries on ml.g5.12xlarge, the fallback type, at once.
    exhausted = {**planned["run"], "capacity_retries": 3}
    fallback = launcher.next_attempt({"run": exhausted, "request": planned["request"], "failure": CAPACITY})
    assert fallback["wait_seconds"] == 0
    assert fallback["request"]["ResourceConfig"]["InstanceType"] == "ml.g5.24xlarge"
    assert fallback["request"]["TrainingJobName"] == "llmtrain-test-retry-a3"


def test_next_attempt_gives_up_with_a_summary(deployed):
    state = _resolve("quota")
    given_up = launcher.next_attempt({**state, "failure": QUOTA})
    assert given_up["decision"] == "fail"
    summary = given_up["summary"]
    assert summary["error"] == "QuotaExceeded" and summary["status"] == "Failed"
    assert summary["quota"] == {
        "name": "ml.g5.12xlarge for training job usage",
        "limit": 1,
        "in_use": 1,
        "requested": 1,
    }
    assert "request an increase in Service Quotas" in summary["message"]
    assert summary["subject"] == "llmtrain: run quota Failed (QuotaExceeded)"


def test_summarize_reports_the_completed_job(deployed):
    state = _resolve("done2")
    job = {
        "TrainingJobName": "llmtrain-test-done2-a1",
        "TrainingJobArn": "arn:job",
        "TrainingJobStatus": "Completed",
        "FinalMetricDataList": [{"MetricName": "train:loss", "Value": 1.5}],
        "ModelArtifacts": {"S3ModelArtifacts": "s3://artifacts-bucket/x/model.tar.gz"},
        "BillableTimeInSeconds": 3600,
        "TrainingTimeInSeconds": 3700,
    }
    summary = launcher.summarize({"run": state["run"], "job": job})["summary"]
    assert summary["status"] == "Completed" and summary["final_metrics"] == {"train:loss": 1.5}
    assert summary["billable_seconds"] == 3600 and summary["attempts"] == 1
    assert "Model artifacts: s3://artifacts-bucket/x/model.tar.gz" in summary["message"]


# -- request layouts ----------------------------------------------------------------------------------


def test_layouts_are_named_by_what_they_lack():
    layouts = request_layouts([{"A": 1, "B": 2, "C": 3}, {"A": 1, "B": 2}, {"A": 1, "B": 2, "C": 3}])
    assert layouts == {"all": ["A", "B", "C"], "without-C": ["A", "B"]}
    assert request_layout({"B": 0, "A": 0}, layouts) == "without-C"
    with pytest.raises(LlmtrainError, match="cannot pass"):
        request_layout({"A": 1, "D": 4}, layouts)
