"""`llmtrain models ls [--template NAME] [--env ENV] [--json]`: the base models a run can start from.

A fine-tuning template (one with a `model` channel) starts from `base_model=<JumpStart model id>`
(llmtrain.core.jumpstart) or from a Hugging Face folder in the team's datasets prefix. This lists
JumpStart's text-generation models that can be trained, in the environment's region, with their
latest version and whether their EULA must be accepted (`accept_eula=true`).
"""

from __future__ import annotations

import argparse
import json
import sys

from llmtrain.commands._common import add_action, add_cloud_arguments, connect, print_table
from llmtrain.core.catalog import Catalog
from llmtrain.core.errors import LlmtrainError
from llmtrain.core.jumpstart import JumpStartCatalog


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "models",
        help="base models a fine-tuning template can start from",
        description=__doc__.split("\n\n")[1],
    )
    actions = parser.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    ls = add_action(actions, "ls", help="list JumpStart's trainable text-generation models in the region")
    ls.add_argument(
        "--template",
        default=None,
        metavar="NAME[@VERSION]",
        help="only if this template can start from a base model (it has a model channel)",
    )
    ls.add_argument("--json", action="store_true", help="print JSON")
    add_cloud_arguments(ls, team=False)
    ls.set_defaults(handler=list_command)


def list_command(args: argparse.Namespace) -> int:
    catalog = Catalog.load()
    starters = sorted(
        {
            t.name
            for t in (catalog.get(n, v) for n in catalog.names() for v in catalog.versions(n))
            if "model" in t.inputs.channels
        }
    )
    if args.template:
        template = catalog.resolve(args.template)
        if "model" not in template.inputs.channels:
            raise LlmtrainError(
                f"{template.ref} trains from scratch: it has no model channel; templates that "
                f"start from a base model: {', '.join(starters)}"
            )
    cloud = connect(args)
    region = cloud.deployed.region
    models = JumpStartCatalog(cloud.session.client("s3", region_name=region), region).text_generation_models()
    if args.json:
        print(json.dumps([vars(m) for m in models], indent=2))
        return 0
    print_table(
        ["base_model", "version", "EULA (accept_eula=true)", "weights"],
        [[m.model_id, m.version, m.eula_url or "-", m.uri] for m in models],
    )
    print(
        f"\nstart from one with --set base_model=<model id>[@version] on {', '.join(starters)}",
        file=sys.stderr,
    )
    return 0
