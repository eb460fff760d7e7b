"""`llmtrain plan` and `llmtrain prices`: will a run fit, how fast, how long and how much.

    llmtrain plan NAME[@VERSION] [--set KEY=VALUE ...] [--json] [--model-config config.json]
                  [--vocab-size N] [--assume KEY=VALUE ...] [--suggest [--max-hours H]]
    llmtrain prices show [--json]
    llmtrain prices refresh [--region REGION]

`plan` renders nothing and calls no AWS API: it plans the run the launcher would start with these
overrides (llmtrain.planner; the model and its validation are in docs/planning.md). `prices
refresh` rewrites the shipped price table from the AWS Price List API (needs credentials allowed
pricing:GetProducts).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmtrain.commands._common import add_action, add_overrides_argument, parse_overrides, writable_folder
from llmtrain.commands.launch import check_locally
from llmtrain.core.catalog import Catalog
from llmtrain.core.errors import LlmtrainError
from llmtrain.core.program_contract import ProgramContract
from llmtrain.planner import prices
from llmtrain.planner.experts import expert_report
from llmtrain.planner.plan import GIB, Plan, PlanOptions, plan_run
from llmtrain.planner.shapes import shape_from_file
from llmtrain.planner.suggest import Suggestions, set_flags, suggest


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="predict a run's memory per GPU, speed, time and cost",
        description="Plan a run of a template version with its overrides, before it costs anything: "
        "memory per GPU (parameters, gradients, optimizer state, activations) against the GPU's, "
        "tokens per second and MFU, hours to max_steps and the cost. --suggest searches the "
        "settings the template lets a run change for the fastest and the cheapest plans that fit.",
    )
    parser.add_argument("ref", metavar="NAME[@VERSION]", help="template name, optionally @VERSION or @latest")
    add_overrides_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--model-config",
        type=Path,
        default=None,
        help="a Hugging Face config.json: plan this model instead of the preset "
        "(a run that starts from a checkpoint in its model channel)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="the tokenizer's vocabulary (default: the preset's published model's)",
    )
    parser.add_argument(
        "--assume",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a training-program hyperparameter the run does not set, for templates "
        "that run their own code (repeatable)",
    )
    parser.add_argument(
        "--suggest",
        action="store_true",
        help="search instance type and count, micro batch, activation checkpointing "
        "and compile within the template's bounds",
    )
    parser.add_argument(
        "--max-hours",
        type=_positive_hours,
        default=None,
        help="with --suggest: the cheapest plan must finish within this many hours",
    )
    parser.add_argument("--catalog", type=Path, default=None, help="catalog folder (default: templates/)")
    parser.set_defaults(handler=plan_command)

    price_parser = subparsers.add_parser(
        "prices",
        help="show or refresh the instance price table the planner uses",
        description="The planner's dated table of SageMaker training prices per instance-hour.",
    )
    actions = price_parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = add_action(actions, "show", help="print the price table")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(handler=prices_show_command)
    refresh = actions.add_parser("refresh", help="rewrite the table from the AWS Price List API")
    refresh.add_argument("--region", default=None, help="the region to price (default: the table's)")
    refresh.add_argument(
        "--out",
        type=Path,
        default=prices.PRICE_TABLE,
        help="where to write the table (default: the shipped one)",
    )
    refresh.set_defaults(handler=prices_refresh_command)


def _options(args: argparse.Namespace, program: ProgramContract | None) -> PlanOptions:
    model = shape_from_file(args.model_config) if args.model_config else None
    return PlanOptions(
        model=model, vocab_size=args.vocab_size, assume=parse_overrides(args.assume), program=program
    )


# The run name the request is checked under (a plan has none; it names nothing that is created).
PLAN_RUN_NAME = "plan"


def _positive_hours(value: str) -> float:
    try:
        hours = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of hours (e.g. 48)") from None
    if not 0 < hours < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r}: the hours a plan must finish within are more than 0 "
                                         "(e.g. 48)")
    return hours


def plan_command(args: argparse.Namespace) -> int:
    if args.max_hours is not None and not args.suggest:
        raise LlmtrainError("--max-hours bounds the plans --suggest searches: add --suggest, or leave "
                            "--max-hours out to plan the run as given")
    catalog = Catalog.load(args.catalog)
    overrides = parse_overrides(args.overrides)
    # What `render` and `start` refuse (the overrides, the request's rules: e.g. several nodes without
    # EFA) is refused here too, by the same checks, before any plan is made.
    template = check_locally(catalog, args.ref, PLAN_RUN_NAME, overrides)
    options = _options(args, catalog.program_contract(template))
    if args.suggest:
        found = suggest(template, overrides, options, max_hours=args.max_hours)
        print(json.dumps(_suggestions_dict(found), indent=2) if args.json else format_suggestions(found))
        return 0
    plan = plan_run(template, overrides, options)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0


def _gib(value: float) -> str:
    return f"{value / GIB:8.2f} GiB"


def _expert_lines(plan: Plan) -> list[str]:
    """A mixture of experts' line: active and total parameters, the experts each GPU holds and what
    their states take, the step's all-to-all."""
    report = expert_report(plan.workload, plan.layout, plan.speed)
    if report is None:
        return []
    m = plan.workload.model
    return [
        f"experts: {m.active_parameters / 1e9:.2f}B of {m.num_parameters / 1e9:.2f}B parameters active per "
        f"token; {report['num_experts']} experts, top-{report['experts_per_token']}, expert parallel "
        f"{report['expert_parallel_degree']} ({report['experts_per_gpu']} experts per GPU); expert weights, "
        f"gradients and moments {_gib(report['expert_state_bytes_per_gpu']).strip()} per GPU; all-to-all "
        f"{report['all_to_all_seconds']:.3f} s per step",
    ]


# The objective's terms (llmtrain.planner.post_training) as format_plan names them.
_OBJECTIVE_TERMS = {
    "reference_forward": "reference forward (no gradients) of every micro batch's rows",
    "generation_prefill": "sampling: the prompts' prefill forward",
    "generation_decode": "sampling: decode steps with the KV cache (weights read per token step)",
}


def _objective_memory_lines(plan: Plan) -> list[str]:
    m, load = plan.memory, plan.workload.objective
    lines = []
    if m.reference:
        lines.append(f"  reference    {_gib(m.reference)}   (objective={load.name}: a frozen copy of the "
                     "model)")
    if m.sampling:
        lines.append(f"  KV cache     {_gib(m.sampling)}   (sampling, before the step: counted against "
                     "activations + working, the larger)")
    return lines


def _objective_speed_lines(plan: Plan) -> list[str]:
    w = plan.workload
    load = w.objective
    if load.name == "next_token":
        return []
    lines = [f"  objective    {load.name}: {load.rows_per_sample} rows per sample "
             f"({w.samples_per_micro_batch} per micro batch), reference {load.reference}"]
    return lines + [f"  {_OBJECTIVE_TERMS[name]:<72} {seconds:.3f} s"
                    for name, seconds in plan.speed.objective.named().items()]


def format_plan(plan: Plan) -> str:
    m, s, w = plan.memory, plan.speed, plan.workload
    lines = [
        f"{plan.template} on {plan.instance_count} x {plan.instance.name} ({plan.layout.world_size} GPUs, "
        f"{plan.layout.describe()})",
        f"model: {w.model.num_parameters / 1e9:.2f}B parameters, {w.model.num_layers} layers, vocabulary "
        f"{w.model.vocab_size:,}; seq_len {w.seq_len}, micro batch {w.micro_batch_size}"
        f"{' rows' if w.objective.rows_per_sample > 1 else ''}, accumulation "
        f"{w.grad_accum_steps}, {w.precision}, activation checkpointing {w.activation_checkpointing}",
        *_expert_lines(plan),
        "",
        "memory per GPU",
        f"  parameters   {_gib(m.parameters)}",
        f"  gradients    {_gib(m.gradients)}",
        f"  optimizer    {_gib(m.optimizer)}",
        f"  activations  {_gib(m.activations)}",
        f"  working      {_gib(m.working)}   (transient buffers at the peak)",
        *_objective_memory_lines(plan),
        f"  overhead     {_gib(m.overhead)}   (CUDA context, NCCL, allocator)",
        f"  total        {_gib(m.per_gpu)} of {m.capacity / GIB:.2f} GiB: "
        + (
            f"fits, {m.headroom / GIB:.2f} GiB headroom"
            if m.fits
            else f"DOES NOT FIT by {-m.headroom / GIB:.2f} GiB (try --suggest)"
        ),
    ]
    if m.offloaded:
        lines.append(f"  offloaded to host memory: {m.offloaded / GIB:.2f} GiB")
    lines += [
        "",
        "speed",
        f"  step         {s.step_seconds:.3f} s (compute {s.compute_seconds:.3f}, exposed communication "
        f"{s.exposed_communication_seconds:.3f}, optimizer {s.optimizer_seconds:.3f}"
        + (f", objective {s.objective.total:.3f})" if s.objective.total else ")"),
        f"  tokens/s     {s.tokens_per_second:,.0f} ({s.tokens_per_second_per_gpu:,.0f} per GPU), "
        f"MFU {s.mfu:.1%}",
        *_objective_speed_lines(plan),
    ]
    lines += [
        f"  {t.name:<36} {t.bytes_per_gpu / GIB:8.2f} GiB/GPU per step, {t.seconds:.3f} s"
        for t in s.transfers
    ]
    lines += [
        "",
        "time and cost",
        f"  {w.max_steps:,} steps: {plan.training_seconds / 3600:.2f} h training, {plan.hours:.2f} h billed",
        f"  ${plan.usd_per_hour:,.2f}/h ({'spot, assumed savings' if plan.spot else 'on-demand'}): "
        f"${plan.usd:,.2f} ({plan.price_source})",
        "",
        plan.summary_line(),
    ]
    return "\n".join(lines)


def _suggestions_dict(found: Suggestions) -> dict:
    def entry(plan: Plan | None) -> dict | None:
        return None if plan is None else {**plan.to_dict(), "set_flags": set_flags(plan)}

    return {
        "current": entry(found.current),
        "fastest": entry(found.fastest),
        "cheapest": entry(found.cheapest),
        "max_hours": found.max_hours,
        "candidates": found.candidates,
        "fitting": found.fitting,
    }


def format_suggestions(found: Suggestions) -> str:
    lines = [
        f"searched {found.candidates} settings the template allows; {found.fitting} fit",
        "",
        "as requested:",
        f"  {found.current.summary_line()}",
    ]
    within = f" finishing within {found.max_hours:g} h" if found.max_hours is not None else ""
    for title, plan in (
        ("fastest that fits:", found.fastest),
        (f"cheapest that fits{within}:", found.cheapest),
    ):
        lines.append("")
        lines.append(title)
        if plan is None:
            lines.append("  none")
            continue
        lines.append(f"  {plan.summary_line()}")
        lines.append(f"  {set_flags(plan) or '(the run as requested)'}")
    return "\n".join(lines)


def prices_show_command(args: argparse.Namespace) -> int:
    table = prices.load()
    if args.json:
        print(json.dumps(table.to_dict(), indent=2))
        return 0
    print(
        f"{table.describe()}; spot assumed {table.spot_savings_assumed:.0%} cheaper\nsource: {table.source}"
    )
    for name, price in sorted(table.on_demand_per_hour.items()):
        print(f"  {name:20} ${price:10.3f}/h")
    return 0


def prices_refresh_command(args: argparse.Namespace) -> int:
    import boto3

    if args.out.is_dir():
        raise LlmtrainError(f"--out {args.out}: is a folder: name the price table's file")
    writable_folder(args.out.absolute().parent, f"--out {args.out}: its folder")
    client = boto3.client("pricing", region_name=prices.PRICING_API_REGION)
    table, missing = prices.refresh(
        client, prices.load(args.out if args.out.exists() else prices.PRICE_TABLE), region=args.region
    )
    prices.write(table, args.out)
    print(f"wrote {len(table.on_demand_per_hour)} prices ({table.describe()}) to {args.out}")
    if missing:
        print(f"the Price List API priced none of: {', '.join(missing)}")
    return 0
