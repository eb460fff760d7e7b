"""A tune through the team's launcher: the synthesized state machine, executed in moto as
test_launcher_state_machine.py runs it (launcher_harness.py), creates a CreateHyperParameterTuningJob
request that botocore validates (the harness's client does, into moto's SageMaker), built from the
run's rendered request; a tune outside the team's limits or budget is refused before anything exists.
The job-creating role's statement for CreateHyperParameterTuningJob carries SageMaker's condition
keys as the CreateTrainingJob statement does."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from aws_cdk.assertions import Template
from launcher_harness import JobOutcome, launcher_in_moto
from test_launcher_state_machine import _dev_config, _platform, _synthesize

from llmtrain.core.catalog import Catalog
from llmtrain.core.run_settings import RunInput
from llmtrain.core.tuning import ParamRange, TuneSpec
from llmtrain.lifecycle.tuning_jobs import render_tune

TEMPLATE = "llama-pretrain-fsdp"
# lr from 5e-5: the template's min_lr is 3e-5, and the program refuses an lr below it.
TUNE = TuneSpec(
    params=(ParamRange.parse("lr=5e-5..1e-3:log"), ParamRange.parse("warmup_steps=10..200:int")),
    objective="train:loss",
    trials=6,
    parallel=2,
)


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory):
    return _synthesize(tmp_path_factory, _dev_config())


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """dev whose team may use 2 instances per job and $100 per run: one trial ($49) fits, six do not."""
    config = _dev_config()
    (team,) = config.teams
    return _synthesize(
        tmp_path_factory,
        dataclasses.replace(
            config, teams=(dataclasses.replace(team, max_instance_count=2, max_run_cost_usd=100),)
        ),
    )


def _input(run_name: str, tune: TuneSpec = TUNE, **overrides):
    return {
        "template": TEMPLATE,
        "run_name": run_name,
        "overrides": {"max_steps": 100, **overrides},
        "tune": tune.to_dict(),
    }


def test_a_tune_creates_the_tuning_job_of_the_rendered_run(synthesized):
    assembly_dir, stack, templates = synthesized
    with launcher_in_moto(assembly_dir, stack, templates, [JobOutcome()]) as harness:
        run = harness.run(_input("lr-1"))
        platform = _platform(harness)
        notifications = harness.notifications()
    assert run.status == "SUCCEEDED", run.cause
    assert harness.jobs.requests == []  # no training job of its own: the tuning job runs the trials
    (request,) = harness.jobs.tuning_requests
    catalog = Catalog.load()
    template = catalog.resolve(TEMPLATE)
    run_input = RunInput(run_name="lr-1", overrides={"max_steps": 100}, owner="launcher")
    expected, _ = render_tune(template, run_input, TUNE, platform, catalog.program_contract(template))
    assert request == expected
    assert request["HyperParameterTuningJobName"] == f"{platform.job_name_prefix}-lr-1-t1"
    assert request["TrainingJobDefinition"]["RoleArn"] == platform.execution_role_arn
    assert run.output["kind"] == "tune" and run.output["status"] == "Completed"
    assert "llmtrain start" in run.output["message"] and notifications


def test_a_tune_outside_the_teams_limits_or_budget_or_the_programs_rules_creates_nothing(limited):
    assembly_dir, stack, templates = limited
    below_min_lr = dataclasses.replace(TUNE, params=(ParamRange.parse("lr=1e-5..1e-3:log"),))
    with launcher_in_moto(assembly_dir, stack, templates, []) as harness:
        too_big = harness.run(_input("too-big", instance_count=4))
        pricey = harness.run(_input("pricey"))
        refused = harness.run(_input("low-lr", below_min_lr))
    assert too_big.status == "FAILED" and too_big.error == "InvalidRunInput", too_big.cause
    assert "max_instance_count" in too_big.cause
    assert pricey.status == "FAILED" and pricey.error == "InvalidRunInput", pricey.cause
    # one trial's planned cost (the planner's speed for the template's GPUs) times the trials
    total, trials, per_trial = map(int, re.search(
        r"planned to cost up to \$(\d+) \((\d+) trials x \$(\d+) per trial", pricey.cause).groups())
    assert trials == 6 and per_trial < 100 < total and abs(total - trials * per_trial) <= trials
    assert "budget of $100" in pricey.cause
    # Within the template's bounds (lr >= 1e-6), but the program refuses an lr below min_lr.
    assert refused.status == "FAILED" and refused.error == "InvalidRunInput", refused.cause
    assert "(lr=1e-05): the training program" in refused.cause and "'min_lr': got 3e-05" in refused.cause
    assert harness.jobs.tuning_requests == [] and harness.jobs.requests == []


def test_a_failed_tuning_job_ends_the_run_with_its_reason(synthesized):
    assembly_dir, stack, templates = synthesized
    outcome = JobOutcome(status="Failed", failure_reason="No training job succeeded")
    with launcher_in_moto(assembly_dir, stack, templates, [outcome]) as harness:
        run = harness.run(_input("broken"))
    assert run.status == "FAILED" and run.error == "TuningJobFailed", run.cause
    assert "No training job succeeded" in run.cause


def test_the_job_creating_role_creates_tuning_jobs_under_the_same_conditions(synthesized):
    _, stack, templates = synthesized
    template = Template.from_json(templates[stack])
    policies = template.find_resources("AWS::IAM::Policy")
    statements = [s for p in policies.values() for s in p["Properties"]["PolicyDocument"]["Statement"]]
    by_sid = {s.get("Sid"): s for s in statements}
    create_jobs, create_tunes = by_sid["CreateTeamTrainingJobs"], by_sid["CreateTeamTuningJobs"]
    assert create_tunes["Action"] == "sagemaker:CreateHyperParameterTuningJob"
    assert "hyper-parameter-tuning-job/llmtrain-dev-default-*" in json.dumps(create_tunes["Resource"])
    expected = {k: v for k, v in create_jobs["Condition"].items() if k != "NumericLessThanEqualsIfExists"}
    assert create_tunes["Condition"] == expected
    for key in ("sagemaker:InstanceTypes", "sagemaker:VpcSubnets", "sagemaker:VpcSecurityGroupIds"):
        assert key in create_tunes["Condition"]["ForAllValues:StringEquals"]
        assert create_tunes["Condition"]["Null"][key] == "false"
    assert set(create_tunes["Condition"]["StringEquals"]) == {
        "sagemaker:OutputKmsKey",
        "aws:RequestTag/llmtrain:team",
        "aws:RequestTag/llmtrain:environment",
    }
    assert set(create_tunes["Condition"]["StringEqualsIfExists"]) == {"sagemaker:VolumeKmsKey"}
    (machine,) = [m for lid, m in template.find_resources("AWS::StepFunctions::StateMachine").items()
                  if lid.startswith("Launcher")]
    definition = json.dumps(machine["Properties"]["DefinitionString"])
    for layout in ("tune", "tune-warm-start"):
        assert f"CreateHyperParameterTuningJob-{layout}" in definition
    assert "sagemaker:createHyperParameterTuningJob.sync" in definition
    assert "StepFunctionsGetEventsForSageMakerTuningJobsRule" in json.dumps(
        by_sid["SyncWithTrainingJobEvents"]
    )
