"""`llmtrain run`: what it refuses before any job starts, with a message that says what to fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtrain.cli import main
from llmtrain.local.data import parse_data_option
from llmtrain.local.job import LocalRunError


def test_without_local_it_points_at_the_launcher(capsys):
    assert main(["run", "llama-pretrain-fsdp", "--run-name", "r1"]) == 2
    assert "llmtrain start" in capsys.readouterr().out


def test_a_channel_the_template_lacks_is_refused(tmp_path, capsys):
    code = main(["run", "--local", "llama-pretrain-fsdp", "--run-name", "r1", "--workdir", str(tmp_path),
                 "--data", f"images={tmp_path}"])
    assert code == 2
    error = capsys.readouterr().err
    assert "images" in error and "train" in error
    assert not (tmp_path / "r1" / "jobs").exists()


def test_an_override_outside_the_templates_bounds_is_refused(tmp_path, capsys):
    code = main(["run", "--local", "llama-pretrain-fsdp", "--run-name", "r1", "--workdir", str(tmp_path),
                 "--set", "micro_batch_size=0"])
    assert code == 2
    assert "micro_batch_size" in capsys.readouterr().err


def test_data_option_names_train_by_default(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert parse_data_option([str(tmp_path / "a"), f"validation={tmp_path / 'b'}"]).channels == {
        "train": (tmp_path / "a").resolve(), "validation": (tmp_path / "b").resolve()}
    with pytest.raises(LocalRunError, match="given twice"):
        parse_data_option([str(tmp_path / "a"), f"train={tmp_path / 'b'}"])
    with pytest.raises(LocalRunError, match="is not a folder"):
        parse_data_option([str(Path(tmp_path) / "missing")])


def test_a_run_already_at_max_steps_says_so_and_starts_nothing(tmp_path, capsys):
    """Its checkpoints reach max_steps: a job would only load and export them."""
    marker = tmp_path / "done" / "checkpoints" / "step_00000007" / "COMPLETE"
    marker.parent.mkdir(parents=True)
    marker.write_text("{}")
    partial = tmp_path / "done" / "checkpoints" / "step_00000009"  # never committed: not counted
    partial.mkdir()
    code = main(["run", "--local", "gpt2-ddp", "--run-name", "done", "--workdir", str(tmp_path),
                 "--set", "max_steps=7"])
    assert code == 0
    out = capsys.readouterr().out
    assert "run 'done' is already trained to step 7 (max_steps=7" in out
    assert "--set max_steps=N with N > 7 trains it further" in out
    assert not (tmp_path / "done" / "jobs").exists()
