"""Run the training program's tests under the PyTorch of each platform template's container.

`make test-container` (docs/templates.md, "Publishing a version"). For every distinct container of
the catalog's latest platform-template versions (the Deep Learning Container, or the SMP image, named
by its PyTorch and Python versions):

1. a virtual environment `.venv-torch-<version>` with that Python and `torch==<version>` (PyPI's
   build: on x86_64 a CUDA build, several GB; it runs on the CPU here);
2. the sourcedir's `requirements.txt` installed on top with torch held at that version, as the
   container's training toolkit installs it: a requirement that would replace the container's torch
   fails here;
3. `pytest tests/training` in it (for the SMP image, the tests of the parts an SMP job runs: SMP
   itself exists only in its container).

Environments are kept between runs (a stamp of the requirements decides when to reinstall).
`--list` prints the containers; `--only VERSION` runs one.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmtrain.core.catalog import Catalog  # noqa: E402

REQUIREMENTS = REPO / "training_jobs" / "requirements.txt"
# The tests' own tools and the references they compare against (TRL's losses, with HF datasets;
# datatrove for the data pipeline's quality steps), pinned as requirements-dev.txt and
# requirements.txt pin them, installed with the container's torch held.
TEST_TOOLS = ("pytest", "psutil", "numpy", "trl==1.16.0", "datatrove==0.10.1")
# The SMP image runs the program's SMP path, which needs torch.sagemaker (absent outside the image):
# its tests check the translation of settings, the clear error outside the image, and the parts an
# SMP job shares with the others (configuration, data, checkpoint layout).
SMP_TESTS = ("tests/training/test_config.py", "tests/training/test_data.py",
             "tests/training/test_parts.py::test_smp_translation_from_named_settings_and_mp_parameters",
             "tests/training/test_parts.py::test_smp_translation_rejects_inconsistent_settings",
             "tests/training/test_parts.py::test_smp_outside_an_smp_container_is_a_clear_error")


@dataclass(frozen=True, order=True)
class Container:
    torch: str
    python: str  # "3.12"
    smp: bool
    templates: tuple[str, ...] = ()

    @property
    def venv(self) -> Path:
        return REPO / f".venv-torch-{self.torch}"

    @property
    def tests(self) -> tuple[str, ...]:
        return SMP_TESTS if self.smp else ("tests/training",)


def containers(catalog: Catalog) -> list[Container]:
    found: dict[tuple[str, str, bool], list[str]] = {}
    for name in catalog.names():
        spec = catalog.latest(name)
        if not spec.code.is_platform or spec.image.framework_version is None:
            continue
        py = spec.image.py_version.removeprefix("py")
        key = (spec.image.framework_version, f"{py[0]}.{py[1:]}", spec.distribution.strategy == "smp")
        found.setdefault(key, []).append(spec.ref)
    return sorted(Container(*key, templates=tuple(refs)) for key, refs in found.items())


def find_python(version: str) -> str:
    """An interpreter of `version` (3.12): on PATH, or under pyenv."""
    candidates = [shutil.which(f"python{version}")]
    pyenv_root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    candidates += sorted(str(p) for p in Path(pyenv_root, "versions").glob(f"{version}*/bin/python{version}"))
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import sys, venv; print(sys.version)"],
                               capture_output=True, text=True)
        if probe.returncode == 0:
            return candidate
    raise SystemExit(f"no Python {version} found (on PATH or under pyenv): the container runs Python "
                     f"{version}; install it (e.g. `pyenv install {version}`) and run again")


def _stamp(container: Container) -> str:
    key = REQUIREMENTS.read_bytes() + container.torch.encode() + " ".join(TEST_TOOLS).encode()
    digest = hashlib.sha256(key)
    return digest.hexdigest()


def ensure_venv(container: Container) -> Path:
    python = container.venv / "bin" / "python"
    stamp = container.venv / ".llmtrain-stamp"
    if stamp.is_file() and stamp.read_text() == _stamp(container):
        return python
    if not python.exists():
        _run([find_python(container.python), "-m", "venv", str(container.venv)])
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    _run([*pip, f"torch=={container.torch}"])
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as held:
        held.write(f"torch=={container.torch}\n")
    # The container's install: its torch stays; a requirement needing another torch fails here.
    _run([*pip, "-r", str(REQUIREMENTS), "-c", held.name])
    _run([*pip, *TEST_TOOLS, "-c", held.name])
    stamp.write_text(_stamp(container))
    return python


def run_tests(container: Container, extra: list[str]) -> int:
    python = ensure_venv(container)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0", "CUDA_VISIBLE_DEVICES": ""}
    version = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, env=env, check=True).stdout.strip()
    print(f"== PyTorch {version} (Python {container.python}) for {', '.join(container.templates)}",
          flush=True)
    command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *container.tests, *extra]
    return subprocess.run(command, cwd=REPO, env=env).returncode


def _run(command: list[str]) -> None:
    print("+ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=tempfile.gettempdir())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the containers and exit")
    parser.add_argument("--only", metavar="TORCH_VERSION", help="only the container with this torch")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    found = containers(Catalog.load())
    if args.only:
        found = [c for c in found if c.torch == args.only]
        if not found:
            raise SystemExit(f"--only {args.only}: no platform template runs PyTorch {args.only}")
    if args.list:
        for container in found:
            kind = "SMP image" if container.smp else "Deep Learning Container"
            print(f"torch {container.torch} python {container.python} ({kind}): "
                  f"{', '.join(container.templates)}")
        return 0
    failed = [c.torch for c in found if run_tests(c, args.pytest_args) != 0]
    if failed:
        print(f"the program's tests failed under PyTorch {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
