"""Helpers the stacks share: stable outputs and pinned logical IDs."""

from __future__ import annotations

from aws_cdk import CfnOutput, CfnResource, Stack
from constructs import IConstruct


def output(stack: Stack, key: str, value: str, description: str) -> CfnOutput:
    """A stack output whose key (``OutputKey`` in DescribeStacks) is exactly ``key``."""
    return CfnOutput(stack, key, value=value, description=description)


def pin_logical_id(construct: IConstruct, logical_id: str) -> None:
    """Fix the CloudFormation logical ID of a construct's resource, so that refactoring the code
    (renaming or moving a construct) can never replace a stateful resource."""
    resource = construct.node.default_child if not isinstance(construct, CfnResource) else construct
    if not isinstance(resource, CfnResource):
        raise TypeError(f"{construct.node.path} has no CloudFormation resource to pin")
    resource.override_logical_id(logical_id)
