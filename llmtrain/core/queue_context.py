"""`TeamQueues`: one team's view of its environment's queues, in its platform context.

The launcher construct passes it to the team's functions (inside `LLMTRAIN_PLATFORM_CONTEXT`) and
the deployed environment's record carries it to the CLI: the queues the team may submit to (name
and ARN), the queue a run takes when it names none, the team's share identifier and highest
priority, and the environment's capacity and capacity wait (the functions refuse a run larger than
the capacity, and the advice names the wait). Pure Python.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from llmtrain.core import queue_policy as policy
from llmtrain.core.errors import PlatformContextError

_QUEUE_ARN = re.compile(r"arn:aws[a-z\-]*:batch:[a-z0-9\-]+:\d{12}:job-queue/[A-Za-z0-9_\-]{1,128}")


@dataclass(frozen=True, kw_only=True)
class TeamQueues:
    queue_arns: Mapping[str, str]
    default_queue: str
    share_identifier: str
    max_priority: int
    max_instances: int
    capacity_wait_seconds: int

    def __post_init__(self) -> None:
        if isinstance(self.queue_arns, Mapping):
            object.__setattr__(self, "queue_arns", dict(self.queue_arns))
        problems = list(self._problems())
        if problems:
            raise PlatformContextError("invalid queues in the platform context: " + "; ".join(problems))

    def _problems(self):
        if not isinstance(self.queue_arns, Mapping) or not self.queue_arns:
            yield "queue_arns must map at least one queue name to its ARN"
            return
        for name, arn in self.queue_arns.items():
            if not isinstance(name, str) or not policy.QUEUE_NAME_PATTERN.fullmatch(name):
                yield f"queue name {name!r} must be 1-16 lowercase letters and digits"
            if not isinstance(arn, str) or not _QUEUE_ARN.fullmatch(arn):
                yield f"queue {name!r}: {arn!r} is not a job queue ARN"
        if self.default_queue not in self.queue_arns:
            yield f"default_queue {self.default_queue!r} is not one of the team's queues"
        if not isinstance(self.share_identifier, str) or not self.share_identifier:
            yield "share_identifier must not be empty"
        problem = policy.priority_problem(self.max_priority)
        if problem:
            yield f"max_priority {problem}"
        for name in ("max_instances", "capacity_wait_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                yield f"{name} must be a positive whole number, got {value!r}"

    def queue_arn(self, name: str | None) -> str:
        return self.queue_arns[name or self.default_queue]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["queue_arns"] = dict(self.queue_arns)
        return data

    @classmethod
    def from_value(cls, value: TeamQueues | Mapping[str, Any] | None) -> TeamQueues | None:
        """The record as a platform context holds it (a TeamQueues, or its dict from JSON)."""
        if value is None or isinstance(value, TeamQueues):
            return value
        if not isinstance(value, Mapping):
            raise PlatformContextError(f"queues must be an object, got {type(value).__name__}")
        names = {f.name for f in fields(cls)}
        if set(value) != names:
            expected, got = ", ".join(sorted(names)), ", ".join(sorted(map(str, value)))
            raise PlatformContextError(f"queues must have exactly the fields {expected}, got {got}")
        return cls(**value)


__all__ = ["TeamQueues"]
