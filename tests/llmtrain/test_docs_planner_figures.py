"""Issue 36 item 20: the planner's figures quoted in docs/planning.md and docs/launcher.md are the
planner's today: each `$ llmtrain plan ...` block is that command's output, and each quoted refusal
is what the launcher's check says for the request the page names."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from llmtrain.cli import main
from llmtrain.core.catalog import Catalog
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.team_context import local_context
from llmtrain.planner.checks import PlanRefused, check_run

DOCS = Path(__file__).resolve().parents[2] / "docs"
PLAN_BLOCK = re.compile(r"^```\n\$ (llmtrain plan [^\n]+)\n(.*?)\n```$", re.M | re.S)
# The refusals docs/launcher.md quotes: the request its sentence names, the team and its budget.
REFUSALS = (
    ("gpt2-ddp", {"model_preset": "gpt2-medium", "seq_len": "1024", "micro_batch_size": "16"}, None),
    ("llama-pretrain-fsdp", {"max_steps": "1500000"}, 250_000.0),
)


def _plan_examples() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in PLAN_BLOCK.finditer((DOCS / "planning.md").read_text())]


def test_the_pages_quote_plans():
    assert len(_plan_examples()) >= 2


@pytest.mark.parametrize(("command", "shown"), _plan_examples(), ids=lambda value: value[:60])
def test_a_quoted_plan_is_the_commands_output(command, shown, capsys):
    assert main(shlex.split(command)[1:]) == 0
    assert capsys.readouterr().out.rstrip("\n") == shown, f"docs/planning.md: rerun `{command}`"


def _refusal(ref: str, overrides: dict[str, str], budget: float | None) -> str:
    catalog = Catalog.load()
    template = catalog.resolve(ref)
    program = catalog.program_contract(template)
    request = render(template, RunInput(run_name="r1", overrides=overrides, owner="local"), local_context(),
                     program)
    with pytest.raises(PlanRefused) as refused:
        check_run(template, request, overrides, budget_usd=budget, team="pretrain", program=program)
    return str(refused.value)


@pytest.mark.parametrize(("ref", "overrides", "budget"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_quoted_refusal_is_the_planners(ref, overrides, budget):
    message = _refusal(ref, overrides, budget)
    launcher = (DOCS / "launcher.md").read_text()
    assert message in launcher.splitlines(), f"docs/launcher.md quotes an old refusal; today's: {message}"
    sets = " ".join(f"--set {key}={value}" for key, value in overrides.items())
    assert sets in " ".join(launcher.split()), "docs/launcher.md must name the request it quotes"


def test_planning_quotes_the_same_fit_advice():
    advice = re.search(r"; (set [^;]+); or set skip_plan_check", _refusal(*REFUSALS[0])).group(1)
    assert f'("{advice}"' in (DOCS / "planning.md").read_text()
