"""`llmtrain tune` in the cloud and `llmtrain models ls` against moto (the environment's record in SSM,
its datasets, JumpStart's recorded catalogue), and a tune's status with its trials: moto has no
ListTrainingJobsForHyperParameterTuningJob, so botocore's Stubber answers it in SageMaker's shape."""

from __future__ import annotations

import dataclasses
import datetime
import json

import boto3
import pytest
from botocore.stub import Stubber
from deployed_support import (
    ACCOUNT,
    PREFIX,
    REGION,
    TEAM_URI,
    TRAIN,
    deploy_environment,
    moto_credentials,
    team_access,
)
from moto import mock_aws
from test_jumpstart import put_jumpstart_catalogue

from llmtrain.cli import main
from llmtrain.client.run_views import RunStatus
from llmtrain.commands.launch import format_status
from llmtrain.core.queue_context import TeamQueues
from llmtrain.core.tuning import ParamRange, TuneSpec
from llmtrain.core.validate import input_problems, shape_problems
from llmtrain.lifecycle.tuning_jobs import tune_trials

VALIDATION = f"channels.validation={TEAM_URI}tiny/validation/"
TUNE = (
    "--param",
    "lr=1e-5..1e-3:log",
    "--param",
    "warmup_steps=10..200:int",
    "--objective",
    "eval:loss",
    "--trials",
    "6",
    "--parallel",
    "2",
)


@pytest.fixture
def environment(monkeypatch):
    moto_credentials(monkeypatch)
    with mock_aws():
        arn = f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:llmtrain-dev-default-launcher"
        deploy_environment(arn, teams=[team_access(arn, run_budget_usd=10.0)])
        yield arn


def llmtrain(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_dry_run_prints_the_tuning_request_valid_against_botocore(capsys, environment):
    code, out, err = llmtrain(
        capsys,
        "tune",
        "gpt2-ddp",
        "--run-name",
        "lr-1",
        *TUNE,
        "--set",
        TRAIN,
        "--set",
        VALIDATION,
        "--dry-run",
        "--json",
    )
    assert code == 0, err
    request = json.loads(out)
    assert input_problems("sagemaker", "CreateHyperParameterTuningJob", request) == []
    assert request["HyperParameterTuningJobName"] == f"{PREFIX}-lr-1-t1"
    assert (
        request["TrainingJobDefinition"]["RoleArn"]
        == f"arn:aws:iam::{ACCOUNT}:role/llmtrain-dev-default-execution"
    )
    assert "tune: up to 6 trials" in err and "nothing started" in err


def test_a_tune_above_the_budget_or_without_its_objectives_data_is_refused(capsys, environment):
    code, _, err = llmtrain(
        capsys,
        "tune",
        "gpt2-ddp",
        "--run-name",
        "lr-2",
        *TUNE,
        "--set",
        TRAIN,
        "--set",
        VALIDATION,
        "--set",
        "max_steps=34000",
        "--dry-run",
    )
    # One trial ($3) is within the team's $10, six are not.
    assert code == 2 and "6 trials x $3 per trial" in err and "budget of $10" in err
    code, _, err = llmtrain(
        capsys, "tune", "gpt2-ddp", "--run-name", "lr-3", *TUNE, "--set", TRAIN, "--dry-run"
    )
    assert code == 2 and "channels.validation" in err
    code, _, err = llmtrain(
        capsys, "tune", "gpt2-ddp", "--run-name", "lr-4", "--param", "lr=1..2", "--set", TRAIN, "--dry-run"
    )
    assert code == 2 and "above the maximum" in err


def test_a_tune_is_refused_where_the_environment_queues_its_jobs(capsys, monkeypatch):
    moto_credentials(monkeypatch)
    queues = TeamQueues(queue_arns={"standard": f"arn:aws:batch:{REGION}:{ACCOUNT}:job-queue/standard"},
                        default_queue="standard", share_identifier="default", max_priority=0, max_instances=4,
                        capacity_wait_seconds=3600)
    with mock_aws():
        arn = f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:llmtrain-dev-default-launcher"
        deploy_environment(arn, teams=[team_access(arn, queues=queues)])
        code, _, err = llmtrain(capsys, "tune", "gpt2-ddp", "--run-name", "lr-1", *TUNE, "--set", TRAIN,
                                "--set", VALIDATION, "--dry-run")
    assert code == 2 and "tuning jobs cannot be queued" in err, err


def test_a_tune_starts_an_execution_with_its_search(capsys, monkeypatch):
    moto_credentials(monkeypatch)
    with mock_aws():
        sfn = boto3.client("stepfunctions", region_name=REGION)
        arn = sfn.create_state_machine(
            name="llmtrain-dev-default-launcher",
            roleArn=f"arn:aws:iam::{ACCOUNT}:role/x",
            definition=json.dumps({"StartAt": "S", "States": {"S": {"Type": "Succeed"}}}),
        )["stateMachineArn"]
        deploy_environment(arn)
        code, out, err = llmtrain(
            capsys, "tune", "gpt2-ddp", "--run-name", "lr-5", *TUNE, "--set", TRAIN, "--set", VALIDATION
        )
        assert code == 0, err
        (execution,) = sfn.list_executions(stateMachineArn=arn)["executions"]
        sent = json.loads(sfn.describe_execution(executionArn=execution["executionArn"])["input"])
    assert TuneSpec.from_dict(sent["tune"]).params[0] == ParamRange.parse("lr=1e-5..1e-3:log")
    assert sent["run_name"] == "lr-5" and "started tune lr-5" in out


def test_a_tunes_status_lists_its_trials_and_the_best_ones_start_line():
    client = boto3.client("sagemaker", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    created = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    summaries = [
        {
            "TrainingJobName": f"{PREFIX}-lr-1-t1-00{n}-abcdef0{n}",
            "TrainingJobArn": f"arn:aws:sagemaker:{REGION}:"
            f"{ACCOUNT}:training-job/{PREFIX}-lr-1-t1-00{n}-abcdef0{n}",
            "CreationTime": created + datetime.timedelta(n),
            "TrainingJobStatus": status,
            "TunedHyperParameters": {"lr": lr},
            **(
                {"FinalHyperParameterTuningJobObjectiveMetric": {"MetricName": "eval:loss", "Value": value}}
                if value is not None
                else {}
            ),
        }
        for n, (status, lr, value) in enumerate(
            [("Completed", "0.0001", 3.5), ("Stopped", "1e-05", None), ("Completed", "0.0004", 2.75)], start=1
        )
    ]
    with Stubber(client) as stub:
        stub.add_response(
            "list_training_jobs_for_hyper_parameter_tuning_job",
            {"TrainingJobSummaries": summaries},
            {"HyperParameterTuningJobName": f"{PREFIX}-lr-1-t1"},
        )
        trials = tune_trials(client, f"{PREFIX}-lr-1-t1")
    tune = TuneSpec(params=(ParamRange.parse("lr=1e-5..1e-3:log"),), objective="eval:loss", trials=6)
    status = RunStatus(
        run_name="lr-1",
        execution_arn="arn",
        execution_status="RUNNING",
        started="2026-01-01",
        stopped=None,
        summary=None,
        error=None,
        cause=None,
        run_input={
            "template": "gpt2-ddp",
            "version": "1.2.0",
            "overrides": {"max_steps": "100"},
            "tune": tune.to_dict(),
        },
        tuning={"name": f"{PREFIX}-lr-1-t1", "status": "InProgress", "trials": [t.to_dict() for t in trials]},
    )
    text = format_status(status)
    assert "3 of 6 trials (minimize eval:loss)" in text
    assert "Stopped eval:loss=- lr=1e-05" in text
    assert f"best trial: {PREFIX}-lr-1-t1-003-abcdef03" in text
    assert "llmtrain start gpt2-ddp@1.2.0 --run-name lr-1-best --set max_steps=100 --set lr=0.0004" in text
    # A tune that failed is started again, its next tuning job, by the same `llmtrain tune`.
    failed = format_status(dataclasses.replace(status, execution_status="FAILED"))
    again = ("llmtrain tune gpt2-ddp@1.2.0 --run-name lr-1 --param lr=1e-05..0.001:log --objective eval:loss "
             "--trials 6 --parallel 1 --set max_steps=100")
    assert again in failed and "llmtrain start gpt2-ddp@1.2.0 --run-name lr-1 " not in failed


def test_models_ls_lists_jumpstarts_trainable_text_models(capsys, environment):
    put_jumpstart_catalogue()
    code, out, err = llmtrain(capsys, "models", "ls", "--json")
    assert code == 0, err
    assert [m["model_id"] for m in json.loads(out)] == [
        "huggingface-llm-falcon-7b-bf16",
        "huggingface-textgeneration-gpt2",
        "meta-textgeneration-llama-2-7b",
    ]
    code, _, err = llmtrain(capsys, "models", "ls", "--template", "llama-pretrain-fsdp")
    assert code == 2 and "trains from scratch" in err and "llama-finetune-lora" in err


def test_start_resolves_a_jumpstart_base_model_in_the_environments_region(capsys, environment):
    put_jumpstart_catalogue()
    base = ("--set", "base_model=meta-textgeneration-llama-2-7b")
    code, _, err = llmtrain(
        capsys, "start", "llama-finetune-lora", "--run-name", "ft-1", *base, "--set", TRAIN, "--dry-run"
    )
    assert code == 2 and "gated model" in err and "llamaEula.txt" in err and "accept_eula=true" in err
    accepted = ("--set", "accept_eula=true", "--set", "max_steps=10", "--set", TRAIN)
    code, out, err = llmtrain(
        capsys, "start", "llama-finetune-lora", "--run-name", "ft-1", *base, *accepted, "--dry-run"
    )
    assert code == 0, err
    request = json.loads(out)
    (model,) = [c for c in request["InputDataConfig"] if c["ChannelName"] == "model"]
    assert model["DataSource"]["S3DataSource"]["ModelAccessConfig"] == {"AcceptEula": True}
    assert model["DataSource"]["S3DataSource"]["S3Uri"].startswith(
        f"s3://jumpstart-private-cache-prod-{REGION}/"
    )
    assert shape_problems(request) == []
