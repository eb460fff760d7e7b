"""An environment shared by two teams, deployed: prod's stacks in moto's CloudFormation, IAM enforced.

Every stack of the synthesized prod stage (teams `pretrain` and `finetune`) is created in moto's
CloudFormation (tests/infra/moto_cloudformation.py says what the test supplies: answers to custom
resources, two template spots moto's models read differently, and the request resources moto's IAM
enforcement does not compute for Step Functions and SageMaker). Then each team's principals call AWS
with moto's IAM enforcement on: the execution role a team's jobs run as, an engineer holding the
team's managed policy, and the team's launcher role that creates its jobs.

moto evaluates actions and resources, not condition keys: what the conditions add (SageMaker's keys
on CreateTrainingJob, the `s3:prefix` of ListBucket, PassRole's service) is asserted on the
synthesized statements in test_access.py and test_launcher.py.

The services stack (prod's CodeArtifact PyPI mirror, its MLflow tracking server, and their endpoints)
is deployed too. moto implements no CodeArtifact API and does not model the tracking server, so what
a team's jobs may do with the mirror and the server is judged by moto's own policy
evaluator on the execution role's policies as moto's IAM holds them after the deployment (actions,
resources and StringEquals conditions).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import time
import uuid
from unittest import mock

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws
from moto.iam.access_control import IAMPolicy, PermissionResult
from moto.iam.policy_conditions import CONDITION_OPERATIONS
from moto_cloudformation import deploy_stage, iam_enforced

from llmtrain.cli import main
from llmtrain.client.launcher import LauncherClient
from llmtrain.core.catalog import Catalog
from llmtrain.core.errors import LlmtrainError
from llmtrain.core.function_settings import ENV_PLATFORM_CONTEXT, ENV_PROCESSING_ROLE_ARN, PreparationSettings
from llmtrain.core.platform import PlatformContext
from llmtrain.core.preparation import Preparation, shards_request
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from training_constructs.teams import TEAM_TAG

ENVIRONMENT = "prod"
TEAMS = ("pretrain", "finetune")
OTHER = {"pretrain": "finetune", "finetune": "pretrain"}


@pytest.fixture(scope="module")
def deployed(platform, environments):
    """prod's stacks in moto, and each team's principals' credentials (taken before enforcement)."""
    config = environments[ENVIRONMENT]
    credentials = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    with (
        mock.patch.dict(
            os.environ,
            {**credentials, "MOTO_ACCOUNT_ID": config.account, "AWS_DEFAULT_REGION": config.region},
        ),
        mock_aws(),
    ):
        stage = deploy_stage(platform.outdir / f"assembly-{ENVIRONMENT}", config.account, config.region)
        yield Principals(stage, config.region)


class Principals:
    """Sessions as each team's principals, and the deployed stage's outputs."""

    def __init__(self, stage, region: str):
        self.stage = stage
        self.region = region
        self.outputs = stage.outputs
        iam = boto3.client("iam", region_name=region)
        sts = boto3.client("sts", region_name=region)
        sfn = boto3.client("stepfunctions", region_name=region)
        self.sessions: dict[tuple[str, str], boto3.Session] = {}
        for team in TEAMS:
            key = team.capitalize()
            self.sessions[("job", team)] = self._assumed(sts, self.outputs[f"Team{key}ExecutionRoleArn"])
            machine = sfn.describe_state_machine(stateMachineArn=self.state_machine(team))
            self.sessions[("launcher", team)] = self._assumed(sts, machine["roleArn"])
            preparations = sfn.describe_state_machine(
                stateMachineArn=self.outputs[f"Team{key}PreparationStateMachineArn"])
            self.sessions[("preparations", team)] = self._assumed(sts, preparations["roleArn"])
            self.sessions[("processing", team)] = self._assumed(sts, self.processing_role(team))
            self.sessions[("steps", team)] = self._assumed(sts, self._preparation_function(team)["Role"])
            user = f"engineer-{team}"
            iam.create_user(UserName=user)
            iam.attach_user_policy(UserName=user, PolicyArn=self.outputs[f"Team{key}EngineerPolicyArn"])
            access_key = iam.create_access_key(UserName=user)["AccessKey"]
            self.sessions[("engineer", team)] = boto3.Session(
                aws_access_key_id=access_key["AccessKeyId"],
                aws_secret_access_key=access_key["SecretAccessKey"],
                region_name=region,
            )

    def _assumed(self, sts, role_arn: str) -> boto3.Session:
        granted = sts.assume_role(RoleArn=role_arn, RoleSessionName="test")["Credentials"]
        return boto3.Session(
            aws_access_key_id=granted["AccessKeyId"],
            aws_secret_access_key=granted["SecretAccessKey"],
            aws_session_token=granted["SessionToken"],
            region_name=self.region,
        )

    def client(self, who: str, team: str, service: str):
        return self.sessions[(who, team)].client(service)

    def bucket(self, name: str) -> str:
        return self.outputs[f"{name.capitalize()}BucketName"]

    def state_machine(self, team: str) -> str:
        return self.outputs[f"Team{team.capitalize()}StateMachineArn"]

    def launcher_role(self, team: str) -> str:
        """The name of the team's launcher (state machine) role."""
        sfn = boto3.client("stepfunctions", region_name=self.region)
        machine = sfn.describe_state_machine(stateMachineArn=self.state_machine(team))
        return machine["roleArn"].rsplit("/", 1)[1]

    def preparation_role(self, team: str) -> str:
        """The name of the team's preparation state machine's role."""
        sfn = boto3.client("stepfunctions", region_name=self.region)
        arn = self.outputs[f"Team{team.capitalize()}PreparationStateMachineArn"]
        return sfn.describe_state_machine(stateMachineArn=arn)["roleArn"].rsplit("/", 1)[1]

    def _preparation_function(self, team: str) -> dict:
        functions = boto3.client("lambda", region_name=self.region)
        for page in functions.get_paginator("list_functions").paginate():
            for function in page["Functions"]:
                variables = function.get("Environment", {}).get("Variables", {})
                if function["Handler"] == PreparationSettings.HANDLER and json.loads(
                        variables[ENV_PLATFORM_CONTEXT])["team"] == team:
                    return function
        raise AssertionError(f"no preparation function of team {team}")

    def processing_role(self, team: str) -> str:
        """The ARN of the role the team's processing jobs run as (its preparation function's setting)."""
        return self._preparation_function(team)["Environment"]["Variables"][ENV_PROCESSING_ROLE_ARN]

    def platform_context(self, team: str) -> PlatformContext:
        """What the team's deployed resolve function receives, as moto's CloudFormation resolved it."""
        functions = boto3.client("lambda", region_name=self.region)
        for page in functions.get_paginator("list_functions").paginate():
            for function in page["Functions"]:
                variables = function.get("Environment", {}).get("Variables", {})
                if function["Handler"].endswith(".resolve") and ENV_PLATFORM_CONTEXT in variables:
                    context = PlatformContext.from_dict(json.loads(variables[ENV_PLATFORM_CONTEXT]))
                    if context.team == team:
                        return context
        raise AssertionError(f"no resolve function of team {team}")


def allowed(call) -> bool:
    """True when moto's IAM lets the call through, False on AccessDenied."""
    try:
        call()
    except ClientError as error:
        if error.response["Error"]["Code"] in ("AccessDenied", "AccessDeniedException", "403"):
            return False
        raise
    except NotImplementedError:
        # moto authorizes before it dispatches: an action it does not implement (StopTrainingJob)
        # got past IAM.
        return True
    return True


def test_every_stack_of_the_two_team_environment_deploys(deployed):
    assert set(deployed.stage.statuses.values()) == {"CREATE_COMPLETE"}, deployed.stage.statuses
    assert len(deployed.stage.statuses) == 6
    # The mirror's and the MLflow tracking server's ARNs are attributes of resources moto does not model
    # (their outputs only are left out).
    assert deployed.stage.outputs_left_out == ["PackageRepositoryArn", "MlflowTrackingServerArn"]
    for team in TEAMS:
        for output in ("ExecutionRoleArn", "EngineerPolicyArn", "StateMachineArn", "NotificationTopicArn",
                   "PreparationStateMachineArn"):
            assert f"Team{team.capitalize()}{output}" in deployed.outputs, (team, output)
    # The JobTemplates' uploads and the default security group's cleanup were answered by the test.
    assert any("CodeCustomResource" in name for name in deployed.stage.answered_custom_resources)


def test_the_queues_deploy_with_the_types_moto_cannot_model_supplied(deployed):
    """moto's CloudFormation models none of the queues' types (moto_cloudformation.py says what the test
    supplies): the scheduling policy is created through moto's Batch API, which then answers with the
    teams' shares; the service environment and the SAGEMAKER_TRAINING queues are stand-ins."""
    supplied = sorted(entry.split(" ")[1] for entry in deployed.stage.supplied_resources)
    assert supplied == ["(AWS::Batch::JobQueue)", "(AWS::Batch::JobQueue)", "(AWS::Batch::SchedulingPolicy)",
                        "(AWS::Batch::ServiceEnvironment)"]
    assert all(entry.startswith("llmtrain-prod-launcher/") for entry in deployed.stage.supplied_resources)
    physical = {r["PhysicalResourceId"] for r in deployed.stage.resources["llmtrain-prod-launcher"]}
    arn = f"arn:aws:batch:{deployed.region}:222222222222"
    assert {f"{arn}:job-queue/llmtrain-prod-standard", f"{arn}:job-queue/llmtrain-prod-urgent",
            f"{arn}:service-environment/llmtrain-prod"} <= physical
    batch = boto3.client("batch", region_name=deployed.region)
    [policy] = batch.describe_scheduling_policies(arns=[f"{arn}:scheduling-policy/llmtrain-prod-fair-share"])[
        "schedulingPolicies"]
    shares = {s["shareIdentifier"]: s["weightFactor"] for s in policy["fairsharePolicy"]["shareDistribution"]}
    assert shares == {"pretrain": 1.0, "finetune": 3.0}


@pytest.mark.parametrize("team", TEAMS)
def test_a_teams_jobs_reach_only_its_own_prefixes(deployed, team):
    other = OTHER[team]
    s3 = boto3.client("s3", region_name=deployed.region)
    for owner in TEAMS:
        for bucket in ("datasets", "checkpoints", "artifacts"):
            s3.put_object(Bucket=deployed.bucket(bucket), Key=f"teams/{owner}/runs/object", Body=b"x")
    s3.put_object(Bucket=deployed.bucket("code"), Key="templates/gpt2-ddp/1.1.0/sourcedir.tar.gz", Body=b"x")
    job = deployed.client("job", team, "s3")
    with iam_enforced():
        for bucket in ("datasets", "checkpoints", "artifacts"):
            own = {"Bucket": deployed.bucket(bucket), "Key": f"teams/{team}/runs/object"}
            theirs = {"Bucket": deployed.bucket(bucket), "Key": f"teams/{other}/runs/object"}
            assert allowed(lambda own=own: job.get_object(**own)), bucket
            assert not allowed(lambda theirs=theirs: job.get_object(**theirs)), bucket
        assert allowed(
            lambda: job.get_object(
                Bucket=deployed.bucket("code"), Key="templates/gpt2-ddp/1.1.0/sourcedir.tar.gz"
            )
        )
        for bucket in ("checkpoints", "artifacts"):
            assert allowed(
                lambda b=bucket: job.put_object(
                    Bucket=deployed.bucket(b), Key=f"teams/{team}/runs/new", Body=b"1"
                )
            )
            assert not allowed(
                lambda b=bucket: job.put_object(
                    Bucket=deployed.bucket(b), Key=f"teams/{other}/runs/new", Body=b"1"
                )
            )
        # Jobs read datasets; they never write them, nor anything outside a team prefix.
        assert not allowed(
            lambda: job.put_object(
                Bucket=deployed.bucket("datasets"), Key=f"teams/{team}/runs/new", Body=b"1"
            )
        )
        assert not allowed(
            lambda: job.put_object(Bucket=deployed.bucket("checkpoints"), Key="runs/new", Body=b"1")
        )
        assert not allowed(
            lambda: job.delete_object(Bucket=deployed.bucket("checkpoints"), Key=f"teams/{other}/runs/object")
        )


def managed_policy_allows(
    policy_arn: str, action: str, resource: str, conditions: dict | None = None
) -> bool:
    """Whether a managed policy, as moto's IAM holds it, allows the call (moto's evaluator)."""
    iam = boto3.client("iam")
    version = iam.get_policy(PolicyArn=policy_arn)["Policy"]["DefaultVersionId"]
    document = iam.get_policy_version(PolicyArn=policy_arn, VersionId=version)["PolicyVersion"]["Document"]
    result = IAMPolicy(json.dumps(document)).is_action_permitted(action, resource,
                                                                 incoming_condition_values=conditions)
    return result == PermissionResult.PERMITTED


def role_allows(role_name: str, action: str, resource: str, conditions: dict | None = None) -> bool:
    """Whether the role's inline policies, as moto's IAM holds them, allow the call (moto's evaluator)."""
    iam = boto3.client("iam")
    results = [
        IAMPolicy(json.dumps(iam.get_role_policy(RoleName=role_name, PolicyName=name)["PolicyDocument"]))
        .is_action_permitted(action, resource, incoming_condition_values=conditions)
        for name in iam.list_role_policies(RoleName=role_name)["PolicyNames"]
    ]
    return PermissionResult.PERMITTED in results and PermissionResult.DENIED not in results


def if_exists_evaluated():
    """moto's policy evaluator knows StringEquals only (other operators pass) and passes a key absent
    from the request: StringEqualsIfExists' meaning. It is taught that operator as StringEquals."""
    string_equals = CONDITION_OPERATIONS["StringEquals"]
    return mock.patch.dict(CONDITION_OPERATIONS, {"StringEqualsIfExists": string_equals})


@pytest.mark.parametrize("team", TEAMS)
def test_a_teams_jobs_may_install_packages_from_the_environments_mirror(deployed, environments, team):
    """What the training toolkit does before the program starts (CA_REPOSITORY_ARN): a token for the
    environment's CodeArtifact domain, the repository's endpoint, the packages; through the mirror's
    endpoints, which the services stack deployed with their policies."""
    config = environments[ENVIRONMENT]
    role = deployed.outputs[f"Team{team.capitalize()}ExecutionRoleArn"].rsplit("/", 1)[1]
    codeartifact = f"arn:aws:codeartifact:{config.region}:{config.account}"
    domain, repository = f"{codeartifact}:domain/llmtrain-prod", f"{codeartifact}:repository/llmtrain-prod"
    assert role_allows(role, "codeartifact:GetAuthorizationToken", domain)
    assert not role_allows(role, "codeartifact:GetAuthorizationToken", f"{codeartifact}:domain/other")
    for action in ("codeartifact:GetRepositoryEndpoint", "codeartifact:ReadFromRepository"):
        assert role_allows(role, action, f"{repository}/pypi-mirror")
        assert not role_allows(role, action, f"{repository}/internal")
    bearer = "sts:AWSServiceName"
    assert role_allows(role, "sts:GetServiceBearerToken", "*", {bearer: "codeartifact.amazonaws.com"})
    assert not role_allows(role, "sts:GetServiceBearerToken", "*", {bearer: "other.amazonaws.com"})
    ec2 = boto3.client("ec2", region_name=deployed.region)
    endpoints = {e["ServiceName"]: e for e in ec2.describe_vpc_endpoints()["VpcEndpoints"]}
    for service in ("codeartifact.api", "codeartifact.repositories"):
        endpoint = endpoints[f"com.amazonaws.{config.region}.{service}"]
        # moto's CloudFormation keeps the template's document as Python's repr of it, not as JSON.
        [statement] = ast.literal_eval(endpoint["PolicyDocument"])["Statement"]
        assert statement["Condition"] == {"StringEquals": {"aws:PrincipalAccount": config.account}}


@pytest.mark.parametrize("team", TEAMS)
def test_a_teams_engineers_start_and_stop_only_its_runs(deployed, team):
    other = OTHER[team]
    sfn = boto3.client("stepfunctions", region_name=deployed.region)
    theirs = sfn.start_execution(
        stateMachineArn=deployed.state_machine(other), name=f"{other}-run-{team}-test", input="{}"
    )["executionArn"]
    engineer = deployed.client("engineer", team, "stepfunctions")
    with iam_enforced():
        ours = engineer.start_execution(
            stateMachineArn=deployed.state_machine(team), name=f"{team}-own-run", input="{}"
        )["executionArn"]
        assert allowed(lambda: engineer.describe_execution(executionArn=ours))
        assert allowed(lambda: engineer.list_executions(stateMachineArn=deployed.state_machine(team)))
        assert not allowed(
            lambda: engineer.start_execution(
                stateMachineArn=deployed.state_machine(other), name=f"{team}-intrudes", input="{}"
            )
        )
        assert not allowed(lambda: engineer.describe_execution(executionArn=theirs))
        assert not allowed(lambda: engineer.stop_execution(executionArn=theirs))
        assert not allowed(lambda: engineer.list_executions(stateMachineArn=deployed.state_machine(other)))
        assert allowed(lambda: engineer.stop_execution(executionArn=ours))


@pytest.mark.parametrize("team", TEAMS)
def test_a_teams_engineers_reach_only_its_jobs_and_data(deployed, team):
    other = OTHER[team]
    requests = {t: _rendered(deployed, t, f"{t}-eng") for t in TEAMS}
    sagemaker = boto3.client("sagemaker", region_name=deployed.region)
    for request in requests.values():
        sagemaker.create_training_job(**request)
    engineer_jobs = deployed.client("engineer", team, "sagemaker")
    engineer_s3 = deployed.client("engineer", team, "s3")
    datasets = deployed.bucket("datasets")
    with iam_enforced():
        own, theirs = requests[team]["TrainingJobName"], requests[other]["TrainingJobName"]
        assert allowed(lambda: engineer_jobs.describe_training_job(TrainingJobName=own))
        assert not allowed(lambda: engineer_jobs.stop_training_job(TrainingJobName=theirs))
        assert allowed(lambda: engineer_jobs.stop_training_job(TrainingJobName=own))
        # `llmtrain data upload`: into the team's datasets prefix only.
        assert allowed(
            lambda: engineer_s3.put_object(Bucket=datasets, Key=f"teams/{team}/up/part", Body=b"1")
        )
        assert not allowed(
            lambda: engineer_s3.put_object(Bucket=datasets, Key=f"teams/{other}/up/part", Body=b"1")
        )
        assert not allowed(lambda: engineer_s3.delete_object(Bucket=datasets, Key=f"teams/{team}/up/part"))
    # Reading another team's job: prod's queued jobs are named by Batch, so engineers read training
    # jobs by the team's tag (aws:ResourceTag), which moto's enforcement does not evaluate (it
    # supplies no resource tags): moto's evaluator judges the deployed policy with the job's tag.
    policy = deployed.outputs[f"Team{team.capitalize()}EngineerPolicyArn"]
    their_job = f"arn:aws:sagemaker:{deployed.region}:222222222222:training-job/{theirs}"
    tagged = {f"aws:ResourceTag/{TEAM_TAG}": other}
    assert not managed_policy_allows(policy, "sagemaker:DescribeTrainingJob", their_job, tagged)
    batch_named = f"arn:aws:sagemaker:{deployed.region}:222222222222:training-job/awsbatch{team}0f2a"
    assert managed_policy_allows(policy, "sagemaker:DescribeTrainingJob", batch_named,
                                 {f"aws:ResourceTag/{TEAM_TAG}": team})
    assert not managed_policy_allows(policy, "sagemaker:DescribeTrainingJob", batch_named, tagged)


@pytest.mark.parametrize("team", TEAMS)
def test_a_teams_engineer_uploads_and_lists_its_datasets_with_the_cli(deployed, team, tmp_path, capsys):
    """`llmtrain data upload|ls` and `templates --env` with nothing but the engineer's credentials: the
    CLI reads the environment's record from SSM and uploads into the team's datasets prefix; the other
    team's prefix is refused by IAM."""
    other = OTHER[team]
    dataset = tmp_path / "tokens"
    (dataset / "train").mkdir(parents=True)
    (dataset / "train" / "manifest.json").write_text("{}")
    (dataset / "train" / "shard-00000.bin").write_bytes(bytes(range(256)) * 64)
    datasets = deployed.bucket("datasets")
    where = ("--env", ENVIRONMENT, "--region", deployed.region)

    def llmtrain(*argv: str, who: str = "engineer") -> tuple[int, str, str]:
        granted = deployed.sessions[(who, team)].get_credentials()
        keys = {
            "AWS_ACCESS_KEY_ID": granted.access_key,
            "AWS_SECRET_ACCESS_KEY": granted.secret_key,
            "AWS_SESSION_TOKEN": granted.token or "",
        }
        with mock.patch.dict(os.environ, keys), iam_enforced():
            code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    # The record is the engineers' to read: the team's jobs (its execution role) may not. (moto answers
    # a JSON-protocol denial with an XML body, which botocore reads as the code "403".)
    code, _, err = llmtrain("data", "ls", *where, "--team", team, who="job")
    assert code == 1 and f"reading environment '{ENVIRONMENT}'" in err
    assert "not authorized to perform: ssm:GetParametersByPath" in err

    code, out, err = llmtrain("data", "upload", str(dataset), "--name", f"{team}-set", *where, "--team", team)
    assert code == 0, err
    assert f"--set channels.train=s3://{datasets}/teams/{team}/{team}-set/train/" in out
    assert f"--team {team}" in out
    code, out, _ = llmtrain("data", "ls", *where, "--team", team, "--json")
    assert (f"{team}-set", True) in [(d["name"], d["complete"]) for d in json.loads(out)]
    code, out, _ = llmtrain("templates", *where, "--team", team, "--json")
    assert {row["name"] for row in json.loads(out)} == set(deployed.platform_context(team).allowed_templates)

    code, _, err = llmtrain("data", "upload", str(dataset), "--name", f"{team}-x", *where, "--team", other)
    assert code == 1 and "access denied" in err and "Team<Name>EngineerPolicyArn" in err
    s3 = boto3.client("s3", region_name=deployed.region)
    keys = s3.list_objects_v2(Bucket=datasets, Prefix=f"teams/{other}/").get("Contents", [])
    assert not [o["Key"] for o in keys if f"{team}-x" in o["Key"]]


@pytest.mark.parametrize("team", TEAMS)
def test_a_teams_engineers_read_only_its_jobs_logs(deployed, team):
    """Issue 25: FilterLogEvents, which AWS authorizes on the whole shared log group, let one team's
    engineer read another team's job log. Now the engineers read events stream by stream (GetLogEvents
    on their team's streams), as `llmtrain logs` (LauncherClient.logs) does for the team's own runs."""
    other = OTHER[team]
    sagemaker = boto3.client("sagemaker", region_name=deployed.region)
    logs = boto3.client("logs", region_name=deployed.region)
    group = "/aws/sagemaker/TrainingJobs"  # SageMaker creates it with the account's first job
    if group not in [g["logGroupName"] for g in logs.describe_log_groups()["logGroups"]]:
        logs.create_log_group(logGroupName=group)
    streams, queued = {}, {}
    for owner in TEAMS:
        request = _rendered(deployed, owner, f"{owner}-logs-for-{team}")
        sagemaker.create_training_job(**request)
        streams[owner] = f"{request['TrainingJobName']}/algo-1-1700000000"
        # the stream of a queued run's job, which AWS Batch names (AWSBatch<name><attempt id>, 63 long)
        batch_name = ("AWSBatch" + request["TrainingJobName"])[:31] + uuid.uuid4().hex
        queued[owner] = f"{batch_name}/algo-1-1700000000"
        for stream in (streams[owner], queued[owner]):
            logs.create_log_stream(logGroupName=group, logStreamName=stream)
            event = {"timestamp": int(time.time() * 1000), "message": f"secret of {owner}"}
            logs.put_log_events(logGroupName=group, logStreamName=stream, logEvents=[event])
    engineer = deployed.client("engineer", team, "logs")
    with iam_enforced():
        def readable(stream: str) -> bool:
            return allowed(lambda: engineer.get_log_events(logGroupName=group, logStreamName=stream))

        assert [readable(s[team]) for s in (streams, queued)] == [True, True]
        assert [readable(s[other]) for s in (streams, queued)] == [False, False]
        assert not allowed(lambda: engineer.filter_log_events(logGroupName=group))
        assert not allowed(
            lambda: engineer.filter_log_events(logGroupName=group, logStreamNames=[streams[team]])
        )
        assert allowed(lambda: engineer.describe_log_streams(logGroupName=group))

    # What `llmtrain logs` reads, as the engineer: the run's job, its streams, their events. (prod queues
    # its runs, and moto implements no Batch service job: these jobs were created directly, so the
    # client reads them as in an environment without queues.)
    prefixes = {owner: deployed.platform_context(owner).job_name_prefix for owner in TEAMS}

    def read(run_owner: str):
        client = LauncherClient(session=deployed.sessions[("engineer", team)], region=deployed.region,
                                state_machine_arn=deployed.state_machine(run_owner),
                                job_name_prefix=prefixes[run_owner])
        return client.logs(f"{run_owner}-logs-for-{team}")

    with iam_enforced():
        assert [event["message"] for event in read(team)] == [f"secret of {team}"]
        with pytest.raises(LlmtrainError) as denied:
            read(other)
    # (moto answers a JSON-protocol denial with an XML body, which botocore reads as the code "403".)
    assert "not authorized to perform: logs:GetLogEvents" in str(denied.value)
    assert "secret" not in str(denied.value)


@pytest.mark.parametrize("team", TEAMS)
def test_a_teams_launcher_submits_only_to_its_queues_with_its_share_and_creates_no_job(deployed, team):
    """prod queues its runs: the launcher role creates no training job (Batch's service-linked role
    does), which moto's IAM enforcement checks on the call. moto implements no Batch service job, so
    the submissions are judged by moto's own policy evaluator on the role's policies as moto's IAM
    holds them after the deployment (actions, resources and StringEquals conditions; the
    NumericLessThanEquals on batch:SchedulingPriority, which it does not evaluate, is asserted in
    test_launcher.py)."""
    other = OTHER[team]
    own = _rendered(deployed, team, f"{team}-own")
    launcher = deployed.client("launcher", team, "sagemaker")
    with iam_enforced():
        assert not allowed(lambda: launcher.create_training_job(**own))
    role = deployed.launcher_role(team)
    context = deployed.platform_context(team)
    queues = context.queues
    assert queues is not None and queues.share_identifier == team
    arn = f"arn:aws:batch:{deployed.region}:222222222222"
    mine = {"batch:ShareIdentifier": team, f"aws:RequestTag/{TEAM_TAG}": team}
    for name in ("standard", "urgent"):
        queue = f"{arn}:job-queue/llmtrain-prod-{name}"
        may = name in queues.queue_arns
        assert queues.queue_arns.get(name, queue) == queue
        assert role_allows(role, "batch:SubmitServiceJob", queue, {f"aws:RequestTag/{TEAM_TAG}": team}) is may
    assert set(queues.queue_arns) == ({"standard", "urgent"} if team == "pretrain" else {"standard"})
    service_job = f"{arn}:service-job/0f2a"
    assert role_allows(role, "batch:SubmitServiceJob", service_job, mine)
    theirs = {"batch:ShareIdentifier": other, f"aws:RequestTag/{TEAM_TAG}": team}
    assert not role_allows(role, "batch:SubmitServiceJob", service_job, theirs)
    untagged = {"batch:ShareIdentifier": team, f"aws:RequestTag/{TEAM_TAG}": other}
    assert not role_allows(role, "batch:SubmitServiceJob", service_job, untagged)
    # Batch tags the job as it is submitted (it has no tags yet); a job another team's launcher submitted
    # (tagged as that team's, whose engineers may cancel it) is never re-tagged as this team's.
    with if_exists_evaluated():
        assert role_allows(role, "batch:TagResource", service_job, {f"aws:RequestTag/{TEAM_TAG}": team})
        assert not role_allows(role, "batch:TagResource", service_job, {f"aws:RequestTag/{TEAM_TAG}": other})
        retagged = {f"aws:RequestTag/{TEAM_TAG}": team, f"aws:ResourceTag/{TEAM_TAG}": other}
        assert not role_allows(role, "batch:TagResource", service_job, retagged)
        assert role_allows(role, "batch:TagResource", service_job,
                           {f"aws:RequestTag/{TEAM_TAG}": team, f"aws:ResourceTag/{TEAM_TAG}": team})
    # Batch passes the payload's role only if the submitter may: the team's execution role, no other.
    own_role, their_role = (deployed.outputs[f"Team{t.capitalize()}ExecutionRoleArn"] for t in (team, other))
    to_sagemaker = {"iam:PassedToService": "sagemaker.amazonaws.com"}
    assert role_allows(role, "iam:PassRole", own_role, to_sagemaker)
    assert not role_allows(role, "iam:PassRole", their_role, to_sagemaker)


@pytest.mark.parametrize("team", TEAMS)
def test_a_teams_engineers_see_the_queues_and_cancel_only_its_queued_runs(deployed, team):
    other = OTHER[team]
    policy = deployed.outputs[f"Team{team.capitalize()}EngineerPolicyArn"]
    arn = f"arn:aws:batch:{deployed.region}:222222222222"
    service_job = f"{arn}:service-job/0f2a"
    assert managed_policy_allows(policy, "batch:ListServiceJobs", "*")
    assert managed_policy_allows(policy, "batch:GetJobQueueSnapshot", f"{arn}:job-queue/llmtrain-prod-urgent")
    assert not managed_policy_allows(policy, "batch:DescribeServiceJob", "*")  # payloads are the launcher's
    assert managed_policy_allows(policy, "batch:TerminateServiceJob", service_job,
                                 {f"aws:ResourceTag/{TEAM_TAG}": team})
    assert not managed_policy_allows(policy, "batch:TerminateServiceJob", service_job,
                                     {f"aws:ResourceTag/{TEAM_TAG}": other})
    for action in ("batch:SubmitServiceJob", "batch:SubmitJob"):
        assert not managed_policy_allows(policy, action, f"{arn}:job-queue/llmtrain-prod-standard")


def test_every_request_the_prod_teams_render_encrypts_inter_container_traffic(deployed, environments):
    """prod asks for inter-container traffic encryption: every version every team may run renders it
    on, with the context its deployed functions received (as CloudFormation resolved it)."""
    assert environments[ENVIRONMENT].network.inter_container_traffic_encryption
    catalog = Catalog.load()
    rendered = 0
    for team in TEAMS:
        context = deployed.platform_context(team)
        assert context.inter_container_traffic_encryption and context.team == team
        assert context.job_name_prefix == environments[ENVIRONMENT].team(team).job_name_prefix
        for name in context.allowed_templates:
            for version in catalog.versions(name):
                request = render(catalog.get(name, version), RunInput(run_name="ice"), context)
                assert request["EnableInterContainerTrafficEncryption"] is True, (team, name, version)
                assert request["CheckpointConfig"]["S3Uri"].startswith(
                    f"s3://{context.checkpoints_bucket}/teams/{team}/"
                )
                rendered += 1
    assert rendered == sum(len(catalog.versions(n)) for n in environments[ENVIRONMENT].enabled_templates)


@pytest.mark.parametrize("team", TEAMS)
def test_prods_jobs_log_to_its_mlflow_tracking_server(deployed, environments, team):
    """Issue 25: prod had no tracking server. Every request a prod team renders, with the context its
    deployed functions received, names the server (MlflowConfig, and MLFLOW_TRACKING_URI for the
    program), and the team's execution role may log to it (moto's evaluator, on the role as deployed)."""
    config = environments[ENVIRONMENT]
    server = f"arn:aws:sagemaker:{config.region}:{config.account}:mlflow-tracking-server/llmtrain-prod"
    assert config.mlflow.tracking_server
    context = deployed.platform_context(team)
    assert context.mlflow_tracking_server_arn == server
    request = _rendered(deployed, team, f"{team}-tracked")
    assert request["MlflowConfig"]["MlflowResourceArn"] == server
    assert request["Environment"]["MLFLOW_TRACKING_URI"] == server
    role = deployed.outputs[f"Team{team.capitalize()}ExecutionRoleArn"].rsplit("/", 1)[1]
    assert role_allows(role, "sagemaker-mlflow:LogBatch", server)
    assert not role_allows(role, "sagemaker-mlflow:LogBatch", server.replace("llmtrain-prod", "other"))


def _rendered(deployed, team: str, run_name: str) -> dict:
    context = deployed.platform_context(team)
    template = Catalog.load().get(context.allowed_templates[0])
    return render(template, RunInput(run_name=run_name), context)


def _processing_request(deployed, team: str, name: str = "web") -> dict:
    """The shards job's request the team's preparation state machine would pass (its processing role)."""
    context = dataclasses.replace(deployed.platform_context(team),
                                  execution_role_arn=deployed.processing_role(team))
    preparation = Preparation(name=name, input_uri=f"{context.datasets_uri}raw/",
                              tokenizer_uri=f"{context.datasets_uri}tok/",
                              instance_type="ml.c5.xlarge", instance_count=2, options=(), owner="alice",
                              input_bytes=1 << 20, stamp="20261128120000")
    template = Catalog.load().get(context.allowed_templates[0])
    return shards_request(preparation, context, template)


@pytest.mark.parametrize("team", TEAMS)
def test_a_teams_preparations_reach_only_its_datasets(deployed, team):
    """Issue 35: the processing jobs (their role) read and write the team's datasets prefix only; the state
    machine's function writes nothing there but `sizes.json` and the dataset's marker, and deletes only the
    shard files and `.dedup/` a finished dataset does not use."""
    other = OTHER[team]
    datasets = deployed.bucket("datasets")
    s3 = boto3.client("s3", region_name=deployed.region)
    for owner in TEAMS:
        s3.put_object(Bucket=datasets, Key=f"teams/{owner}/raw/notes.txt", Body=b"text")
    jobs, steps = deployed.client("processing", team, "s3"), deployed.client("steps", team, "s3")

    def put(client, key: str, bucket: str = datasets):
        return allowed(lambda: client.put_object(Bucket=bucket, Key=key, Body=b"1"))

    with iam_enforced():
        for client in (jobs, steps):
            assert allowed(lambda c=client: c.get_object(Bucket=datasets, Key=f"teams/{team}/raw/notes.txt"))
            theirs = f"teams/{other}/raw/notes.txt"
            assert not allowed(lambda c=client, k=theirs: c.get_object(Bucket=datasets, Key=k))
        assert put(jobs, f"teams/{team}/web/train/shard_00000.bin")
        assert not put(jobs, f"teams/{other}/web/train/shard_00000.bin")
        assert not put(jobs, f"teams/{team}/web/shard", bucket=deployed.bucket("checkpoints"))
        assert put(steps, f"teams/{team}/web/.preparation/sizes.json")
        assert put(steps, f"teams/{team}/web/llmtrain-dataset.json")
        assert not put(steps, f"teams/{team}/web/train/shard_00000.bin")
        assert not put(steps, f"teams/{other}/web/llmtrain-dataset.json")
        # Before the marker, the function removes the shards and .dedup/ the dataset does not use: those only.
        for key in ("web/train/shard_00000_00000.bin", "web/.dedup/signatures/bucket_000/00000.minhash.sig"):
            assert allowed(lambda k=key: steps.delete_object(Bucket=datasets, Key=f"teams/{team}/{k}"))
            assert not allowed(lambda k=key: steps.delete_object(Bucket=datasets, Key=f"teams/{other}/{k}"))
        assert not allowed(lambda: steps.delete_object(Bucket=datasets, Key=f"teams/{team}/raw/notes.txt"))
        assert not allowed(lambda: jobs.delete_object(Bucket=datasets, Key=f"teams/{other}/raw/notes.txt"))


@pytest.mark.parametrize("team", TEAMS)
def test_only_a_teams_preparation_state_machine_creates_its_processing_jobs(deployed, team):
    other = OTHER[team]
    requests = {t: _processing_request(deployed, t, f"{team}-web") for t in TEAMS}
    launcher = deployed.client("preparations", team, "sagemaker")
    engineer = deployed.client("engineer", team, "sagemaker")
    with iam_enforced():
        assert allowed(lambda: launcher.create_processing_job(**requests[team]))
        assert not allowed(lambda: launcher.create_processing_job(**requests[other]))  # its job-name prefix
        renamed = {**requests[team], "ProcessingJobName": requests[team]["ProcessingJobName"] + "-2"}
        assert not allowed(lambda: engineer.create_processing_job(**renamed))  # engineers create no job
        own = requests[team]["ProcessingJobName"]
        assert allowed(lambda: engineer.describe_processing_job(ProcessingJobName=own))
        assert allowed(lambda: engineer.list_processing_jobs())
    boto3.client("sagemaker", region_name=deployed.region).create_processing_job(**requests[other])
    with iam_enforced():
        theirs = requests[other]["ProcessingJobName"]
        assert not allowed(lambda: engineer.describe_processing_job(ProcessingJobName=theirs))
        assert not allowed(lambda: launcher.describe_processing_job(ProcessingJobName=theirs))
    # The condition keys moto's enforcement leaves out, judged by moto's evaluator on the role as deployed
    # (StringEquals: the tags and the output key; the instance types, subnets and security groups are
    # asserted on the statements in test_preparation_launcher.py).
    role, context = deployed.preparation_role(team), deployed.platform_context(team)
    job = f"arn:aws:sagemaker:{deployed.region}:222222222222:processing-job/{context.job_name_prefix}-web-x"
    mine = {f"aws:RequestTag/{TEAM_TAG}": team, "aws:RequestTag/llmtrain:environment": ENVIRONMENT,
            "sagemaker:OutputKmsKey": context.kms_key_arn}
    assert role_allows(role, "sagemaker:CreateProcessingJob", job, mine)
    assert not role_allows(role, "sagemaker:CreateProcessingJob", job,
                           {**mine, f"aws:RequestTag/{TEAM_TAG}": other})
    assert not role_allows(role, "sagemaker:CreateProcessingJob", job,
                           {**mine, "sagemaker:OutputKmsKey": context.kms_key_arn.replace("key/", "key/0")})
    theirs_arn = job.replace(context.job_name_prefix, deployed.platform_context(other).job_name_prefix)
    assert not role_allows(role, "sagemaker:CreateProcessingJob", theirs_arn, mine)
    to_sagemaker = {"iam:PassedToService": "sagemaker.amazonaws.com"}
    assert role_allows(role, "iam:PassRole", deployed.processing_role(team), to_sagemaker)
    assert not role_allows(role, "iam:PassRole", deployed.processing_role(other), to_sagemaker)
    assert not role_allows(role, "iam:PassRole", deployed.outputs[f"Team{team.capitalize()}ExecutionRoleArn"],
                           to_sagemaker)
