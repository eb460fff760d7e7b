"""`JobTemplate`: publish one job-template version's code to the platform's code bucket.

At synth it resolves `name@version` in the catalog, checks that the version is published and
unchanged (templates/catalog.lock), renders it with a dry-run platform context, on its own instance
type and on each capacity fallback and instance-type choice, so an invalid template (multi-node on a
non-EFA type, a hyperparameter the training program of its frozen code refuses, degrees that do not
divide the world size, a warm pool over the cap, bad names) fails the synth with the reason, builds
the deterministic `sourcedir.tar.gz` with llmtrain.core.sourcedir and uploads it to
`templates/<name>/<version>/sourcedir.tar.gz`. The latest version of a template with its own code
(not the platform's training program) warns when that code was edited after the version was
published: the published snapshot is what deploys.

It exposes what the launcher needs to register and resolve the version: `spec` (the template as
data), `code_s3_uri`, `content_hash` and `registry_entry` (all of them as one JSON-ready mapping).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aws_cdk import Annotations, Stack
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3_deployment as s3_deployment
from constructs import Construct

from llmtrain.core.catalog import Catalog, LockEntry
from llmtrain.core.errors import LlmtrainError
from llmtrain.core.platform import MAX_KEEP_ALIVE_SECONDS, PlatformContext
from llmtrain.core.render import code_key, render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.sourcedir import SOURCEDIR_NAME
from llmtrain.core.spec import TemplateSpec
from llmtrain.core.team_context import placeholder_context
from training_constructs._functions import stack_log_group
from training_constructs._props import PropsError, checked_props, is_whole_number, require
from training_constructs.nag import (
    FUNCTION_CHECKOV_REASONS,
    acknowledge,
    acknowledge_checkov,
    acknowledge_wildcards,
)
from training_constructs.resources import StorageResources, check_storage

# The dry-run context used to validate a template at synth: only its shape matters.
_SYNTH_ACCOUNT = "123456789012"
_SYNTH_REGION = "us-east-1"
_ACKNOWLEDGED_MARKER = "JobTemplateNagAcknowledgments"
_NAME = "JobTemplate"
# How long the logs of CDK's upload function (BucketDeployment's provider) are kept.
PROVIDER_LOG_RETENTION = logs.RetentionDays.ONE_YEAR
_PROVIDER_LOGS = "JobTemplateUploadLogs"
_PROVIDER_LOGS_UNENCRYPTED = (
    "the group holds the messages of CDK's upload function (the template code's object keys), nothing "
    "confidential; CloudWatch Logs encrypts it at rest with its own key"
)


@dataclass(frozen=True, kw_only=True)
class JobTemplateProps:
    """Which template version, from which catalog, into which storage; validated when built.

    ``template``: ``name@version`` (or ``name``, ``name@latest``) in the catalog.
    ``storage``: the platform's storage (``TrainingStorage`` or ``ExistingStorage``): the code lands in
      its code bucket at ``templates/<name>/<version>/``, encrypted with its data key.
    ``catalog``: the catalog to resolve in: your own (``Catalog.load(root=<your templates/>,
      repo_root=<the folder its code.source paths are relative to>)``, with its own lock), or None for
      the platform's catalog that the llmtrain package ships.
    ``warm_pool_cap_seconds``: the environment's warm-pool cap the version's default must respect.
    """

    template: str
    storage: StorageResources
    catalog: Catalog | None = None
    warm_pool_cap_seconds: int = MAX_KEEP_ALIVE_SECONDS

    def __post_init__(self) -> None:
        require(isinstance(self.template, str) and bool(self.template), _NAME, "template",
                f"must name a template version such as gpt2-ddp@1.1.0, got {self.template!r}")
        check_storage(_NAME, self.storage)
        require(self.catalog is None or isinstance(self.catalog, Catalog), _NAME, "catalog",
                f"must be a llmtrain.core.catalog.Catalog or None, got {type(self.catalog).__name__}")
        cap = self.warm_pool_cap_seconds
        require(is_whole_number(cap) and 0 <= cap <= MAX_KEEP_ALIVE_SECONDS, _NAME, "warm_pool_cap_seconds",
                f"must be whole seconds from 0 to {MAX_KEEP_ALIVE_SECONDS}, got {cap!r}")


class JobTemplate(Construct):
    """One published template version, uploaded and ready for the launcher's registry.

    Attributes: ``spec`` (the version as data), ``catalog``, ``lock_entry`` (its entry in the
    catalog's lock: content, spec and code hashes), ``content_hash``, ``code_key``, ``code_bucket``,
    ``code_s3_uri``, ``sourcedir_path`` (the frozen code uploaded), ``deployment`` (the upload),
    ``provider_log_group`` (the logs of CDK's upload function, one per stack, kept a year), ``name``,
    ``version``, ``registry_entry``, ``props``.
    """

    def __init__(self, scope: Construct, construct_id: str, props: JobTemplateProps) -> None:
        super().__init__(scope, construct_id)
        self.props = checked_props(_NAME, props, JobTemplateProps)
        self.catalog = props.catalog or Catalog.load()
        self.spec: TemplateSpec = self.catalog.resolve(props.template)
        self.lock_entry: LockEntry = self.catalog.verify(self.spec)
        self.content_hash: str = self.lock_entry.content
        _validate_instance_types(self.spec, self.catalog, _synth_platform(props.warm_pool_cap_seconds))
        if _edited_after_publishing(self.spec, self.catalog):
            Annotations.of(self).add_warning_v2("llmtrain:codeEditedAfterPublishing", _edited_message(self))

        code_bucket, data_key = props.storage.code_bucket, props.storage.data_key
        self.code_key: str = code_key(self.spec)
        self.code_bucket = code_bucket
        self.code_s3_uri: str = f"s3://{code_bucket.bucket_name}/{self.code_key}"
        self.sourcedir_path: Path = _build_sourcedir(self.spec, self.catalog)
        # CDK's upload function is one per stack, shared by every JobTemplate: so is its log group.
        self.provider_log_group, created = stack_log_group(
            self, _PROVIDER_LOGS, retention=PROVIDER_LOG_RETENTION
        )
        if created:
            acknowledge_checkov(self.provider_log_group, {"CKV_AWS_158": _PROVIDER_LOGS_UNENCRYPTED})
        self.deployment = s3_deployment.BucketDeployment(
            self,
            "Code",
            sources=[s3_deployment.Source.asset(str(self.sourcedir_path.parent))],
            destination_bucket=code_bucket,
            destination_key_prefix=self.code_key.rsplit("/", 1)[0] + "/",
            # Published versions stay: never delete other objects, nor this one on stack deletion.
            prune=False,
            retain_on_delete=True,
            extract=True,
            server_side_encryption=s3_deployment.ServerSideEncryption.AWS_KMS,
            server_side_encryption_aws_kms_key_id=data_key.key_arn,
            log_group=self.provider_log_group,
        )
        data_key.grant_encrypt_decrypt(self.deployment.handler_role)
        _acknowledge_deployment_findings(self)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def version(self) -> str:
        return self.spec.version

    @property
    def registry_entry(self) -> dict[str, Any]:
        """What the launcher stores to resolve `name@version` and `name@latest`."""
        return {
            "name": self.spec.name,
            "version": self.spec.version,
            "content_hash": self.content_hash,
            "code_s3_uri": self.code_s3_uri,
            "spec": self.spec.to_dict(),
        }


def _synth_platform(warm_pool_cap_seconds: int) -> PlatformContext:
    """The dry-run context a version is rendered against at synth: only its shape matters."""
    return placeholder_context(
        environment="synth",
        account=_SYNTH_ACCOUNT,
        region=_SYNTH_REGION,
        resource_prefix="synth",
        warm_pool_cap_seconds=warm_pool_cap_seconds,
    )


def _validate_instance_types(spec: TemplateSpec, catalog: Catalog, platform: PlatformContext) -> None:
    """Render the version's defaults, then on each capacity-fallback type and each instance type a run
    may choose: a type that cannot run the version (a mistyped neighbour such as ml.g5.4xlarge for
    ml.g5.48xlarge: too few GPUs for its degrees, no EFA for its nodes) fails the synth here, where it
    was found only by a launcher, at run time. With the training program's own rules, of the code the
    version runs (its frozen code's)."""
    contract = catalog.program_contract(spec)
    render(spec, RunInput(run_name="synth-check"), platform, contract)
    rule = spec.overridable.get("instance_type")
    choices = (rule.choices or ()) if rule is not None else ()
    check = "synth-check"
    runs = [(f"fallback {t} (retry.fallback_instance_types)", RunInput(run_name=check, instance_type=t))
            for t in spec.retry.fallback_instance_types]
    runs += [(f"choice {t} (overridable.instance_type)",
              RunInput(run_name=check, overrides={"instance_type": t})) for t in choices]
    for where, run in runs:
        try:
            render(spec, run, platform, contract)
        except LlmtrainError as error:
            raise PropsError(
                f"{_NAME}(template=...): {spec.ref} {where} cannot run the version: {error}"
            ) from error


def _edited_after_publishing(spec: TemplateSpec, catalog: Catalog) -> bool:
    """The latest version of a template wrapping its catalog's own code, whose code was edited after
    it was published. (Older versions' code moves on by design, and the platform's training program
    is released by the platform team in new versions of its templates.)"""
    return (
        not spec.code.is_platform
        and catalog.latest(spec.name).version == spec.version
        and catalog.code_moved_on(spec)
    )


def _edited_message(template: JobTemplate) -> str:
    spec, catalog = template.spec, template.catalog
    snapshot = catalog.snapshot_path(catalog.verify(spec).code)
    return (
        f"{spec.ref}: its code in {catalog.repo_root / spec.code.source} changed after the version was "
        f"published; the code deployed is the published snapshot {snapshot}, not the edits. To deploy "
        f"them, publish a new version: copy {spec.name}/{spec.version}.yaml to a higher version, run "
        f"`llmtrain templates lock --catalog {catalog.root} --code-root {catalog.repo_root}` and deploy "
        "that version"
    )


def _build_sourcedir(spec: TemplateSpec, catalog: Catalog) -> Path:
    # A folder holding only the archive: the asset zips the folder, the deployment unzips it.
    # No dot in the folder's name: CDK names the staged asset after it, extension included.
    folder = Path(tempfile.mkdtemp(prefix=f"llmtrain-{spec.name}-{spec.version.replace('.', '_')}-"))
    destination = folder / SOURCEDIR_NAME
    destination.write_bytes(catalog.sourcedir(spec))  # a published version's frozen code
    return destination


def _acknowledge_deployment_findings(template: JobTemplate) -> None:
    """BucketDeployment's provider Lambda is CDK's singleton at the stack's root, shared by every
    JobTemplate of the stack: acknowledge its findings once, on it, with the reasons."""
    stack = Stack.of(template)
    handler = next(
        (child for child in stack.node.children if child.node.id.startswith("Custom::CDKBucketDeployment")),
        None,
    )
    if handler is None or handler.node.try_find_child(_ACKNOWLEDGED_MARKER) is not None:
        return
    Construct(handler, _ACKNOWLEDGED_MARKER)
    acknowledge(
        handler,
        "AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/"
        "AWSLambdaBasicExecutionRole]",
        "CDK's BucketDeployment provider function uses the AWS managed basic execution role "
        "for its CloudWatch Logs only",
    )
    acknowledge(
        handler,
        "AwsSolutions-L1",
        "the BucketDeployment provider's runtime is chosen and updated by aws-cdk-lib, not by us",
    )
    acknowledge_checkov(handler, FUNCTION_CHECKOV_REASONS, resource_type="AWS::Lambda::Function")
    acknowledge_wildcards(
        handler,
        {
            "s3:GetObject*": "BucketDeployment copies the CDK asset (the sourcedir zip) into "
            "templates/<name>/<version>/ of the code bucket with the object-level actions CDK "
            "grants on both buckets; prune is off, so it deletes nothing",
            "kms:GenerateDataKey*": "writing SSE-KMS objects to the code bucket needs data keys of its key "
            "(CDK's encrypt/decrypt grant)",
        },
    )
