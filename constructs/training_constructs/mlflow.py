"""An optional SageMaker managed MLflow tracking server that the environment's jobs log to.

The training program logs parameters, metrics and the final model's location to MLflow when its
environment names a tracking server (the request's MlflowConfig and MLFLOW_TRACKING_URI, which the
`sagemaker-mlflow` plugin resolves). The server keeps its artifacts under `mlflow/` in the artifacts
bucket; jobs in isolated subnets reach it through the `sagemaker.experiments` interface endpoint.
Its name is fixed by `llmtrain.core.platform.mlflow_tracking_server_name`, so rendering knows its ARN and
`grant_tracking` grants a team's execution role from the name alone.

One server per environment, shared by its teams: each team's runs of a template go to the experiment
`<team>-<template>` (llmtrain.core.render.mlflow_experiment_name). SageMaker's MLflow permissions are on the
tracking server as a whole (no experiment-level resource), so the teams see each other's experiments;
what keeps them apart is their data, which the program never uploads to MLflow (it logs parameters,
metrics and where the model is).
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_sagemaker as sagemaker
from constructs import Construct

from llmtrain.core.platform import MLFLOW_SIZES, mlflow_tracking_server_name
from training_constructs._props import checked_props, require
from training_constructs.access import TeamAccess
from training_constructs.nag import acknowledge_wildcards
from training_constructs.network import endpoints_in_network
from training_constructs.resources import NetworkResources, StorageResources, check_network, check_storage

_NAME = "TrainingMlflow"
ARTIFACT_PREFIX = "mlflow"
# SageMaker's documentation of this endpoint names no endpoint policy, so it keeps the default one
# (a policy on a service without policy support would fail the deployment); the endpoint's security
# group admits HTTPS from the VPC only, and the roles' own policies hold them to their server.
ENDPOINT_SERVICES = {"SageMakerExperiments": ec2.InterfaceVpcEndpointAwsService.SAGEMAKER_EXPERIMENTS}
# What the MLflow client does during a job: experiments, runs, params, metrics, tags.
TRACKING_ACTIONS = (
    "sagemaker-mlflow:AccessUI",
    "sagemaker-mlflow:CreateExperiment",
    "sagemaker-mlflow:GetExperiment",
    "sagemaker-mlflow:GetExperimentByName",
    "sagemaker-mlflow:SearchExperiments",
    "sagemaker-mlflow:CreateRun",
    "sagemaker-mlflow:GetRun",
    "sagemaker-mlflow:UpdateRun",
    "sagemaker-mlflow:LogBatch",
    "sagemaker-mlflow:LogMetric",
    "sagemaker-mlflow:LogParam",
    "sagemaker-mlflow:SetTag",
    "sagemaker-mlflow:SearchRuns",
    "sagemaker-mlflow:GetMetricHistory",
)


@dataclass(frozen=True, kw_only=True)
class TrainingMlflowProps:
    """``environment_name`` names the server (``llmtrain.core.platform.mlflow_tracking_server_name``);
    ``size`` is its size (``llmtrain.core.platform.MLFLOW_SIZES``); ``storage`` holds its artifacts
    (under ``mlflow/`` in the artifacts bucket, with the data key); ``network`` is where its endpoint
    goes."""

    environment_name: str
    size: str
    storage: StorageResources
    network: NetworkResources

    def __post_init__(self) -> None:
        require(bool(self.environment_name), _NAME, "environment_name", "must not be empty")
        require(self.size in MLFLOW_SIZES, _NAME, "size",
                f"must be one of {', '.join(MLFLOW_SIZES)}, got {self.size!r}")
        check_storage(_NAME, self.storage)
        check_network(_NAME, self.network)


class TrainingMlflow(Construct):
    """The tracking server, its role (the artifact store in the artifacts bucket) and its endpoint.

    Attributes: ``tracking_server``, ``tracking_server_arn``, ``role``, ``endpoints``, ``props``.
    """

    def __init__(self, scope: Construct, construct_id: str, props: TrainingMlflowProps) -> None:
        super().__init__(scope, construct_id)
        self.props = checked_props(_NAME, props, TrainingMlflowProps)
        artifacts_bucket = props.storage.artifacts_bucket
        self.role = iam.Role(self, "ServerRole", assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com"),
                             description="SageMaker MLflow tracking server: its artifact store")
        artifacts_bucket.grant_read_write(self.role, f"{ARTIFACT_PREFIX}/*")
        props.storage.data_key.grant_encrypt_decrypt(self.role)
        acknowledge_wildcards(self.role, {
            "s3:Abort*": "the tracking server reads and writes any artifact under mlflow/ of the artifacts "
                         "bucket (aws-cdk-lib's grant_read_write action groups)",
            "kms:Decrypt": "the artifacts bucket's objects are encrypted with the platform key: data keys "
                           "and re-encryption (aws-cdk-lib's grant_encrypt_decrypt)",
        })
        self.tracking_server = sagemaker.CfnMlflowTrackingServer(
            self, "TrackingServer",
            tracking_server_name=mlflow_tracking_server_name(props.environment_name),
            artifact_store_uri=f"s3://{artifacts_bucket.bucket_name}/{ARTIFACT_PREFIX}",
            role_arn=self.role.role_arn,
            tracking_server_size=props.size,
        )
        # The server needs its permissions when it starts: it depends on the role's policy (on the role
        # itself through the GetAtt of its ARN; a second DependsOn on it is cfn-lint's W3005).
        self.tracking_server.node.add_dependency(self.role.node.find_child("DefaultPolicy"))
        self.tracking_server_arn = self.tracking_server.attr_tracking_server_arn
        self.endpoints = endpoints_in_network(self, props.network, ENDPOINT_SERVICES, policy_actions={})


def tracking_statements(stack: Stack, environment_name: str) -> list[iam.PolicyStatement]:
    """What a job's MLflow client needs on the environment's tracking server."""
    arn = stack.format_arn(service="sagemaker", resource="mlflow-tracking-server",
                           resource_name=mlflow_tracking_server_name(environment_name))
    return [iam.PolicyStatement(sid="MlflowTracking", actions=list(TRACKING_ACTIONS), resources=[arn])]


def grant_tracking(team: TeamAccess, environment_name: str) -> None:
    """Let the team's jobs log to the environment's tracking server."""
    team.add_execution_statements(tracking_statements(team.stack, environment_name), {})


__all__ = [
    "ENDPOINT_SERVICES",
    "TRACKING_ACTIONS",
    "TrainingMlflow",
    "TrainingMlflowProps",
    "grant_tracking",
    "tracking_statements",
]
