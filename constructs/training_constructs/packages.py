"""Python packages for training jobs in isolated subnets: a CodeArtifact PyPI mirror and its endpoints.

The SageMaker training toolkit pip-installs the sourcedir's requirements.txt before the program
starts. In subnets without a route to the internet it can only reach a package index through a VPC
endpoint: CodeArtifact, which the toolkit uses when the job's environment has CA_REPOSITORY_ARN
(sagemaker_training.modules asks `codeartifact:GetAuthorizationToken` and `GetRepositoryEndpoint`,
then pip reads the repository). The repository has PyPI as its upstream (external connection
`public:pypi`), so every package on PyPI is available and is cached on first use.

Names are fixed by `llmtrain.platform` (`package_domain_name`, `PACKAGE_REPOSITORY_NAME`), so the
repository's ARN, which rendering puts into every request, is known without a deployment; and
`read_statements` gives the execution role's permissions from the same names, without a reference
across stacks.
"""

from __future__ import annotations

from aws_cdk import RemovalPolicy, Stack
from aws_cdk import aws_codeartifact as codeartifact
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from constructs import Construct

from llmtrain.platform import PACKAGE_REPOSITORY_NAME, package_domain_name
from training_constructs._props import require

_NAME = "TrainingPackages"
PYPI_CONNECTION = "public:pypi"
# The APIs the toolkit and pip call: the token and endpoint (api), the packages (repositories).
ENDPOINT_SERVICES = {
    "CodeArtifactApi": ec2.InterfaceVpcEndpointAwsService.CODEARTIFACT_API,
    "CodeArtifactRepositories": ec2.InterfaceVpcEndpointAwsService.CODEARTIFACT_REPOSITORIES,
}


def interface_endpoints(scope: Construct, services: dict, *, vpc: ec2.IVpc, subnets: ec2.SubnetSelection,
                        security_group: ec2.ISecurityGroup) -> dict[str, ec2.InterfaceVpcEndpoint]:
    """Private-DNS interface endpoints, like TrainingNetwork's (HTTPS from the VPC only)."""
    return {
        name: ec2.InterfaceVpcEndpoint(scope, f"{name}Endpoint", vpc=vpc, service=service, subnets=subnets,
                                       security_groups=[security_group], private_dns_enabled=True, open=False)
        for name, service in services.items()
    }


class TrainingPackages(Construct):
    """A CodeArtifact domain and PyPI-mirror repository, and the endpoints jobs reach them through.

    Attributes: ``domain``, ``repository``, ``repository_arn``, ``endpoints`` (by the names in
    ``ENDPOINT_SERVICES``; empty when ``endpoint_security_group`` is None: a VPC that has them).
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        environment_name: str,
        vpc: ec2.IVpc,
        subnets: ec2.SubnetSelection,
        endpoint_security_group: ec2.ISecurityGroup | None,
    ) -> None:
        super().__init__(scope, construct_id)
        require(bool(environment_name), _NAME, "environment_name", "must not be empty")
        self.domain_name = package_domain_name(environment_name)
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
        self.endpoints = ({} if endpoint_security_group is None else interface_endpoints(
            self, ENDPOINT_SERVICES, vpc=vpc, subnets=subnets, security_group=endpoint_security_group))


def read_statements(stack: Stack, environment_name: str) -> list[iam.PolicyStatement]:
    """What the SageMaker training toolkit needs to install from the environment's repository."""
    domain = package_domain_name(environment_name)
    domain_arn = stack.format_arn(service="codeartifact", resource="domain", resource_name=domain)
    repository_arn = stack.format_arn(service="codeartifact", resource="repository",
                                      resource_name=f"{domain}/{PACKAGE_REPOSITORY_NAME}")
    package_arn = stack.format_arn(service="codeartifact", resource="package",
                                   resource_name=f"{domain}/{PACKAGE_REPOSITORY_NAME}/pypi/*")
    return [
        iam.PolicyStatement(sid="PackagesToken", actions=["codeartifact:GetAuthorizationToken"],
                            resources=[domain_arn]),
        iam.PolicyStatement(sid="PackagesRead", actions=["codeartifact:GetRepositoryEndpoint",
                                                         "codeartifact:ReadFromRepository"],
                            resources=[repository_arn, package_arn]),
        # GetAuthorizationToken needs a bearer token for CodeArtifact and nothing else.
        iam.PolicyStatement(sid="PackagesBearerToken", actions=["sts:GetServiceBearerToken"],
                            resources=["*"],
                            conditions={"StringEquals": {
                                "sts:AWSServiceName": "codeartifact.amazonaws.com"}}),
    ]
