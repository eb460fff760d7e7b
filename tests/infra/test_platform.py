"""The whole app, every environment: cdk-nag, cfn-lint, IAM hygiene, outputs, names and tags.

These checks read every template the app synthesizes (including stacks added later to the
stage), so a new stack is held to the same rules without changing this file.
"""

from __future__ import annotations

import json

import aws_cdk as cdk
import pytest
from aws_cdk import aws_iam as iam
from infra_helpers import ENV, as_list, cfn_lint_unexplained, checkov_reports, synthesize

from llmtrain.core.environments import StackOutput
from training_constructs.nag import acknowledge, acknowledge_wildcards, flatten_reference

# Allow statements may use Resource "*" only for these actions: AWS offers no narrower resource.
RESOURCE_STAR_ALLOWED = {
    "ecr:GetAuthorizationToken": "an ECR login token is account-wide; the images pulled are scoped",
    "cloudwatch:PutMetricData": "metrics have no ARN; the statement is limited to one namespace by condition",
    "ec2:DescribeNetworkInterfaces": "EC2 Describe* actions support no resource-level permissions",
    "ec2:DescribeVpcs": "EC2 Describe* actions support no resource-level permissions",
    "ec2:DescribeDhcpOptions": "EC2 Describe* actions support no resource-level permissions",
    "ec2:DescribeSubnets": "EC2 Describe* actions support no resource-level permissions",
    "ec2:DescribeSecurityGroups": "EC2 Describe* actions support no resource-level permissions",
    "sagemaker:ListTrainingJobs": "List actions have no resource; descriptions are scoped to the prefix",
    "sagemaker:ListTrainingPlans": "List actions have no resource; llmtrain plans lists the account's plans",
    "sagemaker:ListHyperParameterTuningJobs": "List actions have no resource; tuning jobs are found by name",
    "sagemaker:ListProcessingJobs": "List actions have no resource; a preparation's jobs are found by name",
    "sts:GetServiceBearerToken": "no resource-level permission; a condition limits it to CodeArtifact",
    "servicequotas:ListServiceQuotas": "Service Quotas List* actions have no resource ARN",
    "servicequotas:ListAWSDefaultServiceQuotas": "Service Quotas List* actions have no resource ARN",
    # Queued runs (prod): the Service Authorization Reference lists no resource type for these.
    "batch:ListServiceJobs": "ListServiceJobs has no resource type in IAM",
    "batch:DescribeServiceJob": "DescribeServiceJob has no resource type in IAM",
    # The launcher state machine's logging and X-Ray tracing (aws-cdk-lib's own grants).
    **{f"logs:{action}": "Step Functions log delivery is set up account-wide; CloudWatch Logs offers no "
                         "narrower resource for it" for action in (
        "CreateLogDelivery", "GetLogDelivery", "UpdateLogDelivery", "DeleteLogDelivery", "ListLogDeliveries",
        "PutResourcePolicy", "DescribeResourcePolicies", "DescribeLogGroups")},
    **{f"xray:{action}": "X-Ray trace segments, telemetry and sampling rules have no resource ARN"
       for action in ("PutTraceSegments", "PutTelemetryRecords", "GetSamplingRules", "GetSamplingTargets")},
}
def assembly_templates(platform):
    """Every synthesized template of every environment: (environment, path, template)."""
    for path in sorted(platform.outdir.glob("assembly-*/*.template.json")):
        yield path.parent.name.removeprefix("assembly-"), path, json.loads(path.read_text())


def policy_documents(template):
    """(logical ID, kind, document) of every IAM policy language document in a template."""
    for logical_id, resource in template["Resources"].items():
        props = resource.get("Properties", {})
        kind = resource["Type"]
        if kind in ("AWS::IAM::Policy", "AWS::IAM::ManagedPolicy", "AWS::S3::BucketPolicy"):
            yield logical_id, kind, props["PolicyDocument"]
        elif kind == "AWS::IAM::Role":
            yield logical_id, "trust", props["AssumeRolePolicyDocument"]
            for policy in props.get("Policies", []):
                yield logical_id, kind, policy["PolicyDocument"]
        elif kind == "AWS::KMS::Key":
            yield logical_id, kind, props["KeyPolicy"]
        elif kind in ("AWS::EC2::VPCEndpoint", "AWS::SNS::TopicPolicy") and "PolicyDocument" in props:
            yield logical_id, kind, props["PolicyDocument"]


def test_every_environment_synthesizes_every_stack(platform, environments):
    environment_names = {name for name, _, _ in assembly_templates(platform)}
    assert environment_names == set(environments) == {"dev", "prod"}
    for name, config in environments.items():
        stage = platform.stages[name]
        for part in ("network", "storage", "access"):
            stack = getattr(stage, part)
            assert stack.stack_name == f"llmtrain-{name}-{part}"
            assert (stack.account, stack.region) == (config.account, config.region)
            assert stack.node.path == f"{name}/{part.capitalize()}"


def test_cdk_nag_reports_nothing_left_unacknowledged(platform):
    assert platform.nag_violations() == []
    assert platform.synth_error is None, platform.synth_error


def test_cfn_lint_finds_no_errors_in_any_template(platform, environments):
    unexplained = [
        f"{path.name}: {finding}"
        for env, path, template in assembly_templates(platform)
        for finding in cfn_lint_unexplained(template, environments[env].region)
    ]
    assert unexplained == []


# A VPC endpoint's policy is a perimeter, not a grant: it lets this account's principals (condition
# aws:PrincipalAccount) call the endpoint's service, and their own IAM policies hold them to least
# privilege. It may name the service's actions with a wildcard (tests/infra/test_network.py checks it).
PERIMETER_POLICIES = ("AWS::EC2::VPCEndpoint",)


def test_checkov_reads_every_folder_it_is_given(tmp_path):
    """Two assemblies, each read in a run of its own: the second's resources and finding are found
    (checkov 3.3.30, given both at once, reported the first twice and never read the second)."""
    versioned = {"VersioningConfiguration": {"Status": "Enabled"}}
    folders = {tmp_path / "assembly-a": {"Data": versioned},
               tmp_path / "assembly-b": {"Data": {}, "Logs": {}}}
    for folder, buckets in folders.items():
        folder.mkdir()
        resources = {name: {"Type": "AWS::S3::Bucket", "Properties": p} for name, p in buckets.items()}
        (folder / f"{folder.name}.template.json").write_text(json.dumps({"Resources": resources}))
    first, second = checkov_reports(list(folders))
    assert (first.folder, second.folder) == tuple(folders)
    assert first.scanned == ["assembly-a.template.json"] and second.scanned == ["assembly-b.template.json"]
    assert first.read_every_resource and second.read_every_resource
    unversioned = [failure.split()[1:3] for failure in second.failed if "CKV_AWS_21" in failure]
    assert not any("CKV_AWS_21" in failure for failure in first.failed)
    assert unversioned == [["AWS::S3::Bucket.Data", "CKV_AWS_21"], ["AWS::S3::Bucket.Logs", "CKV_AWS_21"]]


def test_checkov_findings_are_all_fixed_or_acknowledged_with_a_reason(platform, environments):
    """Every checkov finding on every environment's templates is fixed, or skipped in the resource's
    metadata next to it (`training_constructs.nag.acknowledge_checkov`), with a specific reason. Each
    environment's assembly is scanned in a run of its own, and every template of each is read."""
    assemblies = sorted(platform.outdir.glob("assembly-*"))
    assert [a.name for a in assemblies] == sorted(f"assembly-{name}" for name in environments)
    for report in checkov_reports(assemblies):
        name = report.folder.name
        assert report.read_every_resource, name
        assert report.failed == [], name
        assert report.skipped, f"{name}: checkov skipped nothing: are the acknowledgments still read?"
        assert all(len(r["check_result"].get("suppress_comment") or "") >= 20 for r in report.skipped), name
        assert report.passed > 150, name


def test_no_statement_allows_every_action_of_a_service(platform):
    for _env, path, template in assembly_templates(platform):
        for logical_id, kind, document in policy_documents(template):
            if kind in PERIMETER_POLICIES:
                continue
            for statement in as_list(document["Statement"]):
                if statement["Effect"] != "Allow":
                    continue
                for action in as_list(statement.get("Action", [])):
                    assert action != "*" and not action.endswith(":*"), f"{path.name} {logical_id}: {action}"
                assert "NotAction" not in statement and "NotResource" not in statement


def test_resource_star_only_for_actions_without_resource_level_permissions(platform):
    seen = set()
    for _env, path, template in assembly_templates(platform):
        for logical_id, kind, document in policy_documents(template):
            if kind in PERIMETER_POLICIES:
                continue
            for statement in as_list(document["Statement"]):
                if statement["Effect"] != "Allow" or "*" not in as_list(statement.get("Resource", [])):
                    continue
                if kind == "AWS::KMS::Key":
                    # In a key policy "*" is the key itself; only the account, CloudWatch Logs, (for alarm
                    # actions on an encrypted topic) CloudWatch of this account and (for the job events'
                    # dead-letter queue) EventBridge rules of this account hold it.
                    principal = statement["Principal"]
                    service = str(principal.get("Service", ""))
                    conditions = statement.get("Condition", {})
                    alarms = service == "cloudwatch.amazonaws.com" and "aws:SourceAccount" in conditions.get(
                        "StringEquals", {}
                    )
                    rules = service == "events.amazonaws.com" and ":events:" in json.dumps(
                        conditions.get("ArnLike", {}).get("aws:SourceArn")
                    )
                    assert "AWS" in principal or service.startswith("logs.") or alarms or rules, principal
                    continue
                actions = as_list(statement["Action"])
                assert as_list(statement["Resource"]) == ["*"], f"{path.name} {logical_id}: mixes * with ARNs"
                unlisted = set(actions) - set(RESOURCE_STAR_ALLOWED)
                assert not unlisted, f"{path.name} {logical_id}: {sorted(unlisted)} on Resource *"
                seen.update(actions)
    # The allow-list holds no stale entries: each is used somewhere.
    assert seen == set(RESOURCE_STAR_ALLOWED)


def test_condition_values_are_strings_as_every_cloudformation_implementation_parses_them(platform):
    """IAM's grammar writes condition values as strings; a JSON number or boolean is accepted by AWS but
    refused by other implementations (moto's policy validator among them: "Syntax errors in policy")."""
    not_strings = []
    for _env, path, template in assembly_templates(platform):
        for logical_id, _kind, document in policy_documents(template):
            for statement in as_list(document["Statement"]):
                for operator, keys in statement.get("Condition", {}).items():
                    for key, value in keys.items():
                        if any(isinstance(v, bool | int | float) for v in as_list(value)):
                            not_strings.append(f"{path.name} {logical_id} {operator} {key}: {value!r}")
    assert not_strings == []


def test_put_metric_data_is_limited_to_the_sagemaker_namespace(platform):
    for _env, _path, template in assembly_templates(platform):
        for _logical_id, _kind, document in policy_documents(template):
            for statement in as_list(document["Statement"]):
                if "cloudwatch:PutMetricData" in as_list(statement.get("Action", [])):
                    assert statement["Condition"]["StringEquals"]["cloudwatch:namespace"]


@pytest.mark.parametrize(
    ("part", "keys"),
    [
        ("network", {StackOutput.VPC_ID, StackOutput.SUBNET_IDS, StackOutput.SECURITY_GROUP_ID}),
        (
            "storage",
            {
                StackOutput.KEY_ARN,
                StackOutput.DATASETS_BUCKET,
                StackOutput.CHECKPOINTS_BUCKET,
                StackOutput.ARTIFACTS_BUCKET,
                StackOutput.CODE_BUCKET,
                StackOutput.ACCESS_LOGS_BUCKET,
            },
        ),
        ("access", {StackOutput.GUARDRAIL_POLICY_ARN}),
    ],
)
def test_stacks_publish_the_outputs_the_cli_reads(platform, part, keys):
    for env in ("dev", "prod"):
        outputs = platform.template_json(env, part)["Outputs"]
        assert keys <= set(outputs), (env, part)
        for key in keys:
            assert outputs[key]["Description"]
    storage = platform.template_json("dev", "storage")["Outputs"]
    assert storage[StackOutput.DATASETS_BUCKET]["Value"] == {"Ref": "DatasetsBucket"}
    assert storage[StackOutput.KEY_ARN]["Value"] == {"Fn::GetAtt": ["PlatformKey", "Arn"]}


@pytest.mark.parametrize("env", ["dev", "prod"])
def test_every_team_has_its_outputs_and_a_single_team_also_the_bare_keys(platform, environments, env):
    teams = [team.name for team in environments[env].teams]
    per_team = (StackOutput.EXECUTION_ROLE_ARN, StackOutput.ENGINEER_POLICY_ARN)
    access = platform.template_json(env, "access")["Outputs"]
    launcher = platform.template_json(env, "launcher")["Outputs"]
    for team in teams:
        assert {StackOutput.team_output(team, key) for key in per_team} <= set(access)
        launcher_keys = ("StateMachineArn", "NotificationTopicArn")
        assert {StackOutput.team_output(team, key) for key in launcher_keys} <= set(launcher)
    bare = {*per_team} <= set(access) and "StateMachineArn" in launcher
    assert bare == (len(teams) == 1), (env, teams)


def test_config_tags_reach_the_resources(platform, environments):
    for env, config in environments.items():
        template = platform.template_json(env, "storage")
        tags = {
            tag["Key"]: tag["Value"] for tag in template["Resources"]["DatasetsBucket"]["Properties"]["Tags"]
        }
        assert tags == {**config.tags, "llmtrain:environment": env}


# -- the acknowledgment helper itself ----------------------------------------------------------


@pytest.fixture(scope="module")
def acknowledgment_probe(tmp_path_factory):
    """Policies whose wildcards are partly explained, checked by the real cdk-nag."""
    outdir = tmp_path_factory.mktemp("nag-probe")
    app = cdk.App(outdir=str(outdir))
    stack = cdk.Stack(app, "Probe", env=ENV)
    role = iam.Role(stack, "Role", assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"))

    def policy(name, sids):
        statements = [
            iam.PolicyStatement(sid=sid, actions=["ecr:GetAuthorizationToken"], resources=["*"])
            for sid in sids
        ]
        return iam.Policy(stack, name, roles=[role], statements=statements)

    acknowledge_wildcards(
        policy("AllExplained", ["First", "Second"]),
        {"First": "first wildcard, explained in detail", "Second": "second one, also explained"},
    )
    acknowledge_wildcards(
        policy("OneUnexplained", ["Explained", "Sneaky"]), {"Explained": "only this statement has a reason"}
    )
    return synthesize(app, outdir, {("probe", "nag"): stack})


def test_wildcard_acknowledgment_needs_a_reason_for_every_statement(acknowledgment_probe):
    flagged = {
        (violation["ruleName"], resource["constructPath"])
        for violation in acknowledgment_probe.nag_violations()
        for resource in violation.get("violatingConstructs", violation.get("violatingResources", []))
    }
    assert flagged == {("AwsSolutions-IAM5[Resource::*]", "Probe/OneUnexplained/Resource")}


def test_acknowledgments_need_a_specific_reason():
    stack = cdk.Stack(cdk.App(), "Short")
    with pytest.raises(ValueError, match="specific reason"):
        acknowledge(stack, "AwsSolutions-S1", "not needed")
    with pytest.raises(ValueError, match="specific reason"):
        acknowledge_wildcards(stack, {"Sid": "because"})


def test_references_are_named_as_cdk_nag_names_them():
    assert (
        flatten_reference({"Fn::Join": ["", [{"Fn::GetAtt": ["Bucket12", "Arn"]}, "/*"]]})
        == "<Bucket12.Arn>/*"
    )
    assert flatten_reference({"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"}, ":s3:::b/*"]]}) == (
        "arn:<AWS::Partition>:s3:::b/*"
    )
    assert flatten_reference({"Fn::ImportValue": "dev-Storage:Export1"}) == "dev-Storage:Export1"
    assert flatten_reference({"Fn::Sub": "arn:${AWS::Partition}:x"}) == "arn:<AWS::Partition>:x"
