"""Run the synthesized launcher state machine in moto, with its real Lambda handlers.

What is real: the state machine definition, taken from the synthesized CloudFormation template of
the launcher stack and resolved the way CloudFormation would resolve it (``CloudFormationResolver``:
Ref, Fn::GetAtt, Fn::Join, Fn::ImportValue ... with well-formed physical ids); moto's Step Functions
interpreter executing it (``execute_state_machine``); the Lambda handlers (``llmtrain.handlers.launcher``)
called with the event Step Functions builds, the environment the template gives the function and the
template registry bundled in the function's code asset; their AWS calls, and SNS, against moto.

What is supplied in test code, because moto has neither:

- Lambda execution: moto runs Lambda code only in Docker. ``_invoke_in_process`` replaces moto's
  invoke for the ``lambda:invoke`` integration: it imports the function's handler and calls it in
  this process, returning what the Lambda Python runtime returns (the JSON result, or
  ``FunctionError`` with ``{"errorType", "errorMessage", ...}`` for an exception).
- ``sagemaker:createTrainingJob.sync``: moto's interpreter does not implement SageMaker's optimised
  integration. ``SimulatedTrainingJobs`` implements it as Step Functions does: CreateTrainingJob
  (through a botocore client that validates the request against SageMaker's API model, into moto's
  SageMaker), then waits for the job to end; the job's end is scripted per attempt (``JobOutcome``).
  A job that ends badly fails the state with ``States.TaskFailed`` and the DescribeTrainingJob
  output as the cause; an API error fails it with ``SageMaker.AmazonSageMakerException`` and
  SageMaker's message.
- ``sagemaker:createProcessingJob.sync`` (the preparation state machine, ``machine="Preparations"``):
  ``SimulatedProcessingJobs`` (tests/llmtrain/processing_support.py) creates the job through the
  validating client and runs it as SageMaker would, each instance's prepare_data on this machine's
  CPU; a job that ends badly fails the state with ``States.TaskFailed`` and its description as cause.
- Wait states: moto really sleeps; the harness records the requested seconds and does not sleep.
- AWS Batch, for a launcher with queues: moto implements no service job. The state machine's
  `aws-sdk:batch:submitServiceJob` task and the functions' Batch client reach `SimulatedBatch`
  (tests/llmtrain/batch_support.py) instead, the task's parameters turned from Step Functions'
  PascalCase into the API's names by botocore's model as Step Functions does (a name the model
  lacks stays and fails its validation). When a service job leaves its queue, the training job
  Batch would create is created in moto's SageMaker from the payload (through the validating
  client), named as AWS's example shows Batch naming them (`AWSBatch<name><hash>`, cut to 63) and
  tagged with the service job's tags; it ends as its `JobOutcome` scripts.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import json
import os
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import boto3
import botocore.session
from batch_support import QueueOutcome, SimulatedBatch
from botocore.exceptions import ClientError
from moto import mock_aws
from moto.sagemaker.models import sagemaker_backends
from moto.stepfunctions.parser.api import HistoryEventType, TaskFailedEventDetails
from moto.stepfunctions.parser.asl.component.common.error_name.custom_error_name import CustomErrorName
from moto.stepfunctions.parser.asl.component.common.error_name.failure_event import FailureEvent
from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name import StatesErrorName
from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name_type import (
    StatesErrorNameType,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_task import (
    lambda_eval_utils,
    state_task_factory,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
    state_task_service_callback as callback,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.resource import ResourceCondition
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_aws_sdk import (
    StateTaskServiceAwsSdk,
)
from moto.stepfunctions.parser.asl.component.state.wait.wait_function.wait_function import WaitFunction
from moto.stepfunctions.parser.asl.eval.event.event_detail import EventDetails
from moto.stepfunctions.parser.utils import camel_to_snake_case
from processing_support import ProcessingJobEnded, SimulatedProcessingJobs

from llmtrain.core.platform import QUEUED_JOB_NAME_PREFIX, QUEUED_NAME_KEPT
from llmtrain.handlers import launcher as launcher_functions

ACCOUNT = "123456789012"  # moto's default account: the stage is synthesized for it
REGION = "us-east-1"
PARK_SECONDS = 60


# --- resolving the synthesized templates ---------------------------------------------------------


class CloudFormationResolver:
    """Resolves intrinsic functions across the stacks of one synthesized stage.

    Physical ids are invented per resource type, well formed (``subnet-...``, role and key ARNs,
    bucket names); ``physical`` overrides them, e.g. with the ARN of a topic created in moto.
    """

    def __init__(
        self,
        templates: Mapping[str, Mapping[str, Any]],
        *,
        account: str = ACCOUNT,
        region: str = REGION,
        physical: Mapping[tuple[str, str], str] | None = None,
    ):
        self.templates = templates
        self.account = account
        self.region = region
        self.physical = dict(physical or {})
        self._exports: dict[str, Any] | None = None

    def resolve(self, node: Any, stack: str) -> Any:
        if isinstance(node, list):
            return [self.resolve(item, stack) for item in node]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            ((key, value),) = node.items()
            function = _INTRINSICS.get(key)
            if function is not None:
                return function(self, value, stack)
        return {key: self.resolve(value, stack) for key, value in node.items()}

    def resource(self, stack: str, logical_id: str) -> Mapping[str, Any]:
        return self.templates[stack]["Resources"][logical_id]

    def ref(self, logical_id: str, stack: str) -> str:
        pseudo = {
            "AWS::Partition": "aws",
            "AWS::Region": self.region,
            "AWS::AccountId": self.account,
            "AWS::URLSuffix": "amazonaws.com",
            "AWS::StackName": stack,
        }
        if logical_id in pseudo:
            return pseudo[logical_id]
        if (stack, logical_id) in self.physical:
            return self.physical[(stack, logical_id)]
        resource = self.resource(stack, logical_id)
        kind = resource["Type"]
        name = _physical_name(stack, logical_id)
        batch = _BATCH_NAMES.get(kind)
        if batch is not None:  # Ref is the ARN, named by the resource's own name property
            resource_type, name_property = batch
            named = resource["Properties"].get(name_property, name)
            return f"arn:aws:batch:{self.region}:{self.account}:{resource_type}/{named}"
        refs = {
            "AWS::S3::Bucket": name.lower()[:63],
            "AWS::EC2::Subnet": "subnet-" + _digest(name, 17),
            "AWS::EC2::SecurityGroup": "sg-" + _digest(name, 17),
            "AWS::SNS::Topic": f"arn:aws:sns:{self.region}:{self.account}:{name}",
            "AWS::StepFunctions::StateMachine": (
                f"arn:aws:states:{self.region}:{self.account}:stateMachine:{name}"
            ),
            "AWS::Lambda::Function": name,
            "AWS::Logs::LogGroup": name,
            "AWS::IAM::Role": name,
            "AWS::KMS::Key": str(uuid.UUID(_digest(name, 32))),
        }
        if kind not in refs:
            raise KeyError(f"the resolver does not know Ref of {kind} ({stack}/{logical_id})")
        return refs[kind]

    def get_att(self, logical_id: str, attribute: str, stack: str) -> str:
        kind = self.resource(stack, logical_id)["Type"]
        ref = self.ref(logical_id, stack)
        arns = {
            ("AWS::IAM::Role", "Arn"): f"arn:aws:iam::{self.account}:role/{ref}",
            ("AWS::KMS::Key", "Arn"): f"arn:aws:kms:{self.region}:{self.account}:key/{ref}",
            ("AWS::Lambda::Function", "Arn"): f"arn:aws:lambda:{self.region}:{self.account}:function:{ref}",
            ("AWS::Logs::LogGroup", "Arn"): f"arn:aws:logs:{self.region}:{self.account}:log-group:{ref}:*",
            ("AWS::S3::Bucket", "Arn"): f"arn:aws:s3:::{ref}",
            ("AWS::EC2::SecurityGroup", "GroupId"): ref,
            ("AWS::SNS::Topic", "TopicArn"): ref,
            ("AWS::StepFunctions::StateMachine", "Arn"): ref,
            ("AWS::Batch::JobQueue", "JobQueueArn"): ref,
            ("AWS::Batch::ServiceEnvironment", "ServiceEnvironmentArn"): ref,
            ("AWS::Batch::SchedulingPolicy", "Arn"): ref,
        }
        if (kind, attribute) not in arns:
            raise KeyError(f"the resolver does not know {kind}.{attribute} ({stack}/{logical_id})")
        return arns[(kind, attribute)]

    def import_value(self, name: str) -> Any:
        if self._exports is None:
            self._exports = {}
            for stack, template in self.templates.items():
                for output in template.get("Outputs", {}).values():
                    if "Export" in output:
                        export = self.resolve(output["Export"]["Name"], stack)
                        self._exports[export] = (output["Value"], stack)
        value, stack = self._exports[name]
        return self.resolve(value, stack)


_BATCH_NAMES = {
    "AWS::Batch::JobQueue": ("job-queue", "JobQueueName"),
    "AWS::Batch::ServiceEnvironment": ("service-environment", "ServiceEnvironmentName"),
    "AWS::Batch::SchedulingPolicy": ("scheduling-policy", "Name"),
}


def _physical_name(stack: str, logical_id: str) -> str:
    return f"{stack}-{logical_id}"[:64]


def _digest(text: str, length: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def _join(resolver: CloudFormationResolver, value: Any, stack: str) -> str:
    delimiter, items = value
    return delimiter.join(str(resolver.resolve(item, stack)) for item in items)


def _select(resolver: CloudFormationResolver, value: Any, stack: str) -> Any:
    index, items = value
    return resolver.resolve(items, stack)[int(resolver.resolve(index, stack))]


def _split(resolver: CloudFormationResolver, value: Any, stack: str) -> list[str]:
    delimiter, text = value
    return str(resolver.resolve(text, stack)).split(delimiter)


def _get_att(resolver: CloudFormationResolver, value: Any, stack: str) -> str:
    logical_id, attribute = value if isinstance(value, list) else value.split(".", 1)
    return resolver.get_att(logical_id, attribute, stack)


_INTRINSICS: dict[str, Callable[[CloudFormationResolver, Any, str], Any]] = {
    "Ref": lambda resolver, value, stack: resolver.ref(value, stack),
    "Fn::GetAtt": _get_att,
    "Fn::Join": _join,
    "Fn::Select": _select,
    "Fn::Split": _split,
    "Fn::ImportValue": lambda resolver, value, stack: resolver.import_value(resolver.resolve(value, stack)),
}


# --- the synthesized launcher ------------------------------------------------------------------------


@dataclass
class LambdaFunction:
    """One launcher function as the template deploys it."""

    arn: str
    handler: str
    environment: dict[str, str]
    code_dir: Path


@dataclass
class SynthesizedLauncher:
    """The launcher stack of a synthesized stage: its definition and functions, resolved."""

    definition: dict[str, Any]
    functions: dict[str, LambdaFunction]
    topic_logical_id: str
    template: Mapping[str, Any]

    @classmethod
    def from_assembly(
        cls,
        assembly_dir: Path,
        launcher_stack: str,
        templates: Mapping[str, Mapping[str, Any]],
        topic_arn: str,
        machine_prefix: str = "Launcher",
    ) -> SynthesizedLauncher:
        template = templates[launcher_stack]
        topic_id = _only(template, "AWS::SNS::Topic")
        resolver = CloudFormationResolver(templates, physical={(launcher_stack, topic_id): topic_arn})
        machine = template["Resources"][_only(template, "AWS::StepFunctions::StateMachine", machine_prefix)]
        definition = json.loads(resolver.resolve(machine["Properties"]["DefinitionString"], launcher_stack))
        assets = {
            key: value
            for manifest in assembly_dir.glob("*.assets.json")
            for key, value in json.loads(manifest.read_text())["files"].items()
        }
        functions = {}
        for logical_id, resource in template["Resources"].items():
            properties = resource["Properties"]
            if resource["Type"] != "AWS::Lambda::Function" or "llmtrain" not in properties.get("Handler", ""):
                continue
            asset = assets[properties["Code"]["S3Key"].removesuffix(".zip")]["source"]["path"]
            arn = resolver.get_att(logical_id, "Arn", launcher_stack)
            functions[arn] = LambdaFunction(
                arn=arn,
                handler=properties["Handler"],
                code_dir=(assembly_dir / asset).resolve(),
                environment=resolver.resolve(properties["Environment"]["Variables"], launcher_stack),
            )
        return cls(definition=definition, functions=functions, topic_logical_id=topic_id, template=template)


def _only(template: Mapping[str, Any], resource_type: str, prefix: str = "") -> str:
    found = [lid for lid, resource in template["Resources"].items()
             if resource["Type"] == resource_type and lid.startswith(prefix)]
    assert len(found) == 1, f"expected one {resource_type}, found {found}"
    return found[0]


# --- Lambda, in process ----------------------------------------------------------------------------


class InProcessLambda:
    """Calls the launcher's handlers in this process, as the Lambda Python runtime would."""

    def __init__(self, functions: Mapping[str, LambdaFunction]):
        self.functions = functions
        self.invocations: list[tuple[str, Any]] = []
        self._lock = threading.Lock()

    def invoke(self, parameters: Mapping[str, Any], region: str, state_credentials: Any) -> dict[str, Any]:
        function = self.functions[parameters["FunctionName"]]
        event = json.loads(parameters.get("Payload") or b"{}")
        module_name, _, attribute = function.handler.rpartition(".")
        handler = getattr(importlib.import_module(module_name), attribute)
        environment = {**function.environment, "LLMTRAIN_TEMPLATES_DIR": str(function.code_dir / "templates")}
        with self._lock, mock.patch.dict(os.environ, environment):
            self.invocations.append((attribute, event))
            try:
                result = json.loads(json.dumps(handler(event, None)))
            except Exception as error:  # noqa: BLE001 - the runtime reports every exception this way
                return {
                    "StatusCode": 200,
                    "FunctionError": "Unhandled",
                    "Payload": {
                        "errorType": type(error).__name__,
                        "errorMessage": str(error),
                        "requestId": str(uuid.uuid4()),
                        "stackTrace": traceback.format_tb(error.__traceback__),
                    },
                }
        return {"StatusCode": 200, "Payload": result, "ExecutedVersion": "$LATEST"}


# --- SageMaker's optimised integration, simulated ----------------------------------------------------


@dataclass
class JobOutcome:
    """How one CreateTrainingJob attempt ends."""

    status: str = "Completed"  # Completed, Failed or Stopped
    failure_reason: str | None = None
    api_error: tuple[str, str] | None = None  # (code, message): CreateTrainingJob itself fails
    metrics: Mapping[str, float] = field(default_factory=lambda: {"train:loss": 2.25, "eval:loss": 2.5})
    billable_seconds: int = 5400
    hold: threading.Event | None = None  # the job stays InProgress until this is set

    @classmethod
    def capacity_error(cls) -> JobOutcome:
        return cls(
            status="Failed",
            failure_reason="CapacityError: Unable to provision requested ML compute "
            "capacity. Please retry using a different ML instance type.",
            billable_seconds=0,
        )

    @classmethod
    def quota_error(
        cls,
        quota: str = "ml.p4d.24xlarge for training job usage",
        limit: int = 2,
        in_use: int = 2,
        requested: int = 2,
    ) -> JobOutcome:
        return cls(
            api_error=(
                "ResourceLimitExceeded",
                (
                    f"The account-level service limit '{quota}' is {limit} Instances, with current "
                    f"utilization of {in_use} Instances and a request delta of {requested} Instances. "
                    "Please use AWS Service Quotas to request an increase for this quota."
                ),
            )
        )

    @classmethod
    def algorithm_error(cls, reason: str) -> JobOutcome:
        return cls(status="Failed", failure_reason=reason, billable_seconds=120)

    @classmethod
    def throttled(cls) -> JobOutcome:
        """SageMaker refuses the CreateTrainingJob call for its rate: no job is created."""
        return cls(api_error=("ThrottlingException", "Rate exceeded"))


class TrainingJobEnded(Exception):
    """A .sync training job ended in Failed or Stopped."""

    def __init__(self, description: Mapping[str, Any]):
        super().__init__(description.get("FailureReason"))
        self.description = description


class SimulatedTrainingJobs:
    """Scripted outcomes, one per CreateTrainingJob call in order, and what the state machine sent."""

    def __init__(self, outcomes: list[JobOutcome]):
        self.outcomes = list(outcomes)
        self.requests: list[dict[str, Any]] = []
        self.tuning_requests: list[dict[str, Any]] = []
        self._outcome_of: dict[str, JobOutcome] = {}

    def create(self, request: dict[str, Any]) -> str:
        if not self.outcomes:
            raise AssertionError(f"no scripted outcome left for CreateTrainingJob #{len(self.requests) + 1}")
        outcome = self.outcomes.pop(0)
        if outcome.api_error:
            self.requests.append(request)
            code, message = outcome.api_error
            raise ClientError(
                {
                    "Error": {"Code": code, "Message": message},
                    "ResponseMetadata": {"HTTPStatusCode": 400, "RequestId": str(uuid.uuid4())},
                },
                "CreateTrainingJob",
            )
        # A client that validates the request against SageMaker's API model, as the service does.
        client = boto3.client("sagemaker", region_name=REGION)
        arn = client.create_training_job(**request)["TrainingJobArn"]
        job = self._moto_job(request["TrainingJobName"])
        job.training_job_status = job.secondary_status = "InProgress"
        self._outcome_of[request["TrainingJobName"]] = outcome
        self.requests.append(request)  # last: a test that sees it may rely on the job being in moto
        return arn

    def finish(self, job_name: str) -> dict[str, Any] | None:
        """None while the job runs; its description once ended (raises TrainingJobEnded if not Completed)."""
        outcome = self._outcome_of[job_name]
        if outcome.hold is not None and not outcome.hold.is_set():
            return None
        job = self._moto_job(job_name)
        job.training_job_status = job.secondary_status = outcome.status
        job.billable_time_in_seconds = outcome.billable_seconds
        job.final_metric_data_list = (
            [
                {"MetricName": name, "Value": value, "Timestamp": job.creation_time}
                for name, value in outcome.metrics.items()
            ]
            if outcome.status == "Completed"
            else []
        )
        if outcome.failure_reason:
            job.failure_reason = outcome.failure_reason
        description = _json_ready(
            boto3.client("sagemaker", region_name=REGION).describe_training_job(TrainingJobName=job_name)
        )
        description.pop("ResponseMetadata", None)
        if outcome.status != "Completed":
            raise TrainingJobEnded(description)
        return description

    @staticmethod
    def _moto_job(job_name: str):
        return sagemaker_backends[ACCOUNT][REGION].training_jobs[job_name]

    # -- sagemaker:createHyperParameterTuningJob.sync (a tune) --------------------------------------

    def create_tuning(self, request: dict[str, Any]) -> str:
        """CreateHyperParameterTuningJob through a botocore client that validates the request against
        SageMaker's API model, into moto's SageMaker; the tuning job then ends as scripted."""
        if not self.outcomes:
            raise AssertionError(f"no scripted outcome left for tuning job #{len(self.tuning_requests) + 1}")
        outcome = self.outcomes.pop(0)
        client = boto3.client("sagemaker", region_name=REGION)
        arn = client.create_hyper_parameter_tuning_job(**request)["HyperParameterTuningJobArn"]
        name = request["HyperParameterTuningJobName"]
        tuning = sagemaker_backends[ACCOUNT][REGION].hyper_parameter_tuning_jobs[name]
        tuning.hyper_parameter_tuning_job_status = "InProgress"
        self._outcome_of[name] = outcome
        self.tuning_requests.append(request)
        return arn

    def finish_tuning(self, name: str) -> dict[str, Any] | None:
        outcome = self._outcome_of[name]
        if outcome.hold is not None and not outcome.hold.is_set():
            return None
        tuning = sagemaker_backends[ACCOUNT][REGION].hyper_parameter_tuning_jobs[name]
        tuning.hyper_parameter_tuning_job_status = outcome.status
        if outcome.failure_reason:
            tuning.failure_reason = outcome.failure_reason
        client = boto3.client("sagemaker", region_name=REGION)
        described = client.describe_hyper_parameter_tuning_job(HyperParameterTuningJobName=name)
        description = _json_ready(described)
        description.pop("ResponseMetadata", None)
        if outcome.status != "Completed":
            raise TrainingJobEnded(description)
        return description
    # -- the training jobs Batch creates for service jobs ------------------------------------------------

    def create_for_batch(self, payload: Mapping[str, Any], tags: Mapping[str, str]) -> str:
        """CreateTrainingJob as Batch makes it for a service job leaving its queue: the payload under
        a name of Batch's (`AWSBatch<name><hash>`, cut to SageMaker's 63), with the service job's tags."""
        name = QUEUED_JOB_NAME_PREFIX + payload["TrainingJobName"][:QUEUED_NAME_KEPT] + uuid.uuid4().hex
        tag_list = [{"Key": key, "Value": value} for key, value in tags.items()]
        return self.create({**payload, "TrainingJobName": name, **({"Tags": tag_list} if tag_list else {})})

    def status_for_batch(self, job_name: str) -> str | None:
        """How a training job Batch created ended: None while it runs, else its status."""
        try:
            return None if self.finish(job_name) is None else "Completed"
        except TrainingJobEnded as ended:
            return ended.description["TrainingJobStatus"]


def _json_ready(value: Any) -> Any:
    return json.loads(
        json.dumps(value, default=lambda v: v.isoformat() if isinstance(v, datetime.datetime) else str(v))
    )


def _simulated_service(
    jobs: SimulatedTrainingJobs, processing: SimulatedProcessingJobs | None = None
) -> type[callback.StateTaskServiceCallback]:
    class StateTaskServiceSageMakerSimulated(callback.StateTaskServiceCallback):
        def __init__(self):
            super().__init__(
                supported_integration_patterns={ResourceCondition.WaitForTaskToken, ResourceCondition.Sync}
            )

        def _validate_service_integration_is_supported(self):
            assert self.resource.api_action in ("createTrainingJob", "createHyperParameterTuningJob",
                                                "createProcessingJob"), self.resource.resource_arn

        def _eval_service_task(self, env, resource_runtime_part, normalised_parameters, state_credentials):
            if self.resource.api_action == "createProcessingJob":
                assert processing is not None, "a processing job, and no SimulatedProcessingJobs given"
                name = normalised_parameters["ProcessingJobName"]
                env.stack.append({"ProcessingJobArn": processing.create(normalised_parameters),
                                  "ProcessingJobName": name})
                return
            if self.resource.api_action == "createHyperParameterTuningJob":
                name = normalised_parameters["HyperParameterTuningJobName"]
                env.stack.append({"HyperParameterTuningJobArn": jobs.create_tuning(normalised_parameters),
                                  "HyperParameterTuningJobName": name})
                return
            env.stack.append(
                {
                    "TrainingJobArn": jobs.create(normalised_parameters),
                    "TrainingJobName": normalised_parameters["TrainingJobName"],
                }
            )

        def _build_sync_resolver(self, env, resource_runtime_part, normalised_parameters, state_credentials):
            submitted = env.stack.pop()
            if "ProcessingJobName" in submitted:
                return lambda: processing.finish(submitted["ProcessingJobName"])
            if "HyperParameterTuningJobName" in submitted:
                return lambda: jobs.finish_tuning(submitted["HyperParameterTuningJobName"])
            return lambda: jobs.finish(submitted["TrainingJobName"])

        def _from_error(self, env, ex):
            if isinstance(ex, TrainingJobEnded | ProcessingJobEnded):
                error_name = StatesErrorName(typ=StatesErrorNameType.StatesTaskFailed)
                error, cause = error_name.error_name, json.dumps(ex.description)
            elif isinstance(ex, ClientError):
                details = ex.response["Error"]
                error = "SageMaker.AmazonSageMakerException"
                error_name = CustomErrorName(error)
                cause = (
                    f"{details['Message']} (Service: AmazonSageMaker; Status Code: 400; Error Code: "
                    f"{details['Code']}; Request ID: {ex.response['ResponseMetadata']['RequestId']}; "
                    "Proxy: null)"
                )
            else:
                return super()._from_error(env=env, ex=ex)
            return FailureEvent(
                env=env,
                error_name=error_name,
                event_type=HistoryEventType.TaskFailed,
                event_details=EventDetails(
                    taskFailedEventDetails=TaskFailedEventDetails(
                        error=error,
                        cause=cause,
                        resource=self._get_sfn_resource(),
                        resourceType=self._get_sfn_resource_type(),
                    )
                ),
            )

    return StateTaskServiceSageMakerSimulated


# --- AWS Batch's service jobs, through the aws-sdk integration ------------------------------------------


def _batch_sdk_service(batch: SimulatedBatch) -> type[StateTaskServiceAwsSdk]:
    model = botocore.session.get_session().get_service_model("batch")

    class StateTaskServiceBatchSimulated(StateTaskServiceAwsSdk):
        def _eval_service_task(self, env, resource_runtime_part, normalised_parameters, state_credentials):
            if self.resource.api_name != "batch":
                return super()._eval_service_task(env, resource_runtime_part, normalised_parameters,
                                                  state_credentials)
            action = self.resource.api_action
            operation = model.operation_model(action[0].upper() + action[1:])
            parameters = dict(normalised_parameters)
            self._to_boto_request(parameters, operation.input_shape)  # PascalCase -> the API's names
            response = getattr(batch, camel_to_snake_case(action))(**parameters)
            self._from_boto_response(response, operation.output_shape)  # and back
            env.stack.append(response)

    return StateTaskServiceBatchSimulated


# --- the harness -----------------------------------------------------------------------------------


@dataclass
class LauncherRun:
    """One execution's end state, with what it sent and published."""

    status: str
    output: dict[str, Any] | None
    error: str | None
    cause: str | None
    history: list[dict[str, Any]]


class LauncherHarness:
    """moto with the launcher deployed: start executions and read what happened."""

    def __init__(self, launcher: SynthesizedLauncher, jobs: SimulatedTrainingJobs,
                 batch: SimulatedBatch | None = None):
        self.launcher = launcher
        self.jobs = jobs
        self.batch = batch
        self.waits: list[int] = []
        # Wait states return at once; parked, they hold the execution until it is stopped (at most
        # PARK_SECONDS), as a real Wait does: moto's StopExecution that lands while a Lambda task is
        # being invoked breaks that task ("'dict' object has no attribute 'region'") and the
        # execution ends FAILED, where AWS aborts it.
        self.park_waits = False
        self.lambdas = InProcessLambda(launcher.functions)
        self.sfn = boto3.client("stepfunctions", region_name=REGION)
        self.sqs = boto3.client("sqs", region_name=REGION)
        self.state_machine_arn = ""
        self.queue_url = ""

    def deploy(self, topic_arn: str) -> None:
        self.state_machine_arn = self.sfn.create_state_machine(
            name="llmtrain-launcher",
            definition=json.dumps(self.launcher.definition),
            roleArn=f"arn:aws:iam::{ACCOUNT}:role/launcher",
        )["stateMachineArn"]
        self.queue_url = self.sqs.create_queue(QueueName="notifications")["QueueUrl"]
        queue_arn = self.sqs.get_queue_attributes(QueueUrl=self.queue_url, AttributeNames=["QueueArn"])[
            "Attributes"
        ]["QueueArn"]
        boto3.client("sns", region_name=REGION).subscribe(
            TopicArn=topic_arn, Protocol="sqs", Endpoint=queue_arn, Attributes={"RawMessageDelivery": "false"}
        )

    def start(self, execution_input: Any, *, name: str | None = None) -> str:
        """Start an execution with any JSON input (named after its run_name unless `name` is given)."""
        run_name = execution_input.get("run_name") if isinstance(execution_input, Mapping) else None
        return self.sfn.start_execution(
            stateMachineArn=self.state_machine_arn,
            name=name or str(run_name or uuid.uuid4()),
            input=json.dumps(execution_input),
        )["executionArn"]

    def wait(self, execution_arn: str, timeout: float = 60.0) -> LauncherRun:
        deadline = time.monotonic() + timeout
        while True:
            described = self.sfn.describe_execution(executionArn=execution_arn)
            if described["status"] != "RUNNING":
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"execution {execution_arn} still RUNNING after {timeout} s")
            time.sleep(0.05)
        history = self.sfn.get_execution_history(executionArn=execution_arn)["events"]
        return LauncherRun(
            status=described["status"],
            output=json.loads(described["output"]) if described.get("output") else None,
            error=described.get("error"),
            cause=described.get("cause"),
            history=history,
        )

    def run(self, execution_input: Any, **kwargs) -> LauncherRun:
        return self.wait(self.start(execution_input, **kwargs))

    def notifications(self) -> list[dict[str, Any]]:
        messages = []
        while True:
            batch = self.sqs.receive_message(QueueUrl=self.queue_url, MaxNumberOfMessages=10).get(
                "Messages", []
            )
            if not batch:
                return messages
            for message in batch:
                messages.append(json.loads(message["Body"]))
                self.sqs.delete_message(QueueUrl=self.queue_url, ReceiptHandle=message["ReceiptHandle"])


@contextmanager
def launcher_in_moto(
    assembly_dir: Path,
    launcher_stack: str,
    templates: Mapping[str, Mapping[str, Any]],
    outcomes: list[JobOutcome],
    queue_outcomes: list[QueueOutcome] | None = None,
    *,
    processing: SimulatedProcessingJobs | None = None,
    machine_prefix: str = "Launcher",
) -> Iterator[LauncherHarness]:
    """moto with execution on, the synthesized launcher created in it, and the simulations: SageMaker's
    .sync integration, and for a launcher with queues AWS Batch's service jobs (``queue_outcomes``).
    ``machine_prefix="Preparations"`` runs the team's preparation state machine instead, its processing
    jobs run by ``processing``."""
    jobs = SimulatedTrainingJobs(outcomes)
    batch = SimulatedBatch(list(queue_outcomes or []), on_schedule=jobs.create_for_batch,
                           training=jobs.status_for_batch)
    original_factory = state_task_factory.state_task_service_for
    simulated = _simulated_service(jobs, processing)
    batch_sdk = _batch_sdk_service(batch)
    original_client = launcher_functions.service_client

    def service_for(service_name: str):
        if service_name == "aws-sdk":
            return batch_sdk()
        return simulated() if service_name == "sagemaker" else original_factory(service_name)

    def service_client(service: str, platform):
        return batch if service == "batch" else original_client(service, platform)

    with (
        mock.patch.dict(
            os.environ,
            {
                "AWS_DEFAULT_REGION": REGION,
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
            },
        ),
        mock_aws(config={"stepfunctions": {"execute_state_machine": True}}),
    ):
        topic_arn = boto3.client("sns", region_name=REGION).create_topic(Name="launcher-topic")["TopicArn"]
        launcher = SynthesizedLauncher.from_assembly(assembly_dir, launcher_stack, templates, topic_arn,
                                                     machine_prefix)
        harness = LauncherHarness(launcher, jobs, batch)

        def record_wait(self, env, wait_seconds):
            harness.waits.append(wait_seconds)
            deadline = time.monotonic() + PARK_SECONDS
            while harness.park_waits and env.is_running() and time.monotonic() < deadline:
                env.program_state_event.wait(0.05)

        with (
            mock.patch.object(state_task_factory, "state_task_service_for", service_for),
            mock.patch.object(lambda_eval_utils, "_invoke_lambda_function", harness.lambdas.invoke),
            mock.patch.object(WaitFunction, "_wait_interval", record_wait),
            mock.patch.object(launcher_functions, "service_client", service_client),
        ):
            harness.deploy(topic_arn)
            yield harness
