"""One deployment of the platform (an environment in ``config/``) as a CDK Stage."""

from __future__ import annotations

from collections.abc import Iterable

from aws_cdk import Environment, Stage, Tags
from constructs import Construct

from llmtrain.core.catalog import Catalog
from llmtrain.core.environments import EnvironmentConfig
from stacks.access import AccessStack
from stacks.launcher import LauncherStack, preparations_state_machine_name, state_machine_arn
from stacks.network import NetworkStack
from stacks.operations import OperationsStack
from stacks.services import ServicesStack, grant_team_features
from stacks.storage import StorageStack
from stacks.teams import team_specs
from training_constructs.queues import grant_engineer_queue_access


class PlatformStage(Stage):
    """The stacks of one environment, deployed into its account and region.

    Stack construct IDs are stable (``Network``, ``Storage``, ``Access``), so
    ``npx cdk deploy '<env>/*'`` picks one environment. Each stack keeps its construct as an
    attribute (``self.network.network``, ``self.storage.storage``, ``self.access.access``) for
    the stacks built on top of them; ``self.teams`` are the environment's teams (``TeamSpec``).
    ``catalog``: the job templates (default: the platform's, ``Catalog.load()``).
    """

    def __init__(
        self, scope: Construct, *, config: EnvironmentConfig, catalog: Catalog | None = None
    ) -> None:
        super().__init__(scope, config.name, env=Environment(account=config.account, region=config.region))
        self.config = config
        for key, value in {**config.tags, "llmtrain:environment": config.name}.items():
            Tags.of(self).add(key, value)

        catalog = catalog or Catalog.load()
        self.teams = team_specs(config, catalog)

        # The foundation: network and storage, then who may use them (per team).
        self.network = NetworkStack(self, "Network", config=config)
        self.storage = StorageStack(self, "Storage", config=config)
        self.access = AccessStack(self, "Access", config=config, teams=self.teams,
                                  network=self.network.network, storage=self.storage.storage)
        # Jobs reach only the platform's buckets through the S3 endpoint (and ECR's layers).
        self.network.network.restrict_s3_endpoint(self.storage.storage)
        # Package mirror, MLflow, remote debugging (config switches), and each team's permissions to use them.
        self.services = ServicesStack(self, "Services", config=config, network=self.network.network,
                                      storage=self.storage.storage)
        grant_team_features(self.access.access, config)

        # Stacks built on the foundation (the launchers, operations) are added below this line,
        # each taking what it needs from the attributes above.
        self.launcher = LauncherStack(self, "Launcher", config=config, teams=self.teams, catalog=catalog,
                                      network=self.network.network, storage=self.storage.storage,
                                      access=self.access.access)
        for team in self.teams:
            # By the launcher's fixed name: a reference would make the access stack depend on the launcher's.
            self.access.access.teams[team.name].allow_launcher(state_machine_arn(self.access, team))
            self.access.access.teams[team.name].allow_preparations(
                state_machine_arn(self.access, team, preparations_state_machine_name(team)))
            if config.queues is not None:  # likewise the queues, by their fixed names
                grant_engineer_queue_access(self.access.access.teams[team.name], config.name,
                                            config.queues.queue_names)
        # Alarms and job events of the whole environment go to the operations topic (the environment's
        # address); each team's run summaries go to its launcher's topic.
        launchers = self.launcher.launchers.values()
        self.operations = OperationsStack(self, "Operations", config=config, catalog=catalog,
                                          state_machines=[launcher.state_machine for launcher in launchers])


def add_platform_stages(scope: Construct, environments: Iterable[EnvironmentConfig]) -> list[PlatformStage]:
    """One PlatformStage per environment, in the given order."""
    return [PlatformStage(scope, config=config) for config in environments]
