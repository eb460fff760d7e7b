"""The launcher's records: what an execution is started with, and the run's state between its steps.

Both cross a boundary, so they are typed once here and shared:

- `ExecutionInput` is the Step Functions execution input. The CLI builds it (`llmtrain start`), the
  launcher's Resolve function parses it (`ExecutionInput.parse`), and whoever lists runs reads it
  back from an execution. Bad input raises `InvalidRunInput`, whose message says what to fix; the
  state machine ends such a run before any training job exists.
- `RunState` is what the state machine carries from one function to the next (`{"run": ...}`): the
  run's pinned template version, the instance types it may use, its retry counters and the history
  of its attempts. The functions read it with `RunState.from_dict`, which refuses a state that is not
  exactly this record (a state machine and functions from different deployments).

Pure Python: no AWS calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmtrain.core.catalog import LATEST
from llmtrain.core.errors import LauncherStateError, LlmtrainError
from llmtrain.core.queue_policy import QUEUE_NAME_PATTERN, priority_problem
from llmtrain.core.run_settings import RUN_NAME_PATTERN
from llmtrain.core.tuning import TuneSpec

INPUT_SHAPE = (
    '{"template": NAME, "version": SEMVER or "latest", "run_name": NAME, "overrides": {SETTING: VALUE}, '
    '"owner": TEXT, "skip_plan_check": BOOLEAN, "queue": NAME, "priority": 0..9999, '
    '"tune": {...} (a tune, llmtrain.core.tuning.TuneSpec)}'
)
DEFAULT_OWNER = "launcher"


class InvalidRunInput(LlmtrainError):
    """The execution input cannot start a run; nothing was created. The message says what to fix.

    The state machine catches it by this class name (the Lambda runtime's `errorType`).
    """

    def __init__(self, problem: str):
        super().__init__(f"run input rejected before any training job was created: {problem}")
        self.problem = problem


@dataclass(frozen=True, kw_only=True)
class ExecutionInput:
    """One execution of the launcher: which template version to run, under which run name.

    ``skip_plan_check`` starts a run the planner predicts will not fit its GPUs (never one above the
    team's budget). Where the environment has queues, ``queue`` names the team's queue the run
    waits in (None: the team's default) and ``priority`` its scheduling priority there (None: 0, at
    most the team's `max_priority`; Resolve checks both against the team). ``tune`` makes the run a
    tune (`llmtrain.core.tuning.TuneSpec.to_dict`): a SageMaker tuning job whose trials are runs of the
    template."""

    template: str
    run_name: str
    version: str = LATEST
    overrides: Mapping[str, Any] = field(default_factory=dict)
    owner: str | None = None
    skip_plan_check: bool = False
    queue: str | None = None
    priority: int | None = None
    tune: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        problem = _input_problem(self)
        if problem:
            raise InvalidRunInput(problem)
        object.__setattr__(self, "overrides", dict(self.overrides))
        if self.tune is not None:
            object.__setattr__(self, "tune", dict(self.tune))

    @classmethod
    def parse(cls, data: Any) -> ExecutionInput:
        """The input of an execution as Step Functions passes it (any JSON value)."""
        if not isinstance(data, Mapping):
            raise InvalidRunInput(
                f"the execution input must be a JSON object like {INPUT_SHAPE}, got {_json_kind(data)}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(key) for key in data if key not in names)
        if unknown:
            raise InvalidRunInput(f"unknown input field(s) {', '.join(unknown)}; the input is {INPUT_SHAPE}")
        for name in ("template", "run_name"):
            if name not in data:
                raise InvalidRunInput(
                    f"'{name}' is required and must be a non-empty string; the input is {INPUT_SHAPE}"
                )
        values = dict(data)
        if values.get("overrides", {}) is None:
            raise InvalidRunInput("'overrides' must be an object of setting name to value, got null")
        for name in ("owner", "skip_plan_check", "queue", "priority", "tune"):
            if name in values and values[name] is None:
                del values[name]
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "template": self.template,
            "version": self.version,
            "run_name": self.run_name,
            "overrides": dict(self.overrides),
        }
        if self.owner:
            data["owner"] = self.owner
        if self.skip_plan_check:
            data["skip_plan_check"] = True
        for name in ("queue", "priority"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        if self.tune is not None:
            data["tune"] = dict(self.tune)
        return data


def _input_problem(execution: ExecutionInput) -> str | None:
    for name in ("template", "run_name"):
        value = getattr(execution, name)
        if not isinstance(value, str) or not value:
            return (
                f"'{name}' is required and must be a non-empty string, got {value!r}; "
                f"the input is {INPUT_SHAPE}"
            )
    if not isinstance(execution.version, str) or not execution.version:
        return (
            f"'version' must be a published version such as 1.0.0, or \"latest\"; got {execution.version!r} "
            "(leave the field out for the latest version)"
        )
    if execution.owner is not None and not isinstance(execution.owner, str):
        return f"'owner' must be a string, got {execution.owner!r}"
    if not isinstance(execution.skip_plan_check, bool):
        return f"'skip_plan_check' must be true or false, got {execution.skip_plan_check!r:.80}"
    if not isinstance(execution.overrides, Mapping):
        return f"'overrides' must be an object of setting name to value, got {execution.overrides!r:.80}"
    if execution.tune is not None:
        try:
            TuneSpec.from_dict(execution.tune)
        except LlmtrainError as error:
            return f"'tune': {error}"
    return _queue_problem(execution) or run_name_problem(execution.run_name)


def _queue_problem(execution: ExecutionInput) -> str | None:
    if execution.queue is not None and not (
        isinstance(execution.queue, str) and QUEUE_NAME_PATTERN.fullmatch(execution.queue)
    ):
        return f"'queue' must name one of the environment's queues (lowercase letters and digits), got " \
               f"{execution.queue!r:.80}"
    if execution.priority is not None:
        problem = priority_problem(execution.priority)
        if problem:
            return f"'priority' {problem:.200}"
    return None


def run_name_problem(run_name: str) -> str | None:
    """Why a run name cannot name a launcher run, or None.

    SageMaker matches job names without regard to case, so `Llama-7B` and `llama-7b` would be the
    same jobs while their checkpoint prefixes differ: run names are lowercase.
    """
    if not RUN_NAME_PATTERN.fullmatch(run_name):
        return (
            f"run_name {run_name!r} must be letters, digits and single dashes, starting and ending "
            "with a letter or digit"
        )
    if run_name != run_name.lower():
        return (
            f"run_name {run_name!r} has upper-case letters; SageMaker job names ignore case, so it "
            f"would share its jobs with {run_name.lower()!r}: use {run_name.lower()!r}"
        )
    return None


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    kinds = {bool: "a boolean", str: "a string", list: "a list"}
    for kind, name in kinds.items():
        if isinstance(value, kind):
            return f"{name} ({str(value)[:40]!r})" if kind is str else name
    return "a number" if isinstance(value, int | float) else type(value).__name__


@dataclass(frozen=True, kw_only=True)
class AttemptRecord:
    """One ended attempt (training job) of a run: how it ended and why."""

    attempt: int
    job_name: str
    instance_type: str
    # Completed, capacity, plan_capacity, quota, throttled, job_failed, rule_stopped, hung, stopped,
    # api_error, invalid_retry
    outcome: str
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class UnusableInstanceType:
    """A capacity fallback the run cannot use, found before its first job, and why."""

    instance_type: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class RunState:
    """A run between the launcher's steps: fixed at Resolve, advanced by NextAttempt.

    ``instance_types`` are the types this run may use, in order: its own, then the template's
    capacity fallbacks that can hold it (``unusable_instance_types`` lists those that cannot, and
    why). ``type_index`` points at the current one. The counters drive the template's retry policy.
    """

    run_name: str
    team: str
    template: str
    version: str  # pinned: every attempt renders this exact version
    overrides: Mapping[str, Any]
    owner: str
    execution_arn: str | None
    attempt: int
    instance_types: tuple[str, ...]
    unusable_instance_types: tuple[UnusableInstanceType, ...] = ()
    type_index: int = 0
    capacity_retries: int = 0  # capacity retries on the current instance type
    quota_waits: int = 0
    throttle_retries: int = 0  # this attempt's CreateTrainingJob calls SageMaker throttled (no job created)
    checkpoint_s3_uri: str | None = None
    history: tuple[AttemptRecord, ...] = ()
    # The planner's figures for the run (llmtrain.planner.checks.plan_state), for its summary.
    plan: Mapping[str, Any] | None = None
    # Where the environment has queues: the run's queue (its name) and priority, for every attempt.
    queue: str | None = None
    priority: int | None = None
    # A tune's search (llmtrain.core.tuning.TuneSpec.to_dict); None for a run of one training job.
    tune: Mapping[str, Any] | None = None
    # The JumpStart base model resolved at Resolve (llmtrain.core.jumpstart.BaseModel.to_dict): every
    # attempt trains from the same weights.
    base_model: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "overrides", dict(self.overrides))
        object.__setattr__(self, "instance_types", tuple(self.instance_types))
        object.__setattr__(self, "unusable_instance_types", tuple(self.unusable_instance_types))
        object.__setattr__(self, "history", tuple(self.history))

    @property
    def instance_type(self) -> str:
        """The instance type of the current attempt."""
        return self.instance_types[self.type_index]

    def hung_jobs(self) -> int:
        """How many of the run's jobs the training program's hang watchdog ended."""
        return sum(entry.outcome == "hung" for entry in self.history)

    def with_attempt_ended(
        self, job_name: str, outcome: str, reason: str = "", instance_type: str | None = None
    ) -> RunState:
        entry = AttemptRecord(
            attempt=self.attempt,
            job_name=job_name,
            instance_type=instance_type or self.instance_type,
            outcome=outcome,
            reason=reason[:1000],
        )
        return dataclasses.replace(self, history=(*self.history, entry))

    def replace(self, **changes: Any) -> RunState:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["overrides"] = dict(self.overrides)
        data["instance_types"] = list(self.instance_types)
        data["unusable_instance_types"] = [item.to_dict() for item in self.unusable_instance_types]
        data["history"] = [entry.to_dict() for entry in self.history]
        return data

    @classmethod
    def from_dict(cls, data: Any) -> RunState:
        if not isinstance(data, Mapping):
            raise LauncherStateError(f"the run state must be an object, got {_json_kind(data)}")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(data) - names:
            raise LauncherStateError(
                f"the run state has fields {sorted(set(data) - names)} this function does not know: the "
                "state machine and the functions come from different deployments (deploy them together)"
            )
        try:
            return cls(
                **{
                    **data,
                    "unusable_instance_types": tuple(
                        UnusableInstanceType(**item) for item in data.get("unusable_instance_types", ())
                    ),
                    "history": tuple(AttemptRecord(**entry) for entry in data.get("history", ())),
                }
            )
        except TypeError as error:
            raise LauncherStateError(
                f"the run state does not match this function's RunState ({error}): deploy the state machine "
                "and the functions together"
            ) from error


__all__ = [
    "DEFAULT_OWNER",
    "AttemptRecord",
    "ExecutionInput",
    "InvalidRunInput",
    "LauncherStateError",
    "RunState",
    "UnusableInstanceType",
    "run_name_problem",
]
