"""Install this project's wheels into a new virtual environment outside the checkout, offline.

Each wheel is built (`pip wheel --no-build-isolation`) from a copy of its sources, and installed into
a new virtual environment by pip, offline (`--no-index`). So that nothing is downloaded (torch and
aws-cdk-lib alone are gigabytes), the new environment sees exactly the distributions the wheels
declare, followed through their own requirements, plus what the caller adds: their files are linked
from this project's environment into one folder that a `.pth` file of the new environment adds to its
path, and their console scripts are written into its `bin/`. pip resolves the wheels' requirements
against them (an undeclared or missing one fails the install), and a program importing a package
that no wheel declares fails. Everything else is the installed wheels.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
# The new environment is made without a pip of its own (ensurepip's setuptools is too old for
# torch's requirements): this project's pip is linked in like any other distribution.
INSTALLER = "pip"
# What each of this repository's wheels is built from.
LLMTRAIN_SOURCES = (
    "pyproject.toml", "setup.py", "MANIFEST.in", "llmtrain", "templates", "training_jobs", "examples"
)
CONSTRUCTS_SOURCES = ("pyproject.toml", "README.md", "training_constructs")


@dataclass(frozen=True)
class Wheel:
    path: Path
    extras: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return canonicalize_name(self.path.name.split("-")[0])

    @property
    def install_argument(self) -> str:
        return f"{self.path}[{','.join(self.extras)}]" if self.extras else str(self.path)

    def requirements(self) -> list[Requirement]:
        """What the wheel declares (Requires-Dist), with its extras."""
        with zipfile.ZipFile(self.path) as archive:
            name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            text = archive.read(name).decode()
        lines = text.splitlines()
        raw = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]
        declared = list(map(Requirement, raw))
        # An extra may name others of the same distribution (`llm-sagemaker-platform[data]`).
        extras, grown = set(self.extras), True
        while grown:
            own = {e for r in declared if self._is_own(r) and _applies(r, extras) for e in r.extras}
            grown, extras = not own <= extras, extras | own
        return [r for r in declared if _applies(r, extras) and not self._is_own(r)]

    def _is_own(self, requirement: Requirement) -> bool:
        return canonicalize_name(requirement.name) == self.name


def build_wheel(
    project: Path, sources: Sequence[str], destination: Path, *, extras: Sequence[str] = ()
) -> Wheel:
    """The wheel of the project at `project`, built from a copy of `sources` (its files and folders)."""
    source = destination / f"source-{project.name}"
    source.mkdir(parents=True)
    for name in sources:
        if (project / name).is_dir():
            shutil.copytree(project / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(project / name, source / name)
    dist = destination / "dist"
    before = set(dist.glob("*.whl")) if dist.is_dir() else set()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(dist)],
        check=True,
        capture_output=True,
    )
    (wheel,) = set(dist.glob("*.whl")) - before
    return Wheel(wheel, tuple(extras))


def install(
    place: Path, wheels: Sequence[Wheel], *, available: Sequence[Wheel] = (), also: Iterable[str] = ()
) -> dict[str, str]:
    """A new virtual environment under `place` with `wheels` installed; returns the process
    environment to run its programs in (its `bin/` first on PATH, no index for pip).

    `available`: wheels pip may install only where a wheel requires them (by name and version).
    `also`: requirements to provide besides what the wheels declare (what a user installs first)."""
    env = provide(place, wheels, available=available, also=also)
    result = subprocess.run(
        [str(place / "venv" / "bin" / "python"), "-m", "pip", "install", "--no-index",
         *(f"--find-links={wheel.path}" for wheel in available),
         *(wheel.install_argument for wheel in wheels)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return env


def provide(
    place: Path, wheels: Sequence[Wheel], *, available: Sequence[Wheel] = (), also: Iterable[str] = ()
) -> dict[str, str]:
    """A new virtual environment under `place` that already holds what `wheels` (and `available`)
    require, and `also`, linked from this project's environment, but not the wheels themselves: a
    pip command (a user's, as documented) installs them. Returns the process environment to run its
    programs in (its `bin/` first on PATH)."""
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
    wanted = [r for wheel in (*wheels, *available) for r in wheel.requirements()]
    wanted += [Requirement(line) for line in (INSTALLER, *also) if line.strip() and not line.startswith("#")]
    provided = _closure(wanted, installed_from_wheels={wheel.name for wheel in (*wheels, *available)})
    _link_distributions(provided, place / "deps", venv / "bin", python)
    (new_site / "project-deps.pth").write_text(str(place / "deps") + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_"))}
    env.update(
        {
            "PATH": f"{venv / 'bin'}{os.pathsep}/usr/bin:/bin",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "COLUMNS": "200",
        }
    )
    return env


def _applies(requirement: Requirement, extras: Iterable[str]) -> bool:
    return requirement.marker is None or any(requirement.marker.evaluate({"extra": e}) for e in ("", *extras))


def _closure(
    requirements: list[Requirement], *, installed_from_wheels: set[str]
) -> dict[str, metadata.Distribution]:
    """The installed distributions these requirements need, followed through their requirements;
    those the wheels provide themselves are left to the wheels (never this checkout's editable ones)."""
    found: dict[str, metadata.Distribution] = {}
    pending = list(requirements)
    while pending:
        requirement = pending.pop()
        key = canonicalize_name(requirement.name)
        if key in found or key in installed_from_wheels:
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
