"""One deployment of the platform (an environment in ``config/``) as a CDK Stage."""

from __future__ import annotations

from collections.abc import Iterable

from aws_cdk import Environment, Stage, Tags
from constructs import Construct

from llmtrain.environments import EnvironmentConfig
from stacks.access import AccessStack
from stacks.launcher import LauncherStack, state_machine_arn
from stacks.network import NetworkStack
from stacks.operations import OperationsStack
from stacks.services import ServicesStack, add_feature_permissions
from stacks.storage import StorageStack


class PlatformStage(Stage):
    """The stacks of one environment, deployed into its account and region.

    Stack construct IDs are stable (``Network``, ``Storage``, ``Access``), so
    ``npx cdk deploy '<env>/*'`` picks one environment. Each stack keeps its construct as an
    attribute (``self.network.network``, ``self.storage.storage``, ``self.access.access``) for
    the stacks built on top of them.
    """

    def __init__(self, scope: Construct, *, config: EnvironmentConfig) -> None:
        super().__init__(scope, config.name, env=Environment(account=config.account, region=config.region))
        self.config = config
        for key, value in {**config.tags, "llmtrain:environment": config.name}.items():
            Tags.of(self).add(key, value)

        # The foundation: network and storage, then who may use them.
        self.network = NetworkStack(self, "Network", config=config)
        self.storage = StorageStack(self, "Storage", config=config)
        self.access = AccessStack(self, "Access", config=config, network=self.network.network,
                                  storage=self.storage.storage)
        # Package mirror, MLflow, remote debugging (config switches), and the permissions to use them.
        self.services = ServicesStack(self, "Services", config=config, network=self.network.network,
                                      storage=self.storage.storage)
        add_feature_permissions(self.access.access, config)

        # Stacks built on the foundation (the launcher, operations) are added below this line,
        # each taking what it needs from the attributes above.
        self.launcher = LauncherStack(self, "Launcher", config=config, network=self.network.network,
                                      storage=self.storage.storage, access=self.access.access)
        self.access.access.allow_launcher(state_machine_arn(self.access, config))
        # One notification topic per environment: alarms and job events go where run summaries go.
        self.operations = OperationsStack(self, "Operations", config=config,
                                          notification_topic=self.launcher.launcher.topic,
                                          state_machine=self.launcher.launcher.state_machine)


def add_platform_stages(scope: Construct, environments: Iterable[EnvironmentConfig]) -> list[PlatformStage]:
    """One PlatformStage per environment, in the given order."""
    return [PlatformStage(scope, config=config) for config in environments]
