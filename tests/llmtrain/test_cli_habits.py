"""Issue 36, items 9, 10 and 11: plan refuses what render refuses, "did you mean" for a misspelled
--set key in every command, the verbs people type by habit (ls/list, show/describe) in every
command group, one repeated --set key refused in every command that takes --set, an empty version
after '@' refused, and `plan --max-hours` only positive and only with --suggest."""

from __future__ import annotations

import json

import pytest

from llmtrain.cli import main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_templates_ls_and_list_list_the_catalog_as_the_bare_group_does(capsys):
    code, bare, _ = _run(capsys, "templates", "--json")
    assert code == 0
    for verb in ("ls", "list"):
        code, out, err = _run(capsys, "templates", verb, "--json")
        assert code == 0, err
        assert json.loads(out) == json.loads(bare)
    code, out, _ = _run(capsys, "templates", "describe", "gpt2-ddp@1.0.0")
    assert code == 0 and json.loads(out)["version"] == "1.0.0"


@pytest.mark.parametrize("group", [("models",), ("data",)])
def test_every_group_with_ls_takes_list(capsys, group):
    code, out, _ = _run(capsys, *group, "list", "--help")
    assert code == 0 and f"usage: llmtrain {group[0]} ls" in out


def test_prices_show_takes_describe(capsys):
    code, out, _ = _run(capsys, "prices", "describe")
    assert code == 0 and "$" in out


@pytest.mark.parametrize("command", [["plan", "gpt2-ddp"], ["render", "gpt2-ddp", "--run-name", "r1"],
                                     ["run", "--local", "gpt2-ddp", "--run-name", "r1"],
                                     ["tune", "--local", "gpt2-ddp", "--run-name", "r1"],
                                     ["start", "gpt2-ddp", "--run-name", "r1"]])
def test_a_setting_given_twice_is_refused_naming_it(capsys, command):
    code, _, err = _run(capsys, *command, "--set", "max_steps=1", "--set", " max_steps=2")
    assert code == 2
    assert "'max_steps' is set twice ('max_steps=1' and ' max_steps=2'): give each setting once" in err


def test_an_empty_version_after_the_at_sign_is_refused(capsys):
    code, _, err = _run(capsys, "plan", "gpt2-ddp@")
    assert code == 2
    assert "'gpt2-ddp@' has an empty version after '@': write gpt2-ddp@VERSION" in err


@pytest.mark.parametrize("hours", ["-1", "0", "nan"])
def test_plan_max_hours_must_be_positive(capsys, hours):
    code, _, err = _run(capsys, "plan", "gpt2-ddp", "--suggest", "--max-hours", hours)
    assert code == 2 and "argument --max-hours" in err


def test_plan_max_hours_without_suggest_is_refused(capsys):
    code, out, err = _run(capsys, "plan", "gpt2-ddp", "--max-hours", "5")
    assert code == 2 and not out
    assert "--max-hours bounds the plans --suggest searches: add --suggest" in err


def test_plan_refuses_what_render_refuses(capsys):
    efa = "instance_count 2 on ml.g5.12xlarge: more than one node needs an EFA-capable instance type"
    code, out, err = _run(capsys, "plan", "gpt2-ddp", "--set", "instance_count=2")
    assert code == 2 and "fits" not in out and efa in err
    code, _, err = _run(capsys, "render", "gpt2-ddp", "--run-name", "r1", "--set", "instance_count=2")
    assert code == 2 and efa in err
    code, out, _ = _run(capsys, "plan", "gpt2-ddp", "--set", "instance_count=1")
    assert code == 0 and "\nplan: fits" in out


@pytest.mark.parametrize("command", [["plan", "gpt2-ddp"], ["render", "gpt2-ddp", "--run-name", "r1"],
                                     ["start", "gpt2-ddp", "--run-name", "r1"],
                                     ["tune", "gpt2-ddp", "--run-name", "r1", "--param", "lr=1e-4..1e-3"]])
def test_a_misspelled_setting_gets_did_you_mean_in_every_command(capsys, command):
    code, _, err = _run(capsys, *command, "--set", "max_stpes=3")
    assert code == 2
    assert "override 'max_stpes': gpt2-ddp@1.3.0 does not allow overriding it (did you mean " \
        "'max_steps'?)" in err
