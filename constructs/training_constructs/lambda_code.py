"""Package the platform's Lambda handlers as a `lambda_.Code` asset without Docker.

The handlers live in `llmtrain/handlers/` and need the standard library, boto3 (which the Lambda
Python runtime provides) and a few packages it does not provide:

    llmtrain/                 the layers of llmtrain the functions run (`LAMBDA_LAYERS`: core, planner,
                              lifecycle, operations, handlers), copied from where it is installed
                              (pure Python); never the CLI (cli.py, commands/, client/) nor the
                              local runner (local/), nor the platform files a wheel bundles
    training_jobs/contract/   the training program's torch-free contract, which llmtrain imports
                              (with training_jobs/__init__.py; nothing else of the program)
    yaml/, regex/, ...        vendored packages, from wheels built for the Lambda runtime
    <package>-<v>.dist-info/  their metadata
    LICENSES/<package>        each vendored package's licence file
    templates/<name>/<v>.yaml the job-template versions the function should know (optional)
    <extra files>             any data files the caller adds (optional)

Every function runs on `LAMBDA_RUNTIME` (the newest Python runtime Lambda offers) on
`LAMBDA_ARCHITECTURE`, whatever Python synthesizes: the vendored packages are not copied from the
synthesizing environment (whose compiled modules fit only its own interpreter) but unpacked from
the wheels PyPI publishes for that runtime and architecture. The packages the platform's functions
vendor come at the version this release of the construct library pins (`VENDORED_VERSIONS`),
whatever version the synthesizing environment has installed: every app on one release deploys the
same code asset (the same hash: no redeploy because one machine has another `regex`). A package
outside that table comes at the version installed here: pin it in your requirements. pip fetches
the wheels (`pip download --platform ... --python-version ...`, no Docker) into a wheel cache once;
later synths read the cache without the network.

The folder is staged under a directory named after the SHA-256 of its content, so the same
inputs always give the same folder and the same asset hash (no spurious redeploys), and a
concurrent synth never sees a half-written folder (it is written aside and renamed in place).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from aws_cdk import aws_lambda as lambda_

import llmtrain
import training_jobs
import training_jobs.contract

# Every function's runtime: the newest Python runtime Lambda offers, on Graviton (cheaper per GB-s).
LAMBDA_RUNTIME = lambda_.Runtime.PYTHON_3_14
LAMBDA_ARCHITECTURE = lambda_.Architecture.ARM_64
# Wheel platform tags the runtime loads: Amazon Linux 2023, glibc 2.34, aarch64.
LAMBDA_WHEEL_PLATFORMS = ("manylinux_2_34_aarch64", "manylinux_2_28_aarch64", "manylinux2014_aarch64")
# Byte code is rebuilt by the runtime; caches and test suites are not needed at run time.
_EXCLUDED_SUFFIXES = (".pyc", ".pyo")
_EXCLUDED_DIRS = ("__pycache__", "tests")
# The layers of llmtrain a function runs: its entry points (handlers) and what they stand on
# (docs/architecture.md, "Layers"; import-linter keeps the handlers from importing anything else).
LAMBDA_LAYERS = ("core", "planner", "lifecycle", "operations", "handlers")
# The packages the platform's functions vendor, by import name: (distribution, version) of the wheel
# for the Lambda runtime. Pinned by this release of the construct library (a new pin is a new
# release), not taken from the synthesizing environment; the platform's requirements.txt pins the
# same versions, which its tests run with (tests/infra/test_lambda_code.py checks both agree).
VENDORED_VERSIONS: Mapping[str, tuple[str, str]] = {
    "yaml": ("PyYAML", "6.0.4"),
    "regex": ("regex", "2026.11.15"),
}
_LICENCE_NAMES = ("LICENSE", "LICENCE", "COPYING")

DEFAULT_STAGING_ROOT = Path(tempfile.gettempdir()) / "llmtrain-lambda-code"
DEFAULT_WHEEL_CACHE = Path.home() / ".cache" / "llmtrain" / "lambda-wheels"


class LambdaCodeError(ValueError):
    """The Lambda code cannot be packaged here; the message says why and what to do."""


def lambda_code(
    *,
    template_files: Sequence[Path | str] = (),
    extra_files: Mapping[str, bytes] | None = None,
    vendored_packages: Sequence[str] = ("yaml",),
    staging_root: Path | None = None,
    wheel_cache: Path | None = None,
) -> lambda_.Code:
    """Return a `Code.from_asset` of a folder holding llmtrain, the vendored packages and the data.

    template_files: job-template files laid out as `<anything>/<name>/<version>.yaml`; each is
        placed at `templates/<name>/<version>.yaml` in the asset.
    extra_files: more files to add, by relative path inside the asset (e.g. a registry index).
    vendored_packages: import names of the packages to vendor, from their wheels for `LAMBDA_RUNTIME`
        ("yaml" always comes along): those of `VENDORED_VERSIONS` at the version it pins, any other
        at the version installed here.
    staging_root: where the content-addressed folders are written (default: the system temp dir).
    wheel_cache: where the fetched wheels are kept (default: ~/.cache/llmtrain/lambda-wheels).
    """
    folder = stage_lambda_code(
        template_files=template_files,
        extra_files=extra_files,
        vendored_packages=vendored_packages,
        staging_root=staging_root,
        wheel_cache=wheel_cache,
    )
    return lambda_.Code.from_asset(str(folder))


def stage_lambda_code(
    *,
    template_files: Sequence[Path | str] = (),
    extra_files: Mapping[str, bytes] | None = None,
    vendored_packages: Sequence[str] = ("yaml",),
    staging_root: Path | None = None,
    wheel_cache: Path | None = None,
) -> Path:
    """Write the asset folder (see the module docstring) and return its path."""
    files = _collect_files(template_files, extra_files or {}, ("yaml", *vendored_packages),
                           Path(wheel_cache) if wheel_cache is not None else DEFAULT_WHEEL_CACHE)
    digest = _content_hash(files)
    root = Path(staging_root) if staging_root is not None else DEFAULT_STAGING_ROOT
    target = root / digest
    if not target.is_dir():
        _write_atomically(files, root, target)
    return target


def _collect_files(
    template_files: Sequence[Path | str],
    extra_files: Mapping[str, bytes],
    vendored_packages: Sequence[str],
    wheel_cache: Path,
) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    package = Path(llmtrain.__file__).parent
    files["llmtrain/__init__.py"] = (package / "__init__.py").read_bytes()
    for layer in LAMBDA_LAYERS:
        files.update(_package_files(package / layer, f"llmtrain/{layer}"))
    files["training_jobs/__init__.py"] = Path(training_jobs.__file__).read_bytes()
    files.update(_package_files(Path(training_jobs.contract.__file__).parent, "training_jobs/contract"))
    for name in dict.fromkeys(vendored_packages):
        distribution, version = _vendored_distribution(name)
        files.update(_wheel_files(distribution, version, wheel_cache, name))
    for template_file in template_files:
        path = Path(template_file)
        if path.suffix not in (".yaml", ".yml") or not path.is_file():
            raise LambdaCodeError(
                f"lambda_code template_files: {path} is not a template file; pass the paths of "
                "`templates/<name>/<version>.yaml` files"
            )
        files[f"templates/{path.parent.name}/{path.name}"] = path.read_bytes()
    for relative, content in extra_files.items():
        _check_relative(relative)
        files[relative] = bytes(content)
    return files


def _vendored_distribution(name: str) -> tuple[str, str]:
    """The distribution and version of the wheel to vendor for the import name ``name``."""
    if name in VENDORED_VERSIONS:
        return VENDORED_VERSIONS[name]
    try:
        return name, importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        raise LambdaCodeError(
            f"lambda_code vendored_packages: {name!r} is not an installed package in this environment; "
            "install it (and pin it in requirements.txt: the functions get the same version) or drop it "
            "from vendored_packages"
        ) from None


def _package_files(package_dir: Path, name: str) -> dict[str, bytes]:
    files = {}
    for path in sorted(package_dir.rglob("*")):
        relative_parts = path.relative_to(package_dir).parts
        if not path.is_file() or path.suffix in _EXCLUDED_SUFFIXES:
            continue
        if any(part in _EXCLUDED_DIRS for part in relative_parts[:-1]):
            continue
        files["/".join((name, *relative_parts))] = path.read_bytes()
    return files


@functools.cache
def _wheel_files(distribution: str, version: str, wheel_cache: Path, import_name: str) -> dict[str, bytes]:
    """The content of the distribution's wheel for the Lambda runtime, and its licence."""
    wheel = _fetch_wheel(distribution, version, wheel_cache)
    files: dict[str, bytes] = {}
    licence = None
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            parts = Path(member.filename).parts
            # <name>.data/ holds scripts and headers an installer would put elsewhere
            if member.is_dir() or parts[0].endswith(".data") or any(p in _EXCLUDED_DIRS for p in parts[:-1]):
                continue
            content = archive.read(member)
            if parts[0].endswith(".dist-info") and parts[-1].upper().startswith(_LICENCE_NAMES):
                licence = licence or content
            files[member.filename] = content
    files[f"LICENSES/{import_name}"] = licence or f"{distribution} {version}: see its project page\n".encode()
    return files


def _fetch_wheel(distribution: str, version: str, wheel_cache: Path) -> Path:
    """The cached wheel of `distribution==version` for the Lambda runtime; pip fetches it once."""
    requirement = f"{distribution}=={version}"
    python = LAMBDA_RUNTIME.name.removeprefix("python")
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--implementation", "cp", "--python-version", python,
               "--dest", str(wheel_cache), "--find-links", str(wheel_cache)]
    for tag in LAMBDA_WHEEL_PLATFORMS:
        command += ["--platform", tag]
    wheel_cache.mkdir(parents=True, exist_ok=True)
    cached = subprocess.run([*command, "--no-index", requirement], capture_output=True, text=True)
    if cached.returncode != 0:
        fetched = subprocess.run([*command, requirement], capture_output=True, text=True)
        if fetched.returncode != 0:
            raise LambdaCodeError(
                f"cannot fetch the wheel of {requirement} for the Lambda runtime ({LAMBDA_RUNTIME.name}, "
                f"{', '.join(LAMBDA_WHEEL_PLATFORMS)}): {fetched.stderr.strip().splitlines()[-1:]}; "
                f"synthesize once with access to PyPI, or put that wheel into {wheel_cache}"
            )
    return _cached_wheel(distribution, version, wheel_cache)


def _cached_wheel(distribution: str, version: str, wheel_cache: Path) -> Path:
    from packaging.utils import canonicalize_name, parse_wheel_filename

    python = "cp" + LAMBDA_RUNTIME.name.removeprefix("python").replace(".", "")
    for wheel in sorted(wheel_cache.glob("*.whl")):
        name, wheel_version, _, tags = parse_wheel_filename(wheel.name)
        if canonicalize_name(name) != canonicalize_name(distribution) or str(wheel_version) != version:
            continue
        if any(_loads_on_lambda(tag, python) for tag in tags):
            return wheel
    raise LambdaCodeError(f"pip reported {distribution}=={version} fetched, but {wheel_cache} holds no wheel "
                          f"of it for {LAMBDA_RUNTIME.name} on {', '.join(LAMBDA_WHEEL_PLATFORMS)}")


def _loads_on_lambda(tag, python: str) -> bool:
    """A wheel tag (packaging.tags.Tag) the Lambda runtime's interpreter loads."""
    interpreter_fits = tag.interpreter == python or tag.abi == "abi3" or (
        tag.interpreter.startswith("py3") and tag.abi == "none")
    return interpreter_fits and (tag.platform == "any" or tag.platform in LAMBDA_WHEEL_PLATFORMS)


def _check_relative(relative: str) -> None:
    parts = Path(relative).parts
    if not parts or Path(relative).is_absolute() or ".." in parts:
        raise LambdaCodeError(
            f"lambda_code extra_files: {relative!r} must be a relative path inside the asset "
            "(no leading '/', no '..')"
        )


def _content_hash(files: Mapping[str, bytes]) -> str:
    digest = hashlib.sha256()
    for relative in sorted(files):
        content = files[relative]
        digest.update(relative.encode() + b"\0" + str(len(content)).encode() + b"\0" + content)
    return digest.hexdigest()


def _write_atomically(files: Mapping[str, bytes], root: Path, target: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".staging-", dir=root))
    try:
        for relative, content in files.items():
            destination = scratch / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            destination.write_bytes(content)
        try:
            os.rename(scratch, target)
        except OSError:
            # Another synth staged the same content first; its folder is identical to ours.
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
