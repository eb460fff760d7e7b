"""The services stack: what jobs use beyond the network and storage, by the environment's switches.

A CodeArtifact PyPI mirror (`packages.source: codeartifact`, the default), a SageMaker managed MLflow
tracking server (`mlflow.tracking_server`), and the SSM endpoints of remote debugging
(`remote_debug.enabled`), each with the VPC endpoints that isolated subnets need. The permissions to
use them are added to the access stack's roles by `add_feature_permissions`, from the services' fixed
names (no reference from the access stack to this one).
"""

from __future__ import annotations

from aws_cdk import Stack
from aws_cdk import aws_iam as iam
from constructs import Construct

from llmtrain.environments import EnvironmentConfig
from stacks._outputs import output
from training_constructs import TrainingAccess, TrainingNetwork, TrainingStorage, debugging, mlflow, packages
from training_constructs.access import ENGINEER_WILDCARD_REASONS
from training_constructs.debugging import TrainingDebugging
from training_constructs.mlflow import TrainingMlflow
from training_constructs.nag import acknowledge_wildcards
from training_constructs.packages import TrainingPackages

SERVICES_STACK_PART = "services"


class ServicesStack(Stack):
    """Attributes ``packages``, ``mlflow``, ``debugging``: the constructs, or None when switched off."""

    def __init__(self, scope: Construct, construct_id: str, *, config: EnvironmentConfig,
                 network: TrainingNetwork, storage: TrainingStorage) -> None:
        super().__init__(scope, construct_id, stack_name=config.stack_name(SERVICES_STACK_PART),
                         description=f"LLM training platform ({config.name}): package mirror, MLflow, "
                         "remote debugging endpoints")
        where = {"vpc": network.vpc, "subnets": network.subnet_selection,
                 "endpoint_security_group": network.endpoint_security_group}
        self.packages = (TrainingPackages(self, "Packages", environment_name=config.name, **where)
                         if config.packages.codeartifact else None)
        self.mlflow = (TrainingMlflow(self, "Mlflow", environment_name=config.name,
                                      artifacts_bucket=storage.artifacts_bucket, key=storage.key,
                                      size=config.mlflow.size, **where)
                       if config.mlflow.tracking_server else None)
        self.debugging = TrainingDebugging(self, "Debugging", **where) if config.remote_debug else None
        if self.packages is not None:
            output(self, "PackageRepositoryArn", self.packages.repository_arn,
                   "CA_REPOSITORY_ARN of every training job")
        if self.mlflow is not None:
            output(self, "MlflowTrackingServerArn", self.mlflow.tracking_server_arn,
                   "MlflowConfig.MlflowResourceArn of every training job")


def add_feature_permissions(access: TrainingAccess, config: EnvironmentConfig) -> None:
    """The execution role's and the engineers' permissions for the environment's features."""
    stack = Stack.of(access)
    role_statements: list[iam.PolicyStatement] = []
    if config.packages.codeartifact:
        role_statements += packages.read_statements(stack, config.name)
    if config.mlflow.tracking_server:
        role_statements += mlflow.tracking_statements(stack, config.name)
    engineer_statements = debugging.training_plan_statements(stack)
    if config.remote_debug:
        role_statements += debugging.container_statements()
        engineer_statements += debugging.session_statements(stack, config.job_name_prefix)
    if role_statements:
        policy = iam.Policy(access, "FeaturePolicy", statements=role_statements)
        access.execution_role.attach_inline_policy(policy)
        acknowledge_wildcards(policy, WILDCARD_REASONS)
    access.engineer_policy.add_statements(*engineer_statements)
    acknowledge_wildcards(access.engineer_policy, {**ENGINEER_WILDCARD_REASONS, **WILDCARD_REASONS})


# Why each feature statement names a wildcard (cdk-nag AwsSolutions-IAM5), by statement Sid.
WILDCARD_REASONS = {
    "PackagesRead": "pip reads any PyPI package of the environment's own mirror repository (package/*)",
    "PackagesBearerToken": "sts:GetServiceBearerToken has no resource-level permission; the condition "
                           "limits it to CodeArtifact",
    "RemoteDebugChannels": "ssmmessages channel actions have no resource-level permission (SageMaker's "
                           "remote debugging documentation grants them on *)",
    "RemoteDebugStartSession": "SSM session targets of training jobs are not ARNs; the condition on "
                               "aws:ssmmessages:target-id limits sessions to the environment's jobs",
    "RemoteDebugEndSession": "sessions are named after their user at start (${aws:userid}-*): only one's own",
    "TrainingPlansList": "sagemaker:ListTrainingPlans has no resource-level permission",
    "TrainingPlansDescribe": "engineers read every training plan of the account to see its free capacity",
}
