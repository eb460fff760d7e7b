"""The operations stack of every environment, from the app synthesized once per session (conftest).

Alarms, the job-events rule, the schedules, the functions' settings and permissions and the dashboard
are asserted in the synthesized templates against config/ and the template catalog; cdk-nag runs
over them (cfn-lint too: tests/infra/test_platform.py lints every template of the app, this one's
included; the construct on its own is linted here). The functions' code asset is imported the way
Lambda would load it.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import aws_cdk as cdk
import pytest
from aws_cdk import Stack
from aws_cdk import aws_sns as sns
from aws_cdk.assertions import Template
from cdk_nag import AwsSolutionsChecks
from infra_helpers import as_list, cfn_lint_unexplained, resources_of_type

from llmtrain.core import function_settings
from llmtrain.core.catalog import Catalog
from llmtrain.core.failures import FailureClass
from llmtrain.core.function_settings import JobEventSettings, QuotaSettings, ReaperSettings, UsageKind
from training_constructs import PropsError
from training_constructs.lambda_code import stage_lambda_code
from training_constructs.operations import (
    WILDCARD_RESOURCE_ACTIONS,
    TrainingOperations,
    TrainingOperationsProps,
)
from training_constructs.operations_dashboard import TemplateMetrics

ENVIRONMENTS = ("dev", "prod")
CATALOG = Catalog.load()
GOOD = dict(
    environment_name="dev",
    job_name_prefix="llmtrain-dev",
    instance_types=["ml.p4d.24xlarge"],
    quota_alarm_threshold_percent=80,
    warm_pool_idle_budget_seconds=1800,
)


@pytest.fixture(scope="module")
def templates(platform) -> dict[str, dict]:
    return {name: _template_json(platform.stages[name].operations) for name in ENVIRONMENTS}


def _template_json(stack: cdk.Stack) -> dict:
    return json.loads((Path(cdk.Stage.of(stack).outdir) / stack.template_file).read_text())


def expected_instance_types(config) -> list[str]:
    return list(CATALOG.instance_types(config.enabled_templates))


def functions(template: dict) -> dict[str, dict]:
    """The platform's functions by handler module name (quotas, warm_pools, job_events); not
    aws-cdk-lib's own (AwsCustomResource's)."""
    found = {}
    for resource in resources_of_type(template, "AWS::Lambda::Function").values():
        if resource["Properties"]["Handler"].startswith("llmtrain."):
            found[resource["Properties"]["Handler"].split(".")[-2]] = resource
    return found


def notification_topic(template: dict) -> dict:
    """Where the job-events function sends notifications; the alarms must notify the same topic."""
    return functions(template)["job_events"]["Properties"]["Environment"]["Variables"][
        "NOTIFICATION_TOPIC_ARN"
    ]


def logical_id_of(template: dict, resource: dict) -> str:
    return next(
        logical_id for logical_id, candidate in template["Resources"].items() if candidate is resource
    )


# -- cdk-nag ------------------------------------------------------------------------------


def test_cdk_nag_has_no_unacknowledged_finding_in_the_operations_stacks(platform):
    mine = [v for v in platform.nag_violations() if "/Operations/" in json.dumps(v)]
    assert mine == []


# -- alarms -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_one_quota_alarm_per_instance_type_at_the_environment_threshold(templates, environments, environment):
    config, template = environments[environment], templates[environment]
    alarms = {
        alarm["Properties"]["AlarmName"]: alarm["Properties"]
        for alarm in resources_of_type(template, "AWS::CloudWatch::Alarm").values()
    }
    types = expected_instance_types(config)
    assert {f"{config.job_name_prefix}-quota-{t}" for t in types} <= set(alarms)
    assert len([name for name in alarms if name.startswith(f"{config.job_name_prefix}-quota-ml.")]) == len(
        types
    )
    topic = notification_topic(template)  # the environment's one topic, where job events go too
    for instance_type in types:
        alarm = alarms[f"{config.job_name_prefix}-quota-{instance_type}"]
        assert alarm["Threshold"] == config.quotas.alarm_threshold_percent
        assert alarm["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"
        assert alarm["TreatMissingData"] == "notBreaching"
        assert alarm["AlarmActions"] == [topic] and alarm["OKActions"] == [topic]
        [expression] = [m for m in alarm["Metrics"] if "Expression" in m]
        assert expression["Expression"] == "MAX([training, spot, warm_pool])" and expression["ReturnData"]
        inputs = {m["Id"]: m["MetricStat"] for m in alarm["Metrics"] if "MetricStat" in m}
        assert set(inputs) == {"training", "spot", "warm_pool"}
        for metric_id, stat in inputs.items():
            metric = stat["Metric"]
            assert metric["Namespace"] == function_settings.QUOTA_NAMESPACE
            assert metric["MetricName"] == "Utilization"
            assert {d["Name"]: d["Value"] for d in metric["Dimensions"]} == {
                "InstanceType": instance_type,
                "UsageKind": metric_id.replace("_", "-"),
            }


def test_thresholds_differ_per_environment_as_configured(templates, environments):
    thresholds = {
        name: {
            a["Properties"]["Threshold"]
            for a in resources_of_type(templates[name], "AWS::CloudWatch::Alarm").values()
            if "-quota-ml." in a["Properties"]["AlarmName"]
        }
        for name in ENVIRONMENTS
    }
    assert thresholds == {name: {environments[name].quotas.alarm_threshold_percent} for name in ENVIRONMENTS}
    assert thresholds["dev"] != thresholds["prod"]


def test_unreadable_quotas_and_function_errors_raise_alarms(templates):
    template = templates["dev"]
    alarms = {
        a["Properties"]["AlarmName"]: a["Properties"]
        for a in resources_of_type(template, "AWS::CloudWatch::Alarm").values()
    }
    unreadable = alarms["llmtrain-dev-quota-unreadable"]
    assert (unreadable["MetricName"], unreadable["Namespace"], unreadable["Threshold"]) == (
        "UnreadableQuotas",
        function_settings.QUOTA_NAMESPACE,
        1,
    )
    errors = [a for name, a in alarms.items() if name.endswith("-errors")]
    assert len(errors) == 3 and all(
        a["MetricName"] == "Errors" and a["Namespace"] == "AWS/Lambda" for a in errors
    )


# -- the rule, the schedules, the functions -------------------------------------------------------


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_the_job_events_rule_sends_the_platform_s_ended_jobs_to_the_function(
    templates, environments, environment
):
    template, prefix = templates[environment], environments[environment].job_name_prefix
    rules = [
        r["Properties"]
        for r in resources_of_type(template, "AWS::Events::Rule").values()
        if "EventPattern" in r["Properties"]
    ]
    [rule] = rules
    assert rule["EventPattern"] == {
        "source": ["aws.sagemaker"],
        "detail-type": ["SageMaker Training Job State Change"],
        "detail": {
            "TrainingJobStatus": ["Completed", "Failed", "Stopped"],
            # the platform's jobs by name, and a queued run's job (AWS Batch names it) by its tag
            "$or": [
                {"TrainingJobName": [{"prefix": f"{prefix}-"}]},
                {"Tags": {"llmtrain:environment": [environment]}},
            ],
        },
    }
    [target] = rule["Targets"]
    job_events_id = logical_id_of(template, functions(template)["job_events"])
    assert target["Arn"] == {"Fn::GetAtt": [job_events_id, "Arn"]}
    assert target["RetryPolicy"]["MaximumRetryAttempts"] == 8


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_failed_job_events_are_kept_in_an_encrypted_dead_letter_queue_and_alarmed(templates, environment):
    """Issue 25: EventBridge invokes the job-events function asynchronously; an event the rule could
    not deliver, or the function failed on, was lost (and checkov's skip said no one invokes it so)."""
    template = templates[environment]
    [(queue_id, queue)] = resources_of_type(template, "AWS::SQS::Queue").items()
    queue_arn = {"Fn::GetAtt": [queue_id, "Arn"]}
    [rule] = [r for r in resources_of_type(template, "AWS::Events::Rule").values()
              if "EventPattern" in r["Properties"]]
    assert rule["Properties"]["Targets"][0]["DeadLetterConfig"] == {"Arn": queue_arn}
    function = functions(template)["job_events"]
    assert function["Properties"]["DeadLetterConfig"] == {"TargetArn": queue_arn}
    skipped = {skip["id"] for skip in function["Metadata"]["checkov"]["skip"]}
    assert "CKV_AWS_116" not in skipped and {"CKV_AWS_115", "CKV_AWS_117"} <= skipped
    for scheduled in ("quotas", "warm_pools"):  # a missed run is repeated by the next: no queue
        assert "DeadLetterConfig" not in functions(template)[scheduled]["Properties"]
    # Encrypted with its key, which EventBridge may use for this account's rules only; TLS only.
    key_id = queue["Properties"]["KmsMasterKeyId"]["Fn::GetAtt"][0]
    assert queue["Properties"]["MessageRetentionPeriod"] == 14 * 24 * 3600
    key = resources_of_type(template, "AWS::KMS::Key")[key_id]
    key_policy = key["Properties"]["KeyPolicy"]["Statement"]
    [events] = [st for st in key_policy if st.get("Sid") == "EventBridgeDeadLetters"]
    assert events["Principal"] == {"Service": "events.amazonaws.com"}
    assert set(events["Action"]) == {"kms:GenerateDataKey", "kms:Decrypt"}
    assert ":events:" in json.dumps(events["Condition"]["ArnLike"]["aws:SourceArn"])
    [policy] = resources_of_type(template, "AWS::SQS::QueuePolicy").values()
    document = policy["Properties"]["PolicyDocument"]["Statement"]
    assert any(st["Effect"] == "Deny" and st["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
               for st in document)
    assert any(st["Effect"] == "Allow" and st["Principal"] == {"Service": "events.amazonaws.com"}
               and st["Action"] == "sqs:SendMessage" for st in document)
    # The function sends with its role: the queue and its key.
    sent = statements(template, "job_events")
    assert any(st["Action"] == "sqs:SendMessage" and st["Resource"] == queue_arn for st in sent)
    assert any(set(as_list(st["Action"])) == {"kms:GenerateDataKey", "kms:Decrypt"}
               and st["Resource"] == {"Fn::GetAtt": [key_id, "Arn"]} for st in sent)
    [alarm] = [a["Properties"] for a in resources_of_type(template, "AWS::CloudWatch::Alarm").values()
               if a["Properties"].get("MetricName") == "ApproximateNumberOfMessagesVisible"]
    queue_name = {"Fn::GetAtt": [queue_id, "QueueName"]}
    assert alarm["Dimensions"] == [{"Name": "QueueName", "Value": queue_name}]
    assert alarm["Threshold"] == 1 and alarm["AlarmActions"] == [notification_topic(template)]


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_sagemakers_training_log_group_keeps_logs_as_configured(templates, environments, environment):
    """Issue 25: SageMaker creates /aws/sagemaker/TrainingJobs without a retention. At deploy time the
    stack creates it unless it exists (an account that ran jobs has it: the deploy must not fail on
    it), then sets its retention, each call allowed on that group only."""
    template = templates[environment]
    days = environments[environment].logs.training_jobs_retention_days
    calls = {
        json.loads(r["Properties"]["Create"])["action"]: r
        for r in resources_of_type(template, "Custom::AWS").values()
    }
    assert set(calls) == {"createLogGroup", "putRetentionPolicy"}
    create = json.loads(calls["createLogGroup"]["Properties"]["Create"])
    assert create["parameters"] == {"logGroupName": "/aws/sagemaker/TrainingJobs"}
    assert create["ignoreErrorCodesMatching"] == "ResourceAlreadyExistsException"
    put = json.loads(calls["putRetentionPolicy"]["Properties"]["Create"])
    assert put["parameters"] == {"logGroupName": "/aws/sagemaker/TrainingJobs", "retentionInDays": days}
    retention = calls["putRetentionPolicy"]["Properties"]
    assert retention["Update"] == retention["Create"]
    create_id = logical_id_of(template, calls["createLogGroup"])
    assert create_id in calls["putRetentionPolicy"]["DependsOn"]
    policies = resources_of_type(template, "AWS::IAM::Policy")
    allowed = {"TrainingLogGroup": "logs:CreateLogGroup", "TrainingLogRetention": "logs:PutRetentionPolicy"}
    for name, action in allowed.items():
        [statement] = next(
            p["Properties"]["PolicyDocument"]["Statement"]
            for lid, p in policies.items() if lid.startswith(f"Operations{name}CustomResourcePolicy")
        )
        assert statement["Action"] == action
        ends = [json.dumps(r).rsplit(":log-group:", 1)[1] for r in statement["Resource"]]
        assert ends == ['/aws/sagemaker/TrainingJobs"]]}', '/aws/sagemaker/TrainingJobs:*"]]}'], statement


def test_the_scheduled_functions_run_every_few_minutes(templates):
    template = templates["dev"]
    by_target = {}
    for rule in resources_of_type(template, "AWS::Events::Rule").values():
        if "ScheduleExpression" in rule["Properties"]:
            [target] = rule["Properties"]["Targets"]
            by_target[target["Arn"]["Fn::GetAtt"][0]] = rule["Properties"]["ScheduleExpression"]
    lambdas = functions(template)
    assert by_target == {
        logical_id_of(template, lambdas["quotas"]): "rate(5 minutes)",
        logical_id_of(template, lambdas["warm_pools"]): "rate(10 minutes)",
    }


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_the_functions_get_the_environment_s_settings(templates, environments, environment):
    config, lambdas = environments[environment], functions(templates[environment])
    variables = {name: f["Properties"]["Environment"]["Variables"] for name, f in lambdas.items()}
    instance_types = ",".join(expected_instance_types(config))
    assert variables["quotas"]["INSTANCE_TYPES"] == instance_types
    assert QuotaSettings.from_environment(variables["quotas"]).instance_types == tuple(
        instance_types.split(",")
    )
    reaper = ReaperSettings.from_environment(variables["warm_pools"])
    assert (reaper.job_name_prefix, reaper.idle_budget_seconds, reaper.dry_run, reaper.environment) == (
        f"{config.job_name_prefix}-",
        config.warm_pools.idle_budget_seconds,
        False,
        config.name,
    )
    events = JobEventSettings.from_environment(
        {**variables["job_events"], "NOTIFICATION_TOPIC_ARN": "resolved at deploy time"}
    )
    assert (events.job_name_prefix, events.environment) == (f"{config.job_name_prefix}-", config.name)
    for function in lambdas.values():
        module, name = function["Properties"]["Handler"].rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), name))
        assert function["Properties"]["Runtime"] == "python3.14"


def statements(template: dict, function_module: str) -> list[dict]:
    function = functions(template)[function_module]
    role_id = function["Properties"]["Role"]["Fn::GetAtt"][0]
    return [
        statement
        for policy in resources_of_type(template, "AWS::IAM::Policy").values()
        if {"Ref": role_id} in policy["Properties"]["Roles"]
        for statement in policy["Properties"]["PolicyDocument"]["Statement"]
    ]


def test_iam_is_least_privilege(templates):
    template = templates["dev"]
    for module in ("quotas", "warm_pools", "job_events"):
        for statement in statements(template, module):
            assert statement["Effect"] == "Allow"
            actions = as_list(statement["Action"])
            assert not any(action == "*" or action.endswith(":*") for action in actions)
            if statement["Resource"] == "*":
                assert set(actions) <= set(WILDCARD_RESOURCE_ACTIONS), actions
            if "cloudwatch:PutMetricData" in actions:
                assert set(as_list(statement["Condition"]["StringEquals"]["cloudwatch:namespace"])) <= {
                    function_settings.QUOTA_NAMESPACE,
                    function_settings.WARM_POOL_NAMESPACE,
                    function_settings.JOB_NAMESPACE,
                    function_settings.TRAINING_NAMESPACE,
                }
    [update] = [
        s for s in statements(template, "warm_pools") if "sagemaker:UpdateTrainingJob" in as_list(s["Action"])
    ]
    assert json.dumps(update["Resource"]).endswith(':training-job/llmtrain-dev-*"]]}')
    assert not any(
        "sagemaker:UpdateTrainingJob" in as_list(s["Action"])
        for m in ("quotas", "job_events")
        for s in statements(template, m)
    )


def test_the_functions_write_only_their_own_log_groups(templates):
    template = templates["dev"]
    for module in ("quotas", "warm_pools", "job_events"):
        function = functions(template)[module]
        [logs] = [s for s in statements(template, module) if s.get("Sid") == "WriteOwnLogs"]
        assert logs["Resource"] == {
            "Fn::GetAtt": [function["Properties"]["LoggingConfig"]["LogGroup"]["Ref"], "Arn"]
        }


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_the_function_logs_are_encrypted_with_a_key_logs_may_use(templates, environment):
    """The three functions' and aws-cdk-lib's AwsCustomResource function's (issue 25: it kept them
    forever in a group Lambda creates)."""
    template = templates[environment]
    log_groups = resources_of_type(template, "AWS::Logs::LogGroup")
    assert len(log_groups) == 4
    assert {group["Properties"]["RetentionInDays"] for group in log_groups.values()} == {90}
    (sdk_calls,) = [r for r in resources_of_type(template, "AWS::Lambda::Function").values()
                    if r["Properties"]["Handler"] == "index.handler"]
    assert sdk_calls["Properties"]["LoggingConfig"]["LogGroup"]["Ref"] in log_groups
    keys = {json.dumps(group["Properties"]["KmsKeyId"]) for group in log_groups.values()}
    assert len(keys) == 1
    key_id = json.loads(keys.pop())["Fn::GetAtt"][0]
    key = resources_of_type(template, "AWS::KMS::Key")[key_id]
    assert key["Properties"]["EnableKeyRotation"] is True
    statements = key["Properties"]["KeyPolicy"]["Statement"]
    assert any(s.get("Sid") == "CloudWatchLogsOfThisAccount" for s in statements)


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_alarms_and_job_notifications_reach_the_configured_address(
    platform, templates, environments, environment
):
    template, config = templates[environment], environments[environment]
    operations = platform.stages[environment].operations.operations
    topic_arn = notification_topic(template)
    if operations.topic_key is None:  # the stage passed the launcher's topic, which mails the address
        assert topic_arn["Fn::ImportValue"].startswith(f"{config.stack_name('launcher')}:")
        return
    [(topic_id, topic)] = resources_of_type(template, "AWS::SNS::Topic").items()
    assert topic_arn == {"Ref": topic_id} and "KmsMasterKeyId" in topic["Properties"]
    [subscription] = resources_of_type(template, "AWS::SNS::Subscription").values()
    assert subscription["Properties"]["Endpoint"] == config.notifications.email


def test_a_given_topic_is_used_and_no_other_is_created():
    stack = cdk.Stack(cdk.App(), "S", env=cdk.Environment(account="111111111111", region="us-east-1"))
    given = sns.Topic(stack, "Given")
    operations = TrainingOperations(stack, "Ops", TrainingOperationsProps(**GOOD, existing_topic=given))
    template = Template.from_stack(stack).to_json()
    assert operations.topic is given and operations.topic_key is None
    assert list(resources_of_type(template, "AWS::SNS::Topic")) == [
        stack.get_logical_id(given.node.default_child)
    ]
    # The keys are those of the function logs and of the dead-letter queue: no topic key.
    assert list(resources_of_type(template, "AWS::KMS::Key")) == [
        stack.get_logical_id(operations.log_key.node.default_child),
        stack.get_logical_id(operations.dead_letter_key.node.default_child),
    ]
    topic_ref = {"Ref": stack.get_logical_id(given.node.default_child)}
    assert notification_topic(template) == topic_ref
    assert all(
        a["Properties"]["AlarmActions"] == [topic_ref]
        for a in resources_of_type(template, "AWS::CloudWatch::Alarm").values()
    )


@pytest.fixture(scope="module")
def standalone():
    """The construct on its own, as another team's app would use it: no launcher, its own topic."""
    app = cdk.App()
    stack = cdk.Stack(app, "Ops", env=cdk.Environment(account="111111111111", region="us-east-1"))
    operations = TrainingOperations(
        stack,
        "Operations",
        TrainingOperationsProps(**GOOD, notification_email="oncall@example.com", reaper_dry_run=True),
    )
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    app.synth()
    report = json.loads((Path(app.outdir) / "validation-report.json").read_text())
    violations = [v for plugin in report["pluginReports"] for v in plugin["violations"]]
    return operations, Template.from_stack(stack).to_json(), violations


def test_standalone_it_creates_an_encrypted_topic_that_alarms_may_publish_to(standalone):
    operations, template, violations = standalone
    assert violations == []
    assert cfn_lint_unexplained(template, "us-east-1") == []
    [(topic_id, topic)] = resources_of_type(template, "AWS::SNS::Topic").items()
    key_id = Stack.of(operations).get_logical_id(operations.topic_key.node.default_child)
    key = resources_of_type(template, "AWS::KMS::Key")[key_id]
    assert topic["Properties"]["KmsMasterKeyId"] == {"Fn::GetAtt": [key_id, "Arn"]}
    [subscription] = resources_of_type(template, "AWS::SNS::Subscription").values()
    assert (subscription["Properties"]["Protocol"], subscription["Properties"]["Endpoint"]) == (
        "email",
        "oncall@example.com",
    )
    [alarms_statement] = [
        s for s in key["Properties"]["KeyPolicy"]["Statement"] if s.get("Sid") == "CloudWatchAlarmsPublish"
    ]
    assert alarms_statement["Principal"] == {"Service": "cloudwatch.amazonaws.com"}
    assert set(alarms_statement["Action"]) == {"kms:Decrypt", "kms:GenerateDataKey*"}
    assert notification_topic(template) == {"Ref": topic_id}
    for alarm in resources_of_type(template, "AWS::CloudWatch::Alarm").values():
        assert alarm["Properties"]["AlarmActions"] == [{"Ref": topic_id}]
    assert functions(template)["warm_pools"]["Properties"]["Environment"]["Variables"]["DRY_RUN"] == "true"
    assert operations.topic_key is not None and set(operations.quota_alarms) == {"ml.p4d.24xlarge"}


# -- the dashboard ----------------------------------------------------------------------------------


def dashboard(template: dict) -> dict:
    [board] = resources_of_type(template, "AWS::CloudWatch::Dashboard").values()
    parts = board["Properties"]["DashboardBody"]["Fn::Join"][1]
    return json.loads("".join(p if isinstance(p, str) else "TOKEN" for p in parts))


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_the_dashboard_shows_every_part(templates, environments, environment):
    config = environments[environment]
    board = dashboard(templates[environment])
    by_title = {w["properties"].get("title"): w["properties"] for w in board["widgets"]}
    launcher = by_title["Launcher executions"]["metrics"]
    outcomes = ["ExecutionsStarted", "ExecutionsSucceeded", "ExecutionsFailed", "ExecutionsAborted",
                "ExecutionsTimedOut"]
    teams = len(config.teams)
    metrics = [m for m in launcher if isinstance(m[0], str)]
    assert all(m[0] == "AWS/States" and m[2] == "StateMachineArn" for m in metrics)
    # Every team's launcher, each outcome once; with several teams the graph shows their sums.
    assert sorted(m[1] for m in metrics) == sorted(outcomes * teams)
    sums = [m[0] for m in launcher if isinstance(m[0], dict)]
    if teams == 1:
        assert sums == []
    else:
        assert [s["label"] for s in sums] == ["started", "succeeded", "failed", "aborted", "timed out"]
        assert sums[0]["expression"] == " + ".join(f"FILL(started{i}, 0)" for i in range(teams))

    failures = by_title["Job failures by class"]["metrics"]
    assert sorted(m[5] for m in failures) == sorted(c.value for c in FailureClass)

    for instance_type in expected_instance_types(config):
        widget = by_title[f"{instance_type}: quota utilisation (%)"]
        assert widget["annotations"]["horizontal"][0]["value"] == config.quotas.alarm_threshold_percent
        assert {(m[2], m[3]) for m in widget["metrics"]} == {("InstanceType", instance_type)}
        assert sorted(m[5] for m in widget["metrics"]) == sorted(kind.value for kind in UsageKind)

    warm = by_title["Warm-pool instances in use (account)"]["metrics"][0][0]["expression"]
    assert (
        warm.startswith("SEARCH('{LLMTrain/Quotas,InstanceType,UsageKind}")
        and 'UsageKind="warm-pool"' in warm
    )
    assert by_title["Warm pools: retained billable time"]["metrics"][0][:2] == [
        function_settings.WARM_POOL_NAMESPACE,
        "RetainedBillableSeconds",
    ]

    live_loss = by_title["Training loss, live (train:loss)"]["metrics"][0][0]["expression"]
    assert live_loss == (
        'SEARCH(\'{"/aws/sagemaker/TrainingJobs",Host} MetricName="train:loss" '
        f"Host={config.job_name_prefix}', 'Average', 300)"
    )
    assert "Tokens/s, live (train:tokens_per_sec)" in by_title

    for name in config.enabled_templates:
        widget = by_title[f"{name}: final loss and tokens/s per job"]
        loss = widget["metrics"][0]
        assert loss[:2] == [function_settings.TRAINING_NAMESPACE, "train:loss"]
        assert loss[2:6] == ["Environment", config.name, "Template", name]
    assert by_title["Guard-rail functions: errors"]["metrics"]


def test_template_metrics_are_found_by_what_their_regexes_capture():
    for template in CATALOG.all():
        found = TemplateMetrics.from_metric_definitions(
            template.name, {m.name: m.regex for m in template.metrics}
        )
        assert found.loss == "train:loss", template.ref
        expected = None if template.name == "byo-script" else "train:tokens_per_sec"
        assert found.tokens_per_second == expected, template.ref
    odd = TemplateMetrics.from_metric_definitions(
        "x", {"speed": r"tokens_per_sec=(\S+)", "l": r" loss=(\S+)"}
    )
    assert (odd.loss, odd.tokens_per_second) == ("l", "speed")


# -- invalid props --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"environment_name": "Dev"}, "environment_name"),
        ({"job_name_prefix": "LLM_train"}, "job_name_prefix"),
        ({"instance_types": []}, "instance_types"),
        ({"instance_types": ["p4d.24xlarge"]}, "instance_types"),
        ({"quota_alarm_threshold_percent": 0}, "quota_alarm_threshold_percent"),
        ({"quota_alarm_threshold_percent": 120}, "quota_alarm_threshold_percent"),
        ({"warm_pool_idle_budget_seconds": 30000}, "warm_pool_idle_budget_seconds"),
        ({"warm_pool_idle_budget_seconds": True}, "warm_pool_idle_budget_seconds"),
        ({"notification_email": "nobody"}, "notification_email"),
        ({"quota_interval": cdk.Duration.seconds(90)}, "quota_interval"),
    ],
)
def test_invalid_props_fail_naming_the_field(change, field):
    stack = cdk.Stack(cdk.App(), "S", env=cdk.Environment(account="111111111111", region="us-east-1"))
    with pytest.raises(PropsError, match=rf"^TrainingOperations\({field}=\.\.\.\): "):
        TrainingOperations(stack, "Ops", TrainingOperationsProps(**(GOOD | change)))


def test_an_email_is_refused_when_a_topic_is_given():
    stack = cdk.Stack(cdk.App(), "S", env=cdk.Environment(account="111111111111", region="us-east-1"))
    topic = sns.Topic(stack, "Given")
    with pytest.raises(PropsError, match="subscribe the address to the existing_topic you pass"):
        TrainingOperationsProps(**GOOD, existing_topic=topic, notification_email="a@example.com")


# -- the code asset --------------------------------------------------------------------------------

_IMPORT_LIKE_LAMBDA = """
import importlib.abc, sys
# Lambda's Python runtime has the standard library and boto3 (with its dependencies), nothing else:
# every other package of this environment is made unimportable.
allowed = {"boto3", "botocore", "jmespath", "dateutil", "urllib3", "s3transfer", "six"}
blocked = set(sys.argv[2].split(",")) - allowed
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ImportError(f"{name} is not in the Lambda runtime")
sys.meta_path.insert(0, Block())
sys.path.insert(0, sys.argv[1])
for module in ("llmtrain.handlers.quotas", "llmtrain.handlers.warm_pools", "llmtrain.handlers.job_events"):
    loaded = importlib.import_module(module)
    assert loaded.__file__.startswith(sys.argv[1]), loaded.__file__
    assert callable(loaded.handler)
print("ok")
"""


def test_the_function_code_imports_with_only_what_lambda_provides(tmp_path):
    folder = stage_lambda_code(staging_root=tmp_path)
    site_packages = Path(importlib.import_module("boto3").__file__).parents[1]
    installed = {p.name.split(".")[0].split("-")[0] for p in site_packages.iterdir()} | {
        "regex",
        "yaml",
        "llmtrain",
    }
    installed -= {"yaml", "llmtrain"}  # shipped in the asset
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_LIKE_LAMBDA, str(folder), ",".join(sorted(installed))],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
