#!/usr/bin/env python3
"""Acme's CDK app: LLM training in Acme's own account, built from llmtrain-constructs.

The only file that reads CDK context (`-c account=...`); everything else is data below.
cdk-nag (AwsSolutions) checks every stack: an unacknowledged finding fails the synth.
"""

from __future__ import annotations

import aws_cdk as cdk
from acme_training import AcmeDataStack, AcmeEnvironment, AcmeTrainingStack
from cdk_nag import AwsSolutionsChecks

from training_constructs import TeamSpec

RESEARCH = TeamSpec(
    name="research",
    job_name_prefix="acme-research",
    instance_types=("ml.g5.2xlarge", "ml.g5.4xlarge", "ml.g5.12xlarge", "ml.g5.24xlarge"),
    max_keep_alive_seconds=1800,
    max_instance_count=2,
    notification_email="ml-research@acme.example.com",
    max_run_cost_usd=500,
    tags={"cost-center": "research"},
)


def acme_environment(account: str) -> AcmeEnvironment:
    return AcmeEnvironment(
        name="acme",
        account=account,
        region="eu-west-1",
        availability_zones=("eu-west-1a", "eu-west-1b"),
        vpc_cidr="10.70.0.0/16",
        team=RESEARCH,
        own_templates=("acme-charlm@1.0.0",),
        platform_templates=("gpt2-ddp@1.1.0",),
        max_keep_alive_seconds=1800,
        warm_pool_idle_budget_seconds=900,
        quota_alarm_threshold_percent=80,
    )


def main() -> None:
    app = cdk.App()
    environment = acme_environment(app.node.try_get_context("account") or "333333333333")
    where = cdk.Environment(account=environment.account, region=environment.region)
    data = AcmeDataStack(app, "AcmeTrainingData", environment=environment, env=where)
    AcmeTrainingStack(app, "AcmeTraining", environment=environment, storage=data.storage, env=where)
    cdk.Tags.of(app).add("project", "acme-llm-training")
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    app.synth()


if __name__ == "__main__":
    main()
