"""What the launcher and the CLI ask of the planner: a rendered run's plan, the launcher's checks
(fits, within budget) and the cost a finished job actually billed.

The launcher's Resolve refuses a run planned not to fit its GPUs (naming the change that would
make it fit) unless the execution input sets `skip_plan_check`, and a run planned to cost more than
its team's budget (`run_budget_usd` of the team's platform context: the team's `max_run_cost_usd`,
else the environment's `budgets.max_run_cost_usd`). The plan's figures travel in the run state (`plan`)
to the run's summary, where the actual cost (billable seconds x instance count x on-demand price)
stands beside the predicted one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmtrain.core.errors import LlmtrainError, where_set
from llmtrain.core.program_contract import ProgramContract
from llmtrain.core.spec import TemplateSpec
from llmtrain.planner import prices
from llmtrain.planner.plan import Plan, PlanOptions, plan_request
from llmtrain.planner.suggest import fit_advice
from llmtrain.planner.workload import PlanInputError


class PlanRefused(LlmtrainError):
    """The run is planned not to fit, or to cost more than the budget; nothing was created."""


def plan_state(plan: Plan) -> dict[str, Any]:
    """The plan's figures the run state carries to the run's summary (plain JSON)."""
    return {"fits": plan.fits, "per_gpu_bytes": plan.memory.per_gpu, "capacity_bytes": plan.memory.capacity,
            "tokens_per_second": plan.speed.tokens_per_second, "hours": plan.hours,
            "usd_per_hour": plan.usd_per_hour, "usd": plan.usd, "summary": plan.summary_line()}


def check_run(template: TemplateSpec, request: Mapping[str, Any], overrides: Mapping[str, Any], *,
              budget_usd: float | None, team: str, skip_fit_check: bool = False,
              program: ProgramContract | None = None) -> dict[str, Any]:
    """The run state's `plan` for a rendered request; PlanRefused when it must not start. A
    template that runs its own code cannot be planned: its runs start unchecked. `program`: the
    contract of the code the version runs (Catalog.program_contract), whose behaviour is planned."""
    options = PlanOptions(program=program)
    try:
        plan = plan_request(template, request, options)
    except PlanInputError as error:
        return {"unavailable": str(error)}
    if not plan.fits and not skip_fit_check:
        raise PlanRefused(
            f"the run is planned not to fit: {plan.memory.per_gpu / 1024**3:.1f} GiB per GPU of "
            f"{plan.memory.capacity / 1024**3:.1f} ({plan.instance.name}); "
            f"{fit_advice(template, overrides, options)}; or set skip_plan_check to start it anyway")
    if budget_usd is not None and plan.usd > budget_usd:
        raise PlanRefused(
            f"the run is planned to cost ${plan.usd:,.0f} ({plan.hours:.1f} h on {plan.instance_count} x "
            f"{plan.instance.name}), above team {team!r}'s budget of ${budget_usd:,.0f} per run "
            f"({where_set(props='TeamSpec.max_run_cost_usd', config=_budget_fields(team))}): "
            "lower max_steps, or see `llmtrain plan --suggest` for a cheaper configuration")
    return plan_state(plan)


def _budget_fields(team: str) -> str:
    return f"teams.{team}.max_run_cost_usd, else budgets.max_run_cost_usd"


def actual_cost(job: Mapping[str, Any], table: prices.PriceTable | None = None) -> float | None:
    """What a training job billed: billable seconds x instance count x on-demand price (managed
    spot bills fewer billable seconds at the on-demand price). None when the job reports none."""
    billable = job.get("BillableTimeInSeconds")
    resources = job.get("ResourceConfig") or {}
    if billable is None or "InstanceType" not in resources:
        return None
    try:
        price = (table or prices.load()).on_demand(resources["InstanceType"])
    except prices.PriceError:
        return None
    return billable * resources.get("InstanceCount", 1) * price / 3600


def plan_summary(template: TemplateSpec, request: Mapping[str, Any],
                 program: ProgramContract | None = None) -> str:
    """The plan's one-line summary for a rendered request, or why there is none."""
    try:
        return plan_request(template, request, PlanOptions(program=program)).summary_line()
    except LlmtrainError as error:
        return f"plan: not available: {error}"
