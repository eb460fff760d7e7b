"""A run's input (`RunInput`) and the template's settings after its overrides (`JobSettings`).

`resolve_settings` applies a run's overrides within the template's bounds: each override is coerced
to the type the template declares (`coerce_override`), resources, degrees, channels and platform run
options go to their places, and a base model or a training plan is checked against the platform
context. Pure: render builds the request from the result (llmtrain.core.render).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmtrain.core.distribution import DEGREE_NAMES
from llmtrain.core.errors import OverrideError, RunInputError, did_you_mean, shown_value, where_set
from llmtrain.core.instances import instance_type as lookup_instance_type
from llmtrain.core.jumpstart import (
    BaseModel,
    content_bucket,
    gated_content_bucket,
    is_jumpstart_reference,
    parse_reference,
)
from llmtrain.core.platform import PlatformContext
from llmtrain.core.s3_uris import S3_SCHEME, S3Location, S3UriError, parse_s3_uri
from llmtrain.core.spec import (
    CHANNEL_SETTING_PREFIX,
    PLATFORM_RUN_OPTIONS,
    RESOURCE_SETTINGS,
    OverrideRule,
    TemplateSpec,
)

MAX_ATTEMPTS = 99
RUN_NAME_PATTERN = re.compile(r"[a-zA-Z0-9](-?[a-zA-Z0-9])*")
_TAG_VALUE = re.compile(r"[\w .:/=+\-@]{1,256}")
_FEATURES_PROP = "TrainingLauncherProps.platform_features"
# How long a job may wait for its training plan's capacity when the run does not say.
DEFAULT_MAX_PENDING_SECONDS = 24 * 3600


@dataclass(frozen=True)
class RunInput:
    """One run of a template: its name, overrides, and which attempt of the run this is.

    `attempt` makes every attempt's job name unique; all attempts share the run's checkpoint
    prefix, so a retry resumes. `instance_type` is the launcher's capacity fallback choice.
    """

    run_name: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    attempt: int = 1
    instance_type: str | None = None
    owner: str = "unknown"
    # The run's JumpStart base model (`base_model=<model id>[@version]`), resolved in the
    # environment's region when the run starts (llmtrain.core.jumpstart): render reads no AWS.
    base_model: BaseModel | None = None

    def __post_init__(self) -> None:
        if isinstance(self.base_model, Mapping):
            object.__setattr__(self, "base_model", BaseModel.from_dict(self.base_model))
        if not isinstance(self.run_name, str) or not RUN_NAME_PATTERN.fullmatch(self.run_name):
            raise RunInputError(
                "run_name",
                f"{self.run_name!r} must be letters, digits and single dashes, "
                "starting and ending with a letter or digit",
            )
        if (
            isinstance(self.attempt, bool)
            or not isinstance(self.attempt, int)
            or not 1 <= self.attempt <= MAX_ATTEMPTS
        ):
            raise RunInputError("attempt", f"{self.attempt!r} must be an integer in 1..{MAX_ATTEMPTS}")
        if not isinstance(self.owner, str) or not _TAG_VALUE.fullmatch(self.owner):
            raise RunInputError(
                "owner", f"{self.owner!r} must be 1-256 letters, digits, spaces or _ . : / = + - @"
            )
        if not isinstance(self.overrides, Mapping):
            raise RunInputError("overrides", "must be a mapping of setting name to value")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunInput:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise RunInputError(unknown[0], f"is not a run input field; use {', '.join(sorted(names))}")
        if "run_name" not in data:
            raise RunInputError("run_name", "is required")
        return cls(**data)


@dataclass(frozen=True)
class JobSettings:
    """The template's settings after the run's overrides."""

    instance_type: str
    instance_count: int
    volume_size_gb: int
    max_runtime_seconds: int
    spot: bool
    max_wait_seconds: int | None
    keep_alive_seconds: int
    degrees: Mapping[str, int]
    hyperparameters: Mapping[str, Any]
    channels: Mapping[str, str]
    # Platform run options (spec.PLATFORM_RUN_OPTIONS).
    training_plan_arn: str | None = None
    max_pending_seconds: int | None = None
    remote_debug: bool = False
    # A JumpStart base model in the model channel, and whether the run accepts its EULA.
    base_model: BaseModel | None = None
    accept_eula: bool = False

    @property
    def world_size(self) -> int:
        return self.instance_count * lookup_instance_type(self.instance_type).processes_per_host


def resolve_settings(template: TemplateSpec, run: RunInput, platform: PlatformContext) -> JobSettings:
    compute = template.compute
    values: dict[str, Any] = {
        "instance_type": compute.instance_type,
        "instance_count": compute.instance_count,
        "volume_size_gb": compute.volume_size_gb,
        "max_runtime_seconds": template.max_runtime_seconds,
        "spot": template.spot.enabled,
        "max_wait_seconds": template.spot.max_wait_seconds,
        "keep_alive_seconds": template.keep_alive_seconds,
    }
    degrees = template.distribution.degrees
    hyperparameters = dict(template.hyperparameters)
    channels = {name: prefix for name, prefix in template.inputs.channels.items()}
    options: dict[str, Any] = {}
    for setting, raw in run.overrides.items():
        value = coerce_override(template, setting, raw)
        if setting in PLATFORM_RUN_OPTIONS:
            options[setting] = value
        elif setting in RESOURCE_SETTINGS:
            values[setting] = value
        elif setting in DEGREE_NAMES:
            degrees[setting] = value
        elif setting.startswith(CHANNEL_SETTING_PREFIX):
            channels[setting[len(CHANNEL_SETTING_PREFIX) :]] = value
        else:
            hyperparameters[setting] = value
    if run.instance_type is not None:
        values["instance_type"] = _fallback_instance_type(template, run.instance_type)
    if not values["spot"]:
        if "max_wait_seconds" in run.overrides:
            raise OverrideError(
                "max_wait_seconds", "only applies to managed spot training; also set spot=true"
            )
        values["max_wait_seconds"] = None
    channels, base_model, accept_eula = _base_model_settings(template, run, options, channels, platform)
    uris = _channel_uris(channels, platform)
    if base_model is not None:
        uris["model"] = base_model.uri
    return JobSettings(
        **values,
        degrees=degrees,
        hyperparameters=hyperparameters,
        channels=uris,
        base_model=base_model,
        accept_eula=accept_eula,
        **_run_options(options, spot=values["spot"], platform=platform),
    )


def _base_model_settings(
    template: TemplateSpec, run: RunInput, options: Mapping[str, Any], channels: dict[str, str | None],
    platform: PlatformContext,
) -> tuple[dict[str, str | None], BaseModel | None, bool]:
    """The model channel a run's `base_model` gives: a folder in the team's datasets prefix as it is,
    or a JumpStart model's training weights (resolved at start), with its EULA accepted where it has
    one (`accept_eula=true`)."""
    value, accept = options.get("base_model"), bool(options.get("accept_eula", False))
    if value is None:
        if "accept_eula" in options:
            raise OverrideError("accept_eula", "applies to a JumpStart base model: also set "
                                               "base_model=<JumpStart model id>")
        return channels, None, False
    if "model" not in template.inputs.channels:
        raise OverrideError("base_model", f"{template.ref} trains from scratch: it has no model channel to "
                                          "start from (a fine-tuning template, such as llama-finetune-lora, "
                                          "has one)")
    if f"{CHANNEL_SETTING_PREFIX}model" in run.overrides:
        raise OverrideError("base_model", "and channels.model both name the model channel: set one of them")
    if not is_jumpstart_reference(value):
        if accept:
            raise OverrideError("accept_eula", "applies to a JumpStart base model, not to a folder of your "
                                               "own")
        return {**channels, "model": value}, None, False
    model_id, version = parse_reference(value)
    base = run.base_model
    if base is None or base.model_id != model_id or version not in (None, base.version):
        raise OverrideError("base_model", f"JumpStart model {value!r} is resolved in the environment's "
                                          "region when the run starts (`llmtrain start`, `llmtrain tune` and "
                                          "the launcher do it); to see its request, use "
                                          "`llmtrain start --dry-run`")
    buckets = (content_bucket(platform.region), gated_content_bucket(platform.region))
    if not any(base.uri.startswith(f"s3://{bucket}/") for bucket in buckets):
        raise OverrideError("base_model", f"{base.uri} is not in JumpStart's buckets of {platform.region}")
    if base.gated and not accept:
        raise OverrideError("accept_eula", f"{base.reference} is a gated model: read its end-user "
                                           f"license agreement at {base.eula_url} and set accept_eula=true "
                                           "to accept it")
    return channels, base, accept


def _run_options(options: Mapping[str, Any], *, spot: bool, platform: PlatformContext) -> dict[str, Any]:
    """The platform run options, checked against what the environment offers."""
    plan = options.get("training_plan")
    arn = None
    if plan is not None:
        arn = platform.training_plans.get(plan)
        if arn is None:
            lists = where_set(props=f"{_FEATURES_PROP}['training_plans']", config="training_plans")
            known = ", ".join(sorted(platform.training_plans)) or f"none (listed as {lists})"
            raise OverrideError(
                "training_plan", f"{plan!r} is not a training plan of environment "
                f"{platform.environment}; its plans: {known} (llmtrain plans --env ENV lists them)"
            )
        if spot:
            raise OverrideError("training_plan", "a training plan's capacity is reserved on-demand "
                                "capacity: turn spot off (spot=false) to run in a plan")
    pending = options.get("max_pending_seconds")
    if pending is not None and arn is None:
        raise OverrideError("max_pending_seconds", "only applies to a run in a training plan; also set "
                            "training_plan=NAME")
    remote_debug = bool(options.get("remote_debug", False))
    if remote_debug and not platform.remote_debug:
        allows = where_set(props=f"{_FEATURES_PROP}['remote_debug']", config="remote_debug.enabled")
        raise OverrideError(
            "remote_debug", f"environment {platform.environment} does not allow remote debugging: "
            f"its platform team turns it on ({allows}) and deploys"
        )
    return {
        "training_plan_arn": arn,
        "max_pending_seconds": (pending or DEFAULT_MAX_PENDING_SECONDS) if arn else None,
        "remote_debug": remote_debug,
    }


def coerce_override(template: TemplateSpec, setting: str, raw: Any) -> Any:
    """The override's value in its declared type and bounds (strings from the CLI are parsed)."""
    rule = template.overridable.get(setting) or PLATFORM_RUN_OPTIONS.get(setting)
    if rule is None:
        accepted = [*template.overridable, *PLATFORM_RUN_OPTIONS]
        raise OverrideError(setting, f"{template.ref} does not allow overriding it"
                                     f"{did_you_mean(setting, accepted)}; it allows: "
                                     f"{', '.join(sorted(accepted))}")
    value = _parse_typed(setting, raw, rule)
    _check_bounds(setting, value, rule)
    return value


def _parse_typed(setting: str, raw: Any, rule: OverrideRule) -> Any:
    kind = rule.type
    try:
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.lower() in ("true", "false"):
                return raw.lower() == "true"
        elif kind == "int" and not isinstance(raw, bool):
            if isinstance(raw, int) or (isinstance(raw, str) and re.fullmatch(r"[+-]?\d+", raw.strip())):
                return int(raw)
        elif kind == "float" and not isinstance(raw, bool):
            if isinstance(raw, int | float | str) and math.isfinite(float(raw)):
                return float(raw)
        elif isinstance(raw, str):
            if kind == "s3_uri":
                _s3_uri(setting, raw)
            return raw
    except (ValueError, OverflowError):  # OverflowError: an integer too large for a float
        pass
    raise OverrideError(setting, f"{shown_value(raw)} is not a valid {kind}; expected {rule.describe()}")


def _check_bounds(setting: str, value: Any, rule: OverrideRule) -> None:
    shown, allowed = shown_value(value), f"allowed: {rule.describe()}"
    if rule.min is not None and value < rule.min:
        raise OverrideError(setting, f"{shown} is below the minimum {rule.shown(rule.min)}; {allowed}")
    if rule.max is not None and value > rule.max:
        raise OverrideError(setting, f"{shown} is above the maximum {rule.shown(rule.max)}; {allowed}")
    if rule.choices is not None and value not in rule.choices:
        raise OverrideError(setting, f"{shown} is not allowed; {allowed}")


def _fallback_instance_type(template: TemplateSpec, chosen: str) -> str:
    allowed = (template.compute.instance_type, *template.retry.fallback_instance_types)
    if chosen not in allowed:
        raise OverrideError(
            "instance_type",
            f"capacity fallback {chosen!r} is not one of {template.ref}'s instance types: "
            f"{', '.join(allowed)}",
        )
    return chosen


def _channel_uris(channels: Mapping[str, str | None], platform: PlatformContext) -> dict[str, str]:
    """A template's prefixes resolve under the team's datasets prefix; a run's S3 URIs must lie inside
    it (the team's execution role reads nothing else); channels without a source are left out. Every
    URI is parsed (llmtrain.core.s3_uris): one whose key could mean another prefix is refused."""
    datasets = parse_s3_uri(platform.datasets_uri)
    uris = {}
    for name, source in channels.items():
        if source is None:
            continue
        setting = f"{CHANNEL_SETTING_PREFIX}{name}"
        location = _s3_uri(setting, source if source.startswith(S3_SCHEME) else datasets.uri + source)
        if not location.within(datasets):
            raise OverrideError(
                setting,
                f"{location.uri!r} is outside team {platform.team!r}'s datasets prefix; "
                f"its channels may read only under {datasets.uri}",
            )
        uris[name] = location.uri
    return uris


def _s3_uri(setting: str, text: str) -> S3Location:
    try:
        return parse_s3_uri(text)
    except S3UriError as error:
        raise OverrideError(setting, str(error)) from None


