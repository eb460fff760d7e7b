"""Reusable AWS CDK constructs for training LLMs on Amazon SageMaker (constructs/README.md).

Each construct takes one frozen props record (``<Construct>Props``), validated when built:
``PropsError`` names the construct and the field. Resources a caller brings are ``existing_*``
props; the platform's storage and network are passed whole (``StorageResources``,
``NetworkResources``: the constructs, or ``ExistingStorage`` / ``ExistingNetwork``).
"""

from training_constructs._props import PropsError
from training_constructs.access import (
    TeamAccess,
    TrainingAccess,
    TrainingAccessProps,
    guardrail_statements,
    warm_pool_cap_statement,
)
from training_constructs.debugging import TrainingDebugging, TrainingDebuggingProps
from training_constructs.deployed_environment import (
    DeployedEnvironmentRecord,
    DeployedEnvironmentRecordProps,
    TeamEntry,
)
from training_constructs.job_template import JobTemplate, JobTemplateProps
from training_constructs.launcher import TrainingLauncher, TrainingLauncherProps
from training_constructs.mlflow import TrainingMlflow, TrainingMlflowProps
from training_constructs.network import ExistingVpcAttributes, TrainingNetwork, TrainingNetworkProps
from training_constructs.operations import TemplateMetrics, TrainingOperations, TrainingOperationsProps
from training_constructs.packages import TrainingPackages, TrainingPackagesProps
from training_constructs.preparation_launcher import PreparationLauncher, PreparationLauncherProps
from training_constructs.queues import JobQueueSpec, TrainingQueues, TrainingQueuesProps
from training_constructs.resources import ExistingNetwork, ExistingStorage, NetworkResources, StorageResources
from training_constructs.storage import TrainingStorage, TrainingStorageProps
from training_constructs.teams import TeamSpec

__all__ = [
    "DeployedEnvironmentRecord",
    "DeployedEnvironmentRecordProps",
    "ExistingNetwork",
    "ExistingStorage",
    "ExistingVpcAttributes",
    "JobTemplate",
    "JobQueueSpec",
    "JobTemplateProps",
    "NetworkResources",
    "PreparationLauncher",
    "PreparationLauncherProps",
    "PropsError",
    "StorageResources",
    "TeamAccess",
    "TeamEntry",
    "TeamSpec",
    "TemplateMetrics",
    "TrainingAccess",
    "TrainingAccessProps",
    "TrainingDebugging",
    "TrainingDebuggingProps",
    "TrainingLauncher",
    "TrainingLauncherProps",
    "TrainingMlflow",
    "TrainingMlflowProps",
    "TrainingNetwork",
    "TrainingNetworkProps",
    "TrainingOperations",
    "TrainingOperationsProps",
    "TrainingPackages",
    "TrainingPackagesProps",
    "TrainingQueues",
    "TrainingQueuesProps",
    "TrainingStorage",
    "TrainingStorageProps",
    "guardrail_statements",
    "warm_pool_cap_statement",
]


def __getattr__(name: str) -> object:
    """Deprecated names, each with its warning (``deployed_environment.DeployedEnvironmentProps``)."""
    if name == "DeployedEnvironmentProps":
        from training_constructs import deployed_environment

        return getattr(deployed_environment, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
