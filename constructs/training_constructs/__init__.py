"""Reusable AWS CDK constructs for training LLMs on Amazon SageMaker."""

from training_constructs._props import PropsError
from training_constructs.access import (
    TeamAccess,
    TrainingAccess,
    guardrail_statements,
    warm_pool_cap_statement,
)
from training_constructs.debugging import TrainingDebugging
from training_constructs.job_template import JobTemplate
from training_constructs.launcher import TrainingLauncher
from training_constructs.mlflow import TrainingMlflow
from training_constructs.network import ExistingVpcAttributes, TrainingNetwork
from training_constructs.operations import TemplateMetrics, TrainingOperations
from training_constructs.packages import TrainingPackages
from training_constructs.storage import TrainingStorage
from training_constructs.teams import TeamSpec

__all__ = [
    "ExistingVpcAttributes",
    "JobTemplate",
    "PropsError",
    "TeamAccess",
    "TeamSpec",
    "TemplateMetrics",
    "TrainingAccess",
    "TrainingDebugging",
    "TrainingLauncher",
    "TrainingMlflow",
    "TrainingNetwork",
    "TrainingOperations",
    "TrainingPackages",
    "TrainingStorage",
    "guardrail_statements",
    "warm_pool_cap_statement",
]
