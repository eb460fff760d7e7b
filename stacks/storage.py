"""The storage stack (stateful): the KMS key and the buckets, retained and protected from deletion."""

from __future__ import annotations

from aws_cdk import Stack
from constructs import Construct

from llmtrain.core.environments import EnvironmentConfig, StackOutput
from stacks._outputs import output, pin_logical_id
from training_constructs import TrainingStorage, TrainingStorageProps

# Logical IDs of the stateful resources. Changing one makes CloudFormation create a new resource
# (a new, empty bucket) and orphan the old one: never change them.
PINNED_LOGICAL_IDS = {
    "key": "PlatformKey",
    "datasets": "DatasetsBucket",
    "checkpoints": "CheckpointsBucket",
    "artifacts": "ArtifactsBucket",
    "code": "CodeBucket",
    "access_logs": "AccessLogsBucket",
}


class StorageStack(Stack):
    """Wires a ``TrainingStorage``; termination protection on, every stateful resource retained.

    Attribute ``storage`` is the construct (``data_key``, ``datasets_bucket`` ...).
    """

    def __init__(self, scope: Construct, construct_id: str, *, config: EnvironmentConfig) -> None:
        super().__init__(
            scope,
            construct_id,
            stack_name=config.stack_name("storage"),
            termination_protection=True,
            description=f"LLM training platform ({config.name}): KMS key and S3 buckets (stateful, retained)",
        )
        self.storage = TrainingStorage(
            self, "Storage", TrainingStorageProps(data_key_alias=f"alias/llmtrain/{config.name}")
        )
        storage = self.storage
        pin_logical_id(storage.data_key, PINNED_LOGICAL_IDS["key"])
        pin_logical_id(storage.access_logs_bucket, PINNED_LOGICAL_IDS["access_logs"])
        for name, bucket in storage.buckets.items():
            pin_logical_id(bucket, PINNED_LOGICAL_IDS[name])

        output(self, StackOutput.KEY_ARN, storage.data_key.key_arn, "KMS key of the buckets and volumes")
        for key, bucket, what in (
            (StackOutput.DATASETS_BUCKET, storage.datasets_bucket, "training data"),
            (StackOutput.CHECKPOINTS_BUCKET, storage.checkpoints_bucket, "checkpoints"),
            (StackOutput.ARTIFACTS_BUCKET, storage.artifacts_bucket, "model artifacts"),
            (StackOutput.CODE_BUCKET, storage.code_bucket, "training code"),
            (StackOutput.ACCESS_LOGS_BUCKET, storage.access_logs_bucket, "S3 server access logs"),
        ):
            output(self, key, bucket.bucket_name, f"Bucket for {what}")
