"""`llmtrain runs`: the latest runs, in the cloud (`--env ENV`) or on this machine (`--local`).

Cloud runs come from the team's launcher (llmtrain.client.launcher.LauncherClient.runs); local
runs from the run folders `llmtrain run --local` writes (`<workdir>/<run>/summary.json`, the
latest job's summary, shaped like DescribeTrainingJob, beside its `request.json`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llmtrain.client.launcher import LauncherClient
from llmtrain.commands._common import add_cloud_arguments, connect, print_table
from llmtrain.core.render import TAG_PREFIX
from llmtrain.local.report import SUMMARY_FILE

HEADERS = ("RUN", "STATUS", "TEMPLATE", "INSTANCES", "STARTED", "BILLABLE S")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "runs",
        help="list the latest runs (cloud, or --local)",
        description="List the latest runs of your team's launcher: status, template@version, instance type "
        "and count, when started, billable seconds. With --local, the runs in this machine's run folder.",
    )
    parser.add_argument("--local", action="store_true", help="list local runs (`llmtrain run --local`)")
    parser.add_argument(
        "--workdir", type=Path, default=Path("runs"), help="local run folders (default: ./runs)"
    )
    parser.add_argument("--limit", type=int, default=20, help="at most this many cloud runs (default 20)")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    add_cloud_arguments(parser)
    parser.set_defaults(handler=runs_command)


def runs_command(args: argparse.Namespace) -> int:
    rows = local_runs(args.workdir) if args.local else _cloud_runs(args)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print("no local runs in " + str(args.workdir) if args.local else "no runs yet")
    else:
        print_table(HEADERS, [_cells(row) for row in rows])
    return 0


def _cloud_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    cloud = connect(args)
    client = LauncherClient.for_team(
        cloud.deployed, cloud.team, session=cloud.session, identity=cloud.identity
    )
    return [listing.to_dict() for listing in client.runs(limit=args.limit)]


def local_runs(workdir: Path) -> list[dict[str, Any]]:
    """One row per run folder with a summary, the latest started first."""
    rows = []
    for summary_path in sorted(workdir.glob(f"*/{SUMMARY_FILE}")):
        try:
            summary = json.loads(summary_path.read_text())
        except (OSError, ValueError):
            continue  # a run folder being written, or not one of ours
        local = summary.get("LocalRun") or {}
        resources = summary.get("ResourceConfig") or {}
        rows.append(
            {
                "run_name": local.get("RunName") or summary_path.parent.name,
                "status": summary.get("TrainingJobStatus"),
                "template": _template_of(local.get("Request")),
                "instance_type": f"local ({local.get('CloudInstanceType')} in the cloud)",
                "instance_count": resources.get("InstanceCount"),
                "started": summary.get("CreationTime"),
                "billable_seconds": summary.get("BillableTimeInSeconds"),
                "run_folder": str(summary_path.parent),
            }
        )
    rows.extend(local_tunes(workdir))
    return sorted(rows, key=lambda row: row["started"] or "", reverse=True)


def local_tunes(workdir: Path) -> list[dict[str, Any]]:
    """One row per local tune (`llmtrain tune --local`: its results.json), with its trials."""
    rows = []
    for results_path in sorted(workdir.glob("*/results.json")):
        try:
            results, spec = json.loads(results_path.read_text()), json.loads(
                (results_path.parent / "tune.json").read_text())
        except (OSError, ValueError):
            continue
        best = results.get("best") or {}
        status = f"best {results.get('objective')}={best['objective']:g}" if best else "no result"
        rows.append({"run_name": results_path.parent.name, "status": status, "template": spec.get("template"),
                     "instance_type": None, "instance_count": None,
                     "started": _iso_mtime(results_path.parent / "tune.json"), "billable_seconds": None,
                     "run_folder": str(results_path.parent), "kind": "tune",
                     "trials": len(results["trials"])})
    return rows


def _iso_mtime(path: Path) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(path.stat().st_mtime, UTC).isoformat(timespec="seconds")


def _template_of(request_path: str | None) -> str:
    """`name@version` from the tags of the job's rendered request."""
    try:
        request = json.loads(Path(request_path).read_text()) if request_path else {}
    except (OSError, ValueError):
        return "?"
    tags = {t.get("Key"): t.get("Value") for t in request.get("Tags", [])}
    return f"{tags.get(TAG_PREFIX + 'template', '?')}@{tags.get(TAG_PREFIX + 'template-version', '?')}"


def _cells(row: Mapping[str, Any]) -> tuple[str, ...]:
    count = row.get("instance_count")
    instances = f"{count} x {row['instance_type']}" if row.get("instance_type") else "-"
    billable = row.get("billable_seconds")
    status = str(row.get("status") or "-")
    if row.get("kind") == "tune":
        status += f" (tune, {row.get('trials') or 0} trials)"
    return (
        row["run_name"],
        status,
        row.get("template") or "-",
        instances if count is not None else (row.get("instance_type") or "-"),
        (row.get("started") or "-")[:19].replace("T", " "),
        "-" if billable is None else str(billable),
    )
