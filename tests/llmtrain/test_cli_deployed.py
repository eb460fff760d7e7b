"""The CLI against what the stacks deploy: the dev stage is synthesized, its launcher runs in moto
(tests/llmtrain/launcher_harness.py: the real definition and handlers; Lambda execution and the
SageMaker `.sync` integration supplied in test code), and the environment's record is what the
synthesized `DeployedEnvironmentRecord` writes, resolved as CloudFormation would and put into
moto's SSM. The CLI finds everything from there: no config/ file is read."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest
import test_launcher_state_machine
from launcher_harness import ACCOUNT, REGION, CloudFormationResolver, JobOutcome, launcher_in_moto

from llmtrain.cli import main
from llmtrain.core.deployed import STANDARD_PARAMETER_LIMIT, from_parameters
from llmtrain.core.platform import PlatformContext

pytestmark = pytest.mark.slow
# The fixture of test_launcher_state_machine.py: the dev stage synthesized for moto's account.
synthesized = test_launcher_state_machine.synthesized
ROOT = Path(__file__).resolve().parents[2]


def _resources(template, kind: str) -> dict:
    return {lid: r for lid, r in template["Resources"].items() if r["Type"] == kind}


def _deploy_record(harness, launcher_stack: str, templates) -> dict[str, str]:
    """The record's parameters as CloudFormation would create them, with the harness's state
    machine and topic as the physical resources; put into moto's SSM."""
    template = templates[launcher_stack]
    # The launcher's state machine is the harness's (the team's preparation state machine keeps its name).
    machines = _resources(template, "AWS::StepFunctions::StateMachine")
    (machine,) = [lid for lid in machines if lid.startswith("Launcher")]
    (topic,) = _resources(template, "AWS::SNS::Topic")
    topic_arn = boto3.client("sns", region_name=REGION).list_topics()["Topics"][0]["TopicArn"]
    resolver = CloudFormationResolver(
        templates,
        physical={(launcher_stack, machine): harness.state_machine_arn, (launcher_stack, topic): topic_arn},
    )
    ssm = boto3.client("ssm", region_name=REGION)
    values = {}
    for parameter in _resources(template, "AWS::SSM::Parameter").values():
        properties = resolver.resolve(parameter["Properties"], launcher_stack)
        assert properties["Type"] == "String" and properties.get("Tier", "Standard") == "Standard"
        ssm.put_parameter(Name=properties["Name"], Value=properties["Value"], Type="String")
        values[properties["Name"]] = properties["Value"]
    return values


def llmtrain(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_record_the_stacks_write_is_what_the_cli_reads(synthesized):
    _, launcher_stack, templates = synthesized
    with launcher_in_moto(*synthesized, outcomes=[]) as harness:
        values = _deploy_record(harness, launcher_stack, templates)
    assert sorted(values) == ["/llmtrain/dev/environment", "/llmtrain/dev/teams/default"]
    assert all(len(value) < STANDARD_PARAMETER_LIMIT for value in values.values())
    record = from_parameters("dev", values)
    assert (record.environment, record.account, record.region) == ("dev", ACCOUNT, REGION)
    assert record.job_name_prefix == "llmtrain-dev" and "gpt2-ddp" in record.enabled_templates
    team = record.team()
    assert team.name == "default" and team.datasets_prefix == "teams/default/"
    assert team.state_machine_arn == harness.state_machine_arn
    assert team.job_name_prefix == "llmtrain-dev-default"
    assert set(team.allowed_templates) == set(record.enabled_templates)
    # The team's platform context is the one its launcher's functions receive.
    function = next(iter(harness.launcher.functions.values()))
    context = json.loads(function.environment["LLMTRAIN_PLATFORM_CONTEXT"])
    assert team.platform == PlatformContext.from_dict(context)


def test_from_a_text_file_to_a_run_rejected_then_continued_under_its_name(synthesized, tmp_path, capsys):
    """data prepare -> data upload -> start (SageMaker refuses: quota) -> status says how to continue
    -> start again under the same name -> the job runs -> runs lists it."""
    _, launcher_stack, templates = synthesized
    readme = (ROOT / "README.md").read_text()
    # Enough text that the held-out halves fill one evaluation step of gpt2-ddp (128 samples).
    (tmp_path / "notes.txt").write_text(readme * 6)
    (tmp_path / "more.txt").write_text(readme[::-1] * 2)
    assert (
        main(
            [
                "data",
                "prepare",
                "--input",
                str(tmp_path / "notes.txt"),
                str(tmp_path / "more.txt"),
                "--output",
                str(tmp_path / "tokens"),
                "--validation-fraction",
                "0.5",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    quota = JobOutcome.quota_error("ml.g5.12xlarge for training job usage", limit=0, in_use=0, requested=1)
    with launcher_in_moto(*synthesized, outcomes=[quota, JobOutcome()]) as harness:
        values = _deploy_record(harness, launcher_stack, templates)
        bucket = from_parameters("dev", values).team().datasets_bucket
        boto3.client("s3", region_name=REGION).create_bucket(Bucket=bucket)

        code, out, _ = llmtrain(capsys, "data", "upload", str(tmp_path / "tokens"), "--name", "notes")
        assert code == 0
        sets = out.split("--env dev ", 1)[1].split()
        assert sets == [
            "--set",
            f"channels.train=s3://{bucket}/teams/default/notes/train/",
            "--set",
            f"channels.validation=s3://{bucket}/teams/default/notes/validation/",
            "--set",
            f"channels.tokenizer=s3://{bucket}/teams/default/notes/tokenizer/",
        ]

        code, out, _ = llmtrain(capsys, "start", "gpt2-ddp", "--run-name", "notes-1", *sets)
        assert code == 0
        first = harness.wait(out.split("execution ", 1)[1].split()[0])
        assert first.status == "FAILED" and first.error == "QuotaExceeded"
        assert (
            harness.jobs.requests
            and not boto3.client("sagemaker", region_name=REGION).list_training_jobs()["TrainingJobSummaries"]
        )  # SageMaker refused the request: no job exists

        code, out, _ = llmtrain(capsys, "status", "notes-1")
        assert "execution FAILED" in out and "ml.g5.12xlarge for training job usage" in out
        assert "continue this run under its name" in out and "--run-name notes-1 --set channels.train=" in out

        code, out, _ = llmtrain(capsys, "start", "gpt2-ddp", "--run-name", "notes-1", *sets)
        assert code == 0 and "continuing run notes-1: its last execution notes-1-1 ended FAILED" in out
        second = harness.wait(out.rsplit("execution ", 1)[1].split()[0])
        assert second.status == "SUCCEEDED", second.cause
        assert second.output["job_name"] == "llmtrain-dev-default-notes-1-a1"
        request = harness.jobs.requests[-1]
        assert {
            c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in request["InputDataConfig"]
        } == {
            "train": f"s3://{bucket}/teams/default/notes/train/",
            "validation": f"s3://{bucket}/teams/default/notes/validation/",
            "tokenizer": f"s3://{bucket}/teams/default/notes/tokenizer/",
        }

        code, out, _ = llmtrain(capsys, "runs", "--json")
        (run,) = json.loads(out)
        assert run["run_name"] == "notes-1" and run["status"] == "SUCCEEDED" and run["executions"] == 2
        assert run["template"].startswith("gpt2-ddp@") and run["instance_type"] == "ml.g5.12xlarge"

        code, _, err = llmtrain(capsys, "start", "gpt2-ddp", "--run-name", "notes-1", *sets)
        assert code == 2 and "run 'notes-1' already completed (execution notes-1-2)" in err

        code, out, _ = llmtrain(capsys, "templates", "--env", "dev", "--json")
        assert {row["name"] for row in json.loads(out)} == set(
            from_parameters("dev", values).enabled_templates
        )
