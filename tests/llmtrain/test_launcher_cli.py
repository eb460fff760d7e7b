"""`llmtrain start | status | stop | logs | runs` against moto: the environment's record in SSM (what
DeployedEnvironmentRecord writes), its launcher state machine, the datasets bucket, training jobs,
their metrics and logs, all in moto. The state machine here is a small stand-in; the real
definition, started by the CLI, runs in test_cli_deployed.py (and test_launcher_state_machine.py)."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import boto3
import pytest
from botocore.exceptions import ClientError
from deployed_support import (
    ACCOUNT,
    BUCKET,
    DATASET,
    PREFIX,
    REGION,
    TEAM_URI,
    TRAIN,
    deploy_environment,
    moto_credentials,
    put_dataset,
    put_shards,
    team_access,
)
from moto import mock_aws
from moto.sagemaker.models import sagemaker_backends

from llmtrain.cli import main
from llmtrain.client.job_telemetry import TRAINING_LOG_GROUP, TRAINING_METRIC_NAMESPACE
from llmtrain.client.launcher import LauncherClient
from llmtrain.core.catalog import Catalog
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.team_context import placeholder_context

GPT2 = Catalog.load().latest("gpt2-ddp").ref  # what `gpt2-ddp` (no version) resolves to
GPT2_VERSIONS = ", ".join(Catalog.load().versions("gpt2-ddp"))
SUMMARY = {"status": "Completed", "message": f"Run done ({GPT2}): Completed\nAttempts: 1"}
REJECTION = "run input rejected before any training job was created: quota 'x' is 0"
# Runs named held-* wait, so they can be stopped; a run with seed 13 is rejected; the others end at
# once with SUMMARY.
DEFINITION = {
    "StartAt": "Hold",
    "States": {
        "Hold": {
            "Type": "Choice",
            "Choices": [
                {"Variable": "$.run_name", "StringMatches": "held-*", "Next": "Wait"},
                {
                    "And": [
                        {"Variable": "$.overrides.seed", "IsPresent": True},
                        {"Variable": "$.overrides.seed", "StringEquals": "13"},
                    ],
                    "Next": "Reject",
                },
            ],
            "Default": "Summary",
        },
        "Wait": {"Type": "Wait", "Seconds": 600, "Next": "Summary"},
        "Reject": {"Type": "Fail", "Error": "InvalidRunInput", "Cause": REJECTION},
        "Summary": {"Type": "Pass", "Result": SUMMARY, "End": True},
    },
}


@pytest.fixture
def aws(monkeypatch):
    moto_credentials(monkeypatch)
    with mock_aws(config={"stepfunctions": {"execute_state_machine": True}}):
        yield


@pytest.fixture
def launcher(aws) -> str:
    """Environment dev deployed in moto; returns its launcher's state machine ARN."""
    arn = boto3.client("stepfunctions", region_name=REGION).create_state_machine(
        name="llmtrain-dev-default-launcher",
        definition=json.dumps(DEFINITION),
        roleArn=f"arn:aws:iam::{ACCOUNT}:role/launcher",
    )["stateMachineArn"]
    deploy_environment(arn)
    return arn


def llmtrain(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def start(capsys, run_name: str, *sets: str, ref: str = "gpt2-ddp", options=()) -> tuple[int, str, str]:
    # The default train channel stands unless the test gives its own (a --set key is given once).
    given = {setting.partition("=")[0] for setting in sets}
    defaults = [] if "channels.train" in given else [TRAIN]
    settings = [item for setting in (*defaults, *sets) for item in ("--set", setting)]
    return llmtrain(capsys, "start", ref, "--run-name", run_name, *settings, *options)


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


def _job(
    name: str, status: str, *, final_metrics: bool, template: str = "gpt2-ddp", billable: int = 0,
    failure_reason: str | None = None,
) -> None:
    platform = placeholder_context(
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
    job.billable_time_in_seconds = billable
    job.failure_reason = failure_reason
    if not final_metrics:
        job.final_metric_data_list = []


def _no_credentials(monkeypatch, tmp_path) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)


# -- errors a person can act on ----------------------------------------------------------------------------


def test_no_credentials_is_a_clear_error(capsys, monkeypatch, tmp_path):
    _no_credentials(monkeypatch, tmp_path)
    code, _, err = llmtrain(capsys, "status", "r1")
    assert code == 1
    assert "no AWS credentials found" in err and "aws sso login" in err and "Traceback" not in err


def test_an_unknown_profile_is_a_clear_error(capsys, monkeypatch, tmp_path):
    _no_credentials(monkeypatch, tmp_path)
    code, _, err = llmtrain(capsys, "runs", "--profile", "ml-sandbox")
    assert code == 1 and "AWS profile 'ml-sandbox' is not configured" in err
    monkeypatch.setenv("AWS_PROFILE", "typo")
    code, _, err = llmtrain(capsys, "data", "ls")
    assert code == 1 and "AWS profile 'typo' is not configured" in err


def test_no_network_is_told_apart_from_refused_credentials(capsys, monkeypatch):
    """Nothing listens on the endpoint: the message is about the network, not the credentials."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEEXAMPLE00")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the discard port: refused at once
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    code, _, err = llmtrain(capsys, "status", "r1")
    assert code == 1
    assert "cannot reach AWS" in err and "your credentials were not checked" in err


def test_refused_credentials_are_told_apart_from_no_network(capsys, aws):
    """moto checks signatures once authentication is on: unknown keys are refused as AWS does."""
    from moto.core import set_initial_no_auth_action_count

    run = set_initial_no_auth_action_count(0)(lambda: llmtrain(capsys, "status", "r1"))
    code, _, err = run()
    assert code == 1
    assert "AWS refused your credentials (InvalidClientTokenId" in err and "refresh them" in err


def test_an_environment_not_deployed_is_a_clear_error(capsys, aws):
    code, _, err = llmtrain(capsys, "status", "r1", "--env", "prod")
    assert code == 2
    assert "environment 'prod' is not deployed in this account's region us-east-1" in err
    assert "nothing under /llmtrain/prod/" in err


def test_a_record_from_a_newer_platform_asks_for_an_upgrade(capsys, launcher):
    ssm = boto3.client("ssm", region_name=REGION)
    record = json.loads(ssm.get_parameter(Name="/llmtrain/dev/environment")["Parameter"]["Value"])
    record["schema_version"] = 99
    ssm.put_parameter(
        Name="/llmtrain/dev/environment", Value=json.dumps(record), Overwrite=True, Type="String"
    )
    code, _, err = llmtrain(capsys, "runs")
    assert code == 2 and "record schema 99" in err and "upgrade llmtrain" in err


# -- start: checked here first, then against the environment -------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["gpt2-ddp@1.1.1"], f"has no version '1.1.1'; available: {GPT2_VERSIONS}"),
        (
            ["gpt2-ddp", "--set", "max_step=5"],
            f"override 'max_step': {GPT2} does not allow overriding it (did you mean 'max_steps'?)",
        ),
        (["gpt2-ddp", "--set", "max_steps=0"], "0 is below the minimum 1"),
        (["gpt2-ddp", "--set", "channels.train=tokens/"], "must be an S3 URI"),
    ],
)
def test_start_refuses_bad_input_before_any_aws_call(capsys, monkeypatch, tmp_path, argv, message):
    """No credentials at all: the run's own mistakes are found first (exit 2, what to fix)."""
    _no_credentials(monkeypatch, tmp_path)
    code, out, err = llmtrain(capsys, "start", *argv, "--run-name", "r1")
    assert code == 2 and out == ""
    assert message in err
    assert "credentials" not in err


def test_a_template_llmtrain_does_not_ship_is_looked_up_in_the_environment(capsys, monkeypatch, tmp_path):
    """It may be a team's own (the environment's record carries those); where the record cannot be
    read, the name is unknown here first, with its "did you mean", then why AWS could not tell."""
    _no_credentials(monkeypatch, tmp_path)
    code, out, err = llmtrain(capsys, "start", "gpt2-dp", "--run-name", "r1")
    assert code == 2 and out == ""
    assert err.startswith("llmtrain start: error: unknown template 'gpt2-dp' (did you mean 'gpt2-ddp'?)")
    assert "nor could the deployed environment, which lists your team's own templates, be read" in err
    assert "credentials" in err


def test_start_sends_the_run_as_execution_run_1(capsys, launcher):
    code, out, _ = start(capsys, "r1", "max_steps=5", ref="gpt2-ddp@1.0.0")
    assert code == 0 and "started run r1 (gpt2-ddp@1.0.0)" in out and "llmtrain status r1 --env dev" in out
    execution = _execution(launcher, "r1-1")
    sent = json.loads(execution["input"])
    assert sent == {
        "template": "gpt2-ddp",
        "version": "1.0.0",
        "run_name": "r1",
        "overrides": {"channels.train": f"{TEAM_URI}{DATASET}/train/", "max_steps": "5"},
        "owner": sent["owner"],
    }
    assert sent["owner"].startswith(f"arn:aws:sts::{ACCOUNT}:")


def test_start_sends_the_version_it_checked(capsys, launcher):
    code, _, _ = start(capsys, "r0")
    assert code == 0
    assert (
        json.loads(_execution(launcher, "r0-1")["input"])["version"]
        == Catalog.load().latest("gpt2-ddp").version
    )


def test_start_refuses_a_run_in_progress_or_completed(capsys, launcher):
    assert start(capsys, "held-r1")[0] == 0
    code, _, err = start(capsys, "held-r1")
    assert (
        code == 2
        and "run 'held-r1' is running (execution held-r1-1" in err
        and "choose a new --run-name" in err
    )

    assert start(capsys, "r2")[0] == 0
    _wait_until_finished(launcher, "r2-1")
    code, _, err = start(capsys, "r2")
    assert code == 2 and "run 'r2' already completed (execution r2-1)" in err


def test_a_rejected_run_is_started_again_under_its_name(capsys, launcher):
    """The rejection used execution r3-1; the run name is not used up: the next start is r3-2."""
    assert start(capsys, "r3", "seed=13")[0] == 0
    rejected = _wait_until_finished(launcher, "r3-1")
    assert rejected["status"] == "FAILED" and rejected["error"] == "InvalidRunInput"

    code, out, _ = llmtrain(capsys, "status", "r3")
    assert code == 0 and "execution FAILED" in out and REJECTION in out
    assert (
        f"continue this run under its name (it resumes from its latest checkpoint): llmtrain start "
        f"{GPT2} --run-name r3 --set channels.train={TEAM_URI}{DATASET}/train/ --set seed=13 "
        "--env dev"
    ) in out

    code, out, _ = start(capsys, "r3", "seed=14")
    assert code == 0 and "continuing run r3: its last execution r3-1 ended FAILED" in out
    assert _wait_until_finished(launcher, "r3-2")["status"] == "SUCCEEDED"
    code, out, _ = llmtrain(capsys, "status", "r3")
    assert "executions: r3-1, r3-2" in out and "execution SUCCEEDED" in out and "continue this run" not in out


def test_start_refuses_channels_outside_the_teams_datasets_or_empty(capsys, launcher):
    code, _, err = start(capsys, "r4", f"channels.validation=s3://{BUCKET}/tokens/tiny/validation/")
    assert code == 2
    assert f"'s3://{BUCKET}/tokens/tiny/validation/' is outside team 'default''s datasets prefix" in err

    code, _, err = start(capsys, "r4", f"channels.validation={TEAM_URI}tiyn/validation/")
    assert code == 2
    assert f"channel validation: nothing at {TEAM_URI}tiyn/validation/ (did you mean 'tiny'?)" in err
    assert "llmtrain data upload DIR --name NAME" in err
    assert not boto3.client("stepfunctions", region_name=REGION).list_executions(stateMachineArn=launcher)[
        "executions"
    ]


@pytest.mark.parametrize(
    ("escape", "problem"),
    [("../other/tokens/", "the path segment '..'"), ("./../other/", "the path segment '.'"),
     ("%2e%2e/other/", "a percent sign"), (f"{DATASET}/train/ ", "holds SPACE")],
)
def test_start_and_render_refuse_a_channel_that_leaves_the_teams_prefix(capsys, launcher, escape, problem):
    """Issue 25: these start with the team's datasets prefix, so they passed `start` and the launcher."""
    put_dataset(DATASET, team="other")
    code, out, err = start(capsys, "r5", f"channels.validation={TEAM_URI}{escape}")
    assert code == 2 and out == ""
    assert "override 'channels.validation'" in err and problem in err
    assert not boto3.client("stepfunctions", region_name=REGION).list_executions(stateMachineArn=launcher)[
        "executions"
    ]
    code, out, err = llmtrain(capsys, "render", "gpt2-ddp", "--run-name", "r5", "--env", "dev",
                              "--set", f"channels.validation={TEAM_URI}{escape}")
    assert code == 2 and out == "" and problem in err


def test_start_checks_the_channels_manifests_as_the_job_will_load_them(capsys, launcher):
    """What the job would fail on once its instances are up is refused before anything starts: the
    dataset's top folder as the train channel, a manifest that is not one, a missing shard, a
    validation split too small for one evaluation step, data of another tokenizer than the job's."""
    executions = boto3.client("stepfunctions", region_name=REGION).list_executions
    code, _, err = start(capsys, "r5", f"channels.train={TEAM_URI}{DATASET}/")
    assert code == 2
    assert (f"channel train: {TEAM_URI}{DATASET}/ holds no manifest.json but the split folder(s) train/, "
            f"validation/ of a prepared dataset: give each split as its own channel (train -> "
            f"{TEAM_URI}{DATASET}/train/ and validation -> {TEAM_URI}{DATASET}/validation/)") in err

    s3 = boto3.client("s3", region_name=REGION)
    s3.put_object(Bucket=BUCKET, Key="teams/default/broken/manifest.json", Body=b"{}")
    code, _, err = start(capsys, "r5", f"channels.train={TEAM_URI}broken/")
    assert code == 2 and f"{TEAM_URI}broken/manifest.json is not a manifest of token shards" in err

    put_shards("teams/default/short/")
    s3.delete_object(Bucket=BUCKET, Key="teams/default/short/shard_00000.bin")
    code, _, err = start(capsys, "r5", f"channels.train={TEAM_URI}short/")
    assert code == 2 and f"{TEAM_URI}short/shard_00000.bin, listed in its manifest, is missing" in err

    # gpt2-ddp: 4 GPUs x micro_batch_size 32 = 128 samples of 129 tokens per evaluation step
    put_shards("teams/default/small/", tokens=129 * 100)
    code, _, err = start(capsys, "r5", f"channels.validation={TEAM_URI}small/")
    assert code == 2
    assert (f"channel validation ({TEAM_URI}small/) holds 100 sample(s) of seq_len + 1 = 129 tokens, and one "
            "evaluation step takes 128 (data-parallel ranks x micro_batch_size)") in err

    put_shards("teams/default/llama-tokens/", vocab_size=32000, eos_token_id=2)
    code, _, err = start(capsys, "r5", f"channels.train={TEAM_URI}llama-tokens/")
    assert code == 2
    assert ("was made with a tokenizer of 32000 tokens (end-of-sequence id 2), but the job reads it with "
            "the training program's shipped tokenizer (the run has no tokenizer channel), 629 tokens") in err
    code, _, err = start(capsys, "r5", f"channels.train={TEAM_URI}llama-tokens/",
                         f"channels.tokenizer={TEAM_URI}llama-tokens/")
    assert code == 2 and f"channel tokenizer: {TEAM_URI}llama-tokens/ holds no tokenizer" in err
    assert not executions(stateMachineArn=launcher)["executions"]

    s3.put_object(Bucket=BUCKET, Key="teams/default/llama-tokenizer/tokenizer.json", Body=b"{}")
    code, _, err = start(capsys, "r5", f"channels.train={TEAM_URI}llama-tokens/",
                         f"channels.tokenizer={TEAM_URI}llama-tokenizer/")
    assert code == 0, err  # the job checks the data against the tokenizer it loads
    assert [e["name"] for e in executions(stateMachineArn=launcher)["executions"]] == ["r5-1"]


def test_the_templates_default_channels_lie_in_the_teams_datasets(capsys, launcher):
    """Without channels.train a run reads the template's default prefix, under the team's datasets:
    refused while it is empty, started once the team has uploaded data there."""
    template = Catalog.load().latest("gpt2-ddp")
    default = template.inputs.channels["train"]
    code, _, err = llmtrain(capsys, "start", "gpt2-ddp", "--run-name", "r4")
    assert code == 2 and f"channel train: nothing at {TEAM_URI}{default}" in err

    put_shards(f"teams/default/{default}")
    code, out, err = llmtrain(capsys, "start", "gpt2-ddp", "--run-name", "r4")
    assert code == 0, err
    assert json.loads(_execution(launcher, "r4-1")["input"])["overrides"] == {}


def test_start_refuses_a_template_the_environment_or_team_does_not_offer(capsys, aws):
    arn = boto3.client("stepfunctions", region_name=REGION).create_state_machine(
        name="llmtrain-dev-default-launcher",
        definition=json.dumps(DEFINITION),
        roleArn=f"arn:aws:iam::{ACCOUNT}:role/x",
    )["stateMachineArn"]
    deploy_environment(
        arn, enabled=["gpt2-ddp", "byo-script"], teams=[team_access(arn, allowed_templates=["gpt2-ddp"])]
    )
    code, _, err = start(capsys, "r5", ref="llama-pretrain-fsdp")
    assert code == 2 and "template 'llama-pretrain-fsdp' is not enabled in environment 'dev'" in err
    code, _, err = start(capsys, "r5", ref="byo-script")
    assert code == 2 and "team 'default': template 'byo-script' is not one of its templates (gpt2-ddp)" in err
    code, _, err = start(capsys, "r5", options=("--team", "nlp"))
    assert code == 2 and "environment 'dev' has no team 'nlp'; its teams: default" in err


def test_start_on_an_environment_of_several_teams_goes_to_the_teams_launcher(capsys, aws):
    stepfunctions = boto3.client("stepfunctions", region_name=REGION)
    arns = {
        team: stepfunctions.create_state_machine(
            name=f"llmtrain-dev-{team}-launcher",
            definition=json.dumps(DEFINITION),
            roleArn=f"arn:aws:iam::{ACCOUNT}:role/x",
        )["stateMachineArn"]
        for team in ("default", "nlp")
    }
    deploy_environment(
        arns["default"],
        teams=[
            team_access(arns["default"]),
            team_access(arns["nlp"], team="nlp", allowed_instance_types=("ml.g5.12xlarge",)),
        ],
    )
    code, _, err = start(capsys, "r9")
    assert code == 2 and "environment 'dev' has several teams (default, nlp): choose yours with --team" in err
    code, _, err = start(capsys, "r9", options=("--team", "NLP"))
    assert code == 2 and "--team 'NLP' is not a team name" in err
    code, _, err = start(capsys, "r9", options=("--team", "nlp"))  # team default's data
    assert code == 2 and "is outside team 'nlp''s datasets prefix" in err

    put_dataset("tiny", team="nlp")
    nlp_train = f"channels.train=s3://{BUCKET}/teams/nlp/tiny/train/"
    code, _, err = llmtrain(
        capsys, "start", "gpt2-ddp", "--run-name", "r9", "--set", nlp_train, "--set",
        "instance_type=ml.p4d.24xlarge", "--team", "nlp",
    )
    assert code == 2 and "team 'nlp': instance type ml.p4d.24xlarge is not one of its instance types" in err
    nlp_run = ("start", "gpt2-ddp", "--run-name", "r9", "--set", nlp_train, "--team", "nlp")
    code, out, _ = llmtrain(capsys, *nlp_run)
    assert code == 0 and "llmtrain status r9 --env dev --team nlp" in out
    assert _execution(arns["nlp"], "r9-1")["status"] in ("RUNNING", "SUCCEEDED")
    assert not stepfunctions.list_executions(stateMachineArn=arns["default"])["executions"]
    code, out, _ = llmtrain(capsys, *nlp_run, "--dry-run")
    assert json.loads(out)["TrainingJobName"] == "llmtrain-dev-nlp-r9-a1"


def test_start_plans_the_run_as_the_launcher_would_before_starting_it(capsys, aws):
    """The team's budget (its platform context's run_budget_usd) and the fit check refuse a run before
    any execution; --skip-plan-check starts one planned not to fit, and says so in the input."""
    arn = boto3.client("stepfunctions", region_name=REGION).create_state_machine(
        name="llmtrain-dev-default-launcher",
        definition=json.dumps(DEFINITION),
        roleArn=f"arn:aws:iam::{ACCOUNT}:role/x",
    )["stateMachineArn"]
    deploy_environment(arn, teams=[team_access(arn, run_budget_usd=10.0)])
    code, _, err = start(capsys, "r10", "max_steps=200000")
    assert code == 2 and "above team 'default''s budget of $10 per run" in err
    assert ("(TeamSpec.max_run_cost_usd in a CDK app of llmtrain-constructs; teams.default.max_run_cost_usd, "
            "else budgets.max_run_cost_usd in the platform's config/<env>.yaml)") in " ".join(err.split())
    too_big = ("model_preset=gpt2-medium", "seq_len=1024", "micro_batch_size=16")
    code, _, err = start(capsys, "r10", *too_big)
    assert code == 2 and "planned not to fit" in err and "skip_plan_check" in err
    assert not boto3.client("stepfunctions", region_name=REGION).list_executions(stateMachineArn=arn)[
        "executions"
    ]

    code, out, err = start(capsys, "r10", *too_big, options=("--skip-plan-check",))
    assert code == 0 and "plan: DOES NOT FIT" in err
    assert json.loads(_execution(arn, "r10-1")["input"])["skip_plan_check"] is True
    code, _, err = start(capsys, "r11")
    assert code == 0 and "plan: fits" in err
    assert "skip_plan_check" not in json.loads(_execution(arn, "r11-1")["input"])


def test_start_dry_run_prints_the_request_and_starts_nothing(capsys, launcher):
    code, out, err = llmtrain(capsys, "start", "gpt2-ddp", "--run-name", "r6", "--set", TRAIN, "--dry-run")
    assert code == 0 and "passed every check; nothing started" in err
    request = json.loads(out)
    assert request["TrainingJobName"] == f"{PREFIX}-r6-a1"
    assert request["RoleArn"] == f"arn:aws:iam::{ACCOUNT}:role/llmtrain-dev-default-execution"
    assert not boto3.client("stepfunctions", region_name=REGION).list_executions(stateMachineArn=launcher)[
        "executions"
    ]


def test_start_wait_prints_the_summary(capsys, launcher):
    code, out, _ = start(capsys, "r7", options=("--wait", "--poll-seconds", "0.05"))
    assert code == 0
    assert "execution SUCCEEDED" in out and SUMMARY["message"] in out


# -- status, stop, logs -------------------------------------------------------------------------------------


def test_status_shows_the_running_job_and_its_latest_metrics(capsys, launcher):
    start(capsys, "r3")
    _job(f"{PREFIX}-r3-a1", "Failed", final_metrics=False)
    _job(f"{PREFIX}-r3-a2", "InProgress", final_metrics=False)
    host = [{"Name": "Host", "Value": f"{PREFIX}-r3-a2/algo-1"}]
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

    code, out, _ = llmtrain(capsys, "status", "r3")
    assert code == 0
    assert f"training job {PREFIX}-r3-a2: InProgress" in out
    assert "attempts: 1:Failed, 2:InProgress" in out
    assert "latest metrics: train:loss=2.75" in out

    code, out, _ = llmtrain(capsys, "status", "r3", "--json")
    status = json.loads(out)
    assert status["job"]["name"] == f"{PREFIX}-r3-a2" and status["metrics"] == {"train:loss": 2.75}
    assert status["executions"] == ["r3-1"] and status["run_input"]["template"] == "gpt2-ddp"


def test_status_says_what_a_rule_stop_of_the_training_program_means(capsys, launcher):
    start(capsys, "r12")
    reason = ("AlgorithmError: RuleTriggered: loss_spike at step 120: loss 9.1 is above 3 x its running mean "
              "2.9 (action stop)")
    _job(f"{PREFIX}-r12-a1", "Failed", final_metrics=False, failure_reason=reason)
    code, out, _ = llmtrain(capsys, "status", "r12")
    assert code == 0
    assert f"  failure reason: {reason}" in out
    assert "  what it means: a rule of the training program stopped the run" in out


def test_status_says_where_tensorboard_follows_the_run(capsys, launcher):
    start(capsys, "r7")
    _job(f"{PREFIX}-r7-a1", "InProgress", final_metrics=False, template="llama-pretrain-fsdp")
    code, out, _ = llmtrain(capsys, "status", "r7")
    uri = f"s3://llmtrain-dev-artifacts-{ACCOUNT}-{REGION}/teams/default/llama-pretrain-fsdp/x/tensorboard/"
    assert code == 0 and f"TensorBoard (live): tensorboard --logdir {uri}" in out


def test_status_of_a_finished_run_shows_its_summary_and_final_metrics(capsys, launcher):
    start(capsys, "r4")
    _wait_until_finished(launcher, "r4-1")
    _job(f"{PREFIX}-r4-a1", "Completed", final_metrics=True)  # moto's job has a final train:progress
    code, out, _ = llmtrain(capsys, "status", "r4")
    assert code == 0
    assert "execution SUCCEEDED" in out and "latest metrics: train:progress=100" in out
    assert SUMMARY["message"] in out


def test_status_finds_a_run_started_under_another_execution_name(capsys, launcher):
    boto3.client("stepfunctions", region_name=REGION).start_execution(
        stateMachineArn=launcher,
        name="from-the-console",
        input=json.dumps({"template": "gpt2-ddp", "run_name": "r5"}),
    )
    code, out, _ = llmtrain(capsys, "status", "r5")
    assert code == 0 and "run r5: execution" in out and "training job: none yet" in out
    code, _, err = llmtrain(capsys, "status", "r55")
    assert code == 2 and "no run named 'r55'" in err and "llmtrain runs" in err


def test_stop_stops_a_running_run_only(capsys, launcher):
    start(capsys, "held-r6")
    _job(f"{PREFIX}-held-r6-a1", "InProgress", final_metrics=False)
    code, out, _ = llmtrain(capsys, "stop", "held-r6")
    assert code == 0 and f"Step Functions stops training job {PREFIX}-held-r6-a1" in out
    assert _wait_until_finished(launcher, "held-r6-1")["status"] == "ABORTED"
    code, _, err = llmtrain(capsys, "stop", "held-r6")
    assert code == 2 and "run 'held-r6' is not running (its execution is ABORTED)" in err


def test_logs_print_the_latest_attempt_or_the_one_asked_for(capsys, launcher):
    start(capsys, "r7")
    _job(f"{PREFIX}-r7-a1", "Failed", final_metrics=False)
    _job(f"{PREFIX}-r7-a2", "InProgress", final_metrics=False)
    logs = boto3.client("logs", region_name=REGION)
    logs.create_log_group(logGroupName=TRAINING_LOG_GROUP)
    begin = int(time.time() * 1000)
    streams = {
        f"{PREFIX}-r7-a1/algo-1-1700000000": ["first attempt"],
        f"{PREFIX}-r7-a2/algo-1-1700000100": [
            "[metrics] step=1 loss=3.0",
            "[metrics] step=2 loss=2.5",
            "done",
        ],
        f"{PREFIX}-r77-a1/algo-1-1700000200": ["another run"],
    }
    for stream, messages in streams.items():
        logs.create_log_stream(logGroupName=TRAINING_LOG_GROUP, logStreamName=stream)
        logs.put_log_events(
            logGroupName=TRAINING_LOG_GROUP,
            logStreamName=stream,
            logEvents=[{"timestamp": begin + i, "message": m} for i, m in enumerate(messages)],
        )

    code, out, _ = llmtrain(capsys, "logs", "r7", "--limit", "2")
    assert code == 0
    assert out.splitlines() == ["[algo-1-1700000100] [metrics] step=2 loss=2.5", "[algo-1-1700000100] done"]
    code, out, _ = llmtrain(capsys, "logs", "r7", "--attempt", "1")
    assert out.splitlines() == ["[algo-1-1700000000] first attempt"]
    code, _, err = llmtrain(capsys, "logs", "r7", "--attempt", "9")
    assert code == 2 and "attempt 9 of run 'r7' has no training job yet" in err


def test_logs_read_a_long_stream_page_by_page_from_its_end(capsys, launcher):
    """`llmtrain logs` reads each of the job's streams with GetLogEvents (the engineers' policy grants
    it on their team's streams only, issue 25), backwards from the end, 10,000 events a page."""
    start(capsys, "r9")
    _job(f"{PREFIX}-r9-a1", "InProgress", final_metrics=False)
    logs = boto3.client("logs", region_name=REGION)
    logs.create_log_group(logGroupName=TRAINING_LOG_GROUP)
    stream = f"{PREFIX}-r9-a1/algo-1-1700000000"
    logs.create_log_stream(logGroupName=TRAINING_LOG_GROUP, logStreamName=stream)
    begin = int(time.time() * 1000) - 20_000
    for first in range(0, 12_000, 6_000):
        logs.put_log_events(
            logGroupName=TRAINING_LOG_GROUP,
            logStreamName=stream,
            logEvents=[{"timestamp": begin + i, "message": f"line {i}"} for i in range(first, first + 6_000)],
        )
    code, out, _ = llmtrain(capsys, "logs", "r9", "--limit", "0")
    assert code == 0
    assert out.splitlines() == [f"[algo-1-1700000000] line {i}" for i in range(12_000)]
    code, out, _ = llmtrain(capsys, "logs", "r9", "--limit", "3")
    assert out.splitlines() == [f"[algo-1-1700000000] line {i}" for i in range(11_997, 12_000)]


def test_status_without_cloudwatch_access_still_shows_the_run(capsys, launcher, monkeypatch):
    """An engineer whose policy lacks CloudWatch reads gets the rest of the status and a note why."""
    start(capsys, "r8")
    _job(f"{PREFIX}-r8-a1", "InProgress", final_metrics=False)

    def denied(self, job_name):
        raise ClientError(
            {"Error": {"Code": "AccessDenied", "Message": "not authorized: GetMetricData"}}, "GetMetricData"
        )

    monkeypatch.setattr(LauncherClient, "latest_metrics", denied)
    code, out, _ = llmtrain(capsys, "status", "r8")
    assert code == 0 and f"training job {PREFIX}-r8-a1: InProgress" in out
    assert "latest metrics unavailable: reading CloudWatch: access denied" in out


# -- runs ---------------------------------------------------------------------------------------------------


def test_runs_lists_each_run_once_with_its_jobs(capsys, launcher):
    start(capsys, "alpha")
    _wait_until_finished(launcher, "alpha-1")
    _job(f"{PREFIX}-alpha-a1", "Failed", final_metrics=False, billable=60)
    _job(f"{PREFIX}-alpha-a2", "Completed", final_metrics=True, billable=540)
    start(capsys, "beta", "seed=13")
    _wait_until_finished(launcher, "beta-1")
    start(capsys, "beta", "seed=14")
    _wait_until_finished(launcher, "beta-2")
    start(capsys, "held-gamma", ref="gpt2-ddp@1.0.0")

    code, out, _ = llmtrain(capsys, "runs", "--json")
    assert code == 0
    rows = {row["run_name"]: row for row in json.loads(out)}
    assert list(rows) == ["held-gamma", "beta", "alpha"]  # the latest first
    assert rows["alpha"] | {"started": None} == {
        "run_name": "alpha",
        "status": "SUCCEEDED",
        "template": GPT2,
        "instance_type": "ml.g5.12xlarge",
        "instance_count": 1,
        "started": None,
        "billable_seconds": 600,
        "executions": 1,
        "kind": "run",
        "trials": None,
    }
    assert rows["beta"]["status"] == "SUCCEEDED" and rows["beta"]["executions"] == 2
    assert rows["beta"]["instance_type"] is None and rows["beta"]["billable_seconds"] is None
    assert rows["held-gamma"]["status"] == "RUNNING" and rows["held-gamma"]["template"] == "gpt2-ddp@1.0.0"

    code, out, _ = llmtrain(capsys, "runs", "--limit", "2")
    lines = out.splitlines()
    assert lines[0].split() == ["RUN", "STATUS", "TEMPLATE", "INSTANCES", "STARTED", "BILLABLE", "S"]
    assert [line.split()[0] for line in lines[1:]] == ["held-gamma", "beta"]
