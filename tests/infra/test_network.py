"""TrainingNetwork: private subnets, the EFA security group, endpoints and flow logs."""

from __future__ import annotations

import json

import aws_cdk as cdk
import pytest
from aws_cdk import aws_logs as logs
from aws_cdk.assertions import Annotations, Match
from infra_helpers import ENV, as_list, resources_of_type, synthesize

from training_constructs import ExistingVpcAttributes, PropsError, TrainingNetwork, TrainingNetworkProps

ZONES = ["us-east-1a", "us-east-1b"]
EXISTING = ExistingVpcAttributes(
    vpc_id="vpc-0123456789abcdef0",
    vpc_cidr="10.9.0.0/16",
    subnet_ids=["subnet-0aaaaaaaaaaaaaaaa", "subnet-0bbbbbbbbbbbbbbbb"],
    route_table_ids=["rtb-0aaaaaaaaaaaaaaaa", "rtb-0bbbbbbbbbbbbbbbb"],
)
INTERFACE_SERVICES = {"sagemaker.api", "sts", "logs", "monitoring", "ecr.api", "ecr.dkr", "kms"}


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """The options the committed environments do not use, synthesized (with cdk-nag) once."""
    outdir = tmp_path_factory.mktemp("network-variants")
    app = cdk.App(outdir=str(outdir))
    options = {
        "existing": {"existing_vpc": EXISTING},
        "existing-no-endpoints": {
            "existing_vpc": ExistingVpcAttributes(**{**EXISTING.__dict__, "create_endpoints": False})
        },
        "nat": {"nat_gateways": 2, "vpc_cidr": "10.60.0.0/20"},
        "prefix-list": {"s3_prefix_list_id": "pl-63a5400a"},
    }
    stacks = {}
    for name, props in options.items():
        stack = cdk.Stack(app, name, env=ENV)
        TrainingNetwork(stack, "Network", TrainingNetworkProps(availability_zones=ZONES, **props))
        stacks[(name, "network")] = stack
    return synthesize(app, outdir, stacks)


def self_rules(template, rule_type, peer_key):
    """Rules of the training security group that point back at the group itself, by protocol."""
    rules = {}
    for rule in resources_of_type(template, rule_type).values():
        props = rule["Properties"]
        group = props["GroupId"]
        if props.get(peer_key) == group and "TrainingSecurityGroup" in group["Fn::GetAtt"][0]:
            rules.setdefault(props["IpProtocol"], []).append((props.get("FromPort"), props.get("ToPort")))
    return rules


@pytest.mark.parametrize("env", ["dev", "prod"])
def test_vpc_has_only_private_subnets_in_the_configured_zones(platform, environments, env):
    template = platform.template_json(env, "network")
    config = environments[env].network
    vpc = resources_of_type(template, "AWS::EC2::VPC")
    assert [v["Properties"]["CidrBlock"] for v in vpc.values()] == [config.vpc_cidr]
    assert all(
        v["Properties"]["EnableDnsHostnames"] and v["Properties"]["EnableDnsSupport"] for v in vpc.values()
    )
    subnets = resources_of_type(template, "AWS::EC2::Subnet").values()
    assert sorted(s["Properties"]["AvailabilityZone"] for s in subnets) == sorted(config.availability_zones)
    assert not any(s["Properties"]["MapPublicIpOnLaunch"] for s in subnets)
    # Isolated: no way in from, or out to, the internet.
    for kind in ("AWS::EC2::InternetGateway", "AWS::EC2::NatGateway", "AWS::EC2::EgressOnlyInternetGateway"):
        assert not resources_of_type(template, kind), kind
    routes = resources_of_type(template, "AWS::EC2::Route").values()
    assert not [r for r in routes if r["Properties"].get("DestinationCidrBlock") == "0.0.0.0/0"]


@pytest.mark.parametrize("env", ["dev", "prod"])
def test_efa_group_allows_all_traffic_in_from_and_out_to_itself(platform, env):
    template = platform.template_json(env, "network")
    assert "-1" in self_rules(template, "AWS::EC2::SecurityGroupIngress", "SourceSecurityGroupId")
    assert "-1" in self_rules(template, "AWS::EC2::SecurityGroupEgress", "DestinationSecurityGroupId")


@pytest.mark.parametrize("env", ["dev", "prod"])
def test_efa_group_allows_https_out_and_nothing_in_from_outside(platform, environments, env):
    template = platform.template_json(env, "network")
    groups = resources_of_type(template, "AWS::EC2::SecurityGroup")
    training = next(g for logical_id, g in groups.items() if "TrainingSecurityGroup" in logical_id)
    egress = training["Properties"]["SecurityGroupEgress"]
    https = [(rule.get("CidrIp"), rule["FromPort"], rule["ToPort"]) for rule in egress]
    assert (environments[env].network.vpc_cidr, 443, 443) in https
    assert all(rule["IpProtocol"] == "tcp" and rule["FromPort"] == rule["ToPort"] == 443 for rule in egress)
    assert "SecurityGroupIngress" not in training["Properties"]
    # No group in the network admits anything from the internet.
    for group in groups.values():
        for rule in group["Properties"].get("SecurityGroupIngress", []):
            assert rule.get("CidrIp") != "0.0.0.0/0" and rule.get("CidrIpv6") != "::/0"


def test_inter_container_encryption_rules_follow_the_config(platform):
    prod = platform.template_json("prod", "network")
    for rule_type, peer in (
        ("AWS::EC2::SecurityGroupIngress", "SourceSecurityGroupId"),
        ("AWS::EC2::SecurityGroupEgress", "DestinationSecurityGroupId"),
    ):
        rules = self_rules(prod, rule_type, peer)
        assert rules["udp"] == [(500, 500)], rule_type
        assert "50" in rules, rule_type  # ESP
    dev = platform.template_json("dev", "network")
    assert set(self_rules(dev, "AWS::EC2::SecurityGroupIngress", "SourceSecurityGroupId")) == {"-1"}
    assert set(self_rules(dev, "AWS::EC2::SecurityGroupEgress", "DestinationSecurityGroupId")) == {"-1"}


@pytest.mark.parametrize("env", ["dev", "prod"])
def test_endpoints_cover_every_service_a_job_calls(platform, environments, env):
    template = platform.template_json(env, "network")
    region = environments[env].region
    endpoints = resources_of_type(template, "AWS::EC2::VPCEndpoint").values()
    interface = {
        e["Properties"]["ServiceName"].removeprefix(f"com.amazonaws.{region}.")
        for e in endpoints
        if e["Properties"]["VpcEndpointType"] == "Interface"
    }
    assert interface == INTERFACE_SERVICES
    assert all(
        e["Properties"]["PrivateDnsEnabled"]
        for e in endpoints
        if e["Properties"]["VpcEndpointType"] == "Interface"
    )
    gateways = [e for e in endpoints if e["Properties"]["VpcEndpointType"] == "Gateway"]
    assert len(gateways) == 1
    assert gateways[0]["Properties"]["ServiceName"]["Fn::Join"][1][-1] == ".s3"
    route_tables = resources_of_type(template, "AWS::EC2::RouteTable")
    assert {ref["Ref"] for ref in gateways[0]["Properties"]["RouteTableIds"]} == set(route_tables)
    # The endpoints accept HTTPS from the VPC only.
    endpoint_group = next(
        g
        for logical_id, g in resources_of_type(template, "AWS::EC2::SecurityGroup").items()
        if "EndpointSecurityGroup" in logical_id
    )
    [ingress] = endpoint_group["Properties"]["SecurityGroupIngress"]
    assert (ingress["CidrIp"], ingress["FromPort"], ingress["ToPort"]) == (
        environments[env].network.vpc_cidr,
        443,
        443,
    )


@pytest.mark.parametrize("env", ["dev", "prod"])
def test_every_interface_endpoint_serves_only_this_accounts_principals(platform, environments, env):
    template = platform.template_json(env, "network")
    region, account = environments[env].region, environments[env].account
    endpoints = [
        e["Properties"] for e in resources_of_type(template, "AWS::EC2::VPCEndpoint").values()
        if e["Properties"]["VpcEndpointType"] == "Interface"
    ]
    for endpoint in endpoints:
        service = endpoint["ServiceName"].removeprefix(f"com.amazonaws.{region}.")
        [statement] = endpoint["PolicyDocument"]["Statement"]
        prefix = {"sagemaker.api": "sagemaker", "sts": "sts", "logs": "logs", "monitoring": "cloudwatch",
                  "ecr.api": "ecr", "ecr.dkr": "ecr", "kms": "kms"}[service]
        assert statement == {
            "Sid": "ThisAccountOnly",
            "Effect": "Allow",
            "Principal": {"AWS": "*"},
            "Action": f"{prefix}:*",
            "Resource": "*",
            "Condition": {"StringEquals": {"aws:PrincipalAccount": account}},
        }, service


@pytest.mark.parametrize("env", ["dev", "prod"])
def test_the_s3_endpoint_reaches_only_the_platforms_buckets_and_ecr_layers(platform, environments, env):
    template = platform.template_json(env, "network")
    [gateway] = [
        e["Properties"] for e in resources_of_type(template, "AWS::EC2::VPCEndpoint").values()
        if e["Properties"]["VpcEndpointType"] == "Gateway"
    ]
    statements = {s["Sid"]: s for s in gateway["PolicyDocument"]["Statement"]}
    assert set(statements) == {"PlatformBuckets", "PlatformObjects", "EcrImageLayers"}
    assert all(s["Effect"] == "Allow" and s["Principal"] == {"AWS": "*"} for s in statements.values())
    buckets = json.dumps(statements["PlatformBuckets"]["Resource"])
    for name in ("DatasetsBucket", "CheckpointsBucket", "ArtifactsBucket", "CodeBucket"):
        assert name in buckets, name
    assert "AccessLogsBucket" not in buckets  # jobs never touch the access logs
    assert len(statements["PlatformObjects"]["Resource"]) == 4
    assert statements["EcrImageLayers"] == {
        "Sid": "EcrImageLayers",
        "Effect": "Allow",
        "Principal": {"AWS": "*"},
        "Action": "s3:GetObject",
        "Resource": f"arn:aws:s3:::prod-{environments[env].region}-starport-layer-bucket/*",
    }
    actions = {a for s in statements.values() for a in as_list(s["Action"])}
    assert not any(a.endswith("*") for a in actions)


@pytest.mark.parametrize("env", ["dev", "prod"])
def test_flow_logs_go_to_an_encrypted_log_group_with_retention(platform, env):
    template = platform.template(env, "network")
    template.has_resource_properties(
        "AWS::EC2::FlowLog",
        {
            "ResourceType": "VPC",
            "TrafficType": "ALL",
            "LogDestinationType": "cloud-watch-logs",
            "LogGroupName": {"Ref": "FlowLogGroup"},
        },
    )
    template.has_resource(
        "AWS::Logs::LogGroup",
        {
            "Properties": {"RetentionInDays": 365, "KmsKeyId": {"Fn::GetAtt": ["FlowLogKey", "Arn"]}},
            "DeletionPolicy": "Retain",
        },
    )
    template.has_resource_properties(
        "AWS::KMS::Key",
        {
            "EnableKeyRotation": True,
            "KeyPolicy": {
                "Statement": Match.array_with(
                    [
                        Match.object_like(
                            {
                                "Sid": "CloudWatchLogsOfThisAccount",
                                "Condition": {
                                    "ArnLike": {"kms:EncryptionContext:aws:logs:arn": Match.any_value()}
                                },
                            }
                        )
                    ]
                )
            },
        },
    )


@pytest.mark.parametrize("env", ["dev", "prod"])
def test_the_default_group_cleanups_logs_are_kept_like_the_flow_logs(platform, env):
    """Issue 25: aws-cdk-lib's function that empties the VPC's default security group logged to the
    group Lambda creates (/aws/lambda/<name>), kept forever. It logs to a group of the stack, with the
    flow logs' retention and key (a new name: a deployed account's old group is no obstacle)."""
    template = platform.template_json(env, "network")
    network = platform.stacks[(env, "network")].network
    group_id = platform.stacks[(env, "network")].get_logical_id(
        network.default_group_provider_log_group.node.default_child
    )
    [handler] = [r for lid, r in template["Resources"].items()
                 if r["Type"] == "AWS::Lambda::Function" and lid.startswith("CustomVpcRestrictDefaultSG")]
    assert handler["Properties"]["LoggingConfig"] == {"LogGroup": {"Ref": group_id}}
    group = template["Resources"][group_id]["Properties"]
    assert group["RetentionInDays"] == 365 and group["KmsKeyId"] == {"Fn::GetAtt": ["FlowLogKey", "Arn"]}
    assert "LogGroupName" not in group


def test_existing_vpc_is_imported_by_attributes(variants):
    assert variants.synth_error is None, variants.synth_error
    template = variants.template_json("existing", "network")
    assert not resources_of_type(template, "AWS::EC2::VPC")
    assert not resources_of_type(template, "AWS::EC2::Subnet")
    endpoints = resources_of_type(template, "AWS::EC2::VPCEndpoint").values()
    assert {e["Properties"]["VpcId"] for e in endpoints} == {EXISTING.vpc_id}
    gateway = next(e for e in endpoints if e["Properties"]["VpcEndpointType"] == "Gateway")
    assert gateway["Properties"]["RouteTableIds"] == list(EXISTING.route_table_ids)
    interface = [e for e in endpoints if e["Properties"]["VpcEndpointType"] == "Interface"]
    assert len(interface) == len(INTERFACE_SERVICES)
    assert all(e["Properties"]["SubnetIds"] == list(EXISTING.subnet_ids) for e in interface)
    flow_log = next(iter(resources_of_type(template, "AWS::EC2::FlowLog").values()))
    assert flow_log["Properties"]["ResourceId"] == EXISTING.vpc_id
    assert "-1" in self_rules(template, "AWS::EC2::SecurityGroupIngress", "SourceSecurityGroupId")


def test_existing_vpc_can_keep_its_own_interface_endpoints(variants):
    template = variants.template_json("existing-no-endpoints", "network")
    endpoints = resources_of_type(template, "AWS::EC2::VPCEndpoint").values()
    assert [e["Properties"]["VpcEndpointType"] for e in endpoints] == ["Gateway"]


def test_nat_gateways_give_private_subnets_egress_without_public_ingress(variants):
    template = variants.template_json("nat", "network")
    assert len(resources_of_type(template, "AWS::EC2::NatGateway")) == 2
    subnets = resources_of_type(template, "AWS::EC2::Subnet").values()
    assert len(subnets) == 4 and not any(s["Properties"]["MapPublicIpOnLaunch"] for s in subnets)
    default_routes = [r["Properties"] for r in resources_of_type(template, "AWS::EC2::Route").values()]
    assert sum("NatGatewayId" in r for r in default_routes) == 2
    training = next(
        g
        for logical_id, g in resources_of_type(template, "AWS::EC2::SecurityGroup").items()
        if "TrainingSecurityGroup" in logical_id
    )
    assert "SecurityGroupIngress" not in training["Properties"]


def test_s3_prefix_list_narrows_https_egress(variants):
    template = variants.template_json("prefix-list", "network")
    training = next(
        g
        for logical_id, g in resources_of_type(template, "AWS::EC2::SecurityGroup").items()
        if "TrainingSecurityGroup" in logical_id
    )
    egress = training["Properties"]["SecurityGroupEgress"] + [
        rule["Properties"] for rule in resources_of_type(template, "AWS::EC2::SecurityGroupEgress").values()
    ]
    to_s3 = [rule for rule in egress if rule.get("DestinationPrefixListId") == "pl-63a5400a"]
    assert [(rule["IpProtocol"], rule["FromPort"], rule["ToPort"]) for rule in to_s3] == [("tcp", 443, 443)]
    assert not [rule for rule in egress if rule.get("CidrIp") == "0.0.0.0/0"]


def test_synthesis_looks_nothing_up_in_aws(platform, environments):
    """Issue 25: ec2.Vpc compares its zones with the stack's, which a stack with an account and region
    looks up at `cdk synth` (AWS credentials). The network gives the stack the zones of its props, so
    no stage's assembly asks the CDK CLI for a lookup."""
    for env in environments:
        manifest = json.loads((platform.outdir / f"assembly-{env}" / "manifest.json").read_text())
        assert manifest.get("missing") is None, (env, manifest.get("missing"))
        assert platform.stacks[(env, "network")].availability_zones == list(
            environments[env].network.availability_zones
        )


def test_a_network_after_other_constructs_warns_how_to_avoid_the_lookup(tmp_path):
    """A stack that already holds constructs takes no context: ec2.Vpc looks its zones up, and the
    synth warns, naming the two ways out. With the zones in the app's context it looks nothing up."""
    key = "availability-zones:account=111111111111:region=us-east-1"
    for context, lookups in (({}, 1), ({key: ZONES}, 0)):
        app = cdk.App(outdir=str(tmp_path / str(lookups)), context=context)
        stack = cdk.Stack(app, "Late", env=ENV)
        cdk.CfnOutput(stack, "Earlier", value="x")
        network = TrainingNetwork(stack, "Network", TrainingNetworkProps(availability_zones=ZONES))
        lookup = Match.string_like_regexp("availabilityZones")
        warnings = Annotations.from_stack(stack).find_warning("*", lookup)
        app.synth()
        manifest = json.loads((tmp_path / str(lookups) / "manifest.json").read_text())
        assert len(manifest.get("missing", [])) == lookups
        assert len(warnings) == lookups
        if lookups:
            text = warnings[0].entry.data
            assert "llmtrain:availabilityZonesLookup" in text and key in text
            assert "Create the TrainingNetwork first in its stack" in text
        assert network.availability_zones == tuple(ZONES)


def test_construct_exposes_what_later_stacks_need(platform):
    network = platform.stages["prod"].network.network
    assert len(network.subnets) == 3 and len(network.subnet_ids) == 3
    assert set(network.interface_endpoints) == {
        "SageMakerApi",
        "Sts",
        "Logs",
        "Monitoring",
        "EcrApi",
        "EcrDocker",
        "Kms",
    }
    assert network.inter_container_traffic_encryption is True
    for attribute in (
        "vpc",
        "security_group",
        "endpoint_security_group",
        "s3_endpoint",
        "flow_log",
        "flow_log_group",
        "flow_log_key",
        "subnet_selection",
    ):
        assert getattr(network, attribute) is not None, attribute


INVALID_PROPS = [
    ({"vpc_cidr": "10.0.0.0/33"}, "vpc_cidr", "not an IPv4 network"),
    ({"vpc_cidr": "10.0.0.0/12"}, "vpc_cidr", "/16 to /24"),
    ({"availability_zones": ["us-east-1a"]}, "availability_zones", "at least two"),
    ({"availability_zones": ["us-east-1a", "us-east-1a"]}, "availability_zones", "distinct"),
    ({"availability_zones": ["eu-west-1a", "eu-west-1b"]}, "availability_zones", "us-east-1"),
    ({"nat_gateways": 3}, "nat_gateways", "from 0 to"),
    ({"nat_gateways": 1, "existing_vpc": EXISTING}, "nat_gateways", "existing_vpc"),
    ({"s3_prefix_list_id": "com.amazonaws.us-east-1.s3"}, "s3_prefix_list_id", "prefix list id"),
    ({"flow_log_retention": logs.RetentionDays.INFINITE}, "flow_log_retention", "finite"),
    (
        {"existing_vpc": ExistingVpcAttributes(**{**EXISTING.__dict__, "vpc_id": "my-vpc"})},
        "existing_vpc.vpc_id",
        "VPC id",
    ),
    (
        {
            "existing_vpc": ExistingVpcAttributes(
                **{**EXISTING.__dict__, "subnet_ids": ["subnet-0aaaaaaaaaaaaaaaa"]}
            )
        },
        "existing_vpc.subnet_ids",
        "one entry per availability zone",
    ),
    (
        {
            "existing_vpc": ExistingVpcAttributes(
                **{**EXISTING.__dict__, "route_table_ids": ["rtb-1", "rtb-2"]}
            )
        },
        "existing_vpc.route_table_ids",
        "do not look like",
    ),
]


@pytest.mark.parametrize(
    ("props", "field", "explanation"),
    INVALID_PROPS,
    ids=[f"{field}-{explanation}" for _, field, explanation in INVALID_PROPS],
)
def test_invalid_props_fail_at_synth_naming_the_field(props, field, explanation):
    stack = cdk.Stack(cdk.App(), "Invalid", env=ENV)
    with pytest.raises(PropsError) as raised:
        TrainingNetwork(stack, "Network", TrainingNetworkProps(**{"availability_zones": ZONES, **props}))
    assert str(raised.value).startswith(f"TrainingNetwork({field}=...):"), str(raised.value)
    assert explanation in str(raised.value)


def test_security_group_rules_carry_descriptions(platform):
    for env in ("dev", "prod"):
        template = platform.template_json(env, "network")
        for rule_type in ("AWS::EC2::SecurityGroupIngress", "AWS::EC2::SecurityGroupEgress"):
            for rule in resources_of_type(template, rule_type).values():
                assert rule["Properties"].get("Description"), rule
        for group in resources_of_type(template, "AWS::EC2::SecurityGroup").values():
            for rule in as_list(group["Properties"].get("SecurityGroupEgress", [])):
                assert rule.get("Description"), rule
