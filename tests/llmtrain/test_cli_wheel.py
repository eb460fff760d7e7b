"""`pip install` outside the repository: the wheel, in a new virtual environment, from an empty folder.

The wheel is built (`pip wheel --no-build-isolation`) from a copy of the sources, and installed
into a new virtual environment outside the checkout by that environment's own pip, offline
(`--no-index`). So that nothing is downloaded (torch alone is gigabytes), the new environment sees
exactly the distributions the wheel declares, followed through their own requirements, plus what
a local run needs on top (torch, which a user installs first, and the training program's
`requirements.txt`): their files are linked from this project's environment into one folder that
a `.pth` file of the new environment adds to its path, and their console scripts (`torchrun`) are
written into its `bin/`. pip resolves the wheel's requirements against them (an undeclared or
missing one fails the install), and a command importing a package the wheel does not declare
fails. Everything else is the installed wheel: llmtrain from the new site-packages, the catalog,
the training program and the example data from its package data.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "llmtrain", "templates", "training_jobs", "examples")
# What the user installs besides the wheel for `run --local` (README, "Install the CLI").
LOCAL_RUN_EXTRAS = ("torch", *(ROOT / "training_jobs" / "requirements.txt").read_text().splitlines())
# The installer: the new environment is made without one of its own (ensurepip's setuptools is too
# old for torch's requirements), so this project's pip installs the wheel.
INSTALLER = "pip"


def _build_wheel(destination: Path) -> Path:
    source = destination / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(destination / "dist"),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (destination / "dist").glob("*.whl")
    return wheel


def _declared(wheel: Path, extras: tuple[str, ...]) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(name).decode()
    raw = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]
    return [r for r in map(Requirement, raw) if _applies(r, extras)]


def _applies(requirement: Requirement, extras) -> bool:
    return requirement.marker is None or any(requirement.marker.evaluate({"extra": e}) for e in ("", *extras))


def _closure(requirements: list[Requirement]) -> dict[str, metadata.Distribution]:
    """The installed distributions these requirements need, followed through their requirements."""
    found: dict[str, metadata.Distribution] = {}
    pending = list(requirements)
    while pending:
        requirement = pending.pop()
        key = requirement.name.lower().replace("_", "-")
        if key in found:
            continue
        distribution = metadata.distribution(requirement.name)  # not installed here: the test cannot run
        assert requirement.specifier.contains(distribution.version, prereleases=True), (
            requirement,
            distribution,
        )
        found[key] = distribution
        pending += [
            r for r in map(Requirement, distribution.requires or []) if _applies(r, requirement.extras)
        ]
    return found


def _link_distributions(distributions, folder: Path, bin_dir: Path, python: Path) -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    folder.mkdir()
    for distribution in distributions.values():
        tops = {Path(str(f)).parts[0] for f in distribution.files or [] if not str(f).startswith("..")}
        for top in tops:
            if (site / top).exists() and not (folder / top).exists():
                (folder / top).symlink_to(site / top)
        for script in distribution.entry_points.select(group="console_scripts"):
            module, _, attribute = script.value.partition(":")
            call = f"{module}.{attribute}" if attribute else module
            (bin_dir / script.name).write_text(
                f"#!{python}\nimport sys\nimport {module}\nsys.exit({call}())\n"
            )
            (bin_dir / script.name).chmod(0o755)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, str]:
    """A new virtual environment with the wheel installed; returns the environment to run it in."""
    place = tmp_path_factory.mktemp("wheel-install")
    wheel = _build_wheel(place)
    venv = place / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    new_site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    wanted = _declared(wheel, ("local",)) + [
        Requirement(line)
        for line in (INSTALLER, *LOCAL_RUN_EXTRAS)
        if line.strip() and not line.startswith("#")
    ]
    _link_distributions(_closure(wanted), place / "deps", venv / "bin", python)
    (new_site / "project-deps.pth").write_text(str(place / "deps") + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_"))}
    env.update(
        {
            "PATH": f"{venv / 'bin'}{os.pathsep}/usr/bin:/bin",
            "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": "",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "COLUMNS": "200",
        }
    )
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-index", f"{wheel}[local]"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
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
            "import llmtrain, llmtrain.sourcedir as s; print(llmtrain.__file__); print(s.repository_root())",
        ],
        cwd=work,
        env=installed,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert not where[0].startswith(str(ROOT)) and "site-packages" in where[0]
    assert where[1].endswith("site-packages/llmtrain/_bundle")

    version = _llmtrain(installed, work, "--version")
    assert (
        version.returncode == 0
        and version.stdout.strip() == f"llmtrain {metadata.version('llm-sagemaker-platform')}"
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
