"""The platform's Lambda functions as a deployment sees them: each one's entry point, its settings,
and the names of what it publishes. One record per function's settings, typed once and used by
both sides: the construct builds it and writes the function's environment with `to_environment()`;
the handler reads it back with `from_environment(os.environ)`. No construct spells a variable name.

    function                  handler (llmtrain.handlers.*)            settings
    launcher Resolve,         launcher.resolve / next_attempt /        LauncherSettings
      NextAttempt, Summarize    summarize
    launcher Watch (queues)   queue.watch                              WatchSettings
    preparations' steps       preparation.handler                      PreparationSettings
    quota usage               quotas.handler                           QuotaSettings
    warm-pool reaper          warm_pools.handler                       ReaperSettings
    job events                job_events.handler                       JobEventSettings

A settings record validates what it can when built; at synth some values are CDK tokens (ARNs,
names CloudFormation fills in), which it carries through unread. Standard library and
`llmtrain.core.platform` only: the operations functions' code ships no compiled packages.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

from llmtrain.core.errors import LauncherStateError
from llmtrain.core.platform import PlatformContext

# -- what the functions publish and read (the dashboard's and alarms' names) ------------------------

QUOTA_NAMESPACE = "LLMTrain/Quotas"
WARM_POOL_NAMESPACE = "LLMTrain/WarmPools"
JOB_NAMESPACE = "LLMTrain/Jobs"
TRAINING_NAMESPACE = "LLMTrain/Training"
# The job-events function's EventBridge pattern: SageMaker's job state changes that end a job.
EVENT_SOURCE = "aws.sagemaker"
EVENT_DETAIL_TYPE = "SageMaker Training Job State Change"
END_STATES = ("Completed", "Failed", "Stopped")


class UsageKind(StrEnum):
    """A kind of training-instance usage that Service Quotas limits separately (a metric dimension)."""

    TRAINING = "training"
    SPOT = "spot"
    WARM_POOL = "warm-pool"

    @property
    def quota_suffix(self) -> str:
        return _QUOTA_SUFFIXES[self]


_QUOTA_SUFFIXES = {
    UsageKind.TRAINING: "for training job usage",
    UsageKind.SPOT: "for spot training job usage",
    UsageKind.WARM_POOL: "for training warm pool usage",
}
DEFAULT_CACHE_TTL_SECONDS = 3600
_BOOLEAN_WORDS = {"true": True, "false": False}


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


# -- the launcher's functions -------------------------------------------------------------------------

ENV_PLATFORM_CONTEXT = "LLMTRAIN_PLATFORM_CONTEXT"
ENV_REQUEST_LAYOUTS = "LLMTRAIN_REQUEST_LAYOUTS"
ENV_TEMPLATES_DIR = "LLMTRAIN_TEMPLATES_DIR"


@dataclass(frozen=True, kw_only=True)
class LauncherSettings:
    """The settings the launcher's three functions share.

    ``platform_context``: the team's `PlatformContext` as a dict (`to_dict()`; tokens at synth).
    ``request_layouts``: the request layouts the deployed state machine can pass
    (`llmtrain.core.request_layouts.request_layouts`; its CreateTrainingJob states, where the team's
    environment has no queues). Its tuning states need no setting: their layouts are the fixed
    `llmtrain.core.request_layouts.TUNING_LAYOUTS`.
    ``templates_dir``: where the registry's YAML files are (None: the folder bundled beside the
    `llmtrain` package in the function's code).
    """

    HANDLERS: ClassVar[Mapping[str, str]] = {
        step: f"llmtrain.handlers.launcher.{step}" for step in ("resolve", "next_attempt", "summarize")
    }

    platform_context: Mapping[str, Any]
    request_layouts: Mapping[str, Sequence[str]]
    templates_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("platform_context", "request_layouts"):
            if not isinstance(getattr(self, name), Mapping):
                kind = type(getattr(self, name)).__name__
                raise LauncherStateError(f"{name} must be a JSON object, got {kind}")
        object.__setattr__(self, "platform_context", dict(self.platform_context))
        object.__setattr__(
            self, "request_layouts", {name: list(fields) for name, fields in self.request_layouts.items()}
        )

    @property
    def platform(self) -> PlatformContext:
        return PlatformContext.from_dict(self.platform_context)

    def to_environment(self, json_text: Callable[[Any], str] = compact_json) -> dict[str, str]:
        """The functions' environment. ``json_text`` writes the platform context (the construct passes
        its stack's `to_json_string`, which keeps CloudFormation's references in it)."""
        environment = {
            ENV_PLATFORM_CONTEXT: json_text(self.platform_context),
            ENV_REQUEST_LAYOUTS: compact_json(self.request_layouts),
        }
        if self.templates_dir:
            environment[ENV_TEMPLATES_DIR] = self.templates_dir
        return environment

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> LauncherSettings:
        return cls(
            platform_context=_json_setting(environ, ENV_PLATFORM_CONTEXT),
            request_layouts=_json_setting(environ, ENV_REQUEST_LAYOUTS),
            templates_dir=environ.get(ENV_TEMPLATES_DIR) or None,
        )


@dataclass(frozen=True, kw_only=True)
class WatchSettings:
    """The settings of the launcher's Watch function, which follows a queued run's service job (a team
    whose environment has queues). ``platform_context``: the team's `PlatformContext` as a dict, as
    the launcher's other functions get it (its ``queues`` name the team's queues and share)."""

    HANDLER: ClassVar[str] = "llmtrain.handlers.queue.watch"

    platform_context: Mapping[str, Any]

    def __post_init__(self) -> None:
        if not isinstance(self.platform_context, Mapping):
            kind = type(self.platform_context).__name__
            raise LauncherStateError(f"platform_context must be a JSON object, got {kind}")
        object.__setattr__(self, "platform_context", dict(self.platform_context))

    @property
    def platform(self) -> PlatformContext:
        return PlatformContext.from_dict(self.platform_context)

    def to_environment(self, json_text: Callable[[Any], str] = compact_json) -> dict[str, str]:
        """The function's environment (``json_text`` as for `LauncherSettings.to_environment`)."""
        return {ENV_PLATFORM_CONTEXT: json_text(self.platform_context)}

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> WatchSettings:
        return cls(platform_context=_json_setting(environ, ENV_PLATFORM_CONTEXT))


ENV_PROCESSING_ROLE_ARN = "LLMTRAIN_PROCESSING_ROLE_ARN"


@dataclass(frozen=True, kw_only=True)
class PreparationSettings:
    """The settings of the function of a team's preparation state machine (`llmtrain data prepare
    --cloud`): its steps Validate, RecordSizes, Complete and DescribeFailure.

    ``platform_context``: the team's `PlatformContext` as a dict, as the launcher's functions get it.
    ``processing_role_arn``: the role the processing jobs run as (the requests name it; the state
      machine passes no other).
    ``templates_dir``: where the registry's YAML files are (None: bundled beside `llmtrain`), whose
      versions' images run the preparations.
    """

    HANDLER: ClassVar[str] = "llmtrain.handlers.preparation.handler"

    platform_context: Mapping[str, Any]
    processing_role_arn: str
    templates_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.platform_context, Mapping):
            kind = type(self.platform_context).__name__
            raise LauncherStateError(f"platform_context must be a JSON object, got {kind}")
        if not isinstance(self.processing_role_arn, str) or not self.processing_role_arn:
            raise LauncherStateError(
                f"{ENV_PROCESSING_ROLE_ARN} is not set: the preparations construct sets it"
            )
        object.__setattr__(self, "platform_context", dict(self.platform_context))

    @property
    def platform(self) -> PlatformContext:
        """The team's context, with the processing role as the role its jobs run as."""
        return dataclasses.replace(PlatformContext.from_dict(self.platform_context),
                                   execution_role_arn=self.processing_role_arn)

    def to_environment(self, json_text: Callable[[Any], str] = compact_json) -> dict[str, str]:
        """The function's environment (``json_text`` as for `LauncherSettings.to_environment`)."""
        environment = {ENV_PLATFORM_CONTEXT: json_text(self.platform_context),
                       ENV_PROCESSING_ROLE_ARN: self.processing_role_arn}
        if self.templates_dir:
            environment[ENV_TEMPLATES_DIR] = self.templates_dir
        return environment

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> PreparationSettings:
        return cls(
            platform_context=_json_setting(environ, ENV_PLATFORM_CONTEXT),
            processing_role_arn=environ.get(ENV_PROCESSING_ROLE_ARN, ""),
            templates_dir=environ.get(ENV_TEMPLATES_DIR) or None,
        )


def _json_setting(environ: Mapping[str, str], name: str) -> Any:
    raw = environ.get(name)
    if not raw:
        raise LauncherStateError(f"{name} is not set: the launcher construct sets it")
    try:
        return json.loads(raw)
    except ValueError as error:
        raise LauncherStateError(f"{name} is not JSON ({error}): the launcher construct sets it") from error


# -- the operations functions -------------------------------------------------------------------------


@dataclass(frozen=True)
class QuotaSettings:
    """What the quota-usage function watches and where it publishes."""

    HANDLER: ClassVar[str] = "llmtrain.handlers.quotas.handler"

    instance_types: tuple[str, ...]
    namespace: str = QUOTA_NAMESPACE
    cache_ttl_seconds: int = DEFAULT_CACHE_TTL_SECONDS

    def __post_init__(self) -> None:
        object.__setattr__(self, "instance_types", tuple(self.instance_types))
        if not self.instance_types:
            raise ValueError(
                "INSTANCE_TYPES: give at least one SageMaker instance type, e.g. ml.p4d.24xlarge"
            )
        for instance_type in self.instance_types:
            if not instance_type.startswith("ml."):
                raise ValueError(
                    f"INSTANCE_TYPES: {instance_type!r} is not a SageMaker instance type; write e.g. "
                    "ml.p4d.24xlarge"
                )
        if self.cache_ttl_seconds < 0:
            raise ValueError(f"QUOTA_CACHE_TTL_SECONDS: must be >= 0, got {self.cache_ttl_seconds}")

    def to_environment(self) -> dict[str, str]:
        return {
            "INSTANCE_TYPES": ",".join(self.instance_types),
            "METRIC_NAMESPACE": self.namespace,
            "QUOTA_CACHE_TTL_SECONDS": str(self.cache_ttl_seconds),
        }

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> QuotaSettings:
        return cls(
            instance_types=_list_setting(environ, "INSTANCE_TYPES"),
            namespace=environ.get("METRIC_NAMESPACE", QUOTA_NAMESPACE),
            cache_ttl_seconds=_seconds_setting(environ, "QUOTA_CACHE_TTL_SECONDS", DEFAULT_CACHE_TTL_SECONDS),
        )


@dataclass(frozen=True)
class ReaperSettings:
    """Which pools the warm-pool reaper may end, after how long, and whether it only reports."""

    HANDLER: ClassVar[str] = "llmtrain.handlers.warm_pools.handler"

    job_name_prefix: str
    idle_budget_seconds: int
    environment: str
    instance_types: tuple[str, ...] = ()
    dry_run: bool = False
    namespace: str = WARM_POOL_NAMESPACE

    def __post_init__(self) -> None:
        object.__setattr__(self, "instance_types", tuple(self.instance_types))
        if not self.job_name_prefix:
            raise ValueError(
                "JOB_NAME_PREFIX: give the platform's job-name prefix; the reaper ends only those pools"
            )
        if self.idle_budget_seconds < 0:
            raise ValueError(f"IDLE_BUDGET_SECONDS: must be >= 0, got {self.idle_budget_seconds}")
        if not self.environment:
            raise ValueError("ENVIRONMENT_NAME: give the environment's name (a metric dimension)")

    def to_environment(self) -> dict[str, str]:
        return {
            "JOB_NAME_PREFIX": self.job_name_prefix,
            "IDLE_BUDGET_SECONDS": str(self.idle_budget_seconds),
            "ENVIRONMENT_NAME": self.environment,
            "INSTANCE_TYPES": ",".join(self.instance_types),
            "DRY_RUN": "true" if self.dry_run else "false",
            "METRIC_NAMESPACE": self.namespace,
        }

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> ReaperSettings:
        return cls(
            job_name_prefix=environ.get("JOB_NAME_PREFIX", ""),
            idle_budget_seconds=_seconds_setting(environ, "IDLE_BUDGET_SECONDS", None),
            environment=environ.get("ENVIRONMENT_NAME", ""),
            instance_types=_list_setting(environ, "INSTANCE_TYPES"),
            dry_run=_parse_bool("DRY_RUN", environ.get("DRY_RUN", "false")),
            namespace=environ.get("METRIC_NAMESPACE", WARM_POOL_NAMESPACE),
        )


@dataclass(frozen=True)
class JobEventSettings:
    """Which jobs the job-events function reports, and where."""

    HANDLER: ClassVar[str] = "llmtrain.handlers.job_events.handler"

    job_name_prefix: str
    environment: str
    topic_arn: str = ""
    namespace: str = JOB_NAMESPACE
    training_namespace: str = TRAINING_NAMESPACE

    def __post_init__(self) -> None:
        if not self.job_name_prefix:
            raise ValueError("JOB_NAME_PREFIX: give the platform's job-name prefix")
        if not self.environment:
            raise ValueError("ENVIRONMENT_NAME: give the environment's name (a metric dimension)")

    def to_environment(self) -> dict[str, str]:
        return {
            "JOB_NAME_PREFIX": self.job_name_prefix,
            "ENVIRONMENT_NAME": self.environment,
            "NOTIFICATION_TOPIC_ARN": self.topic_arn,
            "METRIC_NAMESPACE": self.namespace,
            "TRAINING_METRIC_NAMESPACE": self.training_namespace,
        }

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> JobEventSettings:
        return cls(
            job_name_prefix=environ.get("JOB_NAME_PREFIX", ""),
            environment=environ.get("ENVIRONMENT_NAME", ""),
            topic_arn=environ.get("NOTIFICATION_TOPIC_ARN", ""),
            namespace=environ.get("METRIC_NAMESPACE", JOB_NAMESPACE),
            training_namespace=environ.get("TRAINING_METRIC_NAMESPACE", TRAINING_NAMESPACE),
        )


def _list_setting(environ: Mapping[str, str], name: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in environ.get(name, "").split(",") if part.strip())


def _seconds_setting(environ: Mapping[str, str], name: str, default: int | None) -> int:
    raw = environ.get(name, "" if default is None else str(default))
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}: {raw!r} is not a whole number of seconds") from None


def _parse_bool(name: str, raw: str) -> bool:
    try:
        return _BOOLEAN_WORDS[raw.strip().lower()]
    except KeyError:
        raise ValueError(f"{name}: write true or false, got {raw!r}") from None


ALL_SETTINGS = (LauncherSettings, WatchSettings, PreparationSettings, QuotaSettings, ReaperSettings,
                JobEventSettings)
__all__ = [
    "ALL_SETTINGS",
    "END_STATES",
    "EVENT_DETAIL_TYPE",
    "EVENT_SOURCE",
    "JOB_NAMESPACE",
    "QUOTA_NAMESPACE",
    "TRAINING_NAMESPACE",
    "WARM_POOL_NAMESPACE",
    "JobEventSettings",
    "LauncherSettings",
    "PreparationSettings",
    "QuotaSettings",
    "ReaperSettings",
    "UsageKind",
    "WatchSettings",
]
