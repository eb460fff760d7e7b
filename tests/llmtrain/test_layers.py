"""llmtrain's layers (docs/architecture.md, "Layers"): the import contracts hold, an import that runs
back up breaks them, modules stay a readable size and no two share a file name."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "llmtrain"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
MAX_MODULE_LINES = 600
# One module per CLI verb and one entry point per operations module share their subject's name.
NAME_SHARING_FOLDERS = ("commands", "handlers")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """lint-imports with the project's contracts over the packages found under `root` first."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO / "constructs")])}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(REPO / "pyproject.toml"), "--no-cache"],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )


def test_the_import_contracts_hold():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "imports", "broken"),
    [
        ("llmtrain/core/upward.py", "import llmtrain.commands.run", "llmtrain's layers import only downward"),
        ("llmtrain/planner/upward.py", "from llmtrain.lifecycle import resolve",
         "llmtrain's layers import only downward"),
        ("llmtrain/local/upward.py", "import llmtrain.planner.plan",
         "the local runner stands on the core only"),
        ("training_constructs/upward.py", "import llmtrain.lifecycle.retries",
         "the construct library imports llmtrain.core only"),
        ("llmtrain/core/heavy.py", "import torch", "the core imports the standard library"),
    ],
)
def test_an_import_against_the_layers_fails_the_lint(tmp_path, module, imports, broken):
    shutil.copytree(PACKAGE, tmp_path / "llmtrain", ignore=shutil.ignore_patterns("__pycache__", "_bundle"))
    shutil.copytree(REPO / "constructs" / "training_constructs", tmp_path / "training_constructs",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / module).write_text(f'"""A deliberate import against the layers."""\n\n{imports}\n')
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    assert f"{broken}" in result.stdout
    assert "BROKEN" in result.stdout
    assert module.removesuffix(".py").replace("/", ".") in result.stdout


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_bundle" not in p.parts)


def test_no_module_is_over_600_lines():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in _modules()}
    long = {name: lines for name, lines in sizes.items() if lines > MAX_MODULE_LINES}
    assert long == {}, f"split these by concern (a module over {MAX_MODULE_LINES} lines is two rooms): {long}"


def test_no_two_modules_share_a_file_name_outside_commands_and_handlers():
    names = Counter(
        p.name for p in _modules()
        if p.name != "__init__.py" and p.parent.name not in NAME_SHARING_FOLDERS
    )
    assert [name for name, count in names.items() if count > 1] == []


@pytest.mark.parametrize("argv, extra, named", [
    (["templates"], "cli", "rich"),
    (["data", "prepare", "--input", "notes.txt", "--output", "tokens"], "data", "transformers"),
    (["run", "--local", "gpt2-ddp"], "local", "sagemaker-training"),
])
def test_the_cli_without_its_extra_says_which_to_install(argv, extra, named):
    """The distribution without an extra brings only the core's dependencies; `llmtrain` then names
    the extra the asked command needs (and what it brings) instead of a traceback."""
    script = (
        "import sys\n"
        "class WithoutRich:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'rich':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name='rich')\n"
        "sys.meta_path.insert(0, WithoutRich())\n"
        "from llmtrain.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                            timeout=120)
    assert result.returncode == 2
    assert f"pip install 'llm-sagemaker-platform[{extra}]'" in result.stderr
    assert named in result.stderr
    assert "Traceback" not in result.stderr
