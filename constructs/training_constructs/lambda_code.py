"""Package the platform's Lambda handlers as a `lambda_.Code` asset without Docker.

The handlers live in `llmtrain/handlers/` and need the standard library, boto3 (which the Lambda
Python runtime provides) and a few packages it does not provide, vendored from this environment:

    llmtrain/                 the llmtrain package, copied from where it is installed
    yaml/                     PyYAML (always): its pure-Python parser, without the C extension
    <other packages>/         e.g. regex (which llmtrain.validate needs), compiled files included
    LICENSES/<package>        each vendored package's licence file
    templates/<name>/<v>.yaml the job-template versions the function should know (optional)
    <extra files>             any data files the caller adds (optional)

PyYAML falls back to pure Python when its C extension is missing, so it is vendored without it and
runs on any Lambda Python runtime. A package with compiled modules and no such fallback (`regex`)
only loads on the same Python version and CPU as the interpreter that synthesizes: use
`matching_runtime()` for functions that vendor one; it fails at synth, with what to do, where no
Lambda runtime matches (e.g. synthesizing on macOS).

The folder is staged under a directory named after the SHA-256 of its content, so the same
inputs always give the same folder and the same asset hash (no spurious redeploys), and a
concurrent synth never sees a half-written folder (it is written aside and renamed in place).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from aws_cdk import aws_lambda as lambda_

import llmtrain

# Packages vendored without their compiled modules because they have a pure-Python fallback.
PURE_FALLBACK_PACKAGES = frozenset({"yaml"})
# Byte code is rebuilt by the runtime; caches and test suites are not needed at run time.
_EXCLUDED_SUFFIXES = (".pyc", ".pyo")
_EXCLUDED_DIRS = ("__pycache__", "tests")
_COMPILED_SUFFIXES = (".so", ".pyd", ".dylib")
# The import name of a vendored package -> its distribution name, for the licence file.
_DISTRIBUTIONS = {"yaml": "PyYAML"}
_LAMBDA_ARCHITECTURES = {"x86_64": "X86_64", "amd64": "X86_64", "aarch64": "ARM_64", "arm64": "ARM_64"}

DEFAULT_STAGING_ROOT = Path(tempfile.gettempdir()) / "llmtrain-lambda-code"


class LambdaCodeError(ValueError):
    """The Lambda code cannot be packaged here; the message says why and what to do."""


def lambda_code(
    *,
    template_files: Sequence[Path | str] = (),
    extra_files: Mapping[str, bytes] | None = None,
    vendored_packages: Sequence[str] = ("yaml",),
    staging_root: Path | None = None,
) -> lambda_.Code:
    """Return a `Code.from_asset` of a folder holding llmtrain, the vendored packages and the data.

    template_files: job-template files laid out as `<anything>/<name>/<version>.yaml`; each is
        placed at `templates/<name>/<version>.yaml` in the asset.
    extra_files: more files to add, by relative path inside the asset (e.g. a registry index).
    vendored_packages: import names of the packages to copy from this environment ("yaml" always
        comes along). One with compiled modules needs `matching_runtime()` for its function.
    staging_root: where the content-addressed folders are written (default: the system temp dir).
    """
    folder = stage_lambda_code(
        template_files=template_files,
        extra_files=extra_files,
        vendored_packages=vendored_packages,
        staging_root=staging_root,
    )
    return lambda_.Code.from_asset(str(folder))


def stage_lambda_code(
    *,
    template_files: Sequence[Path | str] = (),
    extra_files: Mapping[str, bytes] | None = None,
    vendored_packages: Sequence[str] = ("yaml",),
    staging_root: Path | None = None,
) -> Path:
    """Write the asset folder (see the module docstring) and return its path."""
    files = _collect_files(template_files, extra_files or {}, ("yaml", *vendored_packages))
    digest = _content_hash(files)
    root = Path(staging_root) if staging_root is not None else DEFAULT_STAGING_ROOT
    target = root / digest
    if not target.is_dir():
        _write_atomically(files, root, target)
    return target


def matching_runtime() -> tuple[lambda_.Runtime, lambda_.Architecture]:
    """The Lambda runtime and architecture that load compiled modules built for this interpreter."""
    system, machine = platform.system(), platform.machine().lower()
    version = f"{sys.version_info.major}_{sys.version_info.minor}"
    runtime = getattr(lambda_.Runtime, f"PYTHON_{version}", None)
    if (
        sys.implementation.name != "cpython"
        or system != "Linux"
        or machine not in _LAMBDA_ARCHITECTURES
        or runtime is None
    ):
        raise LambdaCodeError(
            f"the launcher functions vendor compiled Python packages from the synthesizing environment "
            f"({sys.implementation.name} {sys.version_info.major}.{sys.version_info.minor} on {system} "
            f"{machine}), and AWS Lambda has no matching runtime: synthesize on Linux (x86_64 or "
            "arm64) with a CPython version that Lambda offers, e.g. in the project's dev container or CI"
        )
    return runtime, getattr(lambda_.Architecture, _LAMBDA_ARCHITECTURES[machine])


def _collect_files(
    template_files: Sequence[Path | str], extra_files: Mapping[str, bytes], vendored_packages: Sequence[str]
) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    files.update(_package_files(Path(llmtrain.__file__).parent, "llmtrain", keep_compiled=False))
    for name in dict.fromkeys(vendored_packages):
        keep_compiled = name not in PURE_FALLBACK_PACKAGES
        files.update(_package_files(_package_dir(name), name, keep_compiled=keep_compiled))
        files[f"LICENSES/{name}"] = _license(name)
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


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise LambdaCodeError(
            f"lambda_code vendored_packages: {name!r} is not an installed package in this environment; "
            "install it (and list it in requirements.txt) or drop it from vendored_packages"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _package_files(package_dir: Path, name: str, *, keep_compiled: bool) -> dict[str, bytes]:
    files = {}
    ext_suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for path in sorted(package_dir.rglob("*")):
        relative_parts = path.relative_to(package_dir).parts
        if not path.is_file() or path.suffix in _EXCLUDED_SUFFIXES:
            continue
        if any(part in _EXCLUDED_DIRS for part in relative_parts[:-1]):
            continue
        if path.name.endswith(_COMPILED_SUFFIXES):
            if not keep_compiled:
                continue
            if not path.name.endswith(ext_suffix):
                raise LambdaCodeError(
                    f"{path} was not built for this interpreter ({ext_suffix}); reinstall {name} here"
                )
        files["/".join((name, *relative_parts))] = path.read_bytes()
    return files


def _license(name: str) -> bytes:
    try:
        distribution = importlib.metadata.distribution(_DISTRIBUTIONS.get(name, name))
    except importlib.metadata.PackageNotFoundError:
        return f"{name}: see the package's own distribution for its licence.\n".encode()
    for entry in distribution.files or ():
        if Path(str(entry)).name.upper().startswith(("LICENSE", "LICENCE", "COPYING")):
            return Path(distribution.locate_file(entry)).read_bytes()
    licence = distribution.metadata.get("License") or distribution.metadata.get("License-Expression")
    name_version = f"{distribution.metadata['Name']} {distribution.version}"
    return f"{name_version}: {licence or 'see its project page'}\n".encode()


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
