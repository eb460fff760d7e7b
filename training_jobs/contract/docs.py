"""The hyperparameter tables of docs/, generated from the contract.

    python -m training_jobs.contract.docs           # rewrite them
    python -m training_jobs.contract.docs --check   # exit 1 when they are stale

Each table sits between `<!-- generated: NAME -->` and `<!-- end generated: NAME -->` in its page:
`hyperparameters` in docs/training.md (every field: type, default, what is allowed, its help) and
`contract` in docs/architecture.md (which dataclass holds which names). tests/training/test_config.py
fails when a page's tables differ from what this module writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from .hyperparameters import GROUPS, hyperparameter_fields

# docs/training.md's sections: a title, then the contract's groups it shows.
SECTIONS = (
    ("Model and data", ("model", "data", "run")),
    ("Optimizer and schedule", ("optim",)),
    ("Parallelism and memory", ("parallel",)),
    ("Mixture of experts", ("moe",)),
    ("LoRA", ("lora",)),
    ("Checkpoints, logging and evaluation", ("checkpoint", "logging")),
    ("Rules", ("rules",)),
    ("Objective: preference tuning and reinforcement learning", ("objective",)),
)
COMMAND = "python -m training_jobs.contract.docs"
DOCS = Path(__file__).resolve().parents[2] / "docs"


def _type_name(hint: Any) -> str:
    return "str" if get_origin(hint) is Literal else hint.__name__


def _default(field: dataclasses.Field) -> str:
    value = field.default_factory() if field.default is dataclasses.MISSING else field.default
    return f"`{json.dumps(value)}`"


def _allowed(field: dataclasses.Field, hint: Any) -> str:
    if get_origin(hint) is Literal:
        return ", ".join(f"`{choice}`" for choice in get_args(hint))
    meta = field.metadata
    low, high = meta.get("minimum"), meta.get("maximum")
    bounds = []
    if low is not None:
        bounds.append(f"> {low}" if meta.get("exclusive_minimum") else f">= {low}")
    if high is not None:
        bounds.append(f"< {high}" if meta.get("exclusive_maximum") else f"<= {high}")
    return ", ".join(bounds)


def hyperparameter_tables() -> str:
    """One table per section of docs/training.md: name, type, default, allowed values, meaning."""
    fields = hyperparameter_fields()
    shown = {group for _, groups in SECTIONS for group in groups}
    if shown != set(GROUPS):
        missing = sorted(set(GROUPS) ^ shown)
        raise ValueError(f"docs.SECTIONS must show every group of the contract once: {missing}")
    parts = []
    for title, groups in SECTIONS:
        rows = [f"### {title}", "", "| name | type | default | allowed | meaning |",
                "| --- | --- | --- | --- | --- |"]
        for name, (group, field, hint) in fields.items():
            if group in groups:
                meaning = field.metadata["help"].replace("|", "\\|")
                rows.append(f"| `{name}` | {_type_name(hint)} | {_default(field)} | {_allowed(field, hint)} "
                            f"| {meaning} |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts)


def contract_table() -> str:
    """docs/architecture.md's summary: each dataclass of the contract and the names it holds."""
    fields = hyperparameter_fields()
    rows = ["| group (dataclass) | hyperparameters |", "| --- | --- |"]
    for group, cls in GROUPS.items():
        names = ", ".join(f"`{name}`" for name, (owner, _, _) in fields.items() if owner == group)
        rows.append(f"| `{group}` (`{cls.__name__}`) | {names} |")
    return "\n".join(rows)


GENERATED = {"training.md": ("hyperparameters", hyperparameter_tables),
             "architecture.md": ("contract", contract_table)}


def with_generated(text: str, name: str, content: str) -> str:
    """`text` with the block between the markers of `name` replaced by `content`."""
    begin, end = f"<!-- generated: {name} -->", f"<!-- end generated: {name} -->"
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"a page needs exactly one {begin} and one {end} where its table goes")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    notice = f"<!-- Generated from training_jobs/contract by `{COMMAND}`: edit the contract, not this. -->"
    return f"{head}{begin}\n{notice}\n\n{content}\n\n{end}{tail}"


def stale_pages(docs: Path = DOCS, *, write: bool = False) -> list[str]:
    """The pages whose generated tables differ from the contract's (rewritten when `write`)."""
    stale = []
    for page, (name, make) in GENERATED.items():
        path = docs / page
        text = path.read_text()
        updated = with_generated(text, name, make())
        if updated != text:
            stale.append(page)
            if write:
                path.write_text(updated)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a page is stale; write nothing")
    parser.add_argument("--docs", type=Path, default=DOCS, help="the docs folder (default: the repository's)")
    args = parser.parse_args(argv)
    try:
        stale = stale_pages(args.docs, write=not args.check)
    except (OSError, ValueError) as error:
        print(f"{COMMAND}: {error}", file=sys.stderr)
        return 2
    if args.check and stale:
        print(f"stale: {', '.join(stale)}: run `{COMMAND}`", file=sys.stderr)
        return 1
    print(f"rewrote {', '.join(stale)}" if stale else "the generated tables are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
