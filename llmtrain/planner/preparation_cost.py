"""The planner's counterpart for a cloud data preparation (`llmtrain data prepare --cloud`): its time
and cost from the input's size, before it starts, checked against the team's budget like a run's.

The rate is measured, not modelled: `prepare_data --workers 1` tokenized 6 MB of JSONL in 14.197 s on
one core (docs/benchmarks.md, "Data preparation"; bench/results/prepare-data-cpu.json, the shipped
tiny tokenizer, a shared 2-core AMD EPYC at load 5-7). An instance runs prepare_data's default
workers, one per vCPU but one, so its rate is that figure times its vCPUs less one. The estimate
covers tokenizing only: each instance first downloads the whole input, pip installs the program's
requirements and starts, and the merge job runs after; a production tokenizer (32k-128k BPE) costs
more per byte than the tiny one. The price is the instance's on-demand price per hour in the
planner's table (llmtrain/planner/prices.json, SageMaker's training prices; processing's CPU
instances are priced alike, but the table has no processing prices of its own).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmtrain.core.errors import where_set
from llmtrain.planner import prices
from llmtrain.planner.checks import PlanRefused

MEASURED_BYTES = 6_000_000
MEASURED_SECONDS = 14.197
BYTES_PER_SECOND_PER_WORKER = MEASURED_BYTES / MEASURED_SECONDS
RATE_SOURCE = (
    "prepare_data --workers 1: 6 MB in 14.2 s on one core, the tiny tokenizer "
    "(docs/benchmarks.md, bench/results/prepare-data-cpu.json)"
)
# EC2's sizes: a "large" has 2 vCPUs, an "xlarge" 4, an "Nxlarge" 4N (every x86 family of the table).
_SIZE = re.compile(r"ml\.[a-z0-9-]+\.(?:(\d*)x)?large")


@dataclass(frozen=True)
class PreparationEstimate:
    instance_type: str
    instance_count: int
    workers_per_instance: int
    input_bytes: int
    usd_per_hour: float  # all instances together

    @property
    def bytes_per_second(self) -> float:
        return BYTES_PER_SECOND_PER_WORKER * self.workers_per_instance * self.instance_count

    @property
    def hours(self) -> float:
        return self.input_bytes / self.bytes_per_second / 3600

    @property
    def usd(self) -> float:
        return self.hours * self.usd_per_hour

    def summary_line(self) -> str:
        return (
            f"estimated {self.hours:.2f} h of tokenizing on {self.instance_count} x {self.instance_type} "
            f"({self.workers_per_instance} workers each, {self.bytes_per_second / 1e6:.1f} MB/s in all), "
            f"${self.usd:,.2f} at ${self.usd_per_hour:,.2f}/h; rate: {RATE_SOURCE}; not counted: "
            "start-up, each instance's download of the input, the merge job"
        )


def vcpus(instance_type: str) -> int:
    match = _SIZE.fullmatch(instance_type)
    if match is None:
        raise prices.PriceError(
            f"{instance_type}: not an instance size the estimate knows (ml.FAMILY.Nxlarge)"
        )
    if match.group(0).endswith(".large"):
        return 2
    return 4 * int(match.group(1) or 1)


def estimate(
    input_bytes: int, instance_type: str, instance_count: int, table: prices.PriceTable | None = None
) -> PreparationEstimate:
    price = (table or prices.load()).on_demand(instance_type)
    return PreparationEstimate(
        instance_type, instance_count, max(1, vcpus(instance_type) - 1), input_bytes, price * instance_count
    )


def check_budget(plan: PreparationEstimate, budget_usd: float | None, team: str) -> None:
    """PlanRefused when the preparation is estimated to cost more than the team's budget per run."""
    if budget_usd is not None and plan.usd > budget_usd:
        where = where_set(props="TeamSpec.max_run_cost_usd", config=_fields(team))
        raise PlanRefused(
            f"the preparation is estimated to cost ${plan.usd:,.2f} ({plan.hours:.1f} h on "
            f"{plan.instance_count} x {plan.instance_type}), above team {team!r}'s budget of "
            f"${budget_usd:,.0f} per run ({where}): prepare part of the input at a time, or ask for a "
            "larger budget"
        )


def _fields(team: str) -> str:
    return f"teams.{team}.max_run_cost_usd, else budgets.max_run_cost_usd"
