"""sourcedir.tar.gz: the contract's layout, byte-for-byte reproducible, and the code hash."""

from __future__ import annotations

import io
import os
import tarfile
import time

import pytest

from llmtrain.core.errors import SourceDirError
from llmtrain.core.sourcedir import archive_code_hash, code_hash, collect_files, package_code, tarball_bytes
from llmtrain.core.spec import CodeSpec

PLATFORM_CODE = CodeSpec(source="platform", entry_point="training_jobs/train.py")


@pytest.fixture
def repo(tmp_path):
    """A small repository: training_jobs/ (with clutter that must stay out) and a byo folder."""
    files = {
        "training_jobs/__init__.py": "",
        "training_jobs/train.py": "print('train')\n",
        "training_jobs/trainer/config.py": "X = 1\n",
        "training_jobs/requirements.txt": "transformers==5.23.0\n",
        "training_jobs/__pycache__/train.cpython-311.pyc": "junk",
        "training_jobs/trainer/old.pyc": "junk",
        "training_jobs/.DS_Store": "junk",
        "mine/run.py": "print('run')\n",
        "mine/lib/util.py": "Y = 2\n",
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def _members(data: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {m.name: m for m in tar.getmembers()}


def test_platform_layout_is_training_jobs_plus_requirements(repo):
    members = _members(tarball_bytes(collect_files(PLATFORM_CODE, repo)))
    assert sorted(members) == [
        "requirements.txt",
        "training_jobs/__init__.py",
        "training_jobs/requirements.txt",
        "training_jobs/train.py",
        "training_jobs/trainer/config.py",
    ]
    with tarfile.open(
        fileobj=io.BytesIO(tarball_bytes(collect_files(PLATFORM_CODE, repo))), mode="r:gz"
    ) as tar:
        assert tar.extractfile("requirements.txt").read() == b"transformers==5.23.0\n"


def test_byo_layout_is_the_users_folder_at_the_root(repo):
    code = CodeSpec(source="mine", entry_point="run.py")
    assert [f.archive_path for f in collect_files(code, repo)] == ["lib/util.py", "run.py"]


def test_archive_is_reproducible_and_owner_and_time_free(repo):
    first = tarball_bytes(collect_files(PLATFORM_CODE, repo))
    later = time.time() + 3600
    for path in (repo / "training_jobs").rglob("*"):
        os.utime(path, (later, later))
    assert tarball_bytes(collect_files(PLATFORM_CODE, repo)) == first
    for member in _members(first).values():
        assert (member.mtime, member.uid, member.gid, member.uname, member.gname) == (315532800, 0, 0, "", "")
        assert member.mode in (0o644, 0o755)
    assert first[4:8] == b"\0\0\0\0"  # gzip header carries no timestamp


def test_code_hash_follows_content_and_names_not_times(repo):
    before = code_hash(collect_files(PLATFORM_CODE, repo))
    os.utime(repo / "training_jobs" / "train.py", (1, 1))
    assert code_hash(collect_files(PLATFORM_CODE, repo)) == before
    (repo / "training_jobs" / "train.py").write_text("print('changed')\n")
    changed = code_hash(collect_files(PLATFORM_CODE, repo))
    assert changed != before and changed.startswith("sha256:")
    (repo / "training_jobs" / "train.py").rename(repo / "training_jobs" / "main.py")
    (repo / "training_jobs" / "train.py").write_text("print('changed')\n")
    assert code_hash(collect_files(PLATFORM_CODE, repo)) != changed


def test_the_package_is_the_archive_and_hashes_like_its_files(repo):
    archive = package_code(PLATFORM_CODE, repo)
    assert archive == tarball_bytes(collect_files(PLATFORM_CODE, repo))
    assert archive_code_hash(archive) == code_hash(collect_files(PLATFORM_CODE, repo))


@pytest.mark.parametrize(
    ("code", "prepare", "message"),
    [
        (
            CodeSpec(source="mine", entry_point="missing.py"),
            None,
            "code.entry_point 'missing.py' is not a file under mine/",
        ),
        (CodeSpec(source="absent", entry_point="run.py"), None, "code folder .*absent does not exist"),
        (
            PLATFORM_CODE,
            lambda repo: (repo / "training_jobs" / "requirements.txt").unlink(),
            "requirements.txt is missing: the SageMaker container installs",
        ),
        (
            CodeSpec(source="mine", entry_point="run.py"),
            lambda repo: (repo / "mine" / "link.py").symlink_to(repo / "mine" / "run.py"),
            "is a symbolic link",
        ),
    ],
)
def test_unpackageable_code_says_what_to_fix(repo, code, prepare, message):
    if prepare:
        prepare(repo)
    with pytest.raises(SourceDirError, match=message):
        collect_files(code, repo)
