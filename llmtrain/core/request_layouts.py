"""The layouts of rendered requests: which top-level fields a CreateTrainingJob (or tuning) request
carries, named for the launcher's state machine.

Step Functions (JSONPath) cannot splat an object into a task's parameters, so the state machine has
one state per layout. The construct computes the layouts at synth from the registered templates'
requests (`request_layouts`); the launcher's functions pick a run's at run time (`request_layout`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llmtrain.core.errors import LlmtrainError

# The layouts of a tune's CreateHyperParameterTuningJob request
# (llmtrain.core.tuning_request.tuning_request): its
# fields are fixed, but for the warm start's. The launcher builds one state per layout.
_TUNING_FIELDS = ("HyperParameterTuningJobName", "HyperParameterTuningJobConfig", "TrainingJobDefinition")
TUNING_LAYOUTS: Mapping[str, Sequence[str]] = {
    "tune": (*_TUNING_FIELDS, "Tags"),
    "tune-warm-start": (*_TUNING_FIELDS, "WarmStartConfig", "Tags"),
}


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
