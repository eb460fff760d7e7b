"""A deployed environment in moto, as the stacks leave it for the CLI: the record in SSM Parameter
Store (llmtrain.core.deployed.parameter_values, the layout DeployedEnvironmentRecord writes), a launcher
state machine per team and the datasets bucket with a dataset of team `default`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import boto3

from llmtrain.core.catalog import Catalog
from llmtrain.core.deployed import TeamAccess, parameter_values
from llmtrain.core.platform import DEFAULT_TEAM, PlatformContext, team_data_prefix, team_job_name_prefix
from llmtrain.core.team_context import PlatformResources, TeamSettings, team_context

ACCOUNT, REGION = "123456789012", "us-east-1"
ENVIRONMENT = "dev"
ENVIRONMENT_PREFIX = "llmtrain-dev"
PREFIX = team_job_name_prefix(ENVIRONMENT_PREFIX, DEFAULT_TEAM)  # the jobs of team default
DATASET = "tiny"


def moto_credentials(monkeypatch) -> None:
    """The region and made-up credentials moto accepts; no profile."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def platform_context(
    team: str = DEFAULT_TEAM, allowed_templates: Sequence[str] = (), **limits
) -> PlatformContext:
    """Team `team`'s context, as its launcher's functions receive it."""
    context = team_context(
        environment=ENVIRONMENT,
        region=REGION,
        account=ACCOUNT,
        resources=PlatformResources(
            execution_role_arn=f"arn:aws:iam::{ACCOUNT}:role/llmtrain-dev-{team}-execution",
            datasets_bucket=f"llmtrain-dev-datasets-{ACCOUNT}",
            checkpoints_bucket=f"llmtrain-dev-checkpoints-{ACCOUNT}",
            artifacts_bucket=f"llmtrain-dev-artifacts-{ACCOUNT}",
            code_bucket=f"llmtrain-dev-code-{ACCOUNT}",
            kms_key_arn=f"arn:aws:kms:{REGION}:{ACCOUNT}:key/11111111-2222-3333-4444-555555555555",
            subnet_ids=("subnet-0a1b2c3d4e5f60001", "subnet-0a1b2c3d4e5f60002"),
            security_group_ids=("sg-0a1b2c3d4e5f60001",),
        ),
        team=TeamSettings(
            name=team,
            job_name_prefix=team_job_name_prefix(ENVIRONMENT_PREFIX, team),
            warm_pool_cap_seconds=3600,
            allowed_templates=tuple(allowed_templates) or tuple(Catalog.load().names()),
        ),
    )
    return dataclasses.replace(context, **limits)


def team_access(state_machine_arn: str, team: str = DEFAULT_TEAM, **limits) -> TeamAccess:
    return TeamAccess(
        name=team,
        state_machine_arn=state_machine_arn,
        notification_topic_arn=f"arn:aws:sns:{REGION}:{ACCOUNT}:llmtrain-dev-{team}-runs",
        platform=platform_context(team, **limits),
    )


BUCKET = platform_context().datasets_bucket
TEAM_URI = f"s3://{BUCKET}/{team_data_prefix(DEFAULT_TEAM)}"
TRAIN = f"channels.train={TEAM_URI}{DATASET}/train/"


def deploy_environment(
    state_machine_arn: str,
    *,
    enabled: Sequence[str] | None = None,
    teams: Sequence[TeamAccess] | None = None,
    with_dataset: bool = True,
) -> None:
    """Write the record of environment `dev` to moto's SSM, and create its datasets bucket."""
    enabled = list(enabled or Catalog.load().names())
    teams = teams or [team_access(state_machine_arn, allowed_templates=enabled)]
    values = parameter_values(
        environment=ENVIRONMENT,
        region=REGION,
        account=ACCOUNT,
        job_name_prefix=ENVIRONMENT_PREFIX,
        enabled_templates=enabled,
        teams=[team.to_dict() for team in teams],
    )
    ssm = boto3.client("ssm", region_name=REGION)
    for name, value in values.items():
        ssm.put_parameter(Name=name, Value=json.dumps(value), Type="String")
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket=BUCKET)
    if with_dataset:
        put_dataset(DATASET)


def put_dataset(name: str, team: str = DEFAULT_TEAM, tokens: int = 1 << 16) -> None:
    """A dataset of `train` and `validation` splits under the team's prefix, as `llmtrain data
    upload` leaves what `data prepare` wrote with the shipped tokenizer: each a manifest and a shard
    of `tokens` tokens."""
    for split in ("train", "validation"):
        put_shards(f"{team_data_prefix(team)}{name}/{split}/", tokens)


def put_shards(prefix: str, tokens: int = 1 << 16, **manifest) -> None:
    """One split's manifest (the shipped tokenizer's vocabulary and end-of-sequence id, unless
    `manifest` says otherwise) and its shard, under `prefix` of the datasets bucket."""
    s3 = boto3.client("s3", region_name=REGION)
    body = {"format": "llmtrain-token-shards", "version": 1, "dtype": "uint16", "vocab_size": 629,
            "eos_token_id": 0, "num_documents": 1, "num_tokens": tokens, "loss_mask": False,
            "shards": [{"path": "shard_00000.bin", "num_tokens": tokens}], **manifest}
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}shard_00000.bin", Body=bytes(2 * tokens))
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}manifest.json", Body=json.dumps(body).encode())
