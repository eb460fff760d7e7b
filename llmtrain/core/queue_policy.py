"""The rules of an environment's queues that config, constructs, launcher and CLI share.

Names: the platform names an environment's Batch resources after it (`llmtrain-<env>`,
`llmtrain-<env>-<queue>`, `llmtrain-<env>-fair-share`), so every side knows their ARNs without a
deployment, as it does for the state machines.

Fair share: each team is one share identifier (its name) of the environment's fair-share
scheduling policy. A team's `share_weight` says how much of the queue it gets relative to the other
teams: under contention, team i's long-run share of instance-hours is w_i / sum(w). AWS Batch's
`weightFactor` works the other way round (a LOWER factor gets MORE: 0.125 gets 8 times what 1.0
gets), so `weight_factors` maps weight w_i to factor max(w) / w_i: the heaviest team gets 1.0, a
team with a third of its weight gets 3.0. Shares are inversely proportional to the factors, so
the ratios are exact (up to Batch's four decimals).

Limits are AWS's (botocore's documentation of the shapes and the CloudFormation schemas).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# SubmitServiceJob.schedulingPriority: 0..9999 (higher runs first within a share).
MAX_SCHEDULING_PRIORITY = 9999
# CreateJobQueue.priority: 0..1000 (a queue of higher priority is served first by the service environment).
MAX_QUEUE_PRIORITY = 1000
# FairsharePolicy.shareDecaySeconds: 0 (Batch's minimum window, 600 s) .. 604800 (one week).
MAX_SHARE_DECAY_SECONDS = 604800
# FairsharePolicy.computeReservation: 0..99 percent.
MAX_COMPUTE_RESERVATION = 99
# JobStateTimeLimitAction.maxTimeSeconds: 600..86400.
MIN_TIME_LIMIT_SECONDS = 600
MAX_TIME_LIMIT_SECONDS = 86400
# Our share weights: whole numbers, so that max/min stays within weightFactor's 0.0001..999.9999.
MIN_SHARE_WEIGHT = 1
MAX_SHARE_WEIGHT = 999

SERVICE_JOB_TYPE = "SAGEMAKER_TRAINING"
CAPACITY_UNIT = "NUM_INSTANCES"
# The only action a SAGEMAKER_TRAINING queue allows on a job stuck at its head (CANCEL is for ECS/EKS).
TIME_LIMIT_ACTION = "TERMINATE"
TIME_LIMIT_STATE = "RUNNABLE"
# Batch's reasons for a job stuck at the head of its queue: no instances for it (SageMaker had
# no capacity, the time in SCHEDULED accumulating), or a job larger than the service environment.
CAPACITY_REASON = "CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY"
MISCONFIGURATION_REASON = "MISCONFIGURATION:SERVICE_ENVIRONMENT_MAX_RESOURCE"
# What Batch writes in statusReason after a time limit terminated a job: "<prefix><reason>".
TIME_LIMIT_TERMINATION = "Terminated by JobStateTimeLimit action due to reason: "

QUEUE_NAME_PATTERN = re.compile(r"[a-z][a-z0-9]{0,15}")
RESOURCE_PREFIX = "llmtrain"


def service_environment_name(environment: str) -> str:
    return f"{RESOURCE_PREFIX}-{environment}"


def job_queue_name(environment: str, queue: str) -> str:
    return f"{RESOURCE_PREFIX}-{environment}-{queue}"


def scheduling_policy_name(environment: str) -> str:
    return f"{RESOURCE_PREFIX}-{environment}-fair-share"


def job_queue_arn(region: str, account: str, environment: str, queue: str, partition: str = "aws") -> str:
    return f"arn:{partition}:batch:{region}:{account}:job-queue/{job_queue_name(environment, queue)}"


def share_identifier(team: str) -> str:
    """A team's share identifier in the fair-share policy: its name (letters and digits, as Batch
    requires, and no prefix of another team's: team names have no wildcard)."""
    return team


def weight_factors(weights: Mapping[str, int]) -> dict[str, float]:
    """Batch's weightFactor per share from our share weights (more weight, lower factor)."""
    if not weights:
        return {}
    heaviest = max(weights.values())
    return {share: round(heaviest / weight, 4) for share, weight in weights.items()}


def expected_shares(weights: Mapping[str, int]) -> dict[str, float]:
    """Each share's fraction of the capacity when every share has work waiting: w_i / sum(w)."""
    total = sum(weights.values())
    return {share: weight / total for share, weight in weights.items()}


def share_weight_problem(value: object) -> str | None:
    whole = isinstance(value, int) and not isinstance(value, bool)
    if not whole or not MIN_SHARE_WEIGHT <= value <= MAX_SHARE_WEIGHT:
        return (f"must be a whole number from {MIN_SHARE_WEIGHT} to {MAX_SHARE_WEIGHT} (the team's share of "
                f"the queues relative to the other teams' weights), got {value!r}")
    return None


def priority_problem(value: object, most: int = MAX_SCHEDULING_PRIORITY) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        return f"must be a whole number from 0 to {most}, got {value!r}"
    return None


__all__ = [
    "CAPACITY_REASON",
    "CAPACITY_UNIT",
    "MAX_COMPUTE_RESERVATION",
    "MAX_QUEUE_PRIORITY",
    "MAX_SCHEDULING_PRIORITY",
    "MAX_SHARE_DECAY_SECONDS",
    "MAX_SHARE_WEIGHT",
    "MAX_TIME_LIMIT_SECONDS",
    "MIN_SHARE_WEIGHT",
    "MIN_TIME_LIMIT_SECONDS",
    "MISCONFIGURATION_REASON",
    "QUEUE_NAME_PATTERN",
    "SERVICE_JOB_TYPE",
    "TIME_LIMIT_ACTION",
    "TIME_LIMIT_STATE",
    "TIME_LIMIT_TERMINATION",
    "expected_shares",
    "job_queue_arn",
    "job_queue_name",
    "priority_problem",
    "scheduling_policy_name",
    "service_environment_name",
    "share_identifier",
    "share_weight_problem",
    "weight_factors",
]
