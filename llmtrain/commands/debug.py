"""`llmtrain debug RUN [--host algo-N] [--print] --env ENV [--team TEAM]`: a shell in a running job's
container, through SSM.

A run started with `--set remote_debug=true` (in an environment with `remote_debug: {enabled: true}`)
gets SageMaker remote debugging (`RemoteDebugConfig`): SageMaker starts the SSM agent in every
container, and `aws ssm start-session --target sagemaker-training-job:<job>_<host>` opens a shell in
one of them. This command reads the deployed environment's record like the other cloud commands
(llmtrain.core.deployed: the team's job-name prefix, whether the environment allows remote debugging),
finds the run's latest job, checks that it is running with remote debugging on and that the host
exists, and opens that session (or prints the command with --print). Opening it needs the AWS CLI and
its Session Manager plugin; a team's engineers' policy allows sessions into its own team's jobs only.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
from dataclasses import dataclass

from botocore.exceptions import BotoCoreError, ClientError

from llmtrain.client.aws import ENGINEER_POLICY_HINT, AwsAccessError
from llmtrain.commands._common import add_cloud_arguments, connect, follow_up_options
from llmtrain.core.errors import LlmtrainError
from llmtrain.core.platform import REMOTE_DEBUG_TARGET_PREFIX
from llmtrain.lifecycle.jobs import run_jobs

_HOST = re.compile(r"algo-([1-9]\d*)")


@dataclass(frozen=True)
class DebugSession:
    job_name: str
    host: str
    region: str

    @property
    def target(self) -> str:
        return ssm_target(self.job_name, self.host)

    def command(self) -> list[str]:
        return ["aws", "ssm", "start-session", "--target", self.target, "--region", self.region]


def ssm_target(job_name: str, host: str) -> str:
    return f"{REMOTE_DEBUG_TARGET_PREFIX}{job_name}_{host}"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "debug",
        help="open a shell in a running job's container (SageMaker remote debugging, SSM)",
        description="Open an SSM session into the container of a run's running training job. The run must "
        "have been started with --set remote_debug=true. Needs the AWS CLI with the Session Manager "
        "plugin (or --print to show the command only). See docs/launcher.md, 'Debugging a job'.",
    )
    parser.add_argument("run_name", metavar="RUN", help="the run's name")
    parser.add_argument("--host", default="algo-1",
                        help="which host of the job: algo-1 (default), algo-2, ...")
    parser.add_argument("--print", dest="print_only", action="store_true",
                        help="print the session command instead of opening it")
    add_cloud_arguments(parser)
    parser.set_defaults(handler=debug_command)


def debug_command(args: argparse.Namespace) -> int:
    cloud = connect(args)
    deployed, team = cloud.deployed, cloud.team
    if not team.platform.remote_debug:
        raise LlmtrainError(
            f"environment {deployed.environment!r} does not allow remote debugging: its platform team sets "
            "remote_debug.enabled in config/<env>.yaml and deploys"
        )
    sagemaker = cloud.session.client("sagemaker", region_name=deployed.region)
    debug = find_session(sagemaker, team.job_name_prefix, args.run_name, args.host, deployed.region,
                         options=follow_up_options(args, cloud))
    command = debug.command()
    if args.print_only:
        print(shlex.join(command))
        return 0
    missing = [tool for tool in ("aws", "session-manager-plugin") if shutil.which(tool) is None]
    if missing:
        raise LlmtrainError(
            f"{' and '.join(missing)} not found on PATH: install the AWS CLI and its Session Manager plugin, "
            f"or run this command yourself: {shlex.join(command)}"
        )
    print(f"llmtrain debug: opening a shell on {debug.host} of {debug.job_name} ({shlex.join(command)})")
    os.execvp(command[0], command)
    return 0  # not reached


def find_session(
    sagemaker, job_name_prefix: str, run_name: str, host: str, region: str, *, options: str = ""
) -> DebugSession:
    """The session into `host` of the run's latest job; LlmtrainError saying why there is none.
    ``options`` point the follow-up commands it suggests at the same environment and team."""
    match = _HOST.fullmatch(host)
    if match is None:
        raise LlmtrainError(f"--host {host!r}: hosts are named algo-1, algo-2, ...")
    try:
        jobs = run_jobs(sagemaker, job_name_prefix, run_name)
        if not jobs:
            raise LlmtrainError(
                f"run {run_name!r} has no training job (yet): see `llmtrain status {run_name}{options}`")
        job = sagemaker.describe_training_job(TrainingJobName=jobs[-1]["job_name"])
    except (ClientError, BotoCoreError) as error:
        raise AwsAccessError(
            f"could not read the training jobs of run {run_name!r}: {error}; your credentials need "
            f"sagemaker:ListTrainingJobs and sagemaker:DescribeTrainingJob ({ENGINEER_POLICY_HINT})"
        ) from error
    name = job["TrainingJobName"]
    if not job.get("RemoteDebugConfig", {}).get("EnableRemoteDebug"):
        raise LlmtrainError(
            f"{name} runs without remote debugging; start the run again with --set remote_debug=true "
            "(it resumes from its checkpoints)"
        )
    if job["TrainingJobStatus"] != "InProgress":
        raise LlmtrainError(f"{name} is {job['TrainingJobStatus']}: a session needs a running job")
    secondary = job.get("SecondaryStatus")
    if secondary not in ("Downloading", "DownloadingTrainingImage", "Training", "Uploading", None):
        raise LlmtrainError(f"{name} is {secondary}: its containers are not up yet; try again when it trains")
    count = job.get("ResourceConfig", {}).get("InstanceCount", 1)
    if int(match.group(1)) > count:
        raise LlmtrainError(f"--host {host}: {name} has {count} host(s), algo-1 to algo-{count}")
    return DebugSession(job_name=name, host=host, region=region)
