"""How an attempt starts: the one seam between a rendered request and the service that runs it.

Resolve and NextAttempt render an attempt's request (`llmtrain.render`); a `Submission` says whether
the deployed state machine can start it (`check`), turns it into what the state machine's start
step reads (`attempt_state`), reads back what that step caught when the attempt failed
(`classify`), and finds the run's earlier attempts where it started them (`attempts`,
`template_of`). There are two, one per way a deployment starts attempts:

- `TrainingJobSubmission` (here): a SageMaker CreateTrainingJob `.sync` state per request layout
  (the launcher construct builds those states from `request_layouts`).
- `llmtrain.queues.submission.QueueSubmission`: where the environment has queues, an AWS Batch
  service job in the team's queue (SubmitServiceJob, then the Watch function until it ends).

A tune's attempt is a third: `llmtrain.lifecycle.tuning.TuningSubmission`, a SageMaker tuning job
(CreateHyperParameterTuningJob `.sync`, one state per `TUNING_LAYOUTS` entry) whose trials are runs
of the rendered request; the lifecycle around it (resolve, retries, summaries) stays the same. The
launcher's entry point picks the deployment's one (`llmtrain.handlers.launcher.submission`), and a
tune's (`llmtrain.lifecycle.tuning.run_submission`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from llmtrain.errors import LlmtrainError
from llmtrain.lifecycle.failures import Failure, classify_failure

if TYPE_CHECKING:  # llmtrain.runs imports the renderer; the functions' settings import this module
    from llmtrain.runs import RunState


class Submission(Protocol):
    """How the launcher's state machine starts an attempt's rendered request."""

    def check(self, request: Mapping[str, Any]) -> None:
        """LlmtrainError (saying what to change) when the deployed state machine cannot start this
        request; Resolve checks every fallback type's request with it too."""
        ...

    def attempt_state(self, request: Mapping[str, Any], run: RunState) -> dict[str, Any]:
        """What the start step reads besides the run (`{"request", "layout"}` for a training job);
        LlmtrainError when the deployed state machine cannot start this request."""
        ...

    def classify(self, caught: Mapping[str, Any], request: Mapping[str, Any]) -> Failure:
        """The failure of an attempt from what the start step caught (`{"Error", "Cause"}`)."""
        ...

    def attempts(self, run_name: str, jobs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The run's attempts so far, oldest first (`{"attempt", "job_name", "job_arn", "status"}`,
        status in SageMaker's words), from the training jobs SageMaker lists under the run's job
        names (`llmtrain.lifecycle.jobs.run_jobs`) and what else this way of starting knows."""
        ...

    def template_of(self, attempts: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
        """The template and version the run's latest attempt ran, where this way of starting records
        them; None leaves it to the tags of the attempt's training job."""
        ...

    def started_job(self, request: Mapping[str, Any]) -> tuple[str, str | None]:
        """The name of the job the start step creates from `request` (what `attempt_state` returned
        as the request) and the instance type it runs on: the run's attempt history records them."""
        ...


@dataclass(frozen=True)
class TrainingJobSubmission:
    """CreateTrainingJob `.sync`, waiting for the job's end; one state per request layout."""

    layouts: Mapping[str, Sequence[str]]

    def check(self, request: Mapping[str, Any]) -> None:
        request_layout(request, self.layouts)

    def attempt_state(self, request: Mapping[str, Any], run: RunState) -> dict[str, Any]:
        return {"request": dict(request), "layout": request_layout(request, self.layouts)}

    def classify(self, caught: Mapping[str, Any], request: Mapping[str, Any]) -> Failure:
        in_plan = "TrainingPlanArn" in (request.get("ResourceConfig") or {})
        return classify_failure(caught, in_training_plan=in_plan)

    def attempts(self, run_name: str, jobs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        return [dict(job) for job in jobs]

    def template_of(self, attempts: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
        return None

    def started_job(self, request: Mapping[str, Any]) -> tuple[str, str | None]:
        return training_job_of(request)


def training_job_of(request: Mapping[str, Any]) -> tuple[str, str | None]:
    """A CreateTrainingJob request's job name and instance type."""
    return request.get("TrainingJobName", ""), (request.get("ResourceConfig") or {}).get("InstanceType")


# The layouts of a tune's CreateHyperParameterTuningJob request (llmtrain.tuning.tuning_request): its
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
