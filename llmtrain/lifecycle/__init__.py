"""A launcher run's lifecycle, as a library: the launcher's functions (`llmtrain.handlers.launcher`,
`llmtrain.handlers.queue`) run it and the CLI (`llmtrain.client.launcher`, `llmtrain
start|status|logs|debug`) reads its records; none of them holds its logic. It stands on the core and
the planner (docs/architecture.md, "Layers").

    resolve            an execution's input -> the run's first attempt, or a refusal before any job
    submission         how an attempt starts (CreateTrainingJob .sync, one state per request layout):
                       the one seam between a rendered request and the service that runs it
    queue_submission   the same seam for queues: an AWS Batch service job, and the Watch function's work
    queue_jobs         the calls to Batch (a queued run's state, the queue's listing)
    queue_simulation   a model of the queues' fair-share policy and its week
    tuning_jobs        a tune's attempt: a tuning job (CreateHyperParameterTuningJob .sync), its checks
                       and plan, its trials
    retries            after a failed attempt: retry (wait, new job name, same checkpoints) or give up
    summaries          the run's summary: the execution's output, the notification, `llmtrain status`
    jobs               a run's training jobs in SageMaker, one per attempt

What failed (capacity, quota, throttling, the job itself) is the core's `llmtrain.core.failures`,
shared with the job-events function and the dashboard. The records that cross the state machine's
boundary (`ExecutionInput`, `RunState`) are `llmtrain.core.runs`; the functions' settings are
`llmtrain.core.function_settings`.
"""
