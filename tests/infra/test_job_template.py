"""JobTemplate: uploads a published version's sourcedir.tar.gz, validates the version at synth, and
exposes what the launcher registers. One stack of our own (a TrainingStorage), synthesized
once with cdk-nag; cfn-lint over its template."""

from __future__ import annotations

import io
import json
import shutil
import tarfile

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Annotations, Match, Template
from cfnlint.api import ManualArgs, lint
from infra_helpers import ENV, ROOT, SynthesizedApp, resources_of_type, synthesize

from llmtrain.core.catalog import Catalog
from llmtrain.core.errors import LockError, RequestValidationError, TemplateNotFoundError
from llmtrain.core.sourcedir import archive_code_hash, collect_files, tarball_bytes
from training_constructs import JobTemplate, JobTemplateProps, PropsError, TrainingStorage

TEMPLATES = ("byo-script@1.0.0", "llama-pretrain-fsdp@latest")


def _storage_stack(app: cdk.App, name: str) -> tuple[cdk.Stack, TrainingStorage]:
    stack = cdk.Stack(app, name, env=ENV)
    return stack, TrainingStorage(stack, "Storage")


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory) -> tuple[SynthesizedApp, dict[str, JobTemplate]]:
    outdir = tmp_path_factory.mktemp("cdk.out")
    app = cdk.App(outdir=str(outdir))
    stack, storage = _storage_stack(app, "JobTemplates")
    templates = {
        ref: JobTemplate(
            stack,
            ref.split("@")[0],
            JobTemplateProps(template=ref, storage=storage, warm_pool_cap_seconds=3600),
        )
        for ref in TEMPLATES
    }
    return synthesize(app, outdir, {("test", "templates"): stack}), templates


@pytest.fixture(scope="module")
def template_json(synthesized) -> dict:
    app, _ = synthesized
    return app.template_json("test", "templates")


def test_synth_passes_cdk_nag(synthesized):
    app, _ = synthesized
    assert app.synth_error is None, app.synth_error
    errors = [v for v in app.nag_violations() if v.get("severity") == "error" and not v.get("acknowledgedId")]
    assert errors == []


def test_cfn_lint_finds_nothing(template_json):
    matches = lint(json.dumps(template_json), config=ManualArgs(regions=["us-east-1"]))
    # W3005: CDK's own BucketDeployment singleton both DependsOn and GetAtt's its role; not ours to change.
    unexpected = [
        str(m) for m in matches if not (m.rule.id == "W3005" and "CustomCDKBucketDeployment" in str(m))
    ]
    assert unexpected == []


def test_code_is_deployed_under_the_versions_prefix(template_json):
    template = Template.from_json(template_json)
    for prefix in ("templates/byo-script/1.0.0/", "templates/llama-pretrain-fsdp/1.3.0/"):
        template.has_resource(
            "Custom::CDKBucketDeployment",
            {
                "Properties": Match.object_like(
                    {
                        "DestinationBucketName": {"Ref": Match.string_like_regexp("^StorageCodeBucket")},
                        "DestinationBucketKeyPrefix": prefix,
                        "Prune": False,
                        "RetainOnDelete": True,
                        "Extract": True,
                        "SystemMetadata": {
                            "sse": "aws:kms",
                            "sse-kms-key-id": {"Fn::GetAtt": [Match.any_value(), "Arn"]},
                        },
                    }
                ),
            },
        )
    assert len(resources_of_type(template_json, "Custom::CDKBucketDeployment")) == 2


def test_uploaded_asset_is_the_deterministic_sourcedir(synthesized, template_json):
    """The asset CDK uploads holds exactly sourcedir.tar.gz, byte-identical to llmtrain.core.sourcedir's."""
    app, templates = synthesized
    catalog = Catalog.load()
    deployments = resources_of_type(template_json, "Custom::CDKBucketDeployment").values()
    assets = json.loads((app.outdir / "JobTemplates.assets.json").read_text())["files"]
    for ref, construct in templates.items():
        prefix = construct.code_key.rsplit("/", 1)[0] + "/"
        deployment = next(d for d in deployments if d["Properties"]["DestinationBucketKeyPrefix"] == prefix)
        asset_hash = deployment["Properties"]["SourceObjectKeys"][0].removesuffix(".zip")
        staged = app.outdir / assets[asset_hash]["source"]["path"]  # a directory asset, zipped when published
        assert assets[asset_hash]["source"]["packaging"] == "zip"
        assert [p.name for p in staged.iterdir()] == ["sourcedir.tar.gz"]
        data = (staged / "sourcedir.tar.gz").read_bytes()
        spec = catalog.resolve(ref)
        published = catalog.verify(spec)
        # The code frozen when the version was published, even after training_jobs/ moved on.
        assert data == catalog.snapshot_path(published.code).read_bytes()
        assert archive_code_hash(data) == published.code
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            names = tar.getnames()
        assert spec.code.entry_point in names
        assert "requirements.txt" in names  # the container installs it (both folders have one)


def test_cdks_upload_function_logs_to_a_group_kept_a_year(synthesized, template_json):
    """Issue 25: BucketDeployment's function (one per stack, shared by the JobTemplates) logged to the
    group Lambda creates, kept forever."""
    _, templates = synthesized
    groups = {template.provider_log_group for template in templates.values()}
    assert len(groups) == 1  # one group for the stack's one upload function
    group = groups.pop()
    group_id = cdk.Stack.of(group).get_logical_id(group.node.default_child)
    [handler] = [r for lid, r in template_json["Resources"].items()
                 if r["Type"] == "AWS::Lambda::Function" and lid.startswith("CustomCDKBucketDeployment")]
    assert handler["Properties"]["LoggingConfig"] == {"LogGroup": {"Ref": group_id}}
    resource = template_json["Resources"][group_id]
    assert resource["Properties"]["RetentionInDays"] == 365
    assert [skip["id"] for skip in resource["Metadata"]["checkov"]["skip"]] == ["CKV_AWS_158"]


def test_construct_exposes_what_the_launcher_registers(synthesized):
    _, templates = synthesized
    catalog = Catalog.load()
    fsdp = templates["llama-pretrain-fsdp@latest"]
    assert (fsdp.name, fsdp.version) == ("llama-pretrain-fsdp", "1.3.0")
    assert fsdp.code_key == "templates/llama-pretrain-fsdp/1.3.0/sourcedir.tar.gz"
    entry = fsdp.registry_entry
    assert entry["content_hash"] == catalog.published_entry(fsdp.spec).content
    assert entry["spec"] == catalog.resolve("llama-pretrain-fsdp@1.3.0").to_dict()
    resolved = cdk.Stack.of(fsdp).resolve(entry["code_s3_uri"])
    bucket_ref = cdk.Stack.of(fsdp).resolve(fsdp.code_bucket.bucket_name)
    assert resolved == {"Fn::Join": ["", ["s3://", bucket_ref, "/" + fsdp.code_key]]}


# --- validation at synth --------------------------------------------------------------------------


def _construct(ref: str, **props) -> JobTemplate:
    app = cdk.App()
    stack, storage = _storage_stack(app, "Invalid")
    return JobTemplate(stack, "Template", JobTemplateProps(template=ref, storage=storage, **props))


@pytest.mark.parametrize(
    ("ref", "error", "message"),
    [
        (
            "byo-script@9.9.9",
            TemplateNotFoundError,
            "template 'byo-script' has no version '9.9.9'; available: 1.0.0",
        ),
        ("byo-script@1.0", TemplateNotFoundError, "version '1.0' is not a semantic version"),
        ("byo-script@v1.0.0", TemplateNotFoundError, "is not a semantic version"),
        ("no-such-template@1.0.0", TemplateNotFoundError, "unknown template 'no-such-template'"),
    ],
)
def test_invalid_version_fails_at_synth(ref, error, message):
    with pytest.raises(error) as raised:
        _construct(ref)
    assert message in str(raised.value)


def test_unpublished_version_fails_at_synth(tmp_path):
    folder = tmp_path / "templates"
    shutil.copytree(ROOT / "templates", folder)
    text = (folder / "gpt2-ddp" / "1.0.0.yaml").read_text().replace("version: 1.0.0", "version: 1.4.0")
    (folder / "gpt2-ddp" / "1.4.0.yaml").write_text(text)
    with pytest.raises(LockError, match=r"gpt2-ddp@1\.4\.0 is not published: run `llmtrain templates lock "):
        _construct("gpt2-ddp@1.4.0", catalog=Catalog.load(folder))


def test_changed_published_version_fails_at_synth(tmp_path):
    folder = tmp_path / "templates"
    shutil.copytree(ROOT / "templates", folder)
    path = folder / "gpt2-ddp" / "1.0.0.yaml"
    path.write_text(path.read_text().replace("max_steps: 3000", "max_steps: 3001"))
    with pytest.raises(LockError, match=r"gpt2-ddp@1\.0\.0 was published and has changed"):
        _construct("gpt2-ddp@1.0.0", catalog=Catalog.load(folder))


def test_a_published_version_deploys_its_frozen_code_after_the_code_changed(tmp_path):
    folder = tmp_path / "templates"
    shutil.copytree(ROOT / "templates", folder)
    shutil.copytree(ROOT / "examples" / "byo_script", tmp_path / "examples" / "byo_script")
    script = tmp_path / "examples" / "byo_script" / "train_clm.py"
    script.write_text(script.read_text() + "\n# changed after 1.0.0 was published\n")
    catalog = Catalog.load(folder, repo_root=tmp_path)
    construct = _construct("byo-script@1.0.0", catalog=catalog)
    deployed = construct.sourcedir_path.read_bytes()
    assert deployed == catalog.snapshot_path(catalog.verify(construct.spec).code).read_bytes()
    assert deployed != tarball_bytes(collect_files(construct.spec.code, tmp_path))
    # Issue 25: it did so without a word. The latest version of a template with its own code warns.
    (warning,) = _edited_warnings(construct)
    assert "byo-script@1.0.0: its code in" in warning and "changed after the version was published" in warning
    assert "the code deployed is the published snapshot" in warning
    assert f"llmtrain templates lock --catalog {folder} --code-root {tmp_path}" in warning

    # Published as 1.1.0, the edits deploy with it; 1.0.0 is an older version, whose code moved on.
    (tmp_path / "training_jobs").symlink_to(ROOT / "training_jobs")  # the other templates' code
    text = (folder / "byo-script" / "1.0.0.yaml").read_text().replace("version: 1.0.0", "version: 1.1.0")
    (folder / "byo-script" / "1.1.0.yaml").write_text(text)
    assert Catalog.load(folder, repo_root=tmp_path).lock_new_versions() == ["byo-script@1.1.0"]
    catalog = Catalog.load(folder, repo_root=tmp_path)
    for ref in ("byo-script@1.0.0", "byo-script@1.1.0"):
        assert _edited_warnings(_construct(ref, catalog=catalog)) == [], ref


def _edited_warnings(construct: JobTemplate) -> list[str]:
    return [m.entry.data for m in Annotations.from_stack(cdk.Stack.of(construct)).find_warning(
        "*", Match.string_like_regexp("codeEditedAfterPublishing"))]


def test_the_platforms_program_moving_on_is_no_warning(synthesized):
    """The platform's training program moves between template releases by design (and a wheel may
    carry a newer program than any published version): its templates do not warn."""
    _, templates = synthesized
    assert templates["llama-pretrain-fsdp@latest"].spec.code.is_platform
    assert _edited_warnings(templates["llama-pretrain-fsdp@latest"]) == []


def test_an_instance_type_that_cannot_run_the_version_fails_at_synth(tmp_path):
    """Issue 25: a capacity fallback or an instance-type choice that cannot run the version (here a
    type without EFA, for a two-node job) was found only by a launcher at run time."""
    folder = tmp_path / "templates"
    shutil.copytree(ROOT / "templates", folder)
    published = (folder / "llama-pretrain-fsdp" / "1.3.0.yaml").read_text()
    text = published.replace("version: 1.3.0", "version: 1.4.0")
    bad = {"fallback": text.replace("fallback_instance_types: [ml.p5.48xlarge]",
                                    "fallback_instance_types: [ml.g5.12xlarge]"),
           "choice": text.replace("choices: [ml.p4d.24xlarge, ml.p4de.24xlarge, ml.p5.48xlarge]",
                                  "choices: [ml.p4d.24xlarge, ml.g5.12xlarge]")}
    for kind, changed in bad.items():
        assert changed != text, kind
        (folder / "llama-pretrain-fsdp" / "1.4.0.yaml").write_text(changed)
        (folder / "catalog.lock").write_text((ROOT / "templates" / "catalog.lock").read_text())
        Catalog.load(folder).lock_new_versions()
        with pytest.raises(PropsError) as raised:
            _construct("llama-pretrain-fsdp@1.4.0", catalog=Catalog.load(folder))
        where = {"fallback": "fallback ml.g5.12xlarge (retry.fallback_instance_types)",
                 "choice": "choice ml.g5.12xlarge (overridable.instance_type)"}[kind]
        assert str(raised.value).startswith(
            f"JobTemplate(template=...): llama-pretrain-fsdp@1.4.0 {where} cannot run the version: "
        ), str(raised.value)


def test_defaults_over_the_environments_warm_pool_cap_fail_at_synth():
    with pytest.raises(
        RequestValidationError, match="keep_alive_seconds 1800 exceeds this environment's warm-pool cap"
    ):
        _construct("llama-finetune-deepspeed@1.0.0", warm_pool_cap_seconds=600)
