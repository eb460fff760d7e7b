"""The services stack: what jobs use beyond the network and storage, by the environment's switches.

A CodeArtifact PyPI mirror (`packages.source: codeartifact`, the default), a SageMaker managed MLflow
tracking server (`mlflow.tracking_server`), and the SSM endpoints of remote debugging
(`remote_debug.enabled`), each with the VPC endpoints that isolated subnets need. Each team's roles
get the permissions to use them from `grant_team_features`, by the services' fixed names (no
reference from the access stack to this one).
"""

from __future__ import annotations

from aws_cdk import Stack
from constructs import Construct

from llmtrain.core.environments import EnvironmentConfig
from stacks._outputs import output
from training_constructs import TrainingAccess, TrainingNetwork, TrainingStorage, debugging, mlflow, packages
from training_constructs.debugging import TrainingDebugging, TrainingDebuggingProps
from training_constructs.mlflow import TrainingMlflow, TrainingMlflowProps
from training_constructs.packages import TrainingPackages, TrainingPackagesProps

SERVICES_STACK_PART = "services"


class ServicesStack(Stack):
    """Attributes ``packages``, ``mlflow``, ``debugging``: the constructs, or None when switched off."""

    def __init__(self, scope: Construct, construct_id: str, *, config: EnvironmentConfig,
                 network: TrainingNetwork, storage: TrainingStorage) -> None:
        super().__init__(scope, construct_id, stack_name=config.stack_name(SERVICES_STACK_PART),
                         description=f"LLM training platform ({config.name}): package mirror, MLflow, "
                         "remote debugging endpoints")
        self.packages = (
            TrainingPackages(
                self, "Packages", TrainingPackagesProps(environment_name=config.name, network=network)
            )
            if config.packages.codeartifact
            else None
        )
        self.mlflow = (
            TrainingMlflow(
                self,
                "Mlflow",
                TrainingMlflowProps(
                    environment_name=config.name, size=config.mlflow.size, storage=storage, network=network
                ),
            )
            if config.mlflow.tracking_server
            else None
        )
        self.debugging = (
            TrainingDebugging(self, "Debugging", TrainingDebuggingProps(network=network))
            if config.remote_debug
            else None
        )
        if self.packages is not None:
            output(self, "PackageRepositoryArn", self.packages.repository_arn,
                   "CA_REPOSITORY_ARN of every training job")
        if self.mlflow is not None:
            output(self, "MlflowTrackingServerArn", self.mlflow.tracking_server_arn,
                   "MlflowConfig.MlflowResourceArn of every training job")


def grant_team_features(access: TrainingAccess, config: EnvironmentConfig) -> None:
    """Each team's execution role and engineers' policy get what the environment's features need:
    its jobs install packages, log to MLflow and open debug channels; its engineers see training
    plans and open sessions into its own jobs."""
    for team in access.teams.values():
        if config.packages.codeartifact:
            packages.grant_read(team, config.name)
        if config.mlflow.tracking_server:
            mlflow.grant_tracking(team, config.name)
        if config.remote_debug:
            debugging.grant_remote_debug(team)
        debugging.grant_training_plans(team, list(config.training_plans.values()))
