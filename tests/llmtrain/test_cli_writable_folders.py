"""Issue 36 item 1: a --workdir or --output the engineer cannot use is refused before any work, with a
one-line error naming the path (exit status 2), never a traceback."""

from __future__ import annotations

import pytest

from llmtrain.cli import main

UNUSABLE = {
    "a folder that cannot be created": "/proc/llm/runs",
    "a file": "notes.txt",
}


def _commands(path: str, tmp_path) -> dict[str, list[str]]:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to tokenize\n" * 10)
    return {
        "run --local": ["run", "--local", "gpt2-ddp", "--run-name", "r1", "--workdir", path],
        "tune --local": ["tune", "--local", "gpt2-ddp", "--run-name", "t1", "--param", "lr=1e-4..1e-3:log",
                         "--workdir", path],
        "data prepare": ["data", "prepare", "--input", str(corpus), "--output", f"{path}/tok"],
    }


@pytest.mark.parametrize("command", ["run --local", "tune --local", "data prepare"])
@pytest.mark.parametrize("kind", sorted(UNUSABLE))
def test_an_unusable_folder_is_refused_first_by_name(command, kind, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("my notes\n")
    path = UNUSABLE[kind]
    assert main(_commands(path, tmp_path)[command]) == 2
    captured = capfd.readouterr()
    error = captured.err.strip().splitlines()
    assert len(error) == 1, captured.err  # one line, no traceback
    assert path.split("/tok")[0] in error[0] or path in error[0]
    assert "cannot write there" in error[0] or "is a file" in error[0]
    assert "Traceback" not in captured.err + captured.out
    assert not (tmp_path / ".tok.partial").exists()
    assert (tmp_path / "notes.txt").read_text() == "my notes\n"


def test_prices_refresh_refuses_an_unwritable_out_before_asking_aws(capsys):
    assert main(["prices", "refresh", "--out", "/proc/x/prices.json"]) == 2
    error = capsys.readouterr().err
    assert "--out /proc/x/prices.json: its folder /proc/x: cannot write there" in error


def test_a_usable_workdir_is_created(tmp_path):
    from llmtrain.commands._common import writable_folder

    assert writable_folder(tmp_path / "a" / "b", "--workdir").is_dir()
