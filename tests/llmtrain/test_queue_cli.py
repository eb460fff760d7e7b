"""`llmtrain queue` and the Batch calls a queued run makes (llmtrain.lifecycle.queue_jobs), against an
environment record in moto's SSM and a simulated Batch (tests/llmtrain/batch_support.py: moto
implements no service job): every request the code sends is checked against botocore's model."""

from __future__ import annotations

import dataclasses
import json
from functools import cache

import boto3
import pytest
from batch_support import QueueOutcome, SimulatedBatch, queue_arn
from deployed_support import (
    ENVIRONMENT,
    REGION,
    deploy_environment,
    moto_credentials,
    platform_context,
    team_access,
)
from moto import mock_aws

from llmtrain.cli import main
from llmtrain.core import queue_policy as policy
from llmtrain.core.catalog import Catalog
from llmtrain.core.errors import RequestValidationError
from llmtrain.core.queue_context import TeamQueues
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.lifecycle import queue_jobs as jobs
from llmtrain.lifecycle.queue_submission import SERVICE_JOB_FAILED, QueueSubmission
from llmtrain.lifecycle.summaries import FAILURE_ERRORS

STANDARD, URGENT = queue_arn(ENVIRONMENT, "standard"), queue_arn(ENVIRONMENT, "urgent")
GPT2 = Catalog.load().latest("gpt2-ddp")


def _queues(team: str, *names: str, max_priority: int = 50) -> TeamQueues:
    arns = {"standard": STANDARD, "urgent": URGENT}
    return TeamQueues(queue_arns={name: arns[name] for name in names or ("standard", "urgent")},
                      default_queue=(names or ("standard",))[0], share_identifier=team,
                      max_priority=max_priority, max_instances=48, capacity_wait_seconds=14400)


@cache
def _platform(team: str):
    return platform_context(team, allowed_templates=["gpt2-ddp"])


def _request(team: str, run: str, attempt: int = 1) -> dict:
    return render(GPT2, RunInput(run_name=run, attempt=attempt), _platform(team))


@pytest.fixture
def batch() -> SimulatedBatch:
    return SimulatedBatch()


@pytest.fixture
def environment(monkeypatch, batch):
    """Environment dev with teams nlp (weight 3) and vision, both queued, deployed in moto; the
    Batch client every session makes is the simulated one."""
    moto_credentials(monkeypatch)
    real_client = boto3.Session.client

    def client(self, service, *args, **kwargs):
        return batch if service == "batch" else real_client(self, service, *args, **kwargs)

    with mock_aws():
        monkeypatch.setattr(boto3.Session, "client", client)
        arn = f"arn:aws:states:{REGION}:123456789012:stateMachine:launcher"
        only = {"allowed_templates": ["gpt2-ddp"]}
        teams = [team_access(arn, "nlp", queues=_queues("nlp"), **only),
                 team_access(arn, "vision", queues=_queues("vision", "standard"), **only)]
        deploy_environment(arn, enabled=["gpt2-ddp"], teams=teams)
        yield batch


def _submit(batch: SimulatedBatch, team: str, run: str, *, queue: str | None = None, priority: int = 0,
            outcome: QueueOutcome | None = None, attempt: int = 1) -> dict:
    batch.outcomes.append(outcome or QueueOutcome(hold=None, waits=10**6))
    params = jobs.submit_request(_request(team, run, attempt), _queues(team), queue=queue, priority=priority)
    return batch.submit_service_job(**params)


def test_a_submission_carries_the_request_as_its_payload_in_the_teams_share():
    request = _request("nlp", "r1")
    params = jobs.submit_request(request, _queues("nlp"), queue="urgent", priority=7)
    assert params["jobQueue"] == URGENT and params["shareIdentifier"] == "nlp"
    assert params["schedulingPriority"] == 7 and params["serviceJobType"] == "SAGEMAKER_TRAINING"
    assert params["jobName"] == request["TrainingJobName"] == "llmtrain-dev-nlp-r1-a1"
    payload = json.loads(params["serviceRequestPayload"])
    # The request itself, its tags moved to the service job (as the SageMaker SDK's TrainingQueue does).
    assert payload == {k: v for k, v in request.items() if k != "Tags"}
    assert params["tags"] == {tag["Key"]: tag["Value"] for tag in request["Tags"]}
    assert params["tags"]["llmtrain:team"] == "nlp"
    # Without a queue or priority: the team's default queue, priority 0.
    default = jobs.submit_request(request, _queues("nlp"))
    assert (default["jobQueue"], default["schedulingPriority"]) == (STANDARD, 0)


def test_a_submission_botocores_models_refuse_is_never_made():
    request = _request("nlp", "r1")
    del request["RoleArn"]
    with pytest.raises(RequestValidationError, match="Missing required parameter in input: \"RoleArn\""):
        jobs.submit_request(request, _queues("nlp"))
    request = _request("nlp", "r1")
    request["TrainingJobName"] = "x" * 129  # over both CreateTrainingJob's 63 and Batch's name rules
    with pytest.raises(RequestValidationError, match="TrainingJobName"):
        jobs.submit_request(request, _queues("nlp"))


def test_a_queued_runs_state_shows_its_place_and_its_teams_share(batch):
    batch.usage[STANDARD] = {"nlp": 16, "vision": 8}
    submitted = _submit(batch, "nlp", "r1", outcome=QueueOutcome(waits=5, ahead=2))
    run, described = jobs.queued_run(batch, submitted["jobId"], share="nlp")
    assert (run.phase, run.status, run.position) == ("QUEUED", "RUNNABLE", 3)
    assert (run.share_instances, run.queue_instances) == (16.0, 24.0)
    assert run.training_job_arn is None and described["jobName"] == "llmtrain-dev-nlp-r1-a1"
    assert run.describe().startswith("QUEUED: #3 in llmtrain-dev-standard, waiting 0m; the team's share runs "
                                      "16 instance(s) of the queue's 24")


def test_a_runs_service_jobs_are_found_by_name_and_cancelled_while_active(batch):
    first = _submit(batch, "nlp", "r1", attempt=1, outcome=QueueOutcome(time_limit=policy.CAPACITY_REASON))
    jobs.queued_run(batch, first["jobId"], share="nlp")  # ends at the head of the queue
    _submit(batch, "nlp", "r1", attempt=2)
    _submit(batch, "nlp", "r10", attempt=1)  # another run, whose name starts like this one's
    stem = "llmtrain-dev-nlp-r1-a"
    found = jobs.run_service_jobs(batch, [STANDARD, URGENT], stem)
    assert [(j["attempt"], j["status"], j["batch_status"]) for j in found] == [
        (1, "Failed", "FAILED"), (2, "InProgress", "RUNNABLE")]
    assert jobs.cancel_run(batch, [STANDARD, URGENT], stem, "llmtrain stop r1") == ["llmtrain-dev-nlp-r1-a2"]
    assert [call for call in batch.calls if call[0] == "TerminateServiceJob"] == [
        ("TerminateServiceJob", {"jobId": found[1]["job_id"], "reason": "llmtrain stop r1"})]


def test_llmtrain_queue_lists_every_teams_runs_with_their_place(environment, capsys):
    batch = environment
    batch.usage[STANDARD] = {"nlp": 8}
    _submit(batch, "nlp", "big", outcome=QueueOutcome(ahead=0))
    _submit(batch, "vision", "small")
    _submit(batch, "nlp", "hurry", queue="urgent", priority=9)
    running = _submit(batch, "nlp", "going")
    batch.jobs[running["jobId"]].status = "RUNNING"
    batch.jobs[running["jobId"]].started_ms = batch.jobs[running["jobId"]].created_ms
    assert main(["queue", "--env", "dev"]) == 0
    out = capsys.readouterr().out
    assert "queue standard: 8 instance(s) running (of the environment's 48; by team: nlp 8)" in out
    assert "queue urgent: 0 instance(s) running" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("standard", "urgent"))]
    assert [row[:4] + row[-1:] for row in rows] == [
        ["standard", "nlp", "going", "RUNNING", "-"],
        ["standard", "nlp", "big", "RUNNABLE", "1"],
        ["standard", "vision", "small", "RUNNABLE", "2"],
        ["urgent", "nlp", "hurry", "RUNNABLE", "1"],
    ]
    assert all(row[4] == "1" for row in rows)  # gpt2-ddp's one instance


def test_llmtrain_queue_team_and_json(environment, capsys):
    _submit(environment, "nlp", "mine")
    _submit(environment, "vision", "theirs")
    assert main(["queue", "--env", "dev", "--team", "vision", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [(r["team"], r["run"], r["position"]) for r in listing["runs"]] == [("vision", "theirs", 2)]
    assert listing["capacity"] == 48 and set(listing["usage"]) == {"standard", "urgent"}
    assert main(["queue", "--env", "dev", "--team", "nobody"]) == 2
    assert "has no team 'nobody'" in capsys.readouterr().err


@pytest.fixture
def without_queues(monkeypatch):
    """Environment dev as it is (no queues), deployed in moto."""
    moto_credentials(monkeypatch)
    with mock_aws():
        arn = f"arn:aws:states:{REGION}:123456789012:stateMachine:launcher"
        only = team_access(arn, allowed_templates=["gpt2-ddp"])
        deploy_environment(arn, enabled=["gpt2-ddp"], teams=[only])
        yield


def test_llmtrain_queue_in_an_environment_without_queues_says_so(without_queues, capsys):
    assert main(["queue", "--env", "dev"]) == 2
    assert "environment 'dev' has no queues: its runs create their training jobs directly" in \
        capsys.readouterr().err


def test_start_refuses_a_queue_or_priority_the_team_may_not_use_before_starting(environment, capsys):
    base = ["start", "gpt2-ddp", "--run-name", "r1", "--env", "dev", "--team", "vision"]
    assert main([*base, "--priority", "51"]) == 2
    assert "priority 51 is above team 'vision''s max_priority (50)" in capsys.readouterr().err
    assert main([*base, "--queue", "urgent"]) == 2
    assert "queue 'urgent' is not one of team 'vision''s queues (standard)" in capsys.readouterr().err
    assert main([*base, "--queue", "Urgent!"]) == 2
    assert "'queue' must name one of the environment's queues" in capsys.readouterr().err
    assert environment.submitted == []


def test_start_refuses_queue_settings_where_there_are_no_queues(without_queues, capsys):
    assert main(["start", "gpt2-ddp", "--run-name", "r1", "--env", "dev", "--priority", "1"]) == 2
    assert "priority given, but environment 'dev' has no queues" in capsys.readouterr().err


def test_batch_ending_a_queued_run_is_told_apart_from_other_failures():
    queued = dataclasses.replace(_platform("nlp"), queues=_queues("nlp"))
    submission = QueueSubmission.for_platform(queued, SimulatedBatch())
    request = _request("nlp", "r1")

    def classify_failure(caught):
        return submission.classify(caught, request)

    ended = policy.TIME_LIMIT_TERMINATION
    capacity = classify_failure({"Error": SERVICE_JOB_FAILED, "Cause": ended + policy.CAPACITY_REASON})
    misconfiguration = ended + policy.MISCONFIGURATION_REASON
    misconfigured = classify_failure({"Error": SERVICE_JOB_FAILED, "Cause": misconfiguration})
    refused = classify_failure({"Error": SERVICE_JOB_FAILED, "Cause": "Received status from SageMaker: "
                                "ResourceLimitExceeded: The account-level service limit 'ml.p4d.24xlarge for "
                                "training job usage' is 2 Instances, with current utilization of 2 Instances "
                                "and a request delta of 2 Instances."})
    assert (FAILURE_ERRORS[capacity.kind], FAILURE_ERRORS[misconfigured.kind]) == (
        "QueueCapacityTimeLimit", "QueueMisconfigured")
    assert refused.kind == "quota" and refused.quota.limit == 2
    # The same words outside a queued run's failure are not the queue's.
    elsewhere = classify_failure({"Error": "States.TaskFailed", "Cause": policy.CAPACITY_REASON})
    assert elsewhere.kind == "api_error"
