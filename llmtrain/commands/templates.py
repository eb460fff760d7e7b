"""`llmtrain templates`: list the catalog, show one version, and lock newly published versions.

With `--env ENV` the list is what that deployed environment offers your team (read from AWS,
llmtrain.core.deployed): the enabled templates the team may run, with the versions this llmtrain knows,
and the versions its launchers run from a team's own catalog (which the environment's record carries,
marked `own catalog`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmtrain.commands._common import add_action, connect, print_table
from llmtrain.core.catalog import DEFAULT_TEMPLATE, Catalog


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "templates",
        help="list the job-template catalog",
        description="List every template version: name, version, strategy and instance type.",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list of objects instead of a table")
    parser.add_argument("--catalog", type=Path, default=None, help="catalog folder (default: templates/)")
    parser.add_argument(
        "--env", default=None, help="list what this deployed environment offers your team (read from AWS)"
    )
    parser.add_argument("--team", default=None, help="with --env: your team (required where it has several)")
    parser.add_argument("--region", default=None, help="with --env: its AWS region (default: AWS_REGION)")
    parser.add_argument("--profile", default=None, help="with --env: the AWS profile (default: AWS_PROFILE)")
    parser.set_defaults(handler=list_templates)
    actions = parser.add_subparsers(dest="action", metavar="ACTION")

    listing = add_action(actions, "ls", help="list the catalog (as `llmtrain templates` does)")
    listing.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for option in ("--catalog", "--env", "--team", "--region", "--profile"):
        listing.add_argument(option, type=Path if option == "--catalog" else str, default=argparse.SUPPRESS,
                             help=argparse.SUPPRESS)
    listing.set_defaults(handler=list_templates)

    show = add_action(actions, "show", help="print one template version as JSON")
    show.add_argument("ref", metavar="NAME[@VERSION]")
    show.add_argument("--catalog", type=Path, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    show.set_defaults(handler=show_template)

    lock = actions.add_parser(
        "lock",
        help="record new template versions in templates/catalog.lock",
        description="Add the content hash of every version missing from the lock. Refuses to run if a "
        "published version changed: publish a new version instead.",
    )
    lock.add_argument("--check", action="store_true", help="only verify the lock; change nothing")
    lock.add_argument("--catalog", type=Path, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    lock.add_argument(
        "--code-root",
        type=Path,
        default=None,
        help="the folder the templates' code.source paths are relative to (default: the platform's files; "
        "for your own catalog, your project's folder)",
    )
    lock.set_defaults(handler=lock_templates)


def _rows(catalog: Catalog, origin: str = "platform") -> list[dict]:
    rows = []
    for spec in catalog.all():
        rows.append(
            {
                "name": spec.name,
                "version": spec.version,
                "catalog": origin,
                "latest": catalog.latest(spec.name).version == spec.version,
                "default": spec.name == DEFAULT_TEMPLATE and origin == "platform",
                "strategy": spec.distribution.strategy,
                "instance_type": spec.compute.instance_type,
                "instance_count": spec.compute.instance_count,
                "description": spec.description,
            }
        )
    return rows


def list_templates(args: argparse.Namespace) -> int:
    rows = _rows(Catalog.load(args.catalog))
    if args.env is not None:
        cloud = connect(args)
        offered = set(cloud.deployed.enabled_templates) & set(
            cloud.team.allowed_templates or cloud.deployed.enabled_templates
        )
        rows += _rows(cloud.deployed.own_catalog(), origin="own")
        rows = [row for row in rows if row["name"] in offered]
        if not args.json:
            deployed = cloud.deployed
            print(f"environment {deployed.environment} ({deployed.account}, {deployed.region}), "
                  f"team {cloud.team.name}:")
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    headers = ("NAME", "VERSION", "STRATEGY", "INSTANCE TYPE", "COUNT", "")
    table = [
        (
            r["name"],
            r["version"],
            r["strategy"],
            r["instance_type"],
            str(r["instance_count"]),
            ", ".join(tag for tag, on in (("latest", r["latest"]), ("default", r["default"]),
                                          ("own catalog", r["catalog"] == "own")) if on),
        )
        for r in rows
    ]
    print_table(headers, table)
    return 0


def show_template(args: argparse.Namespace) -> int:
    spec = Catalog.load(args.catalog).resolve(args.ref)
    print(json.dumps(spec.to_dict(), indent=2))
    return 0


def lock_templates(args: argparse.Namespace) -> int:
    catalog = Catalog.load(args.catalog, repo_root=args.code_root)
    if args.check:
        catalog.check_lock()
        print(f"{catalog.lock_path}: every template version is published and unchanged")
        return 0
    added = catalog.lock_new_versions()
    print(f"locked {', '.join(added)}" if added else "nothing to lock: every version is already published")
    return 0
