"""A launcher run's lifecycle, as a library: the launcher's functions (`llmtrain.handlers.launcher`),
the CLI (`llmtrain.launcher_client`, `llmtrain start|status|logs|debug`) and the launcher construct
import it; none of them holds its logic.

    resolve      an execution's input -> the run's first attempt, or a refusal before any job
    submission   how an attempt starts (CreateTrainingJob .sync, one state per request layout): the
                 one seam between a rendered request and the service that runs it
    tuning       a tune's attempt: a tuning job (CreateHyperParameterTuningJob .sync), its checks
                 and plan, its trials
    retries      after a failed attempt: retry (wait, new job name, same checkpoints) or give up
    failures     what failed: capacity, quota, throttling, the job itself (one table of SageMaker's
                 wording, shared with the job-events function)
    summaries    the run's summary: the execution's output, the notification, `llmtrain status`
    jobs         a run's training jobs in SageMaker, one per attempt

The records that cross the state machine's boundary (`ExecutionInput`, `RunState`) are
`llmtrain.runs`; the functions' settings are `llmtrain.functions`. This package imports nothing
here, so `failures` stays importable without the renderer's compiled dependencies.
"""
