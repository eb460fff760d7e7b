"""Customer-managed KMS keys with an explicit key policy (no ``kms:*``) and yearly rotation."""

from __future__ import annotations

from aws_cdk import ArnFormat, RemovalPolicy, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from constructs import Construct

# What the account's administrators (through IAM policies) may do to the key itself. Listed
# action by action rather than kms:* so that a policy review sees exactly what is granted; the
# list keeps PutKeyPolicy and ScheduleKeyDeletion so the account can never lock itself out.
KEY_ADMINISTRATION_ACTIONS = (
    "kms:CancelKeyDeletion",
    "kms:CreateAlias",
    "kms:DeleteAlias",
    "kms:DescribeKey",
    "kms:DisableKey",
    "kms:DisableKeyRotation",
    "kms:EnableKey",
    "kms:EnableKeyRotation",
    "kms:GetKeyPolicy",
    "kms:GetKeyRotationStatus",
    "kms:ListGrants",
    "kms:ListKeyPolicies",
    "kms:ListKeyRotations",
    "kms:ListResourceTags",
    "kms:PutKeyPolicy",
    "kms:RevokeGrant",
    "kms:RotateKeyOnDemand",
    "kms:ScheduleKeyDeletion",
    "kms:TagResource",
    "kms:UntagResource",
    "kms:UpdateAlias",
    "kms:UpdateKeyDescription",
)
# Cryptographic use, delegated to IAM: a principal of the account may use the key only when its
# own IAM policy also allows it (the execution role's does, for the platform's buckets).
KEY_USE_ACTIONS = (
    "kms:Decrypt",
    "kms:Encrypt",
    "kms:GenerateDataKey",
    "kms:GenerateDataKeyWithoutPlaintext",
    "kms:ReEncryptFrom",
    "kms:ReEncryptTo",
    "kms:CreateGrant",
    "kms:RetireGrant",
)
_LOGS_USE_ACTIONS = (
    "kms:Decrypt",
    "kms:Encrypt",
    "kms:GenerateDataKey",
    "kms:GenerateDataKeyWithoutPlaintext",
    "kms:ReEncryptFrom",
    "kms:ReEncryptTo",
    "kms:DescribeKey",
)


def create_encryption_key(
    scope: Construct,
    construct_id: str,
    *,
    description: str,
    alias: str | None = None,
    allow_cloudwatch_logs: bool = False,
    removal_policy: RemovalPolicy = RemovalPolicy.RETAIN,
) -> kms.Key:
    """A symmetric key with rotation; ``allow_cloudwatch_logs`` lets this account's log groups use it."""
    stack = Stack.of(scope)
    account = iam.AccountRootPrincipal()
    statements = [
        iam.PolicyStatement(
            sid="KeyAdministration",
            principals=[account],
            actions=list(KEY_ADMINISTRATION_ACTIONS),
            resources=["*"],
        ),
        iam.PolicyStatement(
            sid="KeyUseThroughIam", principals=[account], actions=list(KEY_USE_ACTIONS), resources=["*"]
        ),
    ]
    if allow_cloudwatch_logs:
        log_groups = stack.format_arn(
            service="logs", resource="log-group", resource_name="*", arn_format=ArnFormat.COLON_RESOURCE_NAME
        )
        statements.append(
            iam.PolicyStatement(
                sid="CloudWatchLogsOfThisAccount",
                principals=[iam.ServicePrincipal(f"logs.{stack.region}.amazonaws.com")],
                actions=list(_LOGS_USE_ACTIONS),
                resources=["*"],
                conditions={"ArnLike": {"kms:EncryptionContext:aws:logs:arn": log_groups}},
            )
        )
    return kms.Key(
        scope,
        construct_id,
        description=description,
        alias=alias,
        enable_key_rotation=True,
        policy=iam.PolicyDocument(statements=statements),
        removal_policy=removal_policy,
    )


def allow_service(
    key: kms.Key, *, sid: str, service: str, actions: list[str], conditions: dict[str, dict[str, object]]
) -> None:
    """Let an AWS service use ``key`` on this account's behalf, under ``conditions`` that name the
    account or the resources it acts for (in a key policy "*" is the key itself)."""
    key.add_to_resource_policy(
        iam.PolicyStatement(
            sid=sid,
            principals=[iam.ServicePrincipal(service)],
            actions=actions,
            resources=["*"],
            conditions=conditions,
        )
    )
