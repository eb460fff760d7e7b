"""`pip install` outside the repository: the wheel, in a new virtual environment, from an empty folder.

The wheel is built from a copy of the sources and installed into a new virtual environment outside
the checkout, offline (tests/support/wheel_install.py: the environment sees exactly the distributions
the wheel declares, linked from this project's environment, plus what a local run needs on top: torch,
which a user installs first, and the training program's `requirements.txt`). A command importing a
package the wheel does not declare fails. Everything else is the installed wheel: llmtrain from the new
site-packages, the catalog, the training program and the example data from its package data.
"""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

import pytest
from wheel_install import LLMTRAIN_SOURCES, build_wheel, install

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# What the user installs besides the wheel for `run --local` (README, "Install the CLI").
LOCAL_RUN_EXTRAS = ("torch", *(ROOT / "training_jobs" / "requirements.txt").read_text().splitlines())


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, str]:
    """A new virtual environment with the wheel installed; returns the environment to run it in."""
    place = tmp_path_factory.mktemp("wheel-install")
    wheel = build_wheel(ROOT, LLMTRAIN_SOURCES, place, extras=("local",))
    env = install(place, [wheel], also=LOCAL_RUN_EXTRAS)
    env.update({"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""})
    return env


def _llmtrain(env, cwd: Path, *argv: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["llmtrain", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_installed_cli_works_from_an_empty_folder(installed, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    where = subprocess.run(
        [
            "python",
            "-c",
            "import importlib.util, llmtrain, llmtrain.sourcedir as s, training_jobs.contract as c; "
            "print(llmtrain.__file__); print(s.repository_root()); print(c.__file__); "
            "print(importlib.util.find_spec('training_jobs.trainer'))",
        ],
        cwd=work,
        env=installed,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert not where[0].startswith(str(ROOT)) and "site-packages" in where[0]
    assert where[1].endswith("site-packages/llmtrain/_bundle")
    # The training contract is a package of the wheel; the program itself is only in the bundle.
    assert where[2].endswith("site-packages/training_jobs/contract/__init__.py") and where[3] == "None"

    version = _llmtrain(installed, work, "--version")
    assert (
        version.returncode == 0
        and version.stdout.strip() == f"llmtrain {PROJECT['version']}"  # the wheel's, from pyproject.toml
    )

    listing = _llmtrain(installed, work, "templates")
    assert listing.returncode == 0, listing.stderr
    assert "llama-pretrain-fsdp" in listing.stdout and "byo-script" in listing.stdout

    rendered = _llmtrain(installed, work, "render", "llama-pretrain-fsdp", "--run-name", "r1")
    assert rendered.returncode == 0, rendered.stderr
    assert '"TrainingJobName": "llmtrain-dev-default-r1-a1"' in rendered.stdout
    assert "dry run" in rendered.stderr and "stand-in environment" in rendered.stderr
    # The planner's line: its price table ships in the wheel.
    assert "plan: fits" in rendered.stderr and "not available" not in rendered.stderr
    planned = _llmtrain(installed, work, "plan", "gpt2-ddp", "--json")
    assert planned.returncode == 0 and json.loads(planned.stdout)["fits"] is True, planned.stderr

    (work / "notes.txt").write_text((ROOT / "README.md").read_text() * 4)
    prepared = _llmtrain(
        installed, work, "data", "prepare", "--input", "notes.txt", "--output", "tokens", "--workers", "1"
    )
    assert prepared.returncode == 0, prepared.stderr
    assert (work / "tokens" / "manifest.json").is_file() and "tokenizing" in prepared.stderr
    assert "next: llmtrain data upload tokens --name NAME" in prepared.stdout

    run = _llmtrain(
        installed,
        work,
        "run",
        "--local",
        "llama-pretrain-fsdp",
        "--run-name",
        "r1",
        "--set",
        "instance_count=1",
        "--set",
        "max_steps=2",
        "--data",
        "tokens",
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (work / "runs" / "r1" / "summary.json").is_file()
    assert (work / "runs" / "r1" / "mlflow.db").is_file()  # the local MLflow store, with the [local] extra
    runs = _llmtrain(installed, work, "runs", "--local")
    assert runs.returncode == 0 and "r1" in runs.stdout and "Completed" in runs.stdout
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt", "runs", "tokens"]
