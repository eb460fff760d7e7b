"""Encrypted, private S3 buckets for datasets, checkpoints, model artifacts and code, and their KMS key."""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Duration, RemovalPolicy
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from training_constructs._props import checked_props, is_whole_number, require
from training_constructs.encryption import create_encryption_key
from training_constructs.nag import acknowledge, acknowledge_checkov
from training_constructs.resources import data_buckets

_NAME = "TrainingStorage"

# Bucket logical names, also the prefixes of their server access logs in the logs bucket.
DATA_BUCKETS = ("datasets", "checkpoints", "artifacts", "code")
_LOGS_USE_BUCKET_POLICY_FLAG = "@aws-cdk/aws-s3:serverAccessLogsUseBucketPolicy"


@dataclass(frozen=True, kw_only=True)
class TrainingStorageProps:
    """What ``TrainingStorage`` builds; validated when built (``PropsError`` names the field).

    ``data_key_alias``: an alias for the data key (``alias/<name>``, not ``alias/aws/...``).
    ``version_datasets``: keep overwritten or deleted datasets as noncurrent versions.
    ``checkpoint_noncurrent_days``: days before an overwritten checkpoint version expires.
    ``incomplete_upload_days``: days before an unfinished multipart upload is aborted.
    ``access_log_retention_days``: days the server access logs are kept.
    ``removal_policy``: what happens to the key and buckets when the stack goes (RETAIN).
    """

    data_key_alias: str | None = None
    version_datasets: bool = True
    checkpoint_noncurrent_days: int = 30
    incomplete_upload_days: int = 7
    access_log_retention_days: int = 365
    removal_policy: RemovalPolicy = RemovalPolicy.RETAIN

    def __post_init__(self) -> None:
        _validate(self)


class TrainingStorage(Construct):
    """A customer-managed KMS key and the platform's buckets.

    Every data bucket blocks public access, refuses plain HTTP (and TLS below 1.2), encrypts with
    SSE-KMS under ``data_key`` using S3 Bucket Keys (fewer KMS calls: cheaper and no throttling on
    large checkpoints), enforces bucket-owner object ownership, and writes server access logs to
    ``access_logs_bucket``. Checkpoints, artifacts and code are versioned (a bad overwrite or delete
    is recoverable); so are datasets (``version_datasets``, on by default: a dataset overwritten by
    an upload is recoverable); old checkpoint versions expire after ``checkpoint_noncurrent_days`` and
    incomplete multipart uploads are aborted. The logs bucket uses SSE-S3, because S3 server
    access logging cannot deliver to a bucket encrypted with SSE-KMS.

    All of it is retained when the stack is deleted (``removal_policy``), since deleting
    training data or checkpoints by accident costs days of GPU time.

    A ``StorageResources`` (``training_constructs.resources``): the constructs that use the buckets
    and the key take it as their ``storage``.

    Attributes: ``data_key``, ``datasets_bucket``, ``checkpoints_bucket``, ``artifacts_bucket``,
    ``code_bucket``, ``access_logs_bucket``, ``buckets`` (the data buckets by name), ``props``.
    """

    def __init__(
        self, scope: Construct, construct_id: str, props: TrainingStorageProps | None = None
    ) -> None:
        super().__init__(scope, construct_id)
        props = TrainingStorageProps() if props is None else props
        self.props = checked_props(_NAME, props, TrainingStorageProps)
        # Grant S3's log delivery through the logs bucket's policy rather than the legacy ACL
        # (ACLs are disabled here by BucketOwnerEnforced), whatever the consuming app's flags say.
        self.node.set_context(_LOGS_USE_BUCKET_POLICY_FLAG, True)
        self.removal_policy = props.removal_policy
        self.data_key: kms.Key = create_encryption_key(
            self,
            "Key",
            alias=props.data_key_alias,
            removal_policy=props.removal_policy,
            description="Encrypts the LLM training platform's datasets, checkpoints, artifacts and code",
        )
        self.access_logs_bucket = self._access_logs_bucket(props.access_log_retention_days)
        abort_uploads = Duration.days(props.incomplete_upload_days)
        self.datasets_bucket = self._data_bucket(
            "datasets",
            versioned=props.version_datasets,
            lifecycle_rules=[
                s3.LifecycleRule(
                    id="AbortIncompleteUploads", abort_incomplete_multipart_upload_after=abort_uploads
                )
            ],
        )
        self.checkpoints_bucket = self._data_bucket(
            "checkpoints",
            versioned=True,
            lifecycle_rules=[
                s3.LifecycleRule(
                    id="ExpireOldCheckpointVersions",
                    noncurrent_version_expiration=Duration.days(props.checkpoint_noncurrent_days),
                    expired_object_delete_marker=True,
                    abort_incomplete_multipart_upload_after=abort_uploads,
                )
            ],
        )
        self.artifacts_bucket = self._data_bucket(
            "artifacts",
            versioned=True,
            lifecycle_rules=[
                s3.LifecycleRule(
                    id="AbortIncompleteUploads", abort_incomplete_multipart_upload_after=abort_uploads
                )
            ],
        )
        self.code_bucket = self._data_bucket("code", versioned=True)
        self.buckets: dict[str, s3.Bucket] = data_buckets(self)

    def grant_read_datasets(self, grantee: iam.IGrantable) -> iam.Grant:
        """Read training data (and decrypt it)."""
        return self.datasets_bucket.grant_read(grantee)

    def grant_read_write_checkpoints(self, grantee: iam.IGrantable) -> iam.Grant:
        """Read and write checkpoints (and use the key for them)."""
        return self.checkpoints_bucket.grant_read_write(grantee)

    def grant_read_artifacts(self, grantee: iam.IGrantable) -> iam.Grant:
        """Download trained models."""
        return self.artifacts_bucket.grant_read(grantee)

    def grant_write_code(self, grantee: iam.IGrantable) -> iam.Grant:
        """Upload training code (``sourcedir.tar.gz``)."""
        return self.code_bucket.grant_put(grantee)

    def _access_logs_bucket(self, retention_days: int) -> s3.Bucket:
        bucket = s3.Bucket(
            self,
            "AccessLogsBucket",
            # S3 server access logging delivers only to SSE-S3 buckets, never to SSE-KMS ones.
            encryption=s3.BucketEncryption.S3_MANAGED,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            versioned=False,
            lifecycle_rules=[
                s3.LifecycleRule(id="ExpireAccessLogs", expiration=Duration.days(retention_days))
            ],
            removal_policy=self.removal_policy,
        )
        acknowledge(
            bucket,
            "AwsSolutions-S1",
            "This is the server access log destination; logging its own access would loop",
        )
        acknowledge_checkov(
            bucket,
            {
                "CKV_AWS_18": "this is the server access log destination; logging its own access would loop",
                "CKV_AWS_21": "access logs are written once and expire after the retention period; versions "
                "would keep what the lifecycle rule deletes",
            },
            resource_type="AWS::S3::Bucket",
        )
        _deny_old_tls(bucket)
        return bucket

    def _data_bucket(
        self, name: str, *, versioned: bool, lifecycle_rules: list[s3.LifecycleRule] | None = None
    ) -> s3.Bucket:
        bucket = s3.Bucket(
            self,
            f"{name.capitalize()}Bucket",
            encryption=s3.BucketEncryption.KMS,
            encryption_key=self.data_key,
            bucket_key_enabled=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            versioned=versioned,
            lifecycle_rules=lifecycle_rules,
            server_access_logs_bucket=self.access_logs_bucket,
            server_access_logs_prefix=f"{name}/",
            removal_policy=self.removal_policy,
        )
        _deny_old_tls(bucket)
        return bucket


def _deny_old_tls(bucket: s3.Bucket) -> None:
    """Refuse requests over TLS older than 1.2. (The Bucket's own `minimum_tls_version` writes the
    number as a JSON number, which some CloudFormation implementations refuse; IAM's grammar writes
    condition values as strings.)"""
    bucket.add_to_resource_policy(
        iam.PolicyStatement(
            sid="DenyTlsBelow12",
            effect=iam.Effect.DENY,
            principals=[iam.AnyPrincipal()],
            actions=["s3:*"],
            resources=[bucket.bucket_arn, bucket.arn_for_objects("*")],
            conditions={"NumericLessThan": {"s3:TlsVersion": "1.2"}},
        )
    )


def _validate(props: TrainingStorageProps) -> None:
    alias = props.data_key_alias
    require(
        alias is None
        or (isinstance(alias, str) and alias.startswith("alias/") and not alias.startswith("alias/aws/")
            and len(alias) <= 256),
        _NAME,
        "data_key_alias",
        f"{alias!r} must look like alias/<name> and not use the reserved alias/aws/",
    )
    for field in ("checkpoint_noncurrent_days", "incomplete_upload_days", "access_log_retention_days"):
        value = getattr(props, field)
        require(
            is_whole_number(value) and value >= 1,
            _NAME,
            field,
            f"must be a whole number of days of at least 1, got {value!r}",
        )


__all__ = ["DATA_BUCKETS", "TrainingStorage", "TrainingStorageProps"]
