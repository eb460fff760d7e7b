"""Package the code a template wraps as a deterministic `sourcedir.tar.gz`, and hash it.

Layout (docs/architecture.md, "The sourcedir"): platform templates get the `training_jobs/` folder at
the archive root plus `requirements.txt` (a copy of `training_jobs/requirements.txt`, which the
SageMaker container installs before it starts the entry point); byo templates get the user's folder
as the archive root. The archive is byte-for-byte reproducible (sorted entries, fixed timestamps and
owners, gzip without a name or time), so the same code always gives the same S3 asset and hash.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from llmtrain.core.errors import SourceDirError
from llmtrain.core.spec import CodeSpec

PLATFORM_PACKAGE = "training_jobs"
REQUIREMENTS = "requirements.txt"
SOURCEDIR_NAME = "sourcedir.tar.gz"
# Frozen code of published template versions, templates/_code/<code hash>.tar.gz (not a valid
# template name, so the catalog never reads it as one).
SNAPSHOT_FOLDER = "_code"
_FIXED_MTIME = 315532800  # 1980-01-01: the earliest time every archive tool accepts
_SKIPPED_DIRS = frozenset(
    {
        "__pycache__",
        ".git",
        ".pytest_cache",
        ".ruff_cache",
        ".mypy_cache",
        ".ipynb_checkpoints",
        "node_modules",
    }
)
_SKIPPED_SUFFIXES = (".pyc", ".pyo", ".egg-info")
_SKIPPED_FILES = frozenset({".DS_Store"})


@dataclass(frozen=True)
class SourceFile:
    archive_path: str
    path: Path


# Where an installed wheel keeps templates/, training_jobs/ and examples/ (setup.py puts them there).
BUNDLE_FOLDER = "_bundle"


def repository_root() -> Path:
    """The folder holding the platform's files (`templates/`, `training_jobs/`, `examples/`).

    Installed from a wheel, that is the copy bundled as package data (`llmtrain/_bundle/`, laid out
    as in the repository); in a checkout (an editable install, tests) it is the repository itself,
    so a change to the live tree is seen at once.
    """
    bundled = resources.files("llmtrain").joinpath(BUNDLE_FOLDER)
    if bundled.is_dir():
        return Path(str(bundled))
    return Path(__file__).resolve().parents[2]


def program_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """A process environment (this one by default) in which the shipped training program imports
    (`python -m training_jobs.X`, as `llmtrain data prepare` runs it): llmtrain never imports it."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repository_root()), env.get("PYTHONPATH")) if p)
    return env


def collect_files(code: CodeSpec, repo_root: Path | None = None) -> list[SourceFile]:
    """The files of the sourcedir in archive order, checked for the entry point."""
    root = repo_root or repository_root()
    if code.is_platform:
        package = root / PLATFORM_PACKAGE
        files = [SourceFile(f"{PLATFORM_PACKAGE}/{rel}", path) for rel, path in _walk(package)]
        requirements = package / REQUIREMENTS
        if not requirements.is_file():
            raise SourceDirError(
                f"{requirements} is missing: the SageMaker container installs the training program's "
                "dependencies from it, so platform templates cannot be packaged without it"
            )
        files.append(SourceFile(REQUIREMENTS, requirements))
    else:
        files = [SourceFile(rel, path) for rel, path in _walk(root / code.source)]
    files.sort(key=lambda f: f.archive_path)
    if code.entry_point not in {f.archive_path for f in files}:
        where = PLATFORM_PACKAGE if code.is_platform else code.source
        raise SourceDirError(f"code.entry_point {code.entry_point!r} is not a file under {where}/")
    return files


def _walk(folder: Path):
    if not folder.is_dir():
        raise SourceDirError(f"code folder {folder} does not exist")
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIPPED_DIRS and not d.endswith(_SKIPPED_SUFFIXES)
        )
        for name in sorted(filenames):
            if name in _SKIPPED_FILES or name.endswith(_SKIPPED_SUFFIXES):
                continue
            path = Path(dirpath) / name
            if path.is_symlink():
                raise SourceDirError(f"{path} is a symbolic link; copy the file into the code folder instead")
            yield path.relative_to(folder).as_posix(), path


def code_hash(files: list[SourceFile]) -> str:
    """sha256 over (archive path, content) pairs: changes with any byte or name, not with mtimes."""
    return _digest((source.archive_path, source.path.read_bytes()) for source in files)


def archive_code_hash(archive: bytes) -> str:
    """The code hash of the files inside a sourcedir archive: equal to the `code_hash` of the files
    it was built from."""
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            return _digest((member.name, tar.extractfile(member).read())
                           for member in tar.getmembers() if member.isfile())
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise SourceDirError(f"not a sourcedir archive: {exc}") from exc


def _digest(named_contents) -> str:
    digest = hashlib.sha256()
    for name, content in sorted(named_contents):
        digest.update(name.encode())
        digest.update(b"\0")
        digest.update(hashlib.sha256(content).hexdigest().encode())
        digest.update(b"\n")
    return "sha256:" + digest.hexdigest()


def tarball_bytes(files: list[SourceFile]) -> bytes:
    """The gzipped tar archive of `files`, identical for identical contents."""
    raw = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as zipped:
        with tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for source in sorted(files, key=lambda f: f.archive_path):
                data = source.path.read_bytes()
                info = tarfile.TarInfo(source.archive_path)
                info.size = len(data)
                info.mtime = _FIXED_MTIME
                info.mode = 0o755 if os.access(source.path, os.X_OK) else 0o644
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def package_code(code: CodeSpec, repo_root: Path | None = None) -> bytes:
    """The sourcedir archive of `code` as it is now in the working tree."""
    return tarball_bytes(collect_files(code, repo_root))
