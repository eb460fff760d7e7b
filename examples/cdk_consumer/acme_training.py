"""Acme's training stacks: the llmtrain-constructs composed in Acme's own account. They only wire."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import aws_cdk as cdk
from constructs import Construct

from llmtrain.catalog import Catalog
from training_constructs import (
    JobTemplate,
    TeamSpec,
    TrainingAccess,
    TrainingLauncher,
    TrainingNetwork,
    TrainingOperations,
    TrainingStorage,
)
from training_constructs.deployed_environment import DeployedEnvironmentProps, DeployedEnvironmentRecord

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True, kw_only=True)
class AcmeEnvironment:
    """Acme's one training environment: where it is deployed and who trains there."""

    name: str
    account: str
    region: str
    availability_zones: tuple[str, ...]
    vpc_cidr: str
    team: TeamSpec
    # Acme's template from its own catalog (templates/ beside this file, code in training/), and one
    # of the platform's, from the catalog the llmtrain package ships.
    own_templates: tuple[str, ...]
    platform_templates: tuple[str, ...]
    max_keep_alive_seconds: int
    warm_pool_idle_budget_seconds: int
    quota_alarm_threshold_percent: float

    @property
    def job_name_prefix(self) -> str:
        return self.team.job_name_prefix


def acme_catalog() -> Catalog:
    """Acme's catalog: its templates, its lock and frozen code, its code relative to this folder."""
    return Catalog.load(root=HERE / "templates", repo_root=HERE)


class AcmeDataStack(cdk.Stack):
    """Stateful: the key and the buckets, retained and protected from deletion."""

    def __init__(
        self, scope: Construct, construct_id: str, *, environment: AcmeEnvironment, **kwargs
    ) -> None:
        super().__init__(scope, construct_id, termination_protection=True, **kwargs)
        self.storage = TrainingStorage(self, "Storage", key_alias=f"alias/acme/{environment.name}")


class AcmeTrainingStack(cdk.Stack):
    """The network, the team's access, its templates and launcher, operations and the CLI's record."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        environment: AcmeEnvironment,
        storage: TrainingStorage,
        **kwargs,
    ) -> None:
        super().__init__(scope, construct_id, **kwargs)
        team = environment.team
        network = TrainingNetwork(
            self, "Network", availability_zones=environment.availability_zones, vpc_cidr=environment.vpc_cidr
        )
        network.restrict_s3_endpoint(list(storage.buckets.values()))
        access = TrainingAccess(
            self,
            "Access",
            datasets_bucket=storage.datasets_bucket,
            checkpoints_bucket=storage.checkpoints_bucket,
            artifacts_bucket=storage.artifacts_bucket,
            code_bucket=storage.code_bucket,
            key=storage.key,
            teams=[team],
            max_keep_alive_seconds=environment.max_keep_alive_seconds,
            subnets=network.subnets,
            security_groups=[network.security_group],
        )
        catalogs = [
            (acme_catalog(), environment.own_templates),
            (Catalog.load(), environment.platform_templates),
        ]
        templates = [
            JobTemplate(
                self,
                f"Template-{ref}",
                template=ref,
                catalog=catalog,
                code_bucket=storage.code_bucket,
                encryption_key=storage.key,
                warm_pool_cap_seconds=environment.max_keep_alive_seconds,
            )
            for catalog, refs in catalogs
            for ref in refs
        ]
        launcher = TrainingLauncher(
            self,
            "Launcher",
            job_templates=templates,
            team=team,
            execution_role=access.teams[team.name].execution_role,
            datasets_bucket=storage.datasets_bucket,
            checkpoints_bucket=storage.checkpoints_bucket,
            artifacts_bucket=storage.artifacts_bucket,
            code_bucket=storage.code_bucket,
            data_key=storage.key,
            subnets=network.subnets,
            security_groups=[network.security_group],
            environment_name=environment.name,
        )
        access.teams[team.name].allow_launcher(launcher.state_machine.state_machine_arn)
        TrainingOperations(
            self,
            "Operations",
            environment_name=environment.name,
            job_name_prefix=environment.job_name_prefix,
            instance_types=team.instance_types,
            quota_alarm_threshold_percent=environment.quota_alarm_threshold_percent,
            warm_pool_idle_budget_seconds=environment.warm_pool_idle_budget_seconds,
            notification_topic=launcher.topic,
            state_machines=[launcher.state_machine],
        )
        record = DeployedEnvironmentRecord(
            self,
            "Record",
            props=DeployedEnvironmentProps.for_launchers(
                [launcher],
                environment_name=environment.name,
                job_name_prefix=environment.job_name_prefix,
                enabled_templates=sorted({t.name for t in templates}),
            ),
        )
        record.grant_read(access.teams[team.name].engineer_policy)
