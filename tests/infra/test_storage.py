"""TrainingStorage and the storage stack: encrypted, private, versioned, retained, pinned."""

from __future__ import annotations

import aws_cdk as cdk
import pytest
from infra_helpers import ENV, as_list, resources_of_type

from stacks import PINNED_LOGICAL_IDS
from training_constructs import PropsError, StorageResources, TrainingStorage, TrainingStorageProps
from training_constructs.encryption import KEY_ADMINISTRATION_ACTIONS

DATA_BUCKETS = ["DatasetsBucket", "CheckpointsBucket", "ArtifactsBucket", "CodeBucket"]
ENVS = ["dev", "prod"]


def bucket(template, logical_id):
    return template["Resources"][logical_id]


@pytest.mark.parametrize("env", ENVS)
def test_stateful_resources_keep_their_pinned_logical_ids(platform, env):
    resources = platform.template_json(env, "storage")["Resources"]
    assert PINNED_LOGICAL_IDS == {
        "key": "PlatformKey",
        "datasets": "DatasetsBucket",
        "checkpoints": "CheckpointsBucket",
        "artifacts": "ArtifactsBucket",
        "code": "CodeBucket",
        "access_logs": "AccessLogsBucket",
    }
    assert resources["PlatformKey"]["Type"] == "AWS::KMS::Key"
    for logical_id in [*DATA_BUCKETS, "AccessLogsBucket"]:
        assert resources[logical_id]["Type"] == "AWS::S3::Bucket", logical_id
    assert len(resources_of_type(platform.template_json(env, "storage"), "AWS::S3::Bucket")) == 5


@pytest.mark.parametrize("env", ENVS)
def test_stateful_resources_are_retained_and_the_stack_protected(platform, env):
    template = platform.template_json(env, "storage")
    for logical_id in ["PlatformKey", *DATA_BUCKETS, "AccessLogsBucket"]:
        resource = template["Resources"][logical_id]
        assert resource["DeletionPolicy"] == "Retain", logical_id
        assert resource["UpdateReplacePolicy"] == "Retain", logical_id
    assert platform.stacks[(env, "storage")].termination_protection is True
    assert platform.stacks[(env, "network")].termination_protection is False


@pytest.mark.parametrize("env", ENVS)
def test_key_rotates_and_its_policy_names_every_action(platform, env):
    key = platform.template_json(env, "storage")["Resources"]["PlatformKey"]["Properties"]
    assert key["EnableKeyRotation"] is True
    statements = {s["Sid"]: s for s in key["KeyPolicy"]["Statement"]}
    assert set(statements) == {"KeyAdministration", "KeyUseThroughIam"}
    administration = statements["KeyAdministration"]["Action"]
    assert set(administration) == set(KEY_ADMINISTRATION_ACTIONS)
    # The account can always repair the policy or retire the key: no lock-out.
    assert {"kms:PutKeyPolicy", "kms:ScheduleKeyDeletion", "kms:EnableKeyRotation"} <= set(administration)
    for statement in statements.values():
        assert not [a for a in as_list(statement["Action"]) if a.endswith(":*") or a == "*"]
        assert statement["Principal"]["AWS"]["Fn::Join"][1][-1].endswith(":root")


@pytest.mark.parametrize("env", ENVS)
def test_data_buckets_use_sse_kms_with_bucket_keys(platform, env):
    template = platform.template_json(env, "storage")
    for logical_id in DATA_BUCKETS:
        [rule] = bucket(template, logical_id)["Properties"]["BucketEncryption"][
            "ServerSideEncryptionConfiguration"
        ]
        assert rule["BucketKeyEnabled"] is True, logical_id
        assert rule["ServerSideEncryptionByDefault"] == {
            "SSEAlgorithm": "aws:kms",
            "KMSMasterKeyID": {"Fn::GetAtt": ["PlatformKey", "Arn"]},
        }, logical_id


@pytest.mark.parametrize("env", ENVS)
def test_access_logs_bucket_uses_sse_s3_because_log_delivery_cannot_use_kms(platform, env):
    template = platform.template_json(env, "storage")
    logs = bucket(template, "AccessLogsBucket")["Properties"]
    [rule] = logs["BucketEncryption"]["ServerSideEncryptionConfiguration"]
    assert rule["ServerSideEncryptionByDefault"] == {"SSEAlgorithm": "AES256"}
    assert logs["LifecycleConfiguration"]["Rules"][0]["ExpirationInDays"] == 365
    # Log delivery is granted by bucket policy (ACLs are disabled), only for this account's buckets.
    policy = next(
        p["Properties"]["PolicyDocument"]
        for p in resources_of_type(template, "AWS::S3::BucketPolicy").values()
        if p["Properties"]["Bucket"] == {"Ref": "AccessLogsBucket"}
    )
    delivery = [
        s for s in policy["Statement"] if s.get("Principal", {}).get("Service") == "logging.s3.amazonaws.com"
    ]
    assert len(delivery) == 4
    assert all(
        s["Action"] == "s3:PutObject" and "aws:SourceAccount" in s["Condition"]["StringEquals"]
        for s in delivery
    )
    for logical_id in DATA_BUCKETS:
        logging = bucket(template, logical_id)["Properties"]["LoggingConfiguration"]
        assert logging["DestinationBucketName"] == {"Ref": "AccessLogsBucket"}
        assert logging["LogFilePrefix"] == logical_id.removesuffix("Bucket").lower() + "/"


@pytest.mark.parametrize("env", ENVS)
def test_every_bucket_is_private_and_refuses_plain_http(platform, env):
    template = platform.template_json(env, "storage")
    policies = {
        p["Properties"]["Bucket"]["Ref"]: p["Properties"]["PolicyDocument"]["Statement"]
        for p in resources_of_type(template, "AWS::S3::BucketPolicy").values()
    }
    for logical_id in [*DATA_BUCKETS, "AccessLogsBucket"]:
        props = bucket(template, logical_id)["Properties"]
        assert props["PublicAccessBlockConfiguration"] == {
            "BlockPublicAcls": True,
            "BlockPublicPolicy": True,
            "IgnorePublicAcls": True,
            "RestrictPublicBuckets": True,
        }, logical_id
        assert props["OwnershipControls"]["Rules"] == [{"ObjectOwnership": "BucketOwnerEnforced"}]
        denies = [s for s in policies[logical_id] if s["Effect"] == "Deny"]
        assert {"Bool": {"aws:SecureTransport": "false"}} in [s["Condition"] for s in denies], logical_id
        assert {"NumericLessThan": {"s3:TlsVersion": "1.2"}} in [s["Condition"] for s in denies], logical_id


@pytest.mark.parametrize("env", ENVS)
def test_versioning_and_lifecycle(platform, env):
    template = platform.template_json(env, "storage")
    versioned = {
        logical_id
        for logical_id in DATA_BUCKETS
        if bucket(template, logical_id)["Properties"].get("VersioningConfiguration") == {"Status": "Enabled"}
    }
    # Every data bucket: an uploaded dataset that overwrites another is recoverable too.
    assert versioned == {"DatasetsBucket", "CheckpointsBucket", "ArtifactsBucket", "CodeBucket"}
    [rule] = bucket(template, "CheckpointsBucket")["Properties"]["LifecycleConfiguration"]["Rules"]
    assert rule["NoncurrentVersionExpiration"] == {"NoncurrentDays": 30}
    assert rule["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 7}
    assert rule["Status"] == "Enabled"
    for logical_id in ("DatasetsBucket", "ArtifactsBucket"):
        [rule] = bucket(template, logical_id)["Properties"]["LifecycleConfiguration"]["Rules"]
        assert rule["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 7}


def test_construct_options_and_attributes():
    stack = cdk.Stack(cdk.App(), "Options", env=ENV)
    storage = TrainingStorage(
        stack,
        "Storage",
        TrainingStorageProps(
            version_datasets=False, checkpoint_noncurrent_days=3, removal_policy=cdk.RemovalPolicy.DESTROY
        ),
    )
    assert set(storage.buckets) == {"datasets", "checkpoints", "artifacts", "code"}
    assert isinstance(storage, StorageResources) and storage.props.checkpoint_noncurrent_days == 3
    assert storage.buckets["checkpoints"] is storage.checkpoints_bucket
    template = cdk.assertions.Template.from_stack(stack).to_json()
    datasets = next(
        r
        for logical_id, r in template["Resources"].items()
        if logical_id.startswith("StorageDatasets") and r["Type"] == "AWS::S3::Bucket"
    )
    assert "VersioningConfiguration" not in datasets["Properties"]
    assert datasets["DeletionPolicy"] == "Delete"
    checkpoints = next(
        r
        for logical_id, r in template["Resources"].items()
        if logical_id.startswith("StorageCheckpoints") and r["Type"] == "AWS::S3::Bucket"
    )
    assert checkpoints["Properties"]["LifecycleConfiguration"]["Rules"][0]["NoncurrentVersionExpiration"] == {
        "NoncurrentDays": 3
    }


def test_grant_helpers_scope_access_to_one_bucket():
    stack = cdk.Stack(cdk.App(), "Grants", env=ENV)
    storage = TrainingStorage(stack, "Storage")
    reader = cdk.aws_iam.Role(
        stack, "Reader", assumed_by=cdk.aws_iam.ServicePrincipal("lambda.amazonaws.com")
    )
    storage.grant_read_datasets(reader)
    storage.grant_write_code(reader)
    policy = next(
        r
        for r in cdk.assertions.Template.from_stack(stack).to_json()["Resources"].values()
        if r["Type"] == "AWS::IAM::Policy"
    )
    resources = str(policy["Properties"]["PolicyDocument"])
    assert "StorageDatasetsBucket" in resources and "StorageCodeBucket" in resources
    assert "StorageCheckpointsBucket" not in resources and "StorageArtifactsBucket" not in resources


INVALID_PROPS = [
    ({"data_key_alias": "llmtrain"}, "data_key_alias", "alias/<name>"),
    ({"data_key_alias": "alias/aws/s3"}, "data_key_alias", "reserved"),
    ({"checkpoint_noncurrent_days": 0}, "checkpoint_noncurrent_days", "at least 1"),
    ({"incomplete_upload_days": 1.5}, "incomplete_upload_days", "whole number"),
    ({"access_log_retention_days": -3}, "access_log_retention_days", "at least 1"),
]


@pytest.mark.parametrize(
    ("props", "field", "explanation"),
    INVALID_PROPS,
    ids=[f"{field}-{explanation}" for _, field, explanation in INVALID_PROPS],
)
def test_invalid_props_fail_at_synth_naming_the_field(props, field, explanation):
    stack = cdk.Stack(cdk.App(), "Invalid", env=ENV)
    with pytest.raises(PropsError) as raised:
        TrainingStorage(stack, "Storage", TrainingStorageProps(**props))
    assert str(raised.value).startswith(f"TrainingStorage({field}=...):"), str(raised.value)
    assert explanation in str(raised.value)
