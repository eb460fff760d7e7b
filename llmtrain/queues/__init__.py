"""Queues: every run of an environment through an AWS Batch queue of SageMaker training jobs.

`policy` holds the rules both sides share (names, limits, the fair-share weights), `context` the
team's view of its queues that its launcher and the CLI receive, `jobs` the calls to Batch (the
submission, a queued run's state, the queue's listing), and `simulate` a model of the fair-share
policy. docs/infrastructure.md ("Queues") and docs/launcher.md ("Queued runs") describe them.
"""
