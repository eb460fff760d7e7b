"""The platform's Lambda functions: each with its own log group and a role that may write only there."""

from __future__ import annotations

from collections.abc import Mapping

from aws_cdk import Duration, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sqs as sqs
from constructs import Construct

from training_constructs.nag import DEAD_LETTER_CHECK, FUNCTION_CHECKOV_REASONS, acknowledge_checkov


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
    dead_letter_queue: sqs.IQueue | None = None,
) -> tuple[lambda_.Function, logs.LogGroup]:
    """A function whose role holds nothing but the right to write its own log group (callers add the
    rest), so no function shares a role or a log group with another. A function invoked
    asynchronously gets a ``dead_letter_queue`` for the events it failed on."""
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
        dead_letter_queue=dead_letter_queue,
    )
    reasons = dict(FUNCTION_CHECKOV_REASONS)
    if dead_letter_queue is not None:
        del reasons[DEAD_LETTER_CHECK]  # it has one: the skip's reason does not apply
    acknowledge_checkov(function, reasons, resource_type="AWS::Lambda::Function")
    return function, log_group


def stack_log_group(
    scope: Construct,
    construct_id: str,
    *,
    retention: logs.RetentionDays,
    encryption_key: kms.IKey | None = None,
) -> tuple[logs.LogGroup, bool]:
    """The log group ``construct_id`` at the root of ``scope``'s stack, created by the first caller:
    for a function aws-cdk-lib provides once per stack (a custom resource's provider), which would
    otherwise write to the group Lambda creates for it, kept forever. Returns the group and whether
    this call created it."""
    stack = Stack.of(scope)
    existing = stack.node.try_find_child(construct_id)
    if existing is not None:
        return existing, False
    return logs.LogGroup(stack, construct_id, retention=retention, encryption_key=encryption_key), True
