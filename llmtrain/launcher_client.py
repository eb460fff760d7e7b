"""Start and follow launcher runs from the command line: what `llmtrain start|status|stop|logs` call.

Finding the launcher: each environment's launcher stack is `llmtrain-<env>-launcher`
(`EnvironmentConfig.stack_name("launcher")`) and publishes the state machine's ARN as the output
`StateMachineArn` (`LauncherOutput`); `LauncherClient.discover` reads it with DescribeStacks in the
environment's region. A run is one execution, named after the run (`run_name`); its training jobs
are `<job_name_prefix>-<run_name>-a<attempt>`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, NoRegionError

from llmtrain.catalog import LATEST, parse_ref
from llmtrain.environments import EnvironmentConfig
from llmtrain.errors import LlmtrainError
from llmtrain.handlers.launcher import final_metrics, run_jobs

LAUNCHER_STACK_PART = "launcher"
TRAINING_LOG_GROUP = "/aws/sagemaker/TrainingJobs"
TRAINING_METRIC_NAMESPACE = "/aws/sagemaker/TrainingJobs"
_EXECUTIONS_SCANNED = 100
_OWNER = re.compile(r"[\w .:/=+\-@]{1,256}")


class LauncherOutput:
    """Outputs of the launcher stack: the contract between stacks/launcher.py and this client."""

    STATE_MACHINE_ARN = "StateMachineArn"
    TOPIC_ARN = "NotificationTopicArn"


class LauncherError(LlmtrainError):
    """The launcher cannot be reached or the run cannot be found; the message says what to do."""


@dataclass
class RunStatus:
    """What `llmtrain status` shows: the execution, the run's jobs, and the latest job's metrics."""

    run_name: str
    execution_arn: str
    execution_status: str
    started: str
    stopped: str | None
    summary: Mapping[str, Any] | None
    error: str | None
    cause: str | None
    jobs: list[dict[str, Any]] = field(default_factory=list)
    job: Mapping[str, Any] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_name": self.run_name,
            "execution_arn": self.execution_arn,
            "execution_status": self.execution_status,
            "started": self.started,
            "stopped": self.stopped,
            "summary": self.summary,
            "error": self.error,
            "cause": self.cause,
            "jobs": self.jobs,
            "job": dict(self.job) if self.job else None,
            "metrics": self.metrics,
            "notes": self.notes,
        }


class LauncherClient:
    """One environment's launcher, through the caller's AWS credentials."""

    def __init__(
        self,
        *,
        session: boto3.Session,
        region: str,
        state_machine_arn: str,
        job_name_prefix: str,
        identity: Mapping[str, Any] | None = None,
    ):
        self.session = session
        self.identity = dict(identity or {})
        self.region = region
        self.state_machine_arn = state_machine_arn
        self.job_name_prefix = job_name_prefix
        self._clients: dict[str, Any] = {}

    def client(self, service: str):
        if service not in self._clients:
            self._clients[service] = self.session.client(service, region_name=self.region)
        return self._clients[service]

    # -- finding the launcher -----------------------------------------------------------------------

    @classmethod
    def discover(
        cls,
        environment: EnvironmentConfig,
        *,
        session: boto3.Session | None = None,
        state_machine_arn: str | None = None,
    ) -> LauncherClient:
        """The launcher of `environment`: checks credentials and account, reads the stack output."""
        session = session or boto3.Session()
        identity = account_identity(session, environment)
        arn = state_machine_arn or _state_machine_from_stack(session, environment)
        return cls(
            session=session,
            region=environment.region,
            state_machine_arn=arn,
            job_name_prefix=environment.job_name_prefix,
            identity=identity,
        )

    # -- runs -----------------------------------------------------------------------------------------

    def execution_arn(self, run_name: str) -> str:
        """Executions are named after their run: the ARN follows from the state machine's."""
        prefix, _, name = self.state_machine_arn.rpartition(":stateMachine:")
        return f"{prefix}:execution:{name}:{run_name}"

    def start(
        self, *, template_ref: str, run_name: str, overrides: Mapping[str, Any], owner: str | None = None
    ) -> dict[str, Any]:
        """Start the run's execution; refuses a run name already used (a run is never started twice)."""
        existing = self._describe(self.execution_arn(run_name))
        if existing is not None:
            raise LauncherError(
                f"run {run_name!r} was already started (execution {existing['status']}, "
                f"{existing['startDate']:%Y-%m-%d %H:%M}); follow it with `llmtrain status {run_name}`, "
                "or choose a new --run-name for a new run"
            )
        name, version = parse_ref(template_ref)
        execution_input = {
            "template": name,
            "version": version or LATEST,
            "run_name": run_name,
            "overrides": dict(overrides),
        }
        if owner:
            execution_input["owner"] = owner
        try:
            return self.client("stepfunctions").start_execution(
                stateMachineArn=self.state_machine_arn, name=run_name, input=json.dumps(execution_input)
            )
        except ClientError as error:
            raise _launcher_error(error, f"starting run {run_name!r}") from error

    def find_execution(self, run_name: str) -> dict[str, Any]:
        """The run's execution: by name, else among the latest executions by the input's run_name."""
        found = self._describe(self.execution_arn(run_name))
        if found is not None:
            return found
        pages = (
            self.client("stepfunctions")
            .get_paginator("list_executions")
            .paginate(
                stateMachineArn=self.state_machine_arn, PaginationConfig={"MaxItems": _EXECUTIONS_SCANNED}
            )
        )
        for page in pages:
            for item in page["executions"]:
                execution = self._describe(item["executionArn"])
                if execution and _input_run_name(execution) == run_name:
                    return execution
        raise LauncherError(
            f"no run named {run_name!r} in launcher {self.state_machine_arn} (checked the "
            f"{_EXECUTIONS_SCANNED} latest executions); list runs in the Step Functions console"
        )

    def _describe(self, execution_arn: str) -> dict[str, Any] | None:
        try:
            return self.client("stepfunctions").describe_execution(executionArn=execution_arn)
        except ClientError as error:
            if error.response["Error"]["Code"] == "ExecutionDoesNotExist":
                return None
            raise _launcher_error(error, "reading the run's execution") from error

    def jobs(self, run_name: str) -> list[dict[str, Any]]:
        """The run's training jobs, oldest attempt first: `{"attempt", "job_name", "status"}`."""
        return run_jobs(self.client("sagemaker"), self.job_name_prefix, run_name)

    def status(self, run_name: str) -> RunStatus:
        execution = self.find_execution(run_name)
        jobs = self.jobs(run_name)
        sagemaker = self.client("sagemaker")
        job = sagemaker.describe_training_job(TrainingJobName=jobs[-1]["job_name"]) if jobs else None
        metrics, notes = final_metrics(job) if job else {}, []
        if job and not metrics:
            try:
                metrics = self.latest_metrics(job["TrainingJobName"])
            except ClientError as error:
                # The engineers' policy may not grant CloudWatch reads: show the rest of the status.
                notes.append(f"latest metrics unavailable: {_launcher_error(error, 'reading CloudWatch')}")
        output = json.loads(execution["output"]) if execution.get("output") else None
        return RunStatus(
            run_name=run_name,
            execution_arn=execution["executionArn"],
            execution_status=execution["status"],
            started=_time(execution.get("startDate")),
            stopped=_time(execution.get("stopDate")),
            summary=output,
            error=execution.get("error"),
            cause=execution.get("cause"),
            jobs=jobs,
            job=_job_view(job) if job else None,
            metrics=metrics,
            notes=notes,
        )

    def latest_metrics(self, job_name: str) -> dict[str, float]:
        """The latest value of each metric a running job published (SageMaker's CloudWatch metrics,
        dimension Host = <job>/algo-1); empty when there are none yet."""
        cloudwatch = self.client("cloudwatch")
        host = {"Name": "Host", "Value": f"{job_name}/algo-1"}
        names = [
            metric["MetricName"]
            for page in cloudwatch.get_paginator("list_metrics").paginate(
                Namespace=TRAINING_METRIC_NAMESPACE, Dimensions=[host]
            )
            for metric in page["Metrics"]
        ]
        if not names:
            return {}
        queries = [
            {
                "Id": f"m{index}",
                "Label": name,
                "ReturnData": True,
                "MetricStat": {
                    "Metric": {
                        "Namespace": TRAINING_METRIC_NAMESPACE,
                        "MetricName": name,
                        "Dimensions": [host],
                    },
                    "Period": 60,
                    "Stat": "Average",
                },
            }
            for index, name in enumerate(names[:100])
        ]
        created = self.client("sagemaker").describe_training_job(TrainingJobName=job_name)["CreationTime"]
        # A minute of slack either side: CloudWatch refuses an empty window, and clocks differ.
        response = cloudwatch.get_metric_data(
            MetricDataQueries=queries,
            StartTime=created - timedelta(minutes=1),
            EndTime=datetime.now(UTC) + timedelta(minutes=1),
            ScanBy="TimestampDescending",
        )
        return {
            result["Label"]: result["Values"][0]
            for result in response["MetricDataResults"]
            if result["Values"]
        }

    def stop(self, run_name: str, *, by: str | None = None) -> dict[str, Any]:
        execution = self.find_execution(run_name)
        if execution["status"] != "RUNNING":
            raise LauncherError(f"run {run_name!r} is not running (its execution is {execution['status']})")
        try:
            self.client("stepfunctions").stop_execution(
                executionArn=execution["executionArn"],
                error="StoppedByUser",
                cause=f"llmtrain stop {run_name}" + (f" by {by}" if by else ""),
            )
        except ClientError as error:
            raise _launcher_error(error, f"stopping run {run_name!r}") from error
        return execution

    def logs(self, run_name: str, *, attempt: int | None = None, limit: int = 200) -> list[dict[str, Any]]:
        """The last `limit` log events of one attempt's job (default: the latest), oldest first."""
        jobs = self.jobs(run_name)
        if attempt is not None:
            jobs = [job for job in jobs if job["attempt"] == attempt]
        if not jobs:
            which = f"attempt {attempt} of run" if attempt is not None else "run"
            raise LauncherError(
                f"{which} {run_name!r} has no training job yet; see `llmtrain status {run_name}`"
            )
        job_name = jobs[-1]["job_name"]
        logs = self.client("logs")
        pages = logs.get_paginator("describe_log_streams").paginate(
            logGroupName=TRAINING_LOG_GROUP, logStreamNamePrefix=f"{job_name}/"
        )
        streams = [stream["logStreamName"] for page in pages for stream in page["logStreams"]]
        if not streams:
            return []
        events = [
            event
            for page in logs.get_paginator("filter_log_events").paginate(
                logGroupName=TRAINING_LOG_GROUP, logStreamNames=streams[:100]
            )
            for event in page["events"]
        ]
        events.sort(key=lambda event: (event["timestamp"], event.get("logStreamName", "")))
        return events[-limit:] if limit else events


def caller_identity(session: boto3.Session, environment: EnvironmentConfig) -> dict[str, Any]:
    """STS GetCallerIdentity, with the clear error the CLI shows when there are no credentials."""
    try:
        return session.client("sts", region_name=environment.region).get_caller_identity()
    except (NoCredentialsError, NoRegionError) as error:
        raise LauncherError(
            f"no AWS credentials found ({error}): configure them for account {environment.account} "
            "(`aws configure`, `aws sso login` or AWS_PROFILE) and try again"
        ) from error
    except (ClientError, BotoCoreError) as error:
        raise LauncherError(
            f"your AWS credentials were refused ({error}); refresh them and try again"
        ) from error


def account_identity(session: boto3.Session, environment: EnvironmentConfig) -> dict[str, Any]:
    """The caller's identity, checked to be in the environment's account."""
    identity = caller_identity(session, environment)
    if identity["Account"] != environment.account:
        raise LauncherError(
            f"your AWS credentials are for account {identity['Account']} but environment "
            f"{environment.name!r} is in account {environment.account}: use credentials for that account "
            "(e.g. AWS_PROFILE)"
        )
    return identity


def account_session(environment: EnvironmentConfig) -> boto3.Session:
    """A session with the caller's credentials, checked to be for the environment's account."""
    session = boto3.Session()
    account_identity(session, environment)
    return session


def owner_from_identity(identity: Mapping[str, Any]) -> str | None:
    """The caller's ARN as the runs' owner tag, when it fits a tag value."""
    arn = str(identity.get("Arn", ""))
    return arn if _OWNER.fullmatch(arn) else None


def _state_machine_from_stack(session: boto3.Session, environment: EnvironmentConfig) -> str:
    stack_name = environment.stack_name(LAUNCHER_STACK_PART)
    deploy = f"deploy it with `npx cdk deploy '{environment.name}/*'`"
    try:
        stacks = session.client("cloudformation", region_name=environment.region).describe_stacks(
            StackName=stack_name
        )["Stacks"]
    except ClientError as error:
        if "does not exist" in error.response["Error"].get("Message", ""):
            raise LauncherError(
                f"the platform's launcher is not deployed in environment {environment.name!r}: stack "
                f"{stack_name} does not exist in account {environment.account}, region "
                f"{environment.region}; {deploy}"
            ) from error
        raise _launcher_error(error, f"reading stack {stack_name}") from error
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stacks[0].get("Outputs", [])}
    if LauncherOutput.STATE_MACHINE_ARN not in outputs:
        raise LauncherError(
            f"stack {stack_name} has no output {LauncherOutput.STATE_MACHINE_ARN} (status "
            f"{stacks[0].get('StackStatus')}); {deploy}"
        )
    return outputs[LauncherOutput.STATE_MACHINE_ARN]


def _launcher_error(error: ClientError, doing: str) -> LauncherError:
    code = error.response["Error"]["Code"]
    message = error.response["Error"].get("Message", "")
    if code in ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation"):
        return LauncherError(
            f"{doing}: access denied ({message}); ML engineers need the platform's "
            "engineer policy (output EngineerPolicyArn of the access stack)"
        )
    return LauncherError(f"{doing}: {code}: {message}")


def _input_run_name(execution: Mapping[str, Any]) -> str | None:
    try:
        return json.loads(execution.get("input") or "{}").get("run_name")
    except (ValueError, AttributeError):
        return None


def _time(value: Any) -> str | None:
    return value.isoformat(timespec="seconds") if value is not None else None


def _job_view(job: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "name": job.get("TrainingJobName"),
        "status": job.get("TrainingJobStatus"),
        "secondary_status": job.get("SecondaryStatus"),
        "failure_reason": job.get("FailureReason"),
        "instance_type": (job.get("ResourceConfig") or {}).get("InstanceType"),
        "instance_count": (job.get("ResourceConfig") or {}).get("InstanceCount"),
        "model_artifacts": (job.get("ModelArtifacts") or {}).get("S3ModelArtifacts"),
        "tensorboard": (job.get("TensorBoardOutputConfig") or {}).get("S3OutputPath"),
        "billable_seconds": job.get("BillableTimeInSeconds"),
    }
