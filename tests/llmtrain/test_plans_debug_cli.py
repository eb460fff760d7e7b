"""`llmtrain plans` and `llmtrain debug` against SageMaker's API as botocore models it (Stubber: moto
implements neither training plans nor remote debugging). The stubs check every request's parameters
against the service model, so the commands call the API as SageMaker expects. The commands themselves
run as an engineer runs them: `--env` (and `--team`) read the deployed environment's record from
moto's SSM Parameter Store, as every cloud command does, and only SageMaker is stubbed."""

from __future__ import annotations

import datetime as dt
import json

import boto3
import pytest
from botocore.stub import Stubber
from deployed_support import ACCOUNT as DEPLOYED_ACCOUNT
from deployed_support import ENVIRONMENT, moto_credentials, team_access
from moto import mock_aws

from llmtrain.cli import main
from llmtrain.commands.debug import find_session
from llmtrain.commands.plans import PlanScope, list_plans, print_plans
from llmtrain.core.deployed import parameter_values
from llmtrain.core.errors import LlmtrainError

ACCOUNT = "111111111111"
PLAN_ARN = f"arn:aws:sagemaker:us-east-1:{ACCOUNT}:training-plan/p5-week"
OTHER_ARN = f"arn:aws:sagemaker:us-east-1:{ACCOUNT}:training-plan/someone-elses"
GONE_ARN = f"arn:aws:sagemaker:us-east-1:{ACCOUNT}:training-plan/expired-one"
START = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


def _scope(**offered: str) -> PlanScope:
    return PlanScope(environment="dev", account=ACCOUNT, region="us-east-1", offered=offered)


@pytest.fixture
def sagemaker():
    client = boto3.client("sagemaker", region_name="us-east-1", aws_access_key_id="x",
                          aws_secret_access_key="x")
    with Stubber(client) as stubber:
        yield client, stubber
        stubber.assert_no_pending_responses()


def _summary(name: str, arn: str, status: str = "Active") -> dict:
    return {"TrainingPlanArn": arn, "TrainingPlanName": name, "Status": status, "StartTime": START,
            "EndTime": START + dt.timedelta(days=7), "TotalInstanceCount": 4,
            "ReservedCapacitySummaries": [{
                "ReservedCapacityArn": f"arn:aws:sagemaker:us-east-1:{ACCOUNT}:reserved-capacity/rc-1",
                "InstanceType": "ml.p5.48xlarge", "TotalInstanceCount": 4, "Status": "Active"}]}


def test_plans_lists_configured_plans_with_free_capacity_and_marks_the_others(sagemaker, capsys):
    client, stubber = sagemaker
    scope = _scope(**{"p5-week": PLAN_ARN, "old": GONE_ARN})
    stubber.add_response("list_training_plans", {"TrainingPlanSummaries": [_summary("p5-week", PLAN_ARN)],
                                                  "NextToken": "page2"}, {})
    stubber.add_response("list_training_plans", {"TrainingPlanSummaries": [
        _summary("someone-elses", OTHER_ARN, status="Scheduled")]}, {"NextToken": "page2"})
    stubber.add_response("describe_training_plan", {
        **_summary("p5-week", PLAN_ARN), "AvailableInstanceCount": 3, "InUseInstanceCount": 1},
        {"TrainingPlanName": "p5-week"})

    views = list_plans(client, scope)

    by_name = {view.name: view for view in views}
    assert (by_name["p5-week"].available_instances, by_name["p5-week"].in_use_instances) == (3, 1)
    assert by_name["p5-week"].instance_type == "ml.p5.48xlarge" and by_name["p5-week"].configured
    assert by_name["old"].status == "NotFound" and "fix config" in by_name["old"].note
    assert not by_name["someone-elses"].configured
    print_plans(views, scope)
    out = capsys.readouterr().out
    assert "2 training plan(s) offered to runs" in out
    assert "4 x ml.p5.48xlarge" in out and "someone-elses *" in out


def test_plans_says_which_permission_is_missing(sagemaker):
    client, stubber = sagemaker
    stubber.add_client_error("list_training_plans", "AccessDeniedException", "not authorized")
    with pytest.raises(LlmtrainError, match="sagemaker:ListTrainingPlans"):
        list_plans(client, _scope())


def _job(name: str, *, debug: bool = True, status: str = "InProgress", secondary: str = "Training",
         count: int = 2) -> dict:
    return {
        "TrainingJobName": name,
        "TrainingJobArn": f"arn:aws:sagemaker:us-east-1:{ACCOUNT}:training-job/{name}",
        "TrainingJobStatus": status, "SecondaryStatus": secondary, "CreationTime": START,
        "ModelArtifacts": {"S3ModelArtifacts": ""},
        "AlgorithmSpecification": {"TrainingInputMode": "File"},
        "ResourceConfig": {"InstanceType": "ml.p5.48xlarge", "InstanceCount": count, "VolumeSizeInGB": 100},
        "StoppingCondition": {"MaxRuntimeInSeconds": 3600},
        "RemoteDebugConfig": {"EnableRemoteDebug": debug},
    }


def _list(stubber, *names: str) -> None:
    stubber.add_response("list_training_jobs", {"TrainingJobSummaries": [
        {"TrainingJobName": n, "TrainingJobArn": f"arn:aws:sagemaker:us-east-1:{ACCOUNT}:training-job/{n}",
         "CreationTime": START, "TrainingJobStatus": "InProgress"} for n in names]},
        {"NameContains": "llmtrain-dev-r1-a"})


def test_debug_targets_the_latest_attempts_host(sagemaker):
    client, stubber = sagemaker
    _list(stubber, "llmtrain-dev-r1-a1", "llmtrain-dev-r1-a2")
    stubber.add_response("describe_training_job", _job("llmtrain-dev-r1-a2"),
                         {"TrainingJobName": "llmtrain-dev-r1-a2"})

    session = find_session(client, "llmtrain-dev", "r1", "algo-2", "us-east-1")

    assert session.command() == ["aws", "ssm", "start-session", "--target",
                                 "sagemaker-training-job:llmtrain-dev-r1-a2_algo-2", "--region", "us-east-1"]


@pytest.mark.parametrize(("job", "host", "message"), [
    (_job("llmtrain-dev-r1-a1", debug=False), "algo-1", "without remote debugging; start the run again"),
    (_job("llmtrain-dev-r1-a1", status="Completed"), "algo-1", "is Completed: a session needs a running job"),
    (_job("llmtrain-dev-r1-a1", secondary="Starting"), "algo-1", "containers are not up yet"),
    (_job("llmtrain-dev-r1-a1"), "algo-3", "has 2 host"),
])
def test_debug_explains_why_there_is_no_session(sagemaker, job, host, message):
    client, stubber = sagemaker
    _list(stubber, job["TrainingJobName"])
    stubber.add_response("describe_training_job", job, {"TrainingJobName": job["TrainingJobName"]})
    with pytest.raises(LlmtrainError, match=message):
        find_session(client, "llmtrain-dev", "r1", host, "us-east-1")


def test_debug_refuses_a_host_name_that_is_not_sagemakers():
    with pytest.raises(LlmtrainError, match="hosts are named algo-1"):
        find_session(None, "llmtrain-dev", "r1", "host-1", "us-east-1")


# -- the commands, as an engineer runs them --------------------------------------------------------


@pytest.fixture
def deployed_dev(monkeypatch):
    """moto's AWS with environment dev's record, and SageMaker's calls going to a Stubber."""
    moto_credentials(monkeypatch)
    with mock_aws():
        sagemaker = boto3.client("sagemaker", region_name="us-east-1")
        stubber = Stubber(sagemaker)
        real_client = boto3.session.Session.client

        def client(session, service, *args, **kwargs):
            return sagemaker if service == "sagemaker" else real_client(session, service, *args, **kwargs)

        monkeypatch.setattr(boto3.session.Session, "client", client)

        def deploy(**features):
            values = parameter_values(
                environment=ENVIRONMENT, region="us-east-1", account=DEPLOYED_ACCOUNT,
                job_name_prefix="llmtrain-dev", enabled_templates=["gpt2-ddp"],
                teams=[team_access(f"arn:aws:states:us-east-1:{DEPLOYED_ACCOUNT}:stateMachine:{t}-launcher",
                                   team=t, allowed_templates=["gpt2-ddp"], **features).to_dict()
                       for t in ("nlp", "vision")],
            )
            ssm = boto3.client("ssm", region_name="us-east-1")
            for name, value in values.items():
                ssm.put_parameter(Name=name, Value=json.dumps(value), Type="String")

        with stubber:
            yield deploy, stubber
            stubber.assert_no_pending_responses()


def test_plans_reads_the_offered_plans_from_the_deployed_record(deployed_dev, capsys):
    deploy, stubber = deployed_dev
    plan = f"arn:aws:sagemaker:us-east-1:{DEPLOYED_ACCOUNT}:training-plan/p5-week"
    deploy(training_plans={"p5-week": plan})
    stubber.add_response("list_training_plans", {"TrainingPlanSummaries": [_summary("p5-week", plan)]}, {})
    stubber.add_response("describe_training_plan", {**_summary("p5-week", plan), "AvailableInstanceCount": 2},
                         {"TrainingPlanName": "p5-week"})

    assert main(["plans", "--env", "dev", "--team", "nlp", "--json"]) == 0

    [view] = json.loads(capsys.readouterr().out)
    assert (view["name"], view["configured"], view["available_instances"]) == ("p5-week", True, 2)


def test_plans_needs_the_team_where_the_environment_has_several(deployed_dev, capsys):
    deploy, _ = deployed_dev
    deploy()
    assert main(["plans", "--env", "dev"]) == 2
    assert "several teams (nlp, vision): choose yours with --team" in capsys.readouterr().err


def test_debug_prints_the_session_into_the_teams_job(deployed_dev, capsys):
    deploy, stubber = deployed_dev
    deploy(remote_debug=True)
    job = "llmtrain-dev-vision-r1-a1"
    stubber.add_response("list_training_jobs", {"TrainingJobSummaries": [
        {"TrainingJobName": job, "CreationTime": START, "TrainingJobStatus": "InProgress",
         "TrainingJobArn": f"arn:aws:sagemaker:us-east-1:{ACCOUNT}:training-job/{job}"}]},
        {"NameContains": "llmtrain-dev-vision-r1-a"})
    stubber.add_response("describe_training_job", _job("llmtrain-dev-vision-r1-a1"),
                         {"TrainingJobName": "llmtrain-dev-vision-r1-a1"})

    assert main(["debug", "r1", "--print", "--host", "algo-2", "--env", "dev", "--team", "vision"]) == 0

    assert capsys.readouterr().out.strip() == (
        "aws ssm start-session --target sagemaker-training-job:llmtrain-dev-vision-r1-a1_algo-2 "
        "--region us-east-1")


def test_debug_refuses_an_environment_without_remote_debugging_before_asking_sagemaker(deployed_dev, capsys):
    deploy, _ = deployed_dev
    deploy()
    assert main(["debug", "r1", "--print", "--env", "dev", "--team", "nlp"]) == 2
    assert "does not allow remote debugging: its platform team sets remote_debug.enabled" in (
        capsys.readouterr().err)
