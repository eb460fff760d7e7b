"""Python packages for training jobs in isolated subnets: a CodeArtifact PyPI mirror and its endpoints.

The SageMaker training toolkit pip-installs the sourcedir's requirements.txt before the program
starts. In subnets without a route to the internet it can only reach a package index through a VPC
endpoint: CodeArtifact, which the toolkit uses when the job's environment has CA_REPOSITORY_ARN
(sagemaker_training.modules asks `codeartifact:GetAuthorizationToken` and `GetRepositoryEndpoint`,
then pip reads the repository). The repository has PyPI as its upstream (external connection
`public:pypi`), so every package on PyPI is available and is cached on first use. CodeArtifact
serves Python packages itself: unlike Maven's, their downloads do not go through S3, so the S3
gateway endpoint's policy (the platform's buckets only) needs no CodeArtifact bucket.

Names are fixed by `llmtrain.core.platform` (`package_domain_name`, `PACKAGE_REPOSITORY_NAME`), so the
repository's ARN, which rendering puts into every request, is known without a deployment; and
`grant_read` gives a team's execution role its permissions from the same names, without a
reference across stacks.
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import RemovalPolicy, Stack
from aws_cdk import aws_codeartifact as codeartifact
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from constructs import Construct

from llmtrain.core.platform import PACKAGE_REPOSITORY_NAME, package_domain_name
from training_constructs._props import checked_props, require
from training_constructs.access import TeamAccess
from training_constructs.network import endpoints_in_network
from training_constructs.resources import NetworkResources, check_network

_NAME = "TrainingPackages"
PYPI_CONNECTION = "public:pypi"
# The APIs the toolkit and pip call: the token and endpoint (api), the packages (repositories).
ENDPOINT_SERVICES = {
    "CodeArtifactApi": ec2.InterfaceVpcEndpointAwsService.CODEARTIFACT_API,
    "CodeArtifactRepositories": ec2.InterfaceVpcEndpointAwsService.CODEARTIFACT_REPOSITORIES,
}
# CodeArtifact's endpoints take policies (its guide: "Create a VPC endpoint policy for CodeArtifact");
# the token CodeArtifact hands out is an STS service bearer token, asked for through the same endpoint.
ENDPOINT_ACTIONS = ("codeartifact:*", "sts:GetServiceBearerToken")
BEARER_TOKEN_SID = "PackagesBearerToken"
WILDCARD_REASONS = {
    BEARER_TOKEN_SID: "sts:GetServiceBearerToken has no resource-level permission; the condition limits "
    "it to CodeArtifact's tokens",
}


@dataclass(frozen=True, kw_only=True)
class TrainingPackagesProps:
    """``environment_name`` names the domain (``llmtrain.core.platform.package_domain_name``); ``network``
    (``TrainingNetwork`` or ``ExistingNetwork``) is where the endpoints go."""

    environment_name: str
    network: NetworkResources

    def __post_init__(self) -> None:
        require(bool(self.environment_name), _NAME, "environment_name", "must not be empty")
        check_network(_NAME, self.network)


class TrainingPackages(Construct):
    """A CodeArtifact domain and PyPI-mirror repository, and the endpoints jobs reach them through.

    Attributes: ``domain``, ``domain_name``, ``repository``, ``repository_arn``, ``endpoints`` (by the
    names in ``ENDPOINT_SERVICES``; empty when the network has no endpoint security group: a VPC that
    brings its own endpoints), ``props``.
    """

    def __init__(self, scope: Construct, construct_id: str, props: TrainingPackagesProps) -> None:
        super().__init__(scope, construct_id)
        self.props = checked_props(_NAME, props, TrainingPackagesProps)
        self.domain_name = package_domain_name(props.environment_name)
        # Package assets are public PyPI files: CodeArtifact's own key encrypts them.
        self.domain = codeartifact.CfnDomain(self, "Domain", domain_name=self.domain_name)
        self.domain.apply_removal_policy(RemovalPolicy.RETAIN)
        self.repository = codeartifact.CfnRepository(
            self, "Repository", domain_name=self.domain.attr_name, repository_name=PACKAGE_REPOSITORY_NAME,
            external_connections=[PYPI_CONNECTION],
            description="PyPI mirror for the training container's requirements.txt (isolated subnets)",
        )
        self.repository.apply_removal_policy(RemovalPolicy.RETAIN)
        self.repository_arn = self.repository.attr_arn
        self.endpoints = endpoints_in_network(
            self, props.network, ENDPOINT_SERVICES,
            policy_actions={name: ENDPOINT_ACTIONS for name in ENDPOINT_SERVICES},
        )


def read_statements(stack: Stack, environment_name: str) -> list[iam.PolicyStatement]:
    """What the SageMaker training toolkit needs to install from the environment's repository."""
    domain = package_domain_name(environment_name)
    domain_arn = stack.format_arn(service="codeartifact", resource="domain", resource_name=domain)
    repository_arn = stack.format_arn(service="codeartifact", resource="repository",
                                      resource_name=f"{domain}/{PACKAGE_REPOSITORY_NAME}")
    return [
        iam.PolicyStatement(sid="PackagesToken", actions=["codeartifact:GetAuthorizationToken"],
                            resources=[domain_arn]),
        # ReadFromRepository is granted on the repository only (CodeArtifact: a principal reads all of
        # a repository's packages or none).
        iam.PolicyStatement(sid="PackagesRead", actions=["codeartifact:GetRepositoryEndpoint",
                                                         "codeartifact:ReadFromRepository"],
                            resources=[repository_arn]),
        # GetAuthorizationToken needs a bearer token for CodeArtifact and nothing else.
        iam.PolicyStatement(sid=BEARER_TOKEN_SID, actions=["sts:GetServiceBearerToken"],
                            resources=["*"],
                            conditions={"StringEquals": {
                                "sts:AWSServiceName": "codeartifact.amazonaws.com"}}),
    ]


def grant_read(team: TeamAccess, environment_name: str) -> None:
    """Let the team's jobs install requirements.txt from the environment's PyPI mirror."""
    team.add_execution_statements(read_statements(team.stack, environment_name), WILDCARD_REASONS)


__all__ = ["ENDPOINT_SERVICES", "TrainingPackages", "TrainingPackagesProps", "grant_read", "read_statements"]
