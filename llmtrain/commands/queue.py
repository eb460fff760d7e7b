"""`llmtrain queue`: who waits for what in an environment's queues, and who runs.

    llmtrain queue [--env ENV] [--team T] [--json]

For each of the environment's AWS Batch queues (the deployed environment's record names them in
each team's platform context, llmtrain.core.queue_context): the instances it runs and each team's share
of them, then every queued and running run: its queue, team, run name, status, instances, how long
it has waited (queued) or run (running), and its place in the queue (1 = next). `--team` lists that
team's runs only. Runs of every team are listed: the queue is shared, and so is its order.
"""

from __future__ import annotations

import argparse
import json

from llmtrain.client.aws import explained
from llmtrain.commands._common import add_cloud_arguments, connect_environment, print_table
from llmtrain.core.deployed import DeployedEnvironment
from llmtrain.core.errors import LlmtrainError
from llmtrain.lifecycle.queue_jobs import QueueEntry, duration, queue_listing

HEADERS = ("QUEUE", "TEAM", "RUN", "STATUS", "INSTANCES", "WAITING/RUNNING", "POSITION")


class NoQueues(LlmtrainError):
    """The environment runs its jobs without queues."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "queue",
        help="list the queued and running runs of the environment's queues",
        description="List the runs in the environment's AWS Batch queues: team, run, status, instances, "
        "time waiting (queued) or running, and place in the queue; with each queue's instances per team.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    add_cloud_arguments(parser)
    parser.set_defaults(handler=queue_command)


def queue_command(args: argparse.Namespace) -> int:
    session, _identity, deployed = connect_environment(args)
    queues, capacity = environment_queues(deployed)
    share = None
    if args.team is not None:
        team = deployed.team(args.team)
        share = team.platform.queues.share_identifier if team.platform.queues else team.name
    prefixes = {
        team.platform.queues.share_identifier: team.job_name_prefix
        for team in deployed.teams.values()
        if team.platform.queues is not None
    }
    batch = session.client("batch", region_name=deployed.region)
    with explained(f"listing the queues of environment {deployed.environment!r}"):
        entries, usage = queue_listing(batch, queues, prefixes, share=share)
    if args.json:
        print(json.dumps({"capacity": capacity, "usage": usage, "runs": [e.to_dict() for e in entries]},
                         indent=2))
        return 0
    for name, used in usage.items():
        shares = ", ".join(f"{team} {count:g}" for team, count in sorted(used["shares"].items())) or "none"
        print(f"queue {name}: {used['total']:g} instance(s) running (of the environment's {capacity}; "
              f"by team: {shares})")
    print()
    if not entries:
        print("no queued or running runs" + (f" of team {args.team}" if args.team else ""))
    else:
        print_table(HEADERS, [_cells(entry) for entry in entries])
    return 0


def environment_queues(deployed: DeployedEnvironment) -> tuple[dict[str, str], int]:
    """Every queue the environment's teams use (name -> ARN), and the environment's capacity."""
    queues: dict[str, str] = {}
    capacity = 0
    for team in deployed.teams.values():
        if team.platform.queues is not None:
            queues.update(team.platform.queues.queue_arns)
            capacity = team.platform.queues.max_instances
    if not queues:
        raise NoQueues(
            f"environment {deployed.environment!r} has no queues: its runs create their training jobs "
            "directly (`queues:` in its config/<env>.yaml turns them on; docs/infrastructure.md, \"Queues\")"
        )
    return queues, capacity


def _cells(entry: QueueEntry) -> tuple[str, ...]:
    return (
        entry.queue,
        entry.team,
        entry.run,
        entry.status,
        "-" if entry.instances is None else f"{entry.instances:g}",
        duration(entry.seconds),
        "-" if entry.position is None else str(entry.position),
    )

