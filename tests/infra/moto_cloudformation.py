"""Deploy a synthesized stage into moto's CloudFormation, and switch moto's IAM enforcement on.

What is real: the templates the app synthesizes, every stack of the stage, created in dependency
order by moto's CloudFormation with cross-stack exports; the file assets (the Lambda functions' code)
uploaded to the bootstrap bucket the templates name; moto's IAM policy evaluation (actions and
resources) once enforcement is on.

What the test supplies, because moto cannot do it, each said where it happens:

- Custom resources (the JobTemplates' uploads, the VPC's default-security-group cleanup) run their
  provider Lambda in Docker in moto. `deploy_stage` answers each one with SUCCESS instead, after
  moto created the rest of its stack.
- The environment's AWS Batch queues (prod): moto's CloudFormation models none of the three types as
  the platform uses them. `AWS::Batch::SchedulingPolicy` it does not model, but its Batch API does:
  `deploy_stage` creates the policy through moto's Batch backend (DescribeSchedulingPolicies then
  answers with its shares and weights). `AWS::Batch::ServiceEnvironment` neither models, and moto's
  `AWS::Batch::JobQueue` knows only queues of compute environments (its backend refuses a queue
  without one): for those, and only for SAGEMAKER_TRAINING queues, a stand-in creates nothing and
  answers Ref and Fn::GetAtt with the ARN CloudFormation returns, so what references them (the
  launchers' functions and policies) deploys. `DeployedStage.supplied_resources` lists them; their
  properties are asserted on the synthesized template (tests/infra/test_queues.py).
- Four spots where moto's CloudFormation models differ from CloudFormation (`_moto_compatible`): an
  `AWS::KMS::Key`'s tags are read in the KMS API's shape (TagKey/TagValue) rather than
  CloudFormation's (Key/Value), an `AWS::SSM::Parameter`'s tags as a list of Key/Value pairs rather
  than CloudFormation's map of key to value, a security-group rule for IP protocol 50 (ESP) needs
  ports, which EC2 ignores for that protocol, and an output whose value is an attribute of a resource
  type moto does not model (the CodeArtifact repository's ARN) fails the whole stack, where moto skips
  the resource itself: such an output is left out (`DeployedStage.outputs_left_out`). The copy
  deployed is changed in exactly those places.
- moto's IAM enforcement asks each service for the resource of a request; Step Functions' and
  SageMaker's responses in moto do not say it (every request is "*", which no scoped policy matches).
  `iam_enforced` supplies it from the request's parameters, as AWS's own authorization does: the
  state machine or execution ARN, the training job's ARN (names lowercased, as SageMaker's ARNs are),
  and likewise for SSM Parameter Store, the parameter's (or the path's) ARN, and for CloudWatch Logs
  the log stream's ARN (GetLogEvents) or the log group's (FilterLogEvents, DescribeLogStreams ...).

moto ignores IAM condition keys (it evaluates Action and Resource only), and skips resource types it
does not model (CloudWatch alarms, bucket and topic policies, SNS subscriptions, security-group
egress rules): what conditions enforce is asserted on the synthesized statements instead.
"""

from __future__ import annotations

import io
import json
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import boto3
from moto import settings
from moto.awslambda.models import LambdaFunction
from moto.batch.models import JobQueue as MotoJobQueue
from moto.batch.models import batch_backends
from moto.cloudformation import cloudformation_backends
from moto.cloudformation import parsing as moto_parsing
from moto.cloudformation.exceptions import UnformattedGetAttTemplateException
from moto.cloudformation.parsing import resource_class_from_type
from moto.core.authorization import ActionAuthenticatorMixin
from moto.core.common_models import CloudFormationModel
from moto.logs.responses import LogsResponse
from moto.sagemaker.responses import SageMakerResponse
from moto.ssm.responses import SimpleSystemManagerResponse
from moto.stepfunctions.responses import StepFunctionResponse

BOOTSTRAP_VERSION_PARAMETER = "/cdk-bootstrap/hnb659fds/version"


@dataclass
class DeployedStage:
    """The stacks of one stage as moto created them: status, outputs and resources by stack name."""

    account: str
    region: str
    statuses: dict[str, str] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    resources: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    answered_custom_resources: list[str] = field(default_factory=list)
    # Outputs of attributes of resource types moto does not model (see the module's docstring).
    outputs_left_out: list[str] = field(default_factory=list)
    # Resources the test supplied because moto's CloudFormation does not model them: "stack/id (type)".
    supplied_resources: list[str] = field(default_factory=list)


def deploy_stage(assembly_dir: Path, account: str, region: str) -> DeployedStage:
    """Create every stack of a synthesized stage's assembly in moto (inside an active mock_aws)."""
    manifest = json.loads((assembly_dir / "manifest.json").read_text())
    stacks = {
        artifact_id: artifact
        for artifact_id, artifact in manifest["artifacts"].items()
        if artifact["type"] == "aws:cloudformation:stack"
    }
    boto3.client("ssm", region_name=region).put_parameter(
        Name=BOOTSTRAP_VERSION_PARAMETER, Value="30", Type="String"
    )
    _upload_file_assets(assembly_dir, region)
    cloudformation = boto3.client("cloudformation", region_name=region)
    deployed = DeployedStage(account=account, region=region)
    # Custom resources' providers would run in Docker; they are answered below instead.
    with (
        mock.patch.object(LambdaFunction, "invoke", lambda self, body, headers, response_headers: "{}"),
        mock.patch.object(moto_parsing, "resource_class_from_type", _with_batch_queues),
    ):
        for artifact_id in _dependency_order(stacks):
            properties = stacks[artifact_id]["properties"]
            name = properties.get("stackName", artifact_id)
            template = _moto_compatible(json.loads((assembly_dir / properties["templateFile"]).read_text()))
            deployed.outputs_left_out += _leave_out_unmodelled_outputs(template)
            cloudformation.create_stack(
                StackName=name, TemplateBody=json.dumps(template), Capabilities=["CAPABILITY_NAMED_IAM"]
            )
            deployed.answered_custom_resources += _answer_custom_resources(name, account, region)
            described = cloudformation.describe_stacks(StackName=name)["Stacks"][0]
            deployed.statuses[name] = described["StackStatus"]
            deployed.outputs.update({o["OutputKey"]: o["OutputValue"] for o in described.get("Outputs", [])})
            deployed.resources[name] = cloudformation.list_stack_resources(StackName=name)[
                "StackResourceSummaries"
            ]
            deployed.supplied_resources += [
                f"{name}/{logical_id} ({resource['Type']})"
                for logical_id, resource in template["Resources"].items()
                if _supplied_model(resource["Type"], resource.get("Properties", {})) is not None
            ]
    return deployed


def _dependency_order(stacks: dict[str, Any]) -> list[str]:
    ordered: list[str] = []

    def visit(artifact_id: str) -> None:
        if artifact_id in ordered:
            return
        for dependency in stacks[artifact_id].get("dependencies", []):
            if dependency in stacks:
                visit(dependency)
        ordered.append(artifact_id)

    for artifact_id in stacks:
        visit(artifact_id)
    return ordered


def _upload_file_assets(assembly_dir: Path, region: str) -> None:
    """The file assets, zipped as the CDK CLI publishes them, into the bucket the templates name."""
    s3 = boto3.client("s3", region_name=region)
    buckets: set[str] = set()
    for manifest in assembly_dir.glob("*.assets.json"):
        for asset in json.loads(manifest.read_text())["files"].values():
            source = (assembly_dir / asset["source"]["path"]).resolve()
            body = _zipped(source) if source.is_dir() else source.read_bytes()
            for destination in asset["destinations"].values():
                bucket = destination["bucketName"].replace("${AWS::Region}", region)
                if bucket not in buckets:
                    s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": region})
                    buckets.add(bucket)
                s3.put_object(Bucket=bucket, Key=destination["objectKey"], Body=body)


def _zipped(folder: Path) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                archive.write(path, path.relative_to(folder))
    return buffer.getvalue()


# moto files its models by the service their module names (`<package>.<service>`), each class itself.
_MOTO_MODULE = "moto_cloudformation.platform_queues"


class _BatchResource(CloudFormationModel):
    """A Batch resource of the platform's queues, created as the module's docstring says."""

    __module__ = _MOTO_MODULE

    resource = ""  # the ARN's resource type
    name_property = ""
    arn_attribute = ""

    def __init__(self, arn: str):
        self.arn = arn

    @property
    def physical_resource_id(self) -> str:
        return self.arn

    @classmethod
    def has_cfn_attr(cls, attr: str) -> bool:
        return attr == cls.arn_attribute

    def get_cfn_attribute(self, attribute_name: str) -> str:
        if attribute_name != self.arn_attribute:
            raise UnformattedGetAttTemplateException()
        return self.arn

    @classmethod
    def create_from_cloudformation_json(cls, resource_name, cloudformation_json, account_id, region_name,
                                        **kwargs):
        name = cloudformation_json["Properties"].get(cls.name_property, resource_name)
        return cls(f"arn:aws:batch:{region_name}:{account_id}:{cls.resource}/{name}")


class _ServiceEnvironmentStandIn(_BatchResource):
    __module__ = _MOTO_MODULE
    resource, name_property = "service-environment", "ServiceEnvironmentName"
    arn_attribute = "ServiceEnvironmentArn"


class _SageMakerJobQueueStandIn(_BatchResource):
    __module__ = _MOTO_MODULE
    resource, name_property, arn_attribute = "job-queue", "JobQueueName", "JobQueueArn"


class _SchedulingPolicyInMotosBatch(_BatchResource):
    __module__ = _MOTO_MODULE
    name_property, arn_attribute = "Name", "Arn"

    @classmethod
    def create_from_cloudformation_json(cls, resource_name, cloudformation_json, account_id, region_name,
                                        **kwargs):
        properties = cloudformation_json["Properties"]
        fair_share = properties.get("FairsharePolicy", {})
        created = batch_backends[account_id][region_name].create_scheduling_policy(
            name=properties.get("Name", resource_name),
            fairshare_policy={
                "shareDecaySeconds": fair_share.get("ShareDecaySeconds"),
                "computeReservation": fair_share.get("ComputeReservation"),
                "shareDistribution": [
                    {"shareIdentifier": share["ShareIdentifier"], "weightFactor": share.get("WeightFactor")}
                    for share in fair_share.get("ShareDistribution", [])
                ],
            },
            tags=properties.get("Tags") or {},
        )
        return cls(created.arn)


def _supplied_model(resource_type: str, properties: dict[str, Any]) -> type[CloudFormationModel] | None:
    if resource_type == "AWS::Batch::ServiceEnvironment":
        return _ServiceEnvironmentStandIn
    if resource_type == "AWS::Batch::SchedulingPolicy":
        return _SchedulingPolicyInMotosBatch
    sagemaker_queue = properties.get("JobQueueType") == "SAGEMAKER_TRAINING"
    if resource_type == MotoJobQueue.cloudformation_type() and sagemaker_queue:
        return _SageMakerJobQueueStandIn
    return None


_MOTO_RESOURCE_CLASS = resource_class_from_type


def _with_batch_queues(resource_type: str) -> type[CloudFormationModel]:
    """moto's model of a type, with the queues' types supplied (a job queue's model tells a
    SAGEMAKER_TRAINING queue from moto's kind by its properties when it is created)."""
    if resource_type in ("AWS::Batch::ServiceEnvironment", "AWS::Batch::SchedulingPolicy"):
        return _supplied_model(resource_type, {})
    if resource_type == MotoJobQueue.cloudformation_type():
        return _JobQueueByType
    return _MOTO_RESOURCE_CLASS(resource_type)


class _JobQueueByType(_SageMakerJobQueueStandIn):
    """moto's JobQueue for a queue of compute environments; the stand-in for a SAGEMAKER_TRAINING one."""

    __module__ = _MOTO_MODULE

    @classmethod
    def create_from_cloudformation_json(cls, resource_name, cloudformation_json, account_id, region_name,
                                        **kwargs):
        if cloudformation_json["Properties"].get("JobQueueType") == "SAGEMAKER_TRAINING":
            return super().create_from_cloudformation_json(resource_name, cloudformation_json, account_id,
                                                           region_name, **kwargs)
        return MotoJobQueue.create_from_cloudformation_json(resource_name, cloudformation_json, account_id,
                                                            region_name, **kwargs)

    @classmethod
    def has_cfn_attr(cls, attr: str) -> bool:
        return attr == cls.arn_attribute or MotoJobQueue.has_cfn_attr(attr)


def _moto_compatible(template: dict[str, Any]) -> dict[str, Any]:
    """The three changes moto's CloudFormation models need (see the module's docstring)."""
    for resource in template["Resources"].values():
        properties = resource.get("Properties", {})
        if resource["Type"] == "AWS::KMS::Key" and "Tags" in properties:
            properties["Tags"] = [{"TagKey": t["Key"], "TagValue": t["Value"]} for t in properties["Tags"]]
        if resource["Type"] == "AWS::SSM::Parameter" and isinstance(properties.get("Tags"), dict):
            properties["Tags"] = [{"Key": key, "Value": value} for key, value in properties["Tags"].items()]
        rule_types = ("AWS::EC2::SecurityGroupIngress", "AWS::EC2::SecurityGroupEgress")
        if resource["Type"] in rule_types and properties.get("IpProtocol") == "50":
            properties.setdefault("FromPort", -1)
            properties.setdefault("ToPort", -1)
    return template


def _leave_out_unmodelled_outputs(template: dict[str, Any]) -> list[str]:
    """Remove the outputs of attributes of resources moto does not model; their names."""
    left_out = []
    for name, output in list(template.get("Outputs", {}).items()):
        value = output.get("Value")
        if not isinstance(value, dict) or "Fn::GetAtt" not in value:
            continue
        resource_type = template["Resources"][value["Fn::GetAtt"][0]]["Type"]
        if resource_class_from_type(resource_type) is None:
            del template["Outputs"][name]
            left_out.append(name)
    return left_out


def _answer_custom_resources(stack_name: str, account: str, region: str, timeout: float = 30) -> list[str]:
    backend = cloudformation_backends[account][region]
    stack = next(s for s in backend.stacks.values() if s.name == stack_name)
    answered = []
    for logical_id, custom_resource in stack.custom_resources.items():
        custom_resource.set_data({})
        answered.append(f"{stack_name}/{logical_id}")
    stack.verify_readiness()
    deadline = time.monotonic() + timeout
    while stack.status.endswith("IN_PROGRESS") and time.monotonic() < deadline:
        time.sleep(0.05)
    return answered


def _step_functions_resource(self: StepFunctionResponse) -> str:
    body = json.loads(self.body or "{}")
    return body.get("stateMachineArn") or body.get("executionArn") or "*"


def _sagemaker_resource(self: SageMakerResponse) -> str:
    body = json.loads(self.body or "{}")
    for name_field, kind in (("TrainingJobName", "training-job"), ("ProcessingJobName", "processing-job")):
        if body.get(name_field):
            return f"arn:aws:sagemaker:{self.region}:{self.current_account}:{kind}/{body[name_field].lower()}"
    return "*"


def _ssm_resource(self: SimpleSystemManagerResponse) -> str:
    body = json.loads(self.body or "{}")
    name = body.get("Path") or body.get("Name") or next(iter(body.get("Names") or []), None)
    if not name:
        return "*"
    return f"arn:aws:ssm:{self.region}:{self.current_account}:parameter/{name.lstrip('/')}"


# CloudWatch Logs authorizes these on the log stream they read (GetLogEvents), every other action on
# its log group (AWS's service authorization reference, "Actions defined by Amazon CloudWatch Logs").
_LOG_STREAM_ACTIONS = ("GetLogEvents", "PutLogEvents", "CreateLogStream")


def _logs_resource(self: LogsResponse) -> str:
    body = json.loads(self.body or "{}")
    group = body.get("logGroupName")
    if not group:
        return "*"
    arn = f"arn:aws:logs:{self.region}:{self.current_account}:log-group:{group}"
    stream = body.get("logStreamName")
    return f"{arn}:log-stream:{stream}" if stream and self._get_action() in _LOG_STREAM_ACTIONS else arn


@contextmanager
def iam_enforced() -> Iterator[None]:
    """moto evaluates every request's identity policies while inside (see the module's docstring)."""
    with (
        mock.patch.object(StepFunctionResponse, "_determine_resource", _step_functions_resource, create=True),
        mock.patch.object(SageMakerResponse, "_determine_resource", _sagemaker_resource, create=True),
        mock.patch.object(SimpleSystemManagerResponse, "_determine_resource", _ssm_resource, create=True),
        mock.patch.object(LogsResponse, "_determine_resource", _logs_resource, create=True),
        mock.patch.object(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0),
        mock.patch.object(ActionAuthenticatorMixin, "request_count", 0),
    ):
        yield
