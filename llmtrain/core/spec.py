"""The typed model of a job-template version (one `templates/<name>/<semver>.yaml` file).

`TemplateSpec.from_dict` parses the YAML mapping strictly: an unknown key, a wrong type or an
inconsistent combination fails with a `TemplateSpecError` that names the field, so a typo in a
template never silently falls back to a default. docs/templates.md documents every field.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmtrain.core.distribution import DEGREE_NAMES, DistributionSpec
from llmtrain.core.instances import KNOWN_INSTANCE_TYPES
from llmtrain.core.instances import instance_type as lookup_instance_type
from llmtrain.core.spec_fields import Fields, check_positive, fail
from llmtrain.core.validate import quantization_problems

SEMVER_PATTERN = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
)
# Template names become S3 prefixes, tag values and CLI arguments: keep them to a safe alphabet.
TEMPLATE_NAME_PATTERN = re.compile(r"[a-z0-9](-?[a-z0-9])*")
TEMPLATE_NAME_MAX = 40

PLATFORM_CODE = "platform"
PLATFORM_ENTRY_POINT = "training_jobs/train.py"
INPUT_MODES = ("File", "FastFile")
QUOTA_POLICIES = ("fail", "wait")
OVERRIDE_TYPES = ("int", "float", "bool", "str", "s3_uri")
# Settings that are not hyperparameters: a run overrides them by these names.
RESOURCE_SETTINGS = (
    "instance_type",
    "instance_count",
    "volume_size_gb",
    "max_runtime_seconds",
    "spot",
    "max_wait_seconds",
    "keep_alive_seconds",
)
CHANNEL_SETTING_PREFIX = "channels."
# The type each non-hyperparameter setting must be declared with under `overridable`.
_SETTING_TYPES = {
    "instance_type": "str",
    "instance_count": "int",
    "volume_size_gb": "int",
    "max_runtime_seconds": "int",
    "spot": "bool",
    "max_wait_seconds": "int",
    "keep_alive_seconds": "int",
    **{name: "int" for name in DEGREE_NAMES},
}
# botocore's bounds of StoppingCondition.MaxPendingTimeInSeconds.
MIN_PENDING_SECONDS = 1800
MAX_PENDING_SECONDS = 2419200
# Run options of the platform itself, accepted by every template version (a template does not list
# them under `overridable`): the capacity a run uses and how it can be inspected, not what it trains.
PLATFORM_RUN_OPTIONS_DOC = {
    "training_plan": "a training plan of the environment (config training_plans) to run in",
    "max_pending_seconds": "how long a job may wait for its training plan's capacity",
    "remote_debug": "SageMaker remote debugging: an SSM session into the running container",
    "base_model": "the model a fine-tuning template starts from: a JumpStart model id[@version], or an HF "
                  "folder in the team's datasets prefix (s3://... or a prefix)",
    "accept_eula": "accept the end-user license agreement of a gated JumpStart base model (e.g. Llama)",
}
# Hyperparameters that render derives from `distribution` for the platform's own training code.
DERIVED_HYPERPARAMETERS = ("parallelism", "collective_backend", *DEGREE_NAMES)
SAGEMAKER_LIMIT_MAX_RUNTIME_SECONDS = 28 * 24 * 3600


@dataclass(frozen=True)
class CodeSpec:
    """The training code: `platform` (the repository's training_jobs/) or a folder of the user's."""

    source: str
    entry_point: str

    @property
    def is_platform(self) -> bool:
        return self.source == PLATFORM_CODE

    @classmethod
    def parse(cls, f: Fields) -> CodeSpec:
        source = f.get("source", str)
        entry_point = f.get("entry_point", str, PLATFORM_ENTRY_POINT if source == PLATFORM_CODE else ...)
        f.done()
        if source == PLATFORM_CODE and entry_point != PLATFORM_ENTRY_POINT:
            raise fail(f.source, f"'code.entry_point' must be {PLATFORM_ENTRY_POINT} for platform code")
        if source != PLATFORM_CODE and (source.startswith("/") or ".." in source.split("/")):
            raise fail(
                f.source, "'code.source' must be 'platform' or a folder relative to the repository root"
            )
        if entry_point.startswith("/") or not entry_point.endswith(".py"):
            raise fail(f.source, "'code.entry_point' must be a relative path to a .py script")
        return cls(source=source, entry_point=entry_point)


@dataclass(frozen=True)
class ImageSpec:
    """A Deep Learning Container by framework and Python version, or an explicit image URI."""

    framework_version: str | None = None
    py_version: str | None = None
    uri: str | None = None

    @classmethod
    def parse(cls, f: Fields) -> ImageSpec:
        spec = cls(
            framework_version=f.get("framework_version", str, None),
            py_version=f.get("py_version", str, None),
            uri=f.get("uri", str, None),
        )
        f.done()
        if spec.uri is None and (spec.framework_version is None or spec.py_version is None):
            raise fail(f.source, "'image' needs either 'uri' or both 'framework_version' and 'py_version'")
        if spec.uri is not None and (spec.framework_version or spec.py_version):
            raise fail(
                f.source, "'image.uri' excludes 'framework_version' and 'py_version': give one or the other"
            )
        return spec


@dataclass(frozen=True)
class ComputeSpec:
    instance_type: str
    instance_count: int
    volume_size_gb: int

    @classmethod
    def parse(cls, f: Fields) -> ComputeSpec:
        spec = cls(
            instance_type=f.get("instance_type", str),
            instance_count=f.get("instance_count", int),
            volume_size_gb=f.get("volume_size_gb", int),
        )
        f.done()
        _check_instance_type(f, "instance_type", spec.instance_type)
        check_positive(f, "instance_count", spec.instance_count)
        check_positive(f, "volume_size_gb", spec.volume_size_gb)
        return spec


def _check_instance_type(f: Fields, key: str, instance_type: str) -> None:
    if instance_type not in KNOWN_INSTANCE_TYPES:
        raise fail(
            f.source,
            f"'{f._path(key)}' {instance_type!r} is not an instance type the platform knows; "
            f"use one of {', '.join(sorted(KNOWN_INSTANCE_TYPES))}",
        )


@dataclass(frozen=True)
class InputSpec:
    """Input mode and channels; a channel's default is a prefix in the datasets bucket or None."""

    mode: str = "File"
    channels: Mapping[str, str | None] = field(default_factory=dict)

    @classmethod
    def parse(cls, f: Fields) -> InputSpec:
        mode = f.get("mode", str, "File")
        if mode not in INPUT_MODES:
            raise fail(f.source, f"'input.mode' must be one of {', '.join(INPUT_MODES)}, got {mode!r}")
        raw = f.get("channels", Mapping)
        f.done()
        channels: dict[str, str | None] = {}
        for name, prefix in raw.items():
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9.\-_]+", name):
                raise fail(f.source, f"channel name {name!r} must match [A-Za-z0-9.-_]+")
            if prefix is not None and (not isinstance(prefix, str) or prefix.startswith(("/", "s3://"))):
                raise fail(
                    f.source,
                    f"'input.channels.{name}' must be a key prefix in the datasets bucket (no s3://, "
                    "no leading /) or null for a channel that a run supplies",
                )
            channels[name] = prefix
        if "train" not in channels:
            raise fail(f.source, "'input.channels' must define the 'train' channel")
        return cls(mode=mode, channels=channels)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    regex: str

    @classmethod
    def parse(cls, item: Any, index: int, source: str) -> MetricSpec:
        f = Fields(item, f"metrics[{index}]", source)
        spec = cls(name=f.get("name", str), regex=f.get("regex", str))
        f.done()
        try:
            compiled = re.compile(spec.regex)
        except re.error as exc:
            raise fail(source, f"'metrics[{index}].regex' does not compile: {exc}") from exc
        if compiled.groups != 1:
            raise fail(source, f"'metrics[{index}].regex' must have exactly one capture group (the value)")
        return spec


@dataclass(frozen=True)
class SpotSpec:
    enabled: bool = False
    max_wait_seconds: int | None = None


@dataclass(frozen=True)
class RetrySpec:
    """Retries: SageMaker's own (internal errors) and the launcher's (capacity, quota)."""

    internal_error_attempts: int = 1
    capacity_retry_attempts: int = 3
    backoff_seconds: int = 300
    backoff_rate: float = 2.0
    max_backoff_seconds: int = 3600
    fallback_instance_types: tuple[str, ...] = ()
    quota_policy: str = "fail"

    @classmethod
    def parse(cls, f: Fields) -> RetrySpec:
        spec = cls(
            internal_error_attempts=f.get("internal_error_attempts", int, cls.internal_error_attempts),
            capacity_retry_attempts=f.get("capacity_retry_attempts", int, cls.capacity_retry_attempts),
            backoff_seconds=f.get("backoff_seconds", int, cls.backoff_seconds),
            backoff_rate=f.get("backoff_rate", float, cls.backoff_rate),
            max_backoff_seconds=f.get("max_backoff_seconds", int, cls.max_backoff_seconds),
            fallback_instance_types=tuple(f.get("fallback_instance_types", list, [])),
            quota_policy=f.get("quota_policy", str, cls.quota_policy),
        )
        f.done()
        if not 1 <= spec.internal_error_attempts <= 30:
            raise fail(f.source, "'retry.internal_error_attempts' must be 1..30 (SageMaker RetryStrategy)")
        check_positive(f, "capacity_retry_attempts", spec.capacity_retry_attempts, allow_zero=True)
        check_positive(f, "backoff_seconds", spec.backoff_seconds)
        if spec.backoff_rate < 1.0:
            raise fail(f.source, "'retry.backoff_rate' must be >= 1.0 (the wait never shrinks)")
        if spec.max_backoff_seconds < spec.backoff_seconds:
            raise fail(f.source, "'retry.max_backoff_seconds' must be >= 'retry.backoff_seconds'")
        for index, instance_type in enumerate(spec.fallback_instance_types):
            if not isinstance(instance_type, str):
                raise fail(f.source, f"'retry.fallback_instance_types[{index}]' must be a string")
            _check_instance_type(f, f"fallback_instance_types[{index}]", instance_type)
        if spec.quota_policy not in QUOTA_POLICIES:
            raise fail(f.source, f"'retry.quota_policy' must be one of {', '.join(QUOTA_POLICIES)}")
        return spec


@dataclass(frozen=True)
class OverrideRule:
    """What a run may set for one setting: its type and bounds."""

    type: str
    min: float | None = None
    max: float | None = None
    choices: tuple[Any, ...] | None = None

    @classmethod
    def parse(cls, name: str, item: Any, source: str) -> OverrideRule:
        f = Fields(item, f"overridable.{name}", source)
        kind = f.get("type", str)
        if kind not in OVERRIDE_TYPES:
            raise fail(source, f"'overridable.{name}.type' must be one of {', '.join(OVERRIDE_TYPES)}")
        rule = cls(
            type=kind,
            min=f.get("min", (int, float), None),
            max=f.get("max", (int, float), None),
            choices=_tuple_or_none(f.get("choices", list, None)),
        )
        f.done()
        for choice in rule.choices or ():
            if not _matches_type(choice, kind):
                raise fail(
                    source, f"'overridable.{name}.choices' holds {choice!r}, which is not of type {kind}"
                )
        if (rule.min is not None or rule.max is not None) and kind not in ("int", "float"):
            raise fail(source, f"'overridable.{name}': min/max only apply to int and float settings")
        if rule.min is not None and rule.max is not None and rule.min > rule.max:
            raise fail(source, f"'overridable.{name}': min is greater than max")
        return rule

    def shown(self, bound: float) -> str:
        """A bound as a person writes it: `1` for an int setting (parsed as 1.0), `1e-06` for a float."""
        return str(int(bound)) if self.type == "int" and float(bound).is_integer() else str(bound)

    def describe(self) -> str:
        parts = [self.type]
        if self.min is not None:
            parts.append(f">= {self.shown(self.min)}")
        if self.max is not None:
            parts.append(f"<= {self.shown(self.max)}")
        if self.choices is not None:
            parts.append("one of " + ", ".join(str(c) for c in self.choices))
        return " ".join(parts)


PLATFORM_RUN_OPTIONS: Mapping[str, OverrideRule] = {
    "training_plan": OverrideRule("str"),
    "max_pending_seconds": OverrideRule("int", min=MIN_PENDING_SECONDS, max=MAX_PENDING_SECONDS),
    "remote_debug": OverrideRule("bool"),
    "base_model": OverrideRule("str"),
    "accept_eula": OverrideRule("bool"),
}


@dataclass(frozen=True)
class TemplateSpec:
    """One immutable template version."""

    name: str
    version: str
    description: str
    code: CodeSpec
    image: ImageSpec
    distribution: DistributionSpec
    compute: ComputeSpec
    inputs: InputSpec
    hyperparameters: Mapping[str, Any]
    metrics: tuple[MetricSpec, ...]
    max_runtime_seconds: int
    checkpoints: bool
    spot: SpotSpec
    keep_alive_seconds: int
    retry: RetrySpec
    inter_container_encryption: bool
    overridable: Mapping[str, OverrideRule]
    # SageMaker's instance health check before training (InfraCheckConfig), GPU instances only.
    infra_check: bool = False
    # The YAML mapping this spec was parsed from: what the lock hashes and the launcher stores.
    source_data: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def instance_types(self) -> tuple[str, ...]:
        """Every instance type this version may run on, sorted: its own, its capacity fallbacks, and
        the choices a run may pick when it lets runs override `instance_type`."""
        found = {self.compute.instance_type, *self.retry.fallback_instance_types}
        rule = self.overridable.get("instance_type")
        if rule is not None and rule.choices:
            found.update(str(choice) for choice in rule.choices)
        return tuple(sorted(found))

    def to_dict(self) -> dict[str, Any]:
        """The template as data (round-trips through `from_dict`)."""
        return copy.deepcopy(dict(self.source_data))

    @classmethod
    def from_dict(cls, data: Any, source: str = "<template>") -> TemplateSpec:
        f = Fields(data, "", source)
        name = f.get("name", str)
        version = f.get("version", str)
        _check_identity(name, version, source)
        code = CodeSpec.parse(f.sub("code", ...))
        distribution = DistributionSpec.parse(f.sub("distribution", ...))
        hyperparameters = dict(f.get("hyperparameters", Mapping))
        if code.is_platform:
            distribution, hyperparameters = distribution.with_legacy_degrees(hyperparameters, source)
        spec = cls(
            name=name,
            version=version,
            description=f.get("description", str).strip(),
            code=code,
            image=ImageSpec.parse(f.sub("image", ...)),
            distribution=distribution,
            compute=ComputeSpec.parse(f.sub("compute", ...)),
            inputs=InputSpec.parse(f.sub("input", ...)),
            hyperparameters=hyperparameters,
            metrics=_parse_metrics(f.get("metrics", list), source),
            max_runtime_seconds=_parse_stopping(f.sub("stopping", ...)),
            checkpoints=_parse_checkpoints(f.sub("checkpoints", {})),
            spot=_parse_spot(f.sub("spot", {})),
            keep_alive_seconds=_parse_warm_pool(f.sub("warm_pool", {})),
            retry=RetrySpec.parse(f.sub("retry", {})),
            inter_container_encryption=_parse_security(f.sub("security", {})),
            overridable=_parse_overridable(f.get("overridable", Mapping), source),
            infra_check=_parse_infra_check(f.sub("infra_check", {})),
            source_data=copy.deepcopy(dict(data)),
        )
        f.done()
        _check_consistency(spec, source)
        return spec


def _tuple_or_none(items: list | None) -> tuple | None:
    return None if items is None else tuple(items)


def _matches_type(value: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    return isinstance(value, str)


def _check_identity(name: str, version: str, source: str) -> None:
    if len(name) > TEMPLATE_NAME_MAX or not TEMPLATE_NAME_PATTERN.fullmatch(name):
        raise fail(
            source,
            f"'name' {name!r} must be lowercase letters, digits and single dashes, "
            f"at most {TEMPLATE_NAME_MAX}",
        )
    if not SEMVER_PATTERN.fullmatch(version):
        raise fail(source, f"'version' {version!r} is not a semantic version such as 1.0.0")


def _parse_metrics(items: list, source: str) -> tuple[MetricSpec, ...]:
    metrics = tuple(MetricSpec.parse(item, i, source) for i, item in enumerate(items))
    names = [m.name for m in metrics]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise fail(source, f"metric names must be unique; repeated: {', '.join(duplicates)}")
    if len(metrics) > 40:
        raise fail(source, "at most 40 metric definitions are allowed (SageMaker's limit)")
    return metrics


def _parse_stopping(f: Fields) -> int:
    seconds = f.get("max_runtime_seconds", int)
    f.done()
    if not 1 <= seconds <= SAGEMAKER_LIMIT_MAX_RUNTIME_SECONDS:
        raise fail(
            f.source, f"'stopping.max_runtime_seconds' must be 1..{SAGEMAKER_LIMIT_MAX_RUNTIME_SECONDS}"
        )
    return seconds


def _parse_checkpoints(f: Fields) -> bool:
    enabled = f.get("enabled", bool, True)
    f.done()
    return enabled


def _parse_spot(f: Fields) -> SpotSpec:
    spec = SpotSpec(
        enabled=f.get("enabled", bool, False), max_wait_seconds=f.get("max_wait_seconds", int, None)
    )
    f.done()
    if spec.enabled and spec.max_wait_seconds is None:
        raise fail(f.source, "'spot.max_wait_seconds' is required when spot is enabled")
    return spec


def _parse_warm_pool(f: Fields) -> int:
    seconds = f.get("keep_alive_seconds", int, 0)
    f.done()
    check_positive(f, "keep_alive_seconds", seconds, allow_zero=True)
    return seconds


def _parse_security(f: Fields) -> bool:
    enabled = f.get("inter_container_encryption", bool, False)
    f.done()
    return enabled


def _parse_infra_check(f: Fields) -> bool:
    enabled = f.get("enabled", bool, False)
    f.done()
    return enabled


def _parse_overridable(raw: Mapping, source: str) -> dict[str, OverrideRule]:
    return {str(name): OverrideRule.parse(str(name), item, source) for name, item in raw.items()}


def _check_consistency(spec: TemplateSpec, source: str) -> None:
    """Rules across sections, checked once at load so every later step can rely on them."""
    if "max_steps" not in spec.hyperparameters or "max_steps" not in spec.overridable:
        raise fail(
            source, "'max_steps' must be a hyperparameter and listed in 'overridable' (every template)"
        )
    bad = sorted(k for k in spec.hyperparameters if k.startswith("sagemaker_") or k == "mp_parameters")
    if bad:
        raise fail(source, f"hyperparameters {', '.join(bad)} are reserved for the SageMaker container")
    if spec.code.is_platform:
        derived = sorted(set(DERIVED_HYPERPARAMETERS) & set(spec.hyperparameters))
        if derived:
            raise fail(
                source,
                f"hyperparameters {', '.join(derived)} come from the 'distribution' section; remove them",
            )
    if spec.distribution.strategy == "smp" and spec.image.uri is None and not spec.code.is_platform:
        raise fail(
            source, "strategy 'smp' needs the SMP-enabled image: use platform code or an explicit image.uri"
        )
    for problem in quantization_problems(spec.distribution.strategy, spec.hyperparameters, spec.ref):
        raise fail(source, problem)
    if spec.spot.enabled and spec.keep_alive_seconds:
        raise fail(source, "warm pools do not work with managed spot training: set keep_alive_seconds to 0")
    if "spot" in spec.overridable and spec.spot.max_wait_seconds is None:
        raise fail(source, "'spot.max_wait_seconds' is required when runs may turn spot on")
    if spec.spot.max_wait_seconds is not None and spec.spot.max_wait_seconds < spec.max_runtime_seconds:
        raise fail(source, "'spot.max_wait_seconds' must be >= 'stopping.max_runtime_seconds'")
    for setting in spec.overridable:
        _check_overridable_name(setting, spec, source)
    _check_platform_features(spec, source)


def _check_platform_features(spec: TemplateSpec, source: str) -> None:
    reserved = sorted(set(PLATFORM_RUN_OPTIONS) & set(spec.hyperparameters))
    if reserved:
        raise fail(source, f"hyperparameters {', '.join(reserved)} are platform run options; rename them")
    if spec.infra_check:
        _check_infra_check(spec, source)


def _check_infra_check(spec: TemplateSpec, source: str) -> None:
    """SageMaker checks GPU instances (and their interconnect) before training; CPUs it does not."""
    types = {spec.compute.instance_type, *spec.retry.fallback_instance_types}
    rule = spec.overridable.get("instance_type")
    types |= set(rule.choices or ()) if rule is not None else set()
    cpu = sorted(t for t in types if not lookup_instance_type(t).gpus)
    if cpu:
        raise fail(
            source,
            f"'infra_check.enabled' needs GPU instance types; {', '.join(cpu)} has no GPU: "
            "turn the check off or use GPU instances only",
        )


def _check_overridable_name(setting: str, spec: TemplateSpec, source: str) -> None:
    if setting.startswith(CHANNEL_SETTING_PREFIX):
        channel = setting[len(CHANNEL_SETTING_PREFIX) :]
        if channel not in spec.inputs.channels:
            raise fail(
                source, f"'overridable.{setting}' names channel {channel!r}, which 'input.channels' lacks"
            )
        if spec.overridable[setting].type != "s3_uri":
            raise fail(source, f"'overridable.{setting}.type' must be s3_uri")
    elif setting.startswith("sagemaker_") or setting == "mp_parameters":
        raise fail(source, f"'overridable.{setting}' is reserved for the SageMaker container")
    elif setting in PLATFORM_RUN_OPTIONS:
        raise fail(source, f"'overridable.{setting}' is a platform run option every template accepts; "
                            "remove it from 'overridable'")
    elif setting == "parallelism" and spec.code.is_platform:
        raise fail(source, "'overridable.parallelism': the strategy is fixed by the template version")
    elif setting in _SETTING_TYPES and spec.overridable[setting].type != _SETTING_TYPES[setting]:
        raise fail(source, f"'overridable.{setting}.type' must be {_SETTING_TYPES[setting]}")
    if setting == "instance_type":
        unknown = sorted(set(spec.overridable[setting].choices or ()) - KNOWN_INSTANCE_TYPES)
        if unknown or spec.overridable[setting].choices is None:
            raise fail(
                source,
                "'overridable.instance_type' needs 'choices' of instance types the platform knows"
                + (f"; unknown: {', '.join(unknown)}" if unknown else ""),
            )
