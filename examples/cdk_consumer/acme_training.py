"""Acme's training stacks: the llmtrain-constructs composed in Acme's own account. They only wire."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import aws_cdk as cdk
from constructs import Construct

from llmtrain.core.catalog import Catalog
from llmtrain.core.platform import package_repository_arn
from training_constructs import (
    DeployedEnvironmentRecord,
    DeployedEnvironmentRecordProps,
    JobTemplate,
    JobTemplateProps,
    TeamSpec,
    TrainingAccess,
    TrainingAccessProps,
    TrainingLauncher,
    TrainingLauncherProps,
    TrainingNetwork,
    TrainingNetworkProps,
    TrainingOperations,
    TrainingOperationsProps,
    TrainingPackages,
    TrainingPackagesProps,
    TrainingStorage,
    TrainingStorageProps,
    packages,
)

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True, kw_only=True)
class AcmeEnvironment:
    """Acme's one training environment: where it is deployed, who trains there, with what."""

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


def acme_catalog() -> Catalog:
    """Acme's catalog: its templates, its lock and frozen code, its code relative to this folder."""
    return Catalog.load(root=HERE / "templates", repo_root=HERE)


class AcmeDataStack(cdk.Stack):
    """Stateful: the data key and the buckets, retained and protected from deletion."""

    def __init__(
        self, scope: Construct, construct_id: str, *, environment: AcmeEnvironment, **kwargs
    ) -> None:
        super().__init__(scope, construct_id, termination_protection=True, **kwargs)
        self.storage = TrainingStorage(
            self, "Storage", TrainingStorageProps(data_key_alias=f"alias/acme/{environment.name}")
        )


class AcmeTrainingStack(cdk.Stack):
    """The network and package mirror, the team's access, templates and launcher, operations, and the
    environment's record for the llmtrain CLI."""

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
        env, team = environment, environment.team
        network = TrainingNetwork(
            self,
            "Network",
            TrainingNetworkProps(availability_zones=env.availability_zones, vpc_cidr=env.vpc_cidr),
        )
        network.restrict_s3_endpoint(storage)
        # Isolated subnets: the training containers install requirements.txt from this PyPI mirror.
        TrainingPackages(self, "Packages", TrainingPackagesProps(environment_name=env.name, network=network))
        access = TrainingAccess(
            self,
            "Access",
            TrainingAccessProps(
                storage=storage,
                network=network,
                teams=[team],
                max_keep_alive_seconds=env.max_keep_alive_seconds,
            ),
        )
        team_access = access.teams[team.name]
        packages.grant_read(team_access, env.name)
        templates = [
            JobTemplate(
                self,
                f"Template-{ref}",
                JobTemplateProps(
                    template=ref,
                    storage=storage,
                    catalog=catalog,
                    warm_pool_cap_seconds=env.max_keep_alive_seconds,
                ),
            )
            for catalog, refs in ((acme_catalog(), env.own_templates), (None, env.platform_templates))
            for ref in refs
        ]
        # The mirror's ARN reaches every job as CA_REPOSITORY_ARN (by its fixed name: no reference).
        mirror = package_repository_arn(env.region, env.account, env.name)
        launcher = TrainingLauncher(
            self,
            "Launcher",
            TrainingLauncherProps(
                job_templates=templates,
                team=team,
                execution_role=team_access.execution_role,
                storage=storage,
                network=network,
                environment_name=env.name,
                platform_features={"package_repository_arn": mirror},
            ),
        )
        team_access.allow_launcher(launcher.state_machine.state_machine_arn)
        TrainingOperations(
            self,
            "Operations",
            TrainingOperationsProps(
                environment_name=env.name,
                job_name_prefix=team.job_name_prefix,
                instance_types=team.instance_types,
                quota_alarm_threshold_percent=env.quota_alarm_threshold_percent,
                warm_pool_idle_budget_seconds=env.warm_pool_idle_budget_seconds,
                existing_topic=launcher.topic,
                state_machines=[launcher.state_machine],
            ),
        )
        record = DeployedEnvironmentRecord(
            self,
            "Record",
            DeployedEnvironmentRecordProps.for_launchers(
                [launcher],
                environment_name=env.name,
                job_name_prefix=team.job_name_prefix,
                enabled_templates=sorted({t.name for t in templates}),
            ),
        )
        record.grant_read(team_access.engineer_policy)
