"""The encrypted notification topic the launcher and the operations construct publish to."""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Stack
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from constructs import Construct

from training_constructs.encryption import allow_service, create_encryption_key


@dataclass(frozen=True)
class EncryptedTopic:
    """A topic and the key that encrypts it; ``created_key`` is that key when it was created here."""

    topic: sns.Topic
    key: kms.IKey
    created_key: kms.Key | None


def encrypted_topic(
    scope: Construct,
    *,
    display_name: str,
    email: str | None,
    key_id: str,
    key_description: str,
    existing_key: kms.IKey | None = None,
    allow_cloudwatch_logs: bool = False,
) -> EncryptedTopic:
    """A KMS-encrypted, TLS-only topic ``Topic`` under ``scope``, ``email`` subscribed to it.

    Its key is ``existing_key``, or one created as ``key_id`` (with rotation; ``allow_cloudwatch_logs``
    lets this account's log groups use it too) that also lets CloudWatch alarms publish to the topic:
    alarms publish to an encrypted topic only when its key lets CloudWatch use it. A given key must
    allow that itself.
    """
    created = None
    if existing_key is None:
        created = create_encryption_key(
            scope, key_id, description=key_description, allow_cloudwatch_logs=allow_cloudwatch_logs
        )
        allow_service(
            created,
            sid="CloudWatchAlarmsPublish",
            service="cloudwatch.amazonaws.com",
            actions=["kms:Decrypt", "kms:GenerateDataKey*"],
            conditions={"StringEquals": {"aws:SourceAccount": Stack.of(scope).account}},
        )
    key = existing_key or created
    topic = sns.Topic(scope, "Topic", master_key=key, enforce_ssl=True, display_name=display_name)
    if email:
        topic.add_subscription(subscriptions.EmailSubscription(email))
    return EncryptedTopic(topic=topic, key=key, created_key=created)


__all__ = ["EncryptedTopic", "encrypted_topic"]
