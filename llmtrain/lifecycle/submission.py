"""How an attempt starts: the one seam between a rendered request and the service that runs it.

Resolve and NextAttempt render an attempt's request (`llmtrain.core.render`); a `Submission` says whether
the deployed state machine can start it (`check`), turns it into what the state machine's start
step reads (`attempt_state`), reads back what that step caught when the attempt failed
(`classify`), and finds the run's earlier attempts where it started them (`attempts`,
`template_of`). There are two, one per way a deployment starts attempts:

- `TrainingJobSubmission` (here): a SageMaker CreateTrainingJob `.sync` state per request layout
  (the launcher construct builds those states from `request_layouts`).
- `llmtrain.lifecycle.queue_submission.QueueSubmission`: where the environment has queues, an AWS Batch
  service job in the team's queue (SubmitServiceJob, then the Watch function until it ends).

A tune's attempt is a third: `llmtrain.lifecycle.tuning_jobs.TuningSubmission`, a SageMaker tuning job
(CreateHyperParameterTuningJob `.sync`, one state per `TUNING_LAYOUTS` entry) whose trials are runs
of the rendered request; the lifecycle around it (resolve, retries, summaries) stays the same. The
launcher's entry point picks the deployment's one (`llmtrain.handlers.launcher.submission`), and a
tune's (`llmtrain.lifecycle.tuning_jobs.run_submission`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from llmtrain.core.failures import Failure, classify_failure
from llmtrain.core.request_layouts import request_layout

if TYPE_CHECKING:  # llmtrain.core.runs imports the renderer; the functions' settings import this module
    from llmtrain.core.runs import RunState


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


