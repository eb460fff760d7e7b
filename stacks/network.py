"""The network stack: where training jobs run."""

from __future__ import annotations

from aws_cdk import Fn, Stack
from constructs import Construct

from llmtrain.core.environments import EnvironmentConfig, StackOutput
from stacks._outputs import output, pin_logical_id
from training_constructs import ExistingVpcAttributes, TrainingNetwork, TrainingNetworkProps


class NetworkStack(Stack):
    """Wires a ``TrainingNetwork`` from the environment's ``network`` settings.

    Attribute ``network`` is the construct (``vpc``, ``subnets``, ``security_group`` ...).
    """

    def __init__(self, scope: Construct, construct_id: str, *, config: EnvironmentConfig) -> None:
        super().__init__(
            scope,
            construct_id,
            stack_name=config.stack_name("network"),
            description=f"LLM training platform ({config.name}): VPC, EFA security group, "
            "VPC endpoints, flow logs",
        )
        settings = config.network
        existing = settings.existing_vpc
        self.network = TrainingNetwork(
            self,
            "Network",
            TrainingNetworkProps(
                availability_zones=settings.availability_zones,
                vpc_cidr=settings.vpc_cidr,
                nat_gateways=settings.nat_gateways,
                inter_container_traffic_encryption=settings.inter_container_traffic_encryption,
                s3_prefix_list_id=settings.s3_prefix_list_id,
                existing_vpc=None
                if existing is None
                else ExistingVpcAttributes(
                    vpc_id=existing.vpc_id,
                    vpc_cidr=existing.vpc_cidr,
                    subnet_ids=existing.subnet_ids,
                    route_table_ids=existing.route_table_ids,
                    create_endpoints=existing.create_endpoints,
                ),
            ),
        )
        # Flow logs are kept when the stack goes; pinned IDs keep a refactor from orphaning them.
        pin_logical_id(self.network.flow_log_group, "FlowLogGroup")
        pin_logical_id(self.network.flow_log_key, "FlowLogKey")

        output(self, StackOutput.VPC_ID, self.network.vpc.vpc_id, "VPC the training jobs run in")
        output(
            self,
            StackOutput.SUBNET_IDS,
            Fn.join(",", self.network.subnet_ids),
            "Comma-separated private subnets for VpcConfig.Subnets",
        )
        output(
            self,
            StackOutput.SECURITY_GROUP_ID,
            self.network.security_group.security_group_id,
            "Security group for VpcConfig.SecurityGroupIds (EFA-ready)",
        )
