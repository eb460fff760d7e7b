"""Where SageMaker training jobs run: private subnets, the EFA security group, VPC endpoints, flow logs."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from aws_cdk import Annotations, ContextProvider, RemovalPolicy, Stack, Token
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from constructs import Construct

from llmtrain.core.platform import (
    PREFIX_LIST_ID_PATTERN,
    ROUTE_TABLE_ID_PATTERN,
    SUBNET_ID_PATTERN,
    VPC_ID_PATTERN,
)
from training_constructs._functions import stack_log_group
from training_constructs._props import (
    check_cidr,
    checked_props,
    freeze_sequences,
    is_unresolved,
    is_whole_number,
    require,
)
from training_constructs.encryption import create_encryption_key
from training_constructs.nag import FUNCTION_CHECKOV_REASONS, acknowledge_checkov
from training_constructs.resources import (
    NetworkResources,
    StorageResources,
    check_storage,
    data_buckets,
    subnet_selection,
)

_NAME = "TrainingNetwork"
_HTTPS = ec2.Port.tcp(443)
_IKE = ec2.Port.udp(500)
_ESP_PROTOCOL = "50"  # IPsec ESP, by number: EC2 accepts protocol numbers for any protocol.

# The AWS APIs a training job calls from a VPC without internet access, by logical name.
INTERFACE_ENDPOINT_SERVICES: Mapping[str, ec2.InterfaceVpcEndpointAwsService] = {
    "SageMakerApi": ec2.InterfaceVpcEndpointAwsService.SAGEMAKER_API,
    "Sts": ec2.InterfaceVpcEndpointAwsService.STS,
    "Logs": ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_LOGS,
    "Monitoring": ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_MONITORING,
    "EcrApi": ec2.InterfaceVpcEndpointAwsService.ECR,
    "EcrDocker": ec2.InterfaceVpcEndpointAwsService.ECR_DOCKER,
    "Kms": ec2.InterfaceVpcEndpointAwsService.KMS,
}
# The IAM service prefix of each endpoint's API. Every one of these services supports endpoint
# policies; each endpoint's policy allows its own service's actions to this account's principals.
INTERFACE_ENDPOINT_ACTIONS: Mapping[str, str] = {
    "SageMakerApi": "sagemaker",
    "Sts": "sts",
    "Logs": "logs",
    "Monitoring": "cloudwatch",
    "EcrApi": "ecr",
    "EcrDocker": "ecr",
    "Kms": "kms",
}
# What a training job does in the platform's buckets (read data and code, write checkpoints and
# models, the multipart uploads of large files).
S3_ENDPOINT_BUCKET_ACTIONS = ("s3:ListBucket", "s3:GetBucketLocation", "s3:ListBucketMultipartUploads")
S3_ENDPOINT_OBJECT_ACTIONS = (
    "s3:GetObject",
    "s3:PutObject",
    "s3:DeleteObject",
    "s3:AbortMultipartUpload",
    "s3:ListMultipartUploadParts",
)


def ecr_layer_bucket_arn(region: str) -> str:
    """ECR serves image layers from this AWS-owned bucket of the region (through the S3 endpoint)."""
    return f"arn:aws:s3:::prod-{region}-starport-layer-bucket/*"


@dataclass(frozen=True, kw_only=True)
class ExistingVpcAttributes:
    """An existing VPC, imported by attributes (no context lookup, no AWS call at synth).

    ``subnet_ids`` and ``route_table_ids`` list the private subnets the jobs use and their route
    tables, one per availability zone, in the order of ``TrainingNetwork(availability_zones=...)``.
    ``create_endpoints`` is False when the VPC already has the interface endpoints (a second
    endpoint with private DNS for the same service would fail to deploy).
    """

    vpc_id: str
    vpc_cidr: str
    subnet_ids: Sequence[str]
    route_table_ids: Sequence[str]
    create_endpoints: bool = True

    def __post_init__(self) -> None:
        freeze_sequences("ExistingVpcAttributes", self)


@dataclass(frozen=True, kw_only=True)
class TrainingNetworkProps:
    """What ``TrainingNetwork`` builds; validated when built (``PropsError`` names the field).

    ``availability_zones``: at least two zones of the stack's region, one training subnet in each.
    ``vpc_cidr``: the new VPC's IPv4 block, /16 to /24 (ignored with ``existing_vpc``).
    ``nat_gateways``: 0 (isolated subnets: AWS only through the VPC endpoints) or up to one per zone
      (subnets with egress to the internet through them; nothing is allowed in).
    ``existing_vpc``: a VPC to use instead of creating one (``ExistingVpcAttributes``).
    ``inter_container_traffic_encryption``: the training security group also allows IPsec (IKE, ESP)
      within itself, which SageMaker's inter-container traffic encryption runs.
    ``s3_prefix_list_id``: S3's prefix list in the region; HTTPS egress to S3 goes to it only
      (without it, to any IPv4 address, which isolated subnets' routes confine to S3 and the VPC).
    ``flow_log_retention``: how long flow logs are kept (finite), and the logs of aws-cdk-lib's function
      that empties the VPC's default security group.
    ``existing_flow_log_key``: encrypts the flow logs instead of a key created here; it must let
      CloudWatch Logs use it.
    """

    availability_zones: Sequence[str]
    vpc_cidr: str = "10.0.0.0/16"
    nat_gateways: int = 0
    existing_vpc: ExistingVpcAttributes | None = None
    inter_container_traffic_encryption: bool = False
    s3_prefix_list_id: str | None = None
    flow_log_retention: logs.RetentionDays = logs.RetentionDays.ONE_YEAR
    existing_flow_log_key: kms.IKey | None = None

    def __post_init__(self) -> None:
        freeze_sequences(_NAME, self)
        _validate(self)


class TrainingNetwork(Construct):
    """Private subnets, the EFA security group, VPC endpoints and flow logs for training jobs.

    Subnets are ``PRIVATE_ISOLATED`` by default (``nat_gateways=0``): jobs reach AWS only through
    the VPC endpoints created here and nothing can reach them from outside. ``nat_gateways >= 1``
    makes them ``PRIVATE_WITH_EGRESS`` behind NAT gateways in small public subnets, for jobs that
    must download from the internet; still nothing is allowed in.

    Every interface endpoint has a policy: its own service's actions, for this account's principals
    only. ``restrict_s3_endpoint(buckets)`` gives the S3 gateway endpoint a policy that allows only
    those buckets and the ECR layer bucket image pulls need (until then S3's default policy applies).

    A ``NetworkResources`` (``training_constructs.resources``): the constructs that place jobs or
    endpoints in the VPC take it as their ``network``.

    Attributes: ``vpc``, ``subnets``, ``subnet_selection``, ``security_group`` (the one to give
    training jobs), ``endpoint_security_group``, ``s3_endpoint``, ``interface_endpoints`` (by the
    names in ``INTERFACE_ENDPOINT_SERVICES``), ``flow_log``, ``flow_log_group``, ``flow_log_key``,
    ``default_group_provider_log_group`` (the logs of aws-cdk-lib's function that empties the VPC's
    default security group, kept as long as the flow logs; None with ``existing_vpc``), ``props``.
    """

    def __init__(self, scope: Construct, construct_id: str, props: TrainingNetworkProps) -> None:
        props = checked_props(_NAME, props, TrainingNetworkProps)
        _check_zones_in_region(Stack.of(scope).region, props.availability_zones)
        # Before this construct joins the stack: a stack takes context only while it has no children.
        zones_given = props.existing_vpc is None and _give_stack_its_zones(scope, props.availability_zones)
        super().__init__(scope, construct_id)
        self.props = props
        if zones_given is None:
            Annotations.of(self).add_warning_v2(
                "llmtrain:availabilityZonesLookup",
                f"{_NAME}: the stack already holds constructs, so its availability zones could not be set "
                "from availability_zones; ec2.Vpc looks them up, which needs AWS credentials at `cdk synth`. "
                "Create the TrainingNetwork first in its stack, or put the zones in the app's context "
                f"({_zones_context_key(Stack.of(self))}: [...] in cdk.json)",
            )
        existing_vpc = props.existing_vpc
        self.availability_zones = props.availability_zones
        self.vpc_cidr = existing_vpc.vpc_cidr if existing_vpc else props.vpc_cidr
        self.inter_container_traffic_encryption = props.inter_container_traffic_encryption

        if existing_vpc is None:
            self.vpc = self._create_vpc(props.vpc_cidr, props.nat_gateways)
            self.subnets = self.vpc.select_subnets(subnet_group_name="training").subnets
        else:
            self.vpc = self._import_vpc(existing_vpc)
            self.subnets = self.vpc.private_subnets
        self.subnet_selection = ec2.SubnetSelection(subnets=self.subnets)

        self.security_group = self._training_security_group(props.s3_prefix_list_id)
        if props.inter_container_traffic_encryption:
            self._allow_ipsec_within_group()
        self.endpoint_security_group, self.s3_endpoint, self.interface_endpoints = self._endpoints(
            with_interface_endpoints=existing_vpc is None or existing_vpc.create_endpoints
        )
        self.flow_log_key, self.flow_log_group, self.flow_log = self._flow_log(
            props.flow_log_retention, props.existing_flow_log_key
        )
        self.default_group_provider_log_group = (
            _keep_default_group_provider_logs(self, props.flow_log_retention, self.flow_log_key)
            if existing_vpc is None
            else None
        )

    @property
    def subnet_ids(self) -> list[str]:
        return [subnet.subnet_id for subnet in self.subnets]

    def restrict_s3_endpoint(self, storage: StorageResources) -> None:
        """Let the S3 gateway endpoint reach only the data buckets of ``storage`` and the region's ECR
        layer bucket.

        Jobs in the subnets then cannot copy data to, or read from, any other bucket through the
        endpoint (in isolated subnets it is their only way to S3).
        """
        check_storage(f"{_NAME}.restrict_s3_endpoint", storage)
        buckets = list(data_buckets(storage).values())
        principals = [iam.AnyPrincipal()]
        self.s3_endpoint.add_to_policy(
            iam.PolicyStatement(
                sid="PlatformBuckets",
                principals=principals,
                actions=list(S3_ENDPOINT_BUCKET_ACTIONS),
                resources=[bucket.bucket_arn for bucket in buckets],
            )
        )
        self.s3_endpoint.add_to_policy(
            iam.PolicyStatement(
                sid="PlatformObjects",
                principals=principals,
                actions=list(S3_ENDPOINT_OBJECT_ACTIONS),
                resources=[bucket.arn_for_objects("*") for bucket in buckets],
            )
        )
        self.s3_endpoint.add_to_policy(
            iam.PolicyStatement(
                sid="EcrImageLayers",
                principals=principals,
                actions=["s3:GetObject"],
                resources=[ecr_layer_bucket_arn(Stack.of(self).region)],
            )
        )

    def _create_vpc(self, vpc_cidr: str, nat_gateways: int) -> ec2.Vpc:
        subnets = [
            ec2.SubnetConfiguration(
                name="training",
                subnet_type=(
                    ec2.SubnetType.PRIVATE_ISOLATED
                    if nat_gateways == 0
                    else ec2.SubnetType.PRIVATE_WITH_EGRESS
                ),
            )
        ]
        if nat_gateways:
            # Only NAT gateways live here; no security group admits traffic from the internet.
            subnets.insert(
                0,
                ec2.SubnetConfiguration(
                    name="nat", subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=28, map_public_ip_on_launch=False
                ),
            )
        vpc = ec2.Vpc(
            self,
            "Vpc",
            ip_addresses=ec2.IpAddresses.cidr(vpc_cidr),
            availability_zones=list(self.availability_zones),
            nat_gateways=nat_gateways,
            subnet_configuration=subnets,
            enable_dns_hostnames=True,  # private DNS of the interface endpoints needs both
            enable_dns_support=True,
            restrict_default_security_group=True,
        )
        _acknowledge_default_group_provider(Stack.of(self))
        return vpc

    def _import_vpc(self, existing: ExistingVpcAttributes) -> ec2.IVpc:
        return ec2.Vpc.from_vpc_attributes(
            self,
            "Vpc",
            vpc_id=existing.vpc_id,
            vpc_cidr_block=existing.vpc_cidr,
            availability_zones=list(self.availability_zones),
            private_subnet_ids=list(existing.subnet_ids),
            private_subnet_route_table_ids=list(existing.route_table_ids),
        )

    def _training_security_group(self, s3_prefix_list_id: str | None) -> ec2.SecurityGroup:
        group = ec2.SecurityGroup(
            self,
            "TrainingSecurityGroup",
            vpc=self.vpc,
            allow_all_outbound=False,
            description="SageMaker training jobs: all traffic within the group (EFA), HTTPS out",
        )
        # EFA's health check fails unless all traffic is allowed both in from AND out to the group.
        group.add_ingress_rule(group, ec2.Port.all_traffic(), "EFA and NCCL between training nodes")
        group.add_egress_rule(group, ec2.Port.all_traffic(), "EFA and NCCL between training nodes")
        group.add_egress_rule(ec2.Peer.ipv4(self.vpc_cidr), _HTTPS, "HTTPS to the VPC interface endpoints")
        if s3_prefix_list_id:
            group.add_egress_rule(
                ec2.Peer.prefix_list(s3_prefix_list_id),
                _HTTPS,
                "HTTPS to Amazon S3 through the gateway endpoint",
            )
        else:
            # S3's addresses are only known as a regional prefix list, which CloudFormation cannot
            # look up; in isolated subnets the route tables still confine this to S3 and the VPC.
            group.add_egress_rule(
                ec2.Peer.any_ipv4(), _HTTPS, "HTTPS to Amazon S3 (gateway endpoint) and AWS APIs"
            )
        return group

    def _allow_ipsec_within_group(self) -> None:
        """Inter-container traffic encryption runs IPsec between nodes: IKE (UDP 500) and ESP."""
        group = self.security_group
        group.add_ingress_rule(group, _IKE, "IKE for inter-container traffic encryption")
        group.add_egress_rule(group, _IKE, "IKE for inter-container traffic encryption")
        group_id = group.security_group_id
        ec2.CfnSecurityGroupIngress(
            self,
            "EspIngress",
            group_id=group_id,
            source_security_group_id=group_id,
            ip_protocol=_ESP_PROTOCOL,
            description="ESP for inter-container traffic encryption",
        )
        ec2.CfnSecurityGroupEgress(
            self,
            "EspEgress",
            group_id=group_id,
            destination_security_group_id=group_id,
            ip_protocol=_ESP_PROTOCOL,
            description="ESP for inter-container traffic encryption",
        )

    def _endpoints(self, *, with_interface_endpoints: bool):
        s3_endpoint = ec2.GatewayVpcEndpoint(
            self,
            "S3Endpoint",
            vpc=self.vpc,
            service=ec2.GatewayVpcEndpointAwsService.S3,
            subnets=[self.subnet_selection],
        )
        if not with_interface_endpoints:
            return None, s3_endpoint, {}
        endpoint_group = ec2.SecurityGroup(
            self,
            "EndpointSecurityGroup",
            vpc=self.vpc,
            allow_all_outbound=False,
            description="VPC interface endpoints: HTTPS in from the VPC",
        )
        endpoint_group.add_ingress_rule(ec2.Peer.ipv4(self.vpc_cidr), _HTTPS, "HTTPS from the VPC")
        interface_endpoints = create_interface_endpoints(
            self,
            INTERFACE_ENDPOINT_SERVICES,
            vpc=self.vpc,
            subnets=self.subnet_selection,
            security_group=endpoint_group,
            policy_actions={name: [f"{prefix}:*"] for name, prefix in INTERFACE_ENDPOINT_ACTIONS.items()},
        )
        return endpoint_group, s3_endpoint, interface_endpoints

    def _flow_log(self, retention: logs.RetentionDays, key: kms.IKey | None):
        if key is None:
            key = create_encryption_key(
                self,
                "FlowLogKey",
                allow_cloudwatch_logs=True,
                description="Encrypts the VPC flow logs of the training network",
            )
        group = logs.LogGroup(
            self, "FlowLogGroup", retention=retention, encryption_key=key, removal_policy=RemovalPolicy.RETAIN
        )
        flow_log = ec2.FlowLog(
            self,
            "FlowLog",
            resource_type=ec2.FlowLogResourceType.from_vpc(self.vpc),
            destination=ec2.FlowLogDestination.to_cloud_watch_logs(group),
            traffic_type=ec2.FlowLogTrafficType.ALL,
        )
        return key, group, flow_log


def create_interface_endpoints(
    scope: Construct,
    services: Mapping[str, ec2.InterfaceVpcEndpointAwsService],
    *,
    vpc: ec2.IVpc,
    subnets: ec2.SubnetSelection,
    security_group: ec2.ISecurityGroup,
    policy_actions: Mapping[str, Sequence[str]],
) -> dict[str, ec2.InterfaceVpcEndpoint]:
    """Private-DNS interface endpoints (``<name>Endpoint`` under ``scope``), reached with HTTPS
    through ``security_group``.

    An endpoint named in ``policy_actions`` gets a policy that allows those actions to this account's
    principals only. An endpoint left out keeps AWS's default policy: for a service that does not
    support endpoint policies, a policy would fail the deployment.
    """
    endpoints = {
        name: ec2.InterfaceVpcEndpoint(
            scope,
            f"{name}Endpoint",
            vpc=vpc,
            service=service,
            subnets=subnets,
            security_groups=[security_group],
            private_dns_enabled=True,
            open=False,
        )
        for name, service in services.items()
    }
    account = Stack.of(scope).account
    for name, actions in policy_actions.items():
        endpoints[name].add_to_policy(
            iam.PolicyStatement(
                sid="ThisAccountOnly",
                principals=[iam.AnyPrincipal()],
                actions=list(actions),
                resources=["*"],
                conditions={"StringEquals": {"aws:PrincipalAccount": account}},
            )
        )
    return endpoints


def endpoints_in_network(
    scope: Construct,
    network: NetworkResources,
    services: Mapping[str, ec2.InterfaceVpcEndpointAwsService],
    *,
    policy_actions: Mapping[str, Sequence[str]],
) -> dict[str, ec2.InterfaceVpcEndpoint]:
    """``create_interface_endpoints`` in ``network``'s VPC and subnets, behind its endpoint security
    group; none when the network has no such group (a VPC that brings its own endpoints)."""
    if network.endpoint_security_group is None:
        return {}
    return create_interface_endpoints(
        scope,
        services,
        vpc=network.vpc,
        subnets=subnet_selection(network),
        security_group=network.endpoint_security_group,
        policy_actions=policy_actions,
    )


def _default_group_providers(stack: Stack) -> list[Construct]:
    """aws-cdk-lib's provider that empties the default security group: a singleton at the stack's root."""
    prefix = "Custom::VpcRestrictDefaultSG"
    return [child for child in stack.node.children if child.node.id.startswith(prefix)]


def _acknowledge_default_group_provider(stack: Stack) -> None:
    for provider in _default_group_providers(stack):
        acknowledge_checkov(provider, FUNCTION_CHECKOV_REASONS, resource_type="AWS::Lambda::Function")


def _keep_default_group_provider_logs(
    scope: Construct, retention: logs.RetentionDays, key: kms.IKey
) -> logs.LogGroup:
    """The provider's function logs to a group of the stack with the network's log retention and key,
    not to the /aws/lambda/ group Lambda would create and keep forever."""
    group, created = stack_log_group(
        scope, "DefaultSecurityGroupProviderLogs", retention=retention, encryption_key=key
    )
    if created:
        for provider in _default_group_providers(Stack.of(scope)):
            handler = provider.node.find_child("Handler")
            handler.add_property_override("LoggingConfig", {"LogGroup": group.log_group_name})
    return group


# The context provider of a stack's availability zones (cloud_assembly_schema.ContextProvider.
# AVAILABILITY_ZONE_PROVIDER, whose Python enum value is its name, not the provider's).
_ZONES_PROVIDER = "availability-zones"


def _zones_context_key(stack: Stack) -> str:
    return ContextProvider.get_key(stack, provider=_ZONES_PROVIDER).key


def _give_stack_its_zones(scope: Construct, zones: Sequence[str]) -> bool | None:
    """Answer the stack's availability-zone lookup with the zones of the props, so synthesis needs no
    AWS access. ec2.Vpc reads the stack's zones to compare them with the ones it is given; a stack with
    an account and region looks them up through the CDK CLI, with AWS credentials. True when the
    stack now has them, False when it needs none (no account or region, or its context has them),
    None when it cannot take them any more (it already holds constructs)."""
    stack = Stack.of(scope)
    if Token.is_unresolved(stack.account) or Token.is_unresolved(stack.region):
        return False
    key = _zones_context_key(stack)
    if stack.node.try_get_context(key) is not None:
        return False
    if stack.node.children:
        return None
    stack.node.set_context(key, list(zones))
    return True


def _check_zones_in_region(region: str, zones: Sequence[str]) -> None:
    if is_unresolved(region):
        return
    for zone in zones:
        require(
            bool(re.fullmatch(re.escape(region) + r"[a-z]", zone)),
            _NAME,
            "availability_zones",
            f"{zone!r} is not an availability zone of the stack's region {region}",
        )


def _validate(props: TrainingNetworkProps) -> None:
    zones = list(props.availability_zones)
    require(
        len(zones) >= 2 and len(set(zones)) == len(zones),
        _NAME,
        "availability_zones",
        f"needs at least two distinct availability zones, got {zones}",
    )
    nat_gateways = props.nat_gateways
    require(
        is_whole_number(nat_gateways) and 0 <= nat_gateways <= len(zones),
        _NAME,
        "nat_gateways",
        f"must be a whole number from 0 to the number of zones ({len(zones)}), got {nat_gateways!r}",
    )
    prefix_list = props.s3_prefix_list_id
    require(
        prefix_list is None or bool(PREFIX_LIST_ID_PATTERN.fullmatch(prefix_list)),
        _NAME,
        "s3_prefix_list_id",
        f"{prefix_list!r} is not a prefix list id such as pl-63a5400a",
    )
    require(
        props.flow_log_retention != logs.RetentionDays.INFINITE,
        _NAME,
        "flow_log_retention",
        "set a finite retention so flow logs do not accumulate forever",
    )
    if props.existing_vpc is None:
        check_cidr(_NAME, "vpc_cidr", props.vpc_cidr)
        return
    require(nat_gateways == 0, _NAME, "nat_gateways", "must be 0 with existing_vpc (its routing is its own)")
    _validate_existing(props.existing_vpc, len(zones))


def _validate_existing(existing: ExistingVpcAttributes, zone_count: int) -> None:
    field = "existing_vpc"
    require(
        bool(VPC_ID_PATTERN.fullmatch(existing.vpc_id)),
        _NAME,
        f"{field}.vpc_id",
        f"{existing.vpc_id!r} is not a VPC id such as vpc-0123456789abcdef0",
    )
    check_cidr(_NAME, f"{field}.vpc_cidr", existing.vpc_cidr)
    for name, ids, pattern in (
        ("subnet_ids", existing.subnet_ids, SUBNET_ID_PATTERN),
        ("route_table_ids", existing.route_table_ids, ROUTE_TABLE_ID_PATTERN),
    ):
        require(
            len(ids) == zone_count,
            _NAME,
            f"{field}.{name}",
            f"needs one entry per availability zone ({zone_count}), got {len(ids)}",
        )
        bad = [item for item in ids if not pattern.fullmatch(item)]
        require(not bad, _NAME, f"{field}.{name}", f"{bad} do not look like {pattern.pattern}")


__all__ = [
    "INTERFACE_ENDPOINT_ACTIONS",
    "INTERFACE_ENDPOINT_SERVICES",
    "ExistingVpcAttributes",
    "TrainingNetwork",
    "TrainingNetworkProps",
    "create_interface_endpoints",
    "ecr_layer_bucket_arn",
    "endpoints_in_network",
]
