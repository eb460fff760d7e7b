"""TrainingQueues: prod's AWS Batch service environment, job queues and fair-share policy, and the
permissions around them; dev has none."""

from __future__ import annotations

import dataclasses
import re

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Match, Template
from infra_helpers import ENV, as_list, cfn_lint_unexplained, resources_of_type, statements_by_sid

from llmtrain.core import queue_policy as policy
from training_constructs import PropsError, TeamSpec
from training_constructs.queues import (
    CANCEL_SERVICE_JOBS_SID,
    READ_QUEUED_TRAINING_JOBS_SID,
    READ_QUEUES_SID,
    READ_SERVICE_JOBS_SID,
    JobQueueSpec,
    TrainingQueues,
    TrainingQueuesProps,
)

BATCH_TYPES = ("AWS::Batch::ServiceEnvironment", "AWS::Batch::JobQueue", "AWS::Batch::SchedulingPolicy")


def _team(name: str, **settings) -> TeamSpec:
    return TeamSpec(name=name, job_name_prefix=f"acme-{name}", instance_types=("ml.p4d.24xlarge",),
                    max_keep_alive_seconds=0, **settings)


def _props(**changes) -> TrainingQueuesProps:
    values = {
        "environment_name": "acme",
        "teams": [_team("a", share_weight=2), _team("b")],
        "max_instances": 16,
        "job_queues": [JobQueueSpec(name="standard", priority=1)],
    }
    return TrainingQueuesProps(**{**values, **changes})


def test_prod_has_a_service_environment_two_queues_and_a_fair_share_policy(platform, environments):
    prod = environments["prod"]
    template = platform.template("prod", "launcher")
    template.resource_count_is("AWS::Batch::ServiceEnvironment", 1)
    template.has_resource_properties("AWS::Batch::ServiceEnvironment", {
        "ServiceEnvironmentName": "llmtrain-prod",
        "ServiceEnvironmentType": "SAGEMAKER_TRAINING",
        "State": "ENABLED",
        "CapacityLimits": [{"MaxCapacity": prod.queues.max_instances, "CapacityUnit": "NUM_INSTANCES"}],
    })
    environment_id = next(iter(resources_of_type(platform.template_json("prod", "launcher"),
                                                 "AWS::Batch::ServiceEnvironment")))
    policy_id = next(iter(resources_of_type(platform.template_json("prod", "launcher"),
                                            "AWS::Batch::SchedulingPolicy")))
    for name, priority in (("standard", 10), ("urgent", 100)):
        template.has_resource_properties("AWS::Batch::JobQueue", {
            "JobQueueName": f"llmtrain-prod-{name}",
            "JobQueueType": "SAGEMAKER_TRAINING",
            "Priority": priority,
            "State": "ENABLED",
            "SchedulingPolicyArn": {"Fn::GetAtt": [policy_id, "Arn"]},
            "ServiceEnvironmentOrder": [
                {"Order": 1, "ServiceEnvironment": {"Fn::GetAtt": [environment_id, "ServiceEnvironmentArn"]}}
            ],
            # The only action a SAGEMAKER_TRAINING queue takes on a job stuck at its head: TERMINATE.
            "JobStateTimeLimitActions": [
                {"Reason": "CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY", "State": "RUNNABLE",
                 "MaxTimeSeconds": 14400, "Action": "TERMINATE"},
                {"Reason": "MISCONFIGURATION:SERVICE_ENVIRONMENT_MAX_RESOURCE", "State": "RUNNABLE",
                 "MaxTimeSeconds": 600, "Action": "TERMINATE"},
            ],
        })
    template.resource_count_is("AWS::Batch::JobQueue", 2)
    template.has_resource_properties("AWS::Batch::SchedulingPolicy", {
        "Name": "llmtrain-prod-fair-share",
        "FairsharePolicy": {
            "ShareDecaySeconds": 86400,
            "ComputeReservation": 10,
            # pretrain weighs 3, finetune 1: Batch's factors are the inverse (lower gets more).
            "ShareDistribution": [
                {"ShareIdentifier": "pretrain", "WeightFactor": 1},
                {"ShareIdentifier": "finetune", "WeightFactor": 3},
            ],
        },
    })


def test_dev_has_no_queues_anywhere(platform):
    for (env, part), _stack in platform.stacks.items():
        if env == "dev":
            for kind in BATCH_TYPES:
                assert resources_of_type(platform.template_json(env, part), kind) == {}, (part, kind)
    engineers = statements_by_sid(platform.template_json("dev", "access"), "AWS::IAM::ManagedPolicy")
    batch = [sid for sid, s in engineers.items() if any(a.startswith("batch:") for a in as_list(s["Action"]))]
    assert batch == []


@pytest.mark.parametrize("weights", [{"a": 3, "b": 1}, {"a": 2, "b": 3, "c": 7}, {"a": 1},
                                     {"a": 999, "b": 1}])
def test_batch_weight_factors_give_each_team_its_share_weights_fraction(weights):
    factors = policy.weight_factors(weights)
    assert all(0.0001 <= factor <= 999.9999 for factor in factors.values())
    # Batch gives share i a fraction of (1 / factor_i) / sum(1 / factor): a lower factor gets more.
    inverse = {share: 1 / factor for share, factor in factors.items()}
    batch_shares = {share: value / sum(inverse.values()) for share, value in inverse.items()}
    expected = policy.expected_shares(weights)
    assert batch_shares == pytest.approx(expected, rel=1e-3)
    heaviest = max(weights, key=weights.get)
    assert factors[heaviest] == 1.0 and max(factors.values()) == pytest.approx(max(weights.values()) /
                                                                                min(weights.values()))


def test_engineers_see_the_queues_and_cancel_only_their_teams_jobs(platform):
    access = platform.template_json("prod", "access")
    for team in ("Pretrain", "Finetune"):
        statements = statements_by_sid(access, "AWS::IAM::ManagedPolicy", f"AccessTeam{team}")
        assert statements[READ_SERVICE_JOBS_SID]["Action"] == "batch:ListServiceJobs"  # no payloads
        queues = [str(arn) for arn in as_list(statements[READ_QUEUES_SID]["Resource"])]
        assert len(queues) == 2 and all("job-queue/llmtrain-prod-" in arn for arn in queues)
        cancel = statements[CANCEL_SERVICE_JOBS_SID]
        assert cancel["Action"] == "batch:TerminateServiceJob" and "service-job/*" in str(cancel["Resource"])
        assert cancel["Condition"] == {"StringEquals": {"aws:ResourceTag/llmtrain:team": team.lower()}}
        jobs = statements[READ_QUEUED_TRAINING_JOBS_SID]
        assert jobs["Condition"] == {"StringEquals": {"aws:ResourceTag/llmtrain:team": team.lower()}}


def test_the_queues_are_lint_clean_with_these_resource_types(platform, environments):
    # cfn-lint 1.58 knows AWS::Batch::ServiceEnvironment, the queue's JobQueueType and the policy.
    assert cfn_lint_unexplained(platform.template_json("prod", "launcher"), environments["prod"].region) == []


def test_an_existing_service_environment_is_queued_into_not_created():
    stack = cdk.Stack(cdk.App(), "Existing", env=ENV)
    arn = "arn:aws:batch:us-east-1:111111111111:service-environment/shared"
    queues = TrainingQueues(stack, "Queues", _props(existing_service_environment_arn=arn,
                                                    default_queue="urgent", job_queues=[
                                                        JobQueueSpec(name="standard", priority=1),
                                                        JobQueueSpec(name="urgent", priority=2)]))
    template = Template.from_stack(stack)
    template.resource_count_is("AWS::Batch::ServiceEnvironment", 0)
    template.has_resource_properties("AWS::Batch::JobQueue", {
        "ServiceEnvironmentOrder": [{"Order": 1, "ServiceEnvironment": arn}],
        "JobQueueName": "llmtrain-acme-urgent",
    })
    assert queues.service_environment is None and queues.service_environment_arn == arn
    assert queues.weight_factors == {"a": 1.0, "b": 2.0}
    context = queues.team_context("b")
    assert context["default_queue"] == "urgent" and list(context["queue_arns"]) == ["urgent", "standard"]
    assert (context["share_identifier"], context["max_priority"], context["max_instances"]) == ("b", 0, 16)
    template.has_resource_properties("AWS::Batch::SchedulingPolicy", {
        "FairsharePolicy": {
            "ShareDistribution": Match.array_with([{"ShareIdentifier": "b", "WeightFactor": 2}])
        }
    })


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"environment_name": "Prod!"}, "environment_name", "must be an environment name"),
        ({"teams": []}, "teams", "must list the teams"),
        ({"teams": [_team("a"), _team("a")]}, "teams", "lists a team twice"),
        ({"teams": [_team("a", queues=("fast",))]}, "teams", "names queues ['fast']"),
        ({"teams": [_team("a", max_instance_count=17)]}, "teams", "more than max_instances (16)"),
        # a queued job's name keeps 23 characters of the payload's (Batch's naming): its logs need them
        ({"teams": [dataclasses.replace(_team("a"), job_name_prefix="acme-training-platform-a")]}, "teams",
         "'acme-training-platform-a' is longer than 22 characters"),
        ({"max_instances": 0}, "max_instances", "at least 1"),
        ({"job_queues": []}, "job_queues", "at least one JobQueueSpec"),
        ({"job_queues": [JobQueueSpec(name="a"), JobQueueSpec(name="a")]}, "job_queues",
         "names a queue twice"),
        ({"default_queue": "urgent"}, "default_queue", "not one of job_queues"),
        ({"share_decay_seconds": 604801}, "share_decay_seconds", "from 0 to 604800"),
        ({"compute_reservation": 100}, "compute_reservation", "from 0 to 99"),
        ({"capacity_wait_seconds": 599}, "capacity_wait_seconds", "from 600 to 86400"),
        ({"misconfiguration_wait_seconds": 86401}, "misconfiguration_wait_seconds", "from 600 to 86400"),
        ({"existing_service_environment_arn": "arn:aws:batch:::job-queue/x"},
         "existing_service_environment_arn", "not a Batch service environment ARN"),
    ],
)
def test_invalid_props_name_the_field(changes, field, message):
    with pytest.raises(PropsError, match=rf"^TrainingQueues\({field}=\.\.\.\): .*{re.escape(message)}"):
        _props(**changes)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: JobQueueSpec(name="Urgent"), r"JobQueueSpec\(name=...\)"),
        (lambda: JobQueueSpec(name="a", priority=1001),
         r"JobQueueSpec\(priority=...\): must be .* 0 to 1000"),
        (lambda: _team("a", share_weight=0), r"TeamSpec\(share_weight=...\): must be a whole number from 1"),
        (lambda: _team("a", max_priority=10000), r"TeamSpec\(max_priority=...\): must be .* 0 to 9999"),
        (lambda: _team("a", queues=("No",)), r"TeamSpec\(queues=...\)"),
    ],
)
def test_queue_records_refuse_bad_values(build, message):
    with pytest.raises(PropsError, match=message):
        build()


def test_a_team_outside_the_queues_is_refused_by_name():
    stack = cdk.Stack(cdk.App(), "Outside", env=ENV)
    queues = TrainingQueues(stack, "Queues", _props())
    refused = r"TrainingQueues\(teams=...\): team 'z' does not share these queues"
    with pytest.raises(PropsError, match=refused):
        queues.team_context("z")
