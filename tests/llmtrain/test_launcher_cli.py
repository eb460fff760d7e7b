"""`llmtrain start | status | stop | logs` against moto: a deployed launcher stack, its state machine,
training jobs, their metrics and logs, all in moto. The state machine here is a small stand-in with
the launcher's name and output (test_launcher_state_machine.py executes the real definition)."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws
from moto.sagemaker.models import sagemaker_backends

from llmtrain.catalog import Catalog
from llmtrain.cli import main
from llmtrain.launcher_client import (
    TRAINING_LOG_GROUP,
    TRAINING_METRIC_NAMESPACE,
    LauncherClient,
    LauncherOutput,
)
from llmtrain.platform import PlatformContext
from llmtrain.render import RunInput, render

ROOT = Path(__file__).resolve().parents[2]
ACCOUNT, REGION = "123456789012", "us-east-1"
SUMMARY = {"status": "Completed", "message": "Run done (gpt2-ddp@1.0.0): Completed\nAttempts: 1"}
# Runs named held-* wait, so they can be stopped; the others end at once with SUMMARY.
DEFINITION = {
    "StartAt": "Hold",
    "States": {
        "Hold": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.run_name", "StringMatches": "held-*", "Next": "Wait"}],
            "Default": "Summary",
        },
        "Wait": {"Type": "Wait", "Seconds": 600, "Next": "Summary"},
        "Summary": {"Type": "Pass", "Result": SUMMARY, "End": True},
    },
}


@pytest.fixture
def config_dir(tmp_path) -> Path:
    """config/dev.yaml for moto's account (and prod unchanged)."""
    folder = tmp_path / "config"
    folder.mkdir()
    dev = (ROOT / "config" / "dev.yaml").read_text()
    (folder / "dev.yaml").write_text(dev.replace('account: "111111111111"', f'account: "{ACCOUNT}"'))
    return folder


@pytest.fixture
def aws(monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    with mock_aws(config={"stepfunctions": {"execute_state_machine": True}}):
        yield


@pytest.fixture
def launcher(aws) -> str:
    """The launcher stack and its state machine, deployed in moto; returns the state machine ARN."""
    arn = boto3.client("stepfunctions", region_name=REGION).create_state_machine(
        name="llmtrain-dev-launcher",
        definition=json.dumps(DEFINITION),
        roleArn=f"arn:aws:iam::{ACCOUNT}:role/launcher",
    )["stateMachineArn"]
    template = {
        "Resources": {"Topic": {"Type": "AWS::SNS::Topic"}},
        "Outputs": {LauncherOutput.STATE_MACHINE_ARN: {"Value": arn}},
    }
    boto3.client("cloudformation", region_name=REGION).create_stack(
        StackName="llmtrain-dev-launcher", TemplateBody=json.dumps(template)
    )
    return arn


def llmtrain(capsys, *argv: str, config_dir: Path) -> tuple[int, str, str]:
    code = main([*argv, "--config-dir", str(config_dir)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _execution(arn: str, name: str) -> dict:
    prefix, _, machine = arn.rpartition(":stateMachine:")
    return boto3.client("stepfunctions", region_name=REGION).describe_execution(
        executionArn=f"{prefix}:execution:{machine}:{name}"
    )


def _wait_until_finished(arn: str, name: str) -> dict:
    for _ in range(200):
        execution = _execution(arn, name)
        if execution["status"] != "RUNNING":
            return execution
        time.sleep(0.05)
    raise AssertionError(f"{name} still running")


def _job(name: str, status: str, *, final_metrics: bool, template: str = "gpt2-ddp") -> None:
    platform = PlatformContext.placeholder(
        environment="dev",
        account=ACCOUNT,
        region=REGION,
        resource_prefix="llmtrain-dev",
        warm_pool_cap_seconds=3600,
    )
    request = render(Catalog.load().get(template), RunInput(run_name="x"), platform)
    boto3.client("sagemaker", region_name=REGION).create_training_job(**{**request, "TrainingJobName": name})
    job = sagemaker_backends[ACCOUNT][REGION].training_jobs[name]
    job.training_job_status = job.secondary_status = status
    if not final_metrics:
        job.final_metric_data_list = []


# -- errors before anything runs ---------------------------------------------------------------------------


def test_no_credentials_is_a_clear_error(capsys, config_dir, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    code, _, err = llmtrain(capsys, "status", "r1", config_dir=config_dir)
    assert code == 2
    assert "no AWS credentials found" in err and f"account {ACCOUNT}" in err


def test_credentials_of_another_account_are_a_clear_error(capsys, aws):
    code, _, err = llmtrain(capsys, "status", "r1", config_dir=ROOT / "config")  # dev is 111111111111
    assert code == 2
    assert f"credentials are for account {ACCOUNT} but environment 'dev' is in account 111111111111" in err


def test_a_platform_not_deployed_is_a_clear_error(capsys, aws, config_dir):
    code, _, err = llmtrain(capsys, "start", "gpt2-ddp", "--run-name", "r1", config_dir=config_dir)
    assert code == 2
    assert "launcher is not deployed in environment 'dev': stack llmtrain-dev-launcher does not exist" in err
    assert "npx cdk deploy 'dev/*'" in err


# -- start, status, stop, logs -----------------------------------------------------------------------------


def test_start_sends_the_run_and_refuses_a_second_start(capsys, launcher, config_dir):
    code, out, _ = llmtrain(
        capsys, "start", "gpt2-ddp@1.0.0", "--run-name", "r1", "--set", "max_steps=5", config_dir=config_dir
    )
    assert code == 0 and "started run r1" in out and "llmtrain status r1" in out
    execution = _execution(launcher, "r1")
    sent = json.loads(execution["input"])
    assert sent == {
        "template": "gpt2-ddp",
        "version": "1.0.0",
        "run_name": "r1",
        "overrides": {"max_steps": "5"},
        "owner": sent["owner"],
    }
    assert sent["owner"].startswith(f"arn:aws:sts::{ACCOUNT}:")

    code, _, err = llmtrain(capsys, "start", "gpt2-ddp", "--run-name", "r1", config_dir=config_dir)
    assert code == 2 and "run 'r1' was already started" in err and "choose a new --run-name" in err


def test_start_wait_prints_the_summary(capsys, launcher, config_dir):
    code, out, _ = llmtrain(
        capsys,
        "start",
        "gpt2-ddp",
        "--run-name",
        "r2",
        "--wait",
        "--poll-seconds",
        "0.05",
        config_dir=config_dir,
    )
    assert code == 0
    assert "execution SUCCEEDED" in out and SUMMARY["message"] in out


def test_status_shows_the_running_job_and_its_latest_metrics(capsys, launcher, config_dir):
    llmtrain(capsys, "start", "gpt2-ddp", "--run-name", "r3", config_dir=config_dir)
    _job("llmtrain-dev-r3-a1", "Failed", final_metrics=False)
    _job("llmtrain-dev-r3-a2", "InProgress", final_metrics=False)
    host = [{"Name": "Host", "Value": "llmtrain-dev-r3-a2/algo-1"}]
    now = datetime.now(UTC)
    boto3.client("cloudwatch", region_name=REGION).put_metric_data(
        Namespace=TRAINING_METRIC_NAMESPACE,
        MetricData=[
            {
                "MetricName": "train:loss",
                "Dimensions": host,
                "Timestamp": now - timedelta(minutes=5),
                "Value": 3.5,
            },
            {"MetricName": "train:loss", "Dimensions": host, "Timestamp": now, "Value": 2.75},
        ],
    )

    code, out, _ = llmtrain(capsys, "status", "r3", config_dir=config_dir)
    assert code == 0
    assert "training job llmtrain-dev-r3-a2: InProgress" in out
    assert "attempts: 1:Failed, 2:InProgress" in out
    assert "latest metrics: train:loss=2.75" in out

    code, out, _ = llmtrain(capsys, "status", "r3", "--json", config_dir=config_dir)
    status = json.loads(out)
    assert status["job"]["name"] == "llmtrain-dev-r3-a2" and status["metrics"] == {"train:loss": 2.75}
    assert status["execution_status"] in ("RUNNING", "SUCCEEDED")


def test_status_says_where_tensorboard_follows_the_run(capsys, launcher, config_dir):
    llmtrain(capsys, "start", "gpt2-ddp", "--run-name", "r7", config_dir=config_dir)
    _job("llmtrain-dev-r7-a1", "InProgress", final_metrics=False, template="llama-pretrain-fsdp")
    code, out, _ = llmtrain(capsys, "status", "r7", config_dir=config_dir)
    uri = f"s3://llmtrain-dev-artifacts-{ACCOUNT}-{REGION}/teams/default/llama-pretrain-fsdp/x/tensorboard/"
    assert code == 0 and f"TensorBoard (live): tensorboard --logdir {uri}" in out
    code, out, _ = llmtrain(capsys, "status", "r7", "--json", config_dir=config_dir)
    assert json.loads(out)["job"]["tensorboard"] == uri


def test_status_of_a_finished_run_shows_its_summary_and_final_metrics(capsys, launcher, config_dir):
    llmtrain(capsys, "start", "gpt2-ddp", "--run-name", "r4", config_dir=config_dir)
    _wait_until_finished(launcher, "r4")
    _job("llmtrain-dev-r4-a1", "Completed", final_metrics=True)  # moto's job has a final train:progress
    code, out, _ = llmtrain(capsys, "status", "r4", config_dir=config_dir)
    assert code == 0
    assert "execution SUCCEEDED" in out and "latest metrics: train:progress=100" in out
    assert SUMMARY["message"] in out


def test_status_finds_a_run_started_under_another_execution_name(capsys, launcher, config_dir):
    boto3.client("stepfunctions", region_name=REGION).start_execution(
        stateMachineArn=launcher,
        name="from-the-console",
        input=json.dumps({"template": "gpt2-ddp", "run_name": "r5"}),
    )
    code, out, _ = llmtrain(capsys, "status", "r5", config_dir=config_dir)
    assert code == 0 and "run r5: execution" in out and "training job: none yet" in out
    code, _, err = llmtrain(capsys, "status", "nobody", config_dir=config_dir)
    assert code == 2 and "no run named 'nobody'" in err


def test_stop_stops_a_running_run_only(capsys, launcher, config_dir):
    llmtrain(capsys, "start", "gpt2-ddp", "--run-name", "held-r6", config_dir=config_dir)
    _job("llmtrain-dev-held-r6-a1", "InProgress", final_metrics=False)
    code, out, _ = llmtrain(capsys, "stop", "held-r6", config_dir=config_dir)
    assert code == 0 and "Step Functions stops training job llmtrain-dev-held-r6-a1" in out
    execution = _wait_until_finished(launcher, "held-r6")
    assert execution["status"] == "ABORTED"
    code, _, err = llmtrain(capsys, "stop", "held-r6", config_dir=config_dir)
    assert code == 2 and "run 'held-r6' is not running (its execution is ABORTED)" in err


def test_logs_print_the_latest_attempt_or_the_one_asked_for(capsys, launcher, config_dir):
    llmtrain(capsys, "start", "gpt2-ddp", "--run-name", "r7", config_dir=config_dir)
    _job("llmtrain-dev-r7-a1", "Failed", final_metrics=False)
    _job("llmtrain-dev-r7-a2", "InProgress", final_metrics=False)
    logs = boto3.client("logs", region_name=REGION)
    logs.create_log_group(logGroupName=TRAINING_LOG_GROUP)
    start = int(time.time() * 1000)
    streams = {
        "llmtrain-dev-r7-a1/algo-1-1700000000": ["first attempt"],
        "llmtrain-dev-r7-a2/algo-1-1700000100": [
            "[metrics] step=1 loss=3.0",
            "[metrics] step=2 loss=2.5",
            "done",
        ],
        "llmtrain-dev-r77-a1/algo-1-1700000200": ["another run"],
    }
    for stream, messages in streams.items():
        logs.create_log_stream(logGroupName=TRAINING_LOG_GROUP, logStreamName=stream)
        logs.put_log_events(
            logGroupName=TRAINING_LOG_GROUP,
            logStreamName=stream,
            logEvents=[{"timestamp": start + i, "message": m} for i, m in enumerate(messages)],
        )

    code, out, _ = llmtrain(capsys, "logs", "r7", "--limit", "2", config_dir=config_dir)
    assert code == 0
    assert out.splitlines() == ["[algo-1-1700000100] [metrics] step=2 loss=2.5", "[algo-1-1700000100] done"]
    code, out, _ = llmtrain(capsys, "logs", "r7", "--attempt", "1", config_dir=config_dir)
    assert out.splitlines() == ["[algo-1-1700000000] first attempt"]
    code, _, err = llmtrain(capsys, "logs", "r7", "--attempt", "9", config_dir=config_dir)
    assert code == 2 and "attempt 9 of run 'r7' has no training job yet" in err


def test_status_without_cloudwatch_access_still_shows_the_run(capsys, launcher, config_dir, monkeypatch):
    """An engineer whose policy lacks CloudWatch reads gets the rest of the status and a note why."""
    llmtrain(capsys, "start", "gpt2-ddp", "--run-name", "r8", config_dir=config_dir)
    _job("llmtrain-dev-r8-a1", "InProgress", final_metrics=False)

    def denied(self, job_name):
        raise ClientError(
            {"Error": {"Code": "AccessDenied", "Message": "not authorized: GetMetricData"}}, "GetMetricData"
        )

    monkeypatch.setattr(LauncherClient, "latest_metrics", denied)
    code, out, _ = llmtrain(capsys, "status", "r8", config_dir=config_dir)
    assert code == 0 and "training job llmtrain-dev-r8-a1: InProgress" in out
    assert "latest metrics unavailable: reading CloudWatch: access denied" in out
