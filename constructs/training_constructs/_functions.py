"""The platform's Lambda functions: each with its own log group and a role that may write only there."""

from __future__ import annotations

from collections.abc import Mapping

from aws_cdk import Duration
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from constructs import Construct

from training_constructs.nag import FUNCTION_CHECKOV_REASONS, acknowledge_checkov


def logged_function(
    scope: Construct,
    construct_id: str,
    *,
    code: lambda_.Code,
    handler: str,
    description: str,
    runtime: lambda_.Runtime,
    architecture: lambda_.Architecture,
    memory_size: int,
    timeout: Duration,
    environment: Mapping[str, str],
    log_retention: logs.RetentionDays,
    log_encryption_key: kms.IKey | None = None,
) -> tuple[lambda_.Function, logs.LogGroup]:
    """A function whose role holds nothing but the right to write its own log group (callers add the
    rest), so no function shares a role or a log group with another."""
    log_group = logs.LogGroup(
        scope, f"{construct_id}Logs", retention=log_retention, encryption_key=log_encryption_key
    )
    role = iam.Role(
        scope,
        f"{construct_id}Role",
        assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
        description=description,
    )
    role.add_to_policy(
        iam.PolicyStatement(
            sid="WriteOwnLogs",
            actions=["logs:CreateLogStream", "logs:PutLogEvents"],
            # The log group's ARN ends in ':*', which covers its log streams.
            resources=[log_group.log_group_arn],
        )
    )
    function = lambda_.Function(
        scope,
        construct_id,
        code=code,
        handler=handler,
        runtime=runtime,
        architecture=architecture,
        memory_size=memory_size,
        timeout=timeout,
        description=description,
        role=role,
        log_group=log_group,
        environment=dict(environment),
    )
    acknowledge_checkov(function, FUNCTION_CHECKOV_REASONS, resource_type="AWS::Lambda::Function")
    return function, log_group
