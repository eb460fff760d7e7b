"""How an attempt starts: the one seam between a rendered request and the service that runs it.

Resolve and NextAttempt render an attempt's request (`llmtrain.render`); a `Submission` turns it
into what the state machine's start step reads (`attempt_state`), and reads back what that step
caught when the attempt failed (`classify`). Today there is one: `TrainingJobSubmission`, a
SageMaker CreateTrainingJob `.sync` state per request layout (the launcher construct builds those
states from `request_layouts`). Another way of starting an attempt (a queue, a tuning job) is
another `Submission` and its states in the construct; the lifecycle around it stays the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from llmtrain.errors import LlmtrainError
from llmtrain.lifecycle.failures import Failure, classify_failure


class Submission(Protocol):
    """How the launcher's state machine starts an attempt's rendered request."""

    def attempt_state(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """What the start step reads besides the run (`{"request", "layout"}` for a training job);
        LlmtrainError when the deployed state machine cannot start this request."""
        ...

    def classify(self, caught: Mapping[str, Any], request: Mapping[str, Any]) -> Failure:
        """The failure of an attempt from what the start step caught (`{"Error", "Cause"}`)."""
        ...


@dataclass(frozen=True)
class TrainingJobSubmission:
    """CreateTrainingJob `.sync`, waiting for the job's end; one state per request layout."""

    layouts: Mapping[str, Sequence[str]]

    def attempt_state(self, request: Mapping[str, Any]) -> dict[str, Any]:
        return {"request": dict(request), "layout": request_layout(request, self.layouts)}

    def classify(self, caught: Mapping[str, Any], request: Mapping[str, Any]) -> Failure:
        in_plan = "TrainingPlanArn" in (request.get("ResourceConfig") or {})
        return classify_failure(caught, in_training_plan=in_plan)


def request_layouts(requests: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """The layouts (sets of top-level fields) of some rendered requests, named for the state machine.

    Step Functions (JSONPath) cannot splat an object into a task's parameters, and a path to a
    missing field fails the state, so the state machine has one CreateTrainingJob state per
    layout, passing every field of it. The construct computes the layouts at synth from the
    registered templates' requests; `request_layout` picks a run's at run time. A layout is named
    after the fields it lacks from their union: "all", or e.g. "without-CheckpointConfig".
    """
    union = list(dict.fromkeys(field for request in requests for field in request))
    layouts: dict[str, list[str]] = {}
    for request in requests:
        missing = [field for field in union if field not in request]
        name = "without-" + "-".join(missing) if missing else "all"
        layouts[name] = [field for field in union if field in request]
    return dict(sorted(layouts.items()))


def request_layout(request: Mapping[str, Any], layouts: Mapping[str, Sequence[str]]) -> str:
    """The name of the layout whose fields are exactly the request's; LlmtrainError when none is."""
    fields = set(request)
    for name, layout in layouts.items():
        if fields == set(layout):
            return name
    known = set().union(*map(set, layouts.values())) if layouts else set()
    raise LlmtrainError(
        f"these settings produce a CreateTrainingJob request with fields "
        f"{sorted(fields - known) or sorted(fields)} "
        "in a combination the deployed launcher cannot pass (it was built for the layouts "
        f"{sorted(layouts)}); redeploy the platform with this template enabled, or change the overrides"
    )
