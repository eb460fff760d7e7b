"""Base models from SageMaker JumpStart: a run names `base_model=<JumpStart model id>[@version]`.

JumpStart publishes its catalogue per region in its content bucket `jumpstart-cache-prod-<region>`:
`models_manifest.json` lists every model version (`model_id`, `version`, `spec_key`), and each
version's spec (JSON at `spec_key`) says whether it can be trained (`training_supported`), where its
training weights are (`training_artifact_key`, an object or a prefix), whether they sit in the gated
bucket `jumpstart-private-cache-prod-<region>` (`gated_bucket`, e.g. Llama) and where its end-user
license agreement is (`hosting_eula_key`). The SageMaker Python SDK reads the same files
(`sagemaker.jumpstart`); tests check that this resolution agrees with its `model_uris.retrieve`.

A gated model's weights are read by SageMaker only when the channel carries
`ModelAccessConfig: {AcceptEula: true}`, which a run sends by setting `accept_eula=true`.
A base model may also be a Hugging Face folder in the team's datasets prefix (`base_model=s3://...`
or a prefix relative to it), which becomes the `model` channel as it is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from botocore.exceptions import ClientError

from llmtrain.core.errors import LlmtrainError, OverrideError, did_you_mean

MANIFEST_KEY = "models_manifest.json"
JUMPSTART = "jumpstart"
S3_FOLDER = "s3"
# JumpStart's text-generation models: what the training program's causal LMs can start from.
_TEXT_GENERATION = re.compile(r"(textgeneration|-llm-|text-generation)")
_MODEL_ID = re.compile(r"[a-z0-9][a-z0-9.\-]*")


def content_bucket(region: str) -> str:
    return f"jumpstart-cache-prod-{region}"


def gated_content_bucket(region: str) -> str:
    return f"jumpstart-private-cache-prod-{region}"


def is_jumpstart_reference(value: str) -> bool:
    """`model-id` or `model-id@version`, as opposed to a folder (`s3://...` or a relative prefix)."""
    return not value.startswith("s3://") and "/" not in value


def parse_reference(value: str) -> tuple[str, str | None]:
    model_id, _, version = value.partition("@")
    if not _MODEL_ID.fullmatch(model_id) or (version == "" and "@" in value):
        raise OverrideError(
            "base_model",
            f"{value!r} is neither a JumpStart model id (model-id or "
            "model-id@version) nor an S3 folder (s3://...)",
        )
    return model_id, version or None


@dataclass(frozen=True)
class BaseModel:
    """A resolved JumpStart base model: where its training weights are and whether its EULA must be
    accepted. Part of a run's state once resolved, so every attempt trains from the same weights."""

    model_id: str
    version: str
    uri: str
    gated: bool = False
    eula_url: str | None = None

    @property
    def reference(self) -> str:
        return f"{self.model_id}@{self.version}"

    @property
    def is_archive(self) -> bool:
        """The weights are one .tar.gz (the training program unpacks it), not a folder."""
        return not self.uri.endswith("/")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BaseModel:
        return cls(
            **{key: data[key] for key in ("model_id", "version", "uri", "gated", "eula_url") if key in data}
        )


class JumpStartError(LlmtrainError):
    """A JumpStart model cannot be resolved as asked; the message says what to fix."""


@dataclass(frozen=True)
class ModelListing:
    """One line of `llmtrain models ls`."""

    model_id: str
    version: str
    gated: bool
    eula_url: str | None
    uri: str


class JumpStartCatalog:
    """JumpStart's manifest and specs in one region, read from its content bucket."""

    def __init__(self, s3_client, region: str):
        self.s3, self.region = s3_client, region
        self._manifest: list[dict[str, Any]] | None = None

    def _json(self, key: str) -> Any:
        try:
            body = self.s3.get_object(Bucket=content_bucket(self.region), Key=key)["Body"].read()
        except ClientError as error:
            code = error.response["Error"]["Code"]
            raise JumpStartError(
                f"cannot read s3://{content_bucket(self.region)}/{key} ({code}): JumpStart "
                f"may not serve region {self.region}, or your role may not read its bucket"
            ) from error
        return json.loads(body)

    def manifest(self) -> list[dict[str, Any]]:
        if self._manifest is None:
            self._manifest = list(self._json(MANIFEST_KEY))
        return self._manifest

    def header(self, model_id: str, version: str | None) -> dict[str, Any]:
        versions = [h for h in self.manifest() if h["model_id"] == model_id]
        if not versions:
            ids = sorted({h["model_id"] for h in self.manifest()})
            raise OverrideError(
                "base_model",
                f"{model_id!r} is not a JumpStart model in {self.region}"
                f"{did_you_mean(model_id, ids)}; `llmtrain models ls` lists them",
            )
        if version is None:
            return max(versions, key=lambda h: _version(h["version"]))
        for header in versions:
            if header["version"] == version:
                return header
        known = ", ".join(sorted((h["version"] for h in versions), key=_version))
        raise OverrideError(
            "base_model", f"{model_id} has no version {version!r} in {self.region}; its versions: {known}"
        )

    def spec(self, header: Mapping[str, Any]) -> dict[str, Any]:
        return self._json(header["spec_key"])

    def resolve(self, reference: str) -> BaseModel:
        """The training weights of `model-id[@version]` (the latest version when none is named)."""
        model_id, version = parse_reference(reference)
        spec = self.spec(self.header(model_id, version))
        if not spec.get("training_supported"):
            raise OverrideError(
                "base_model",
                f"{model_id}@{spec['version']} cannot be fine-tuned "
                "(JumpStart publishes no training weights for it)",
            )
        return self._base_model(spec)

    def _base_model(self, spec: Mapping[str, Any]) -> BaseModel:
        key = spec["training_artifact_key"]
        gated = bool(spec.get("gated_bucket"))
        bucket = gated_content_bucket(self.region) if gated else content_bucket(self.region)
        uri = key if key.startswith("s3://") else f"s3://{bucket}/{key}"
        return BaseModel(
            model_id=spec["model_id"],
            version=spec["version"],
            uri=uri,
            gated=gated,
            eula_url=eula_url(self.region, spec.get("hosting_eula_key")),
        )

    def text_generation_models(self) -> list[ModelListing]:
        """The latest version of each JumpStart text-generation model that can be trained."""
        latest: dict[str, dict[str, Any]] = {}
        for header in self.manifest():
            if not _TEXT_GENERATION.search(header["model_id"]):
                continue
            known = latest.get(header["model_id"])
            if known is None or _version(header["version"]) > _version(known["version"]):
                latest[header["model_id"]] = header
        listings = []
        for model_id in sorted(latest):
            spec = self.spec(latest[model_id])
            if spec.get("training_supported") and not spec.get("deprecated"):
                model = self._base_model(spec)
                listings.append(
                    ModelListing(model.model_id, model.version, model.gated, model.eula_url, model.uri)
                )
        return listings


def eula_url(region: str, key: str | None) -> str | None:
    """Where JumpStart publishes a model's EULA (the SDK's link)."""
    return f"https://{content_bucket(region)}.s3.{region}.amazonaws.com/{key}" if key else None


def _version(text: str) -> tuple[int, ...]:
    """JumpStart's versions are dotted numbers (`4.3.0`); anything else sorts first. (The launcher's
    functions run without `packaging`.)"""
    parts = text.split(".")
    return tuple(int(part) for part in parts) if all(part.isdigit() for part in parts) else (-1,)


def resolve_base_model(overrides: Mapping[str, Any], s3_client, region: str) -> BaseModel | None:
    """The run's JumpStart base model, resolved in `region`; None when it names none (or a folder)."""
    value = overrides.get("base_model")
    if not isinstance(value, str) or not is_jumpstart_reference(value):
        return None
    return JumpStartCatalog(s3_client, region).resolve(value)
