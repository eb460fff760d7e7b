"""Metrics from a job's log, extracted with the template's own MetricDefinitions.

SageMaker applies each metric definition's regex to every line the algorithm writes and keeps the
first capture group as the value; FinalMetricDataList holds each metric's last value. This module
does the same locally, and also remembers the `step=N` of the line a value came from, so that the
local run can plot metrics over steps (SageMaker plots them over time).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

# The training program's metric lines carry the optimizer step (docs/architecture.md, "Metric lines").
_STEP = re.compile(r"\bstep=(\d+)\b")


@dataclass(frozen=True)
class MetricDefinition:
    name: str
    regex: str

    @classmethod
    def from_request(cls, request: Mapping) -> tuple[MetricDefinition, ...]:
        """The definitions of a CreateTrainingJob request (AlgorithmSpecification.MetricDefinitions)."""
        items = request.get("AlgorithmSpecification", {}).get("MetricDefinitions", [])
        return tuple(cls(name=item["Name"], regex=item["Regex"]) for item in items)


@dataclass(frozen=True)
class MetricPoint:
    name: str
    value: float
    step: int | None
    timestamp: datetime
    host: str


@dataclass
class MetricExtractor:
    """Feeds log lines through every metric definition; keeps every value it finds."""

    definitions: tuple[MetricDefinition, ...]
    points: list[MetricPoint] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._compiled = [(d.name, re.compile(d.regex)) for d in self.definitions]

    def feed(self, line: str, *, host: str, when: datetime | None = None) -> list[MetricPoint]:
        """Every metric value `line` holds (none for most lines)."""
        found = []
        for name, pattern in self._compiled:
            match = pattern.search(line)
            if match is None:
                continue
            value = _to_float(match.group(1))
            if value is None:
                continue
            step = _STEP.search(line)
            found.append(
                MetricPoint(
                    name=name,
                    value=value,
                    step=int(step.group(1)) if step else None,
                    timestamp=when or datetime.now(UTC),
                    host=host,
                )
            )
        self.points.extend(found)
        return found

    def feed_all(self, lines: Iterable[str], *, host: str) -> None:
        for line in lines:
            self.feed(line, host=host)

    def final_values(self) -> dict[str, MetricPoint]:
        """Each metric's last value, as SageMaker's FinalMetricDataList reports it."""
        final: dict[str, MetricPoint] = {}
        for point in self.points:
            final[point.name] = point
        return final

    def unmatched(self) -> list[MetricDefinition]:
        """Definitions whose regex matched no line: in the cloud these metrics would stay empty."""
        seen = {p.name for p in self.points}
        return [d for d in self.definitions if d.name not in seen]

    def series(self, name: str) -> list[tuple[int, float]]:
        """(step, value) pairs of one metric, for values logged on a line that names its step."""
        return [(p.step, p.value) for p in self.points if p.name == name and p.step is not None]


def _to_float(text: str) -> float | None:
    # SageMaker drops captures that are not numbers; so do we.
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def pick_metric(names: Iterable[str], *keywords: str, avoid: tuple[str, ...] = ()) -> str | None:
    """The first metric name holding one of `keywords` (in order) and none of `avoid`."""
    names = list(names)
    for keyword in keywords:
        for name in names:
            lowered = name.lower()
            if keyword in lowered and not any(a in lowered for a in avoid):
                return name
    return None


def loss_metric(names: Iterable[str]) -> str | None:
    return pick_metric(names, "loss", avoid=("eval", "val"))


def eval_loss_metric(names: Iterable[str]) -> str | None:
    """The validation loss: a loss metric named for evaluation or validation."""
    losses = [name for name in names if "loss" in name.lower()]
    return pick_metric(losses, "eval", "val")


def throughput_metric(names: Iterable[str]) -> str | None:
    return pick_metric(names, "tokens_per_sec", "tokens/s", "throughput", "samples_per_sec")
