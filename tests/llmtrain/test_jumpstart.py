"""Base models from SageMaker JumpStart (llmtrain.core.jumpstart), offline: a recorded JumpStart manifest
and model specs (tests/llmtrain/data/jumpstart: a gated Llama 2 in two versions, a Falcon whose
weights are a prefix, GPT-2, a model without training weights and an image classifier) in moto's S3
as JumpStart's content bucket of the region. The resolution agrees with the SageMaker Python SDK's
own (`sagemaker.model_uris.retrieve`) against the same bucket; the rendered model channel, with
`ModelAccessConfig.AcceptEula` only when the run accepts the EULA, is valid against botocore."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest
from deployed_support import platform_context
from moto import mock_aws

from llmtrain.core.catalog import Catalog
from llmtrain.core.errors import OverrideError, RequestValidationError
from llmtrain.core.jumpstart import JumpStartCatalog, content_bucket, resolve_base_model
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.validate import shape_problems

DATA = Path(__file__).parent / "data" / "jumpstart"
REGION = "us-east-1"
LORA = Catalog.load().resolve("llama-finetune-lora")
LLAMA = "meta-textgeneration-llama-2-7b"


@pytest.fixture
def s3(monkeypatch):
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }.items():
        monkeypatch.setenv(name, value)
    with mock_aws():
        yield put_jumpstart_catalogue()


def put_jumpstart_catalogue():
    """The recorded manifest and specs in moto's S3, as JumpStart's content bucket of REGION."""
    client = boto3.client("s3", region_name=REGION)
    client.create_bucket(Bucket=content_bucket(REGION))
    for path in DATA.rglob("*.json"):
        client.put_object(Bucket=content_bucket(REGION), Key=path.relative_to(DATA).as_posix(),
                          Body=path.read_bytes())
    return client


def test_a_model_id_resolves_to_its_training_weights_in_the_region(s3):
    catalog = JumpStartCatalog(s3, REGION)
    latest = catalog.resolve(LLAMA)
    assert latest.version == "4.3.0" and latest.gated
    assert latest.uri == f"s3://jumpstart-private-cache-prod-{REGION}/meta-training/train-{LLAMA}.tar.gz"
    assert latest.is_archive
    assert (
        latest.eula_url
        == f"https://jumpstart-cache-prod-{REGION}.s3.{REGION}.amazonaws.com/fmhMetadata/eula/llamaEula.txt"
    )
    assert catalog.resolve(f"{LLAMA}@4.1.0").version == "4.1.0"
    falcon = catalog.resolve("huggingface-llm-falcon-7b-bf16")
    assert not falcon.gated and not falcon.is_archive
    assert falcon.uri.startswith(f"s3://jumpstart-cache-prod-{REGION}/huggingface-training/")


def test_the_resolution_agrees_with_the_sagemaker_sdk(s3, monkeypatch):
    monkeypatch.setenv("DISABLE_JUMPSTART_LOGGING", "1")
    monkeypatch.setenv("SAGEMAKER_SUPPRESS_V2_WARNING", "1")
    from sagemaker import model_uris
    from sagemaker.jumpstart import accessors
    from sagemaker.session import Session

    session = Session(boto_session=boto3.Session(region_name=REGION), default_bucket="unused")
    accessors.JumpStartModelsAccessor.reset_cache()
    for reference in (
        f"{LLAMA}@4.1.0",
        f"{LLAMA}@4.3.0",
        "huggingface-llm-falcon-7b-bf16@2.1.0",
        "huggingface-textgeneration-gpt2@1.3.0",
    ):
        model_id, version = reference.split("@")
        expected = model_uris.retrieve(
            model_id=model_id,
            model_version=version,
            model_scope="training",
            region=REGION,
            sagemaker_session=session,
        )
        assert JumpStartCatalog(s3, REGION).resolve(reference).uri == expected, reference


def test_unknown_models_versions_and_untrainable_models_are_refused(s3):
    catalog = JumpStartCatalog(s3, REGION)
    with pytest.raises(
        OverrideError, match=r"not a JumpStart model in us-east-1 \(did you mean 'meta-textgeneration"
    ):
        catalog.resolve("meta-textgeneration-llama-2-7")
    with pytest.raises(OverrideError, match="no version '9.9.9'.*4.1.0, 4.3.0"):
        catalog.resolve(f"{LLAMA}@9.9.9")
    with pytest.raises(OverrideError, match="cannot be fine-tuned"):
        catalog.resolve("huggingface-textgeneration-bloom-560m")


def test_models_ls_lists_trainable_text_generation_models(s3):
    listed = {m.model_id: m for m in JumpStartCatalog(s3, REGION).text_generation_models()}
    assert sorted(listed) == ["huggingface-llm-falcon-7b-bf16", "huggingface-textgeneration-gpt2", LLAMA]
    assert listed[LLAMA].version == "4.3.0" and listed[LLAMA].eula_url


def _render(s3, **overrides):
    base = resolve_base_model(overrides, s3, REGION)
    return render(LORA, RunInput(run_name="ft-1", overrides=overrides, base_model=base), platform_context())


def _model_channel(request):
    return next(c for c in request["InputDataConfig"] if c["ChannelName"] == "model")


def test_a_gated_model_needs_accept_eula_and_sends_model_access_config(s3):
    with pytest.raises(
        OverrideError,
        match=r"accept_eula.*gated model: read its end-user license agreement at "
        r"https://jumpstart-cache-prod-us-east-1\S+llamaEula.txt",
    ):
        _render(s3, base_model=LLAMA)
    request = _render(s3, base_model=LLAMA, accept_eula="true")
    channel = _model_channel(request)
    assert channel["DataSource"]["S3DataSource"] == {
        "S3DataType": "S3Prefix",
        "S3Uri": f"s3://jumpstart-private-cache-prod-{REGION}/meta-training/train-{LLAMA}.tar.gz",
        "S3DataDistributionType": "FullyReplicated",
        "ModelAccessConfig": {"AcceptEula": True},
    }
    assert shape_problems(request) == []


def test_an_open_model_sends_no_model_access_config_unless_accepted(s3):
    request = _render(s3, base_model="huggingface-llm-falcon-7b-bf16")
    assert "ModelAccessConfig" not in _model_channel(request)["DataSource"]["S3DataSource"]
    accepted = _render(s3, base_model="huggingface-llm-falcon-7b-bf16", accept_eula="true")
    assert _model_channel(accepted)["DataSource"]["S3DataSource"]["ModelAccessConfig"] == {"AcceptEula": True}
    assert shape_problems(accepted) == []


def test_a_folder_in_the_teams_datasets_is_the_model_channel_as_it_is(s3):
    folder = platform_context().datasets_uri + "models/my-llama/"
    assert _model_channel(_render(s3, base_model=folder))["DataSource"]["S3DataSource"]["S3Uri"] == folder
    with pytest.raises(OverrideError, match="outside team 'default'"):
        _render(s3, base_model="s3://someone-elses-bucket/llama/")
    with pytest.raises(OverrideError, match="accept_eula.*not to a folder"):
        _render(s3, base_model=folder, accept_eula="true")


def test_base_model_is_refused_where_it_cannot_apply(s3):
    with pytest.raises(OverrideError, match="trains from scratch"):
        render(
            Catalog.load().resolve("llama-pretrain-fsdp"),
            RunInput(run_name="r", overrides={"base_model": "s3://x/y/"}),
            platform_context(),
        )
    with pytest.raises(OverrideError, match="resolved in the environment's region when the run starts"):
        render(LORA, RunInput(run_name="r", overrides={"base_model": LLAMA}), platform_context())
    with pytest.raises(OverrideError, match="channels.model both"):
        _render(
            s3,
            base_model="huggingface-llm-falcon-7b-bf16",
            **{"channels.model": platform_context().datasets_uri},
        )
    with pytest.raises(OverrideError, match="accept_eula.*also set base_model"):
        render(LORA, RunInput(run_name="r", overrides={"accept_eula": "true"}), platform_context())


def test_an_archive_is_refused_for_code_that_reads_only_a_folder(s3):
    """llama-finetune-lora@1.2.0 runs code frozen before the program unpacked a model archive."""
    catalog = Catalog.load()
    frozen = catalog.resolve("llama-finetune-lora@1.2.0")
    program = catalog.program_contract(frozen)
    assert program.capabilities["model_archive"] is False
    overrides = {"base_model": LLAMA, "accept_eula": "true"}
    run = RunInput(run_name="ft-1", overrides=overrides, base_model=resolve_base_model(overrides, s3, REGION))
    refusal = rf"base_model={LLAMA}@4.3.0: its training weights are one archive .*cannot unpack .*newer"
    with pytest.raises(RequestValidationError, match=refusal):
        render(frozen, run, platform_context(), program)
    folder = platform_context().datasets_uri + "models/my-llama/"
    assert render(frozen, RunInput(run_name="ft-1", overrides={"base_model": folder}), platform_context(),
                  program)


def test_the_resolved_model_travels_in_the_run_state_as_json(s3):
    base = resolve_base_model({"base_model": LLAMA}, s3, REGION)
    again = RunInput(run_name="r", base_model=json.loads(json.dumps(base.to_dict())))
    assert again.base_model == base
