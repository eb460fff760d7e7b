"""The launcher with queues, executed: the synthesized state machine of an environment whose runs go
through AWS Batch runs in moto (tests/llmtrain/launcher_harness.py), its functions the real ones.

The environment is dev with queues turned on (`queues:` with a `standard` and an `urgent` queue of
4 instances; its team `default` may ask for priority 50), synthesized as app.py does. Supplied in test
code, as launcher_harness.py and batch_support.py say: Lambda execution, SageMaker's training jobs'
ends, and AWS Batch's service jobs (moto implements none), whose every request is checked against
botocore's Batch model, and every payload against CreateTrainingJob's.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import aws_cdk as cdk
import boto3
import pytest
from batch_support import QueueOutcome
from launcher_harness import ACCOUNT, REGION, JobOutcome, launcher_in_moto

from llmtrain.client.launcher import LauncherClient
from llmtrain.core import queue_policy as policy
from llmtrain.core.catalog import Catalog
from llmtrain.core.environments import JobQueueConfig, QueuesConfig, load_environment
from llmtrain.core.platform import PlatformContext
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.validate import input_problems
from stacks.platform import PlatformStage

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # a full synth of the stage, then moto

PREFIX = "llmtrain-dev-default"
URGENT = f"arn:aws:batch:{REGION}:{ACCOUNT}:job-queue/llmtrain-dev-urgent"
STANDARD = f"arn:aws:batch:{REGION}:{ACCOUNT}:job-queue/llmtrain-dev-standard"


def _queued_dev():
    dev = load_environment(ROOT / "config" / "dev.yaml")
    [team] = dev.teams
    queues = QueuesConfig(
        max_instances=4,
        job_queues=(JobQueueConfig(name="standard", priority=10),
                    JobQueueConfig(name="urgent", priority=100)),
        default_queue="standard",
        capacity_wait_seconds=3600,
    )
    return dataclasses.replace(dev, account=ACCOUNT, queues=queues,
                               teams=(dataclasses.replace(team, max_priority=50),))


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("cdk.out")
    app = cdk.App(outdir=str(outdir))
    stage = PlatformStage(app, config=_queued_dev())
    assembly = app.synth().get_nested_assembly(stage.artifact_id)
    templates = {stack.stack_name: stack.template for stack in assembly.stacks}
    return Path(assembly.directory), stage.launcher.stack_name, templates


@pytest.fixture
def launcher(synthesized):
    assembly_dir, launcher_stack, templates = synthesized

    def start(outcomes, queue_outcomes):
        return launcher_in_moto(assembly_dir, launcher_stack, templates, outcomes, queue_outcomes)

    return start


def _platform(harness) -> PlatformContext:
    function = next(iter(harness.launcher.functions.values()))
    return PlatformContext.from_dict(json.loads(function.environment["LLMTRAIN_PLATFORM_CONTEXT"]))


def _states_entered(run) -> list[str]:
    return [e["stateEnteredEventDetails"]["name"] for e in run.history if "stateEnteredEventDetails" in e]


def _watched(run) -> list[dict]:
    """What each Watch step saw ($.queue after it)."""
    return [
        json.loads(e["stateExitedEventDetails"]["output"])["queue"]
        for e in run.history
        if e.get("stateExitedEventDetails", {}).get("name") == "Watch"
    ]


def test_a_run_waits_in_its_queue_then_trains_and_is_summarized(launcher):
    with launcher([JobOutcome(metrics={"train:loss": 1.5}, billable_seconds=600)],
                  [QueueOutcome(waits=2, ahead=3)]) as harness:
        harness.batch.usage[URGENT] = {"default": 2}
        run = harness.run({"template": "gpt2-ddp", "version": "1.1.0", "run_name": "queued",
                           "overrides": {"max_steps": 10}, "queue": "urgent", "priority": 7})
        platform = _platform(harness)
        notifications = harness.notifications()

    assert run.status == "SUCCEEDED", run.cause
    [submitted] = harness.batch.submitted
    # A valid SubmitServiceJob request (botocore's Batch model) whose payload is the rendered request,
    # itself valid for CreateTrainingJob; its tags are the service job's.
    assert input_problems("batch", "SubmitServiceJob", submitted) == []
    payload = json.loads(submitted["serviceRequestPayload"])
    assert input_problems("sagemaker", "CreateTrainingJob", payload) == []
    expected = render(Catalog.load().get("gpt2-ddp", "1.1.0"),
                      RunInput(run_name="queued", overrides={"max_steps": 10}, owner="launcher"), platform)
    assert payload == {key: value for key, value in expected.items() if key != "Tags"}
    assert submitted["tags"] == {tag["Key"]: tag["Value"] for tag in expected["Tags"]}
    assert (submitted["jobName"], submitted["jobQueue"]) == (f"{PREFIX}-queued-a1", URGENT)
    assert (submitted["shareIdentifier"], submitted["schedulingPriority"]) == ("default", 7)
    assert submitted["serviceJobType"] == "SAGEMAKER_TRAINING"
    # QUEUED (fourth in line, the team's share running 2 instances) before TRAINING, then done.
    seen = _watched(run)
    assert [state["phase"] for state in seen] == ["QUEUED", "QUEUED", "TRAINING", "SUCCEEDED"]
    assert (seen[0]["position"], seen[0]["share_instances"], seen[0]["queue_instances"]) == (4, 2.0, 2.0)
    assert seen[0]["message"].startswith("QUEUED: #4 in llmtrain-dev-urgent")
    assert harness.waits == [300, 300, 900]
    # The state machine created no training job itself: Batch did, under its own name.
    [created] = harness.jobs.requests
    assert created["TrainingJobName"].startswith("AWSBatchllmtrain-dev-default")
    states = _states_entered(run)
    assert "ChooseRequestLayout" not in states and states.count("SubmitToQueue") == 1
    summary = run.output
    assert summary["status"] == "Completed" and summary["final_metrics"] == {"train:loss": 1.5}
    assert summary["job_name"] == summary["attempt_history"][0]["job_name"] == created["TrainingJobName"]
    assert [n["MessageAttributes"]["status"]["Value"] for n in notifications] == ["Completed"]


@pytest.mark.parametrize(
    ("execution_input", "message"),
    [
        ({"priority": 51}, "priority 51 is above team 'default''s max_priority (50)"),
        ({"queue": "fast"}, "queue 'fast' is not one of team 'default''s queues (standard, urgent)"),
        ({"priority": -1}, "'priority' must be a whole number from 0 to 9999"),
        ({"overrides": {"instance_count": 8, "instance_type": "ml.p4d.24xlarge", "max_steps": 10}},
         "the run asks for 8 instances; the environment's queues run at most 4 at once"),
        # `llmtrain tune`: a SageMaker tuning job cannot be submitted to a Batch queue.
        ({"tune": {"params": [{"name": "lr", "kind": "continuous", "low": 1e-5, "high": 1e-3, "log": True}],
                   "objective": "train:loss"}},
         "tuning jobs cannot be queued: tune in an environment without queues, or locally (--local)"),
    ],
)
def test_bad_input_submits_nothing(launcher, execution_input, message):
    with launcher([], []) as harness:
        run = harness.run({"template": "gpt2-ddp", "run_name": "bad", **execution_input})
    assert run.status == "FAILED" and run.error == "InvalidRunInput", run.cause
    assert message in run.cause
    assert harness.batch.submitted == [] and harness.jobs.requests == []
    assert harness.jobs.tuning_requests == []


def test_llmtrain_stop_cancels_a_queued_run(launcher):
    held = threading.Event()
    with launcher([], [QueueOutcome(hold=held, ahead=1)]) as harness:
        harness.park_waits = True  # the run waits in WaitInQueue, as a queued run does, when stopped
        execution_arn = harness.start({"template": "gpt2-ddp", "run_name": "waiting"}, name="waiting-1")
        deadline = time.monotonic() + 30
        while not harness.waits:
            assert time.monotonic() < deadline, "the run never reached its queue"
            time.sleep(0.05)
        platform = _platform(harness)
        client = LauncherClient(session=boto3.Session(region_name=REGION), region=REGION,
                                state_machine_arn=harness.state_machine_arn, job_name_prefix=PREFIX,
                                queues=platform.queues)
        client._clients["batch"] = harness.batch
        status = client.status("waiting")
        stopped = client.stop("waiting", by="alice")
        run = harness.wait(execution_arn)
        held.set()

    assert status.queue["phase"] == "QUEUED" and status.queue["position"] == 2 and status.job is None
    assert stopped["cancelled"] == [f"{PREFIX}-waiting-a1"]
    [(_, terminated)] = [call for call in harness.batch.calls if call[0] == "TerminateServiceJob"]
    assert terminated["reason"] == "llmtrain stop waiting by alice"
    [job] = harness.batch.jobs.values()
    assert (job.status, job.terminated, job.training_job_arn) == ("FAILED", True, None)
    assert run.status == "ABORTED" and harness.jobs.requests == []


def test_a_run_that_waits_past_the_capacity_time_limit_ends_with_a_clear_status(launcher):
    # gpt2-ddp 1.1.0 falls back from ml.g5.12xlarge to ml.g5.24xlarge: both wait out the limit.
    limit = QueueOutcome(waits=1, time_limit=policy.CAPACITY_REASON)
    with launcher([], [limit, dataclasses.replace(limit)]) as harness:
        run = harness.run({"template": "gpt2-ddp", "version": "1.1.0", "run_name": "nocap"})
    assert run.status == "FAILED" and run.error == "QueueCapacityTimeLimit", run.cause
    types = [json.loads(s["serviceRequestPayload"])["ResourceConfig"]["InstanceType"]
             for s in harness.batch.submitted]
    assert types == ["ml.g5.12xlarge", "ml.g5.24xlarge"]
    assert [s["jobName"] for s in harness.batch.submitted] == [f"{PREFIX}-nocap-a1", f"{PREFIX}-nocap-a2"]
    # The run's summary (the failure's cause) says why and what to do.
    assert "Terminated by JobStateTimeLimit action due to reason: CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY" \
        in run.cause
    assert "waited at the head of its queue" in run.cause and "capacity time limit" in run.cause
    assert "Attempts: 2" in run.cause
    assert harness.jobs.requests == []  # no training job was ever created


def test_a_failed_queued_run_started_again_resumes_as_its_next_attempt(launcher):
    failure = JobOutcome.algorithm_error("AlgorithmError: loss is nan")
    with launcher([failure, JobOutcome()], [QueueOutcome(), QueueOutcome()]) as harness:
        first = harness.run({"template": "gpt2-ddp", "version": "1.1.0", "run_name": "again"},
                            name="again-1")
        second = harness.run({"template": "gpt2-ddp", "run_name": "again"}, name="again-2")
    assert first.status == "FAILED" and first.error == "TrainingJobFailed", first.cause
    assert "loss is nan" in first.cause
    assert second.status == "SUCCEEDED", second.cause
    # The second execution found attempt 1 among the run's service jobs, kept its version (1.1.0,
    # though "latest" was asked) and its checkpoints.
    names = [s["jobName"] for s in harness.batch.submitted]
    assert names == [f"{PREFIX}-again-a1", f"{PREFIX}-again-a2"]
    payloads = [json.loads(s["serviceRequestPayload"]) for s in harness.batch.submitted]
    assert payloads[0]["CheckpointConfig"] == payloads[1]["CheckpointConfig"]
    assert harness.batch.submitted[1]["tags"]["llmtrain:template-version"] == "1.1.0"
    assert second.output["template"] == "gpt2-ddp@1.1.0"
