"""The job-template catalog: `templates/<name>/<semver>.yaml`, resolution and the lock.

`name@1.2.3` names one version, `name` and `name@latest` the highest released (non-prerelease)
version by semantic-version precedence. `templates/catalog.lock` records each published version's
content hash (its spec and the code it wraps); `check_lock` fails when a published version changed,
and `lock_new_versions` records new versions but never rewrites a published one.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property, total_ordering
from pathlib import Path

import yaml

from llmtrain.core.errors import LockError, TemplateNotFoundError, TemplateSpecError, did_you_mean
from llmtrain.core.program_contract import ProgramContract, archive_contract, folder_contract
from llmtrain.core.sourcedir import (
    PLATFORM_PACKAGE,
    SNAPSHOT_FOLDER,
    archive_code_hash,
    code_hash,
    collect_files,
    package_code,
    repository_root,
)
from llmtrain.core.spec import SEMVER_PATTERN, TemplateSpec
from llmtrain.core.yaml_documents import load_document

DEFAULT_TEMPLATE = "llama-pretrain-fsdp"
LOCK_FILE = "catalog.lock"
LATEST = "latest"


@total_ordering
@dataclass(frozen=True)
class SemVer:
    major: int
    minor: int
    patch: int
    prerelease: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> SemVer:
        match = SEMVER_PATTERN.fullmatch(text)
        if not match:
            raise TemplateNotFoundError(
                f"version {text!r} is not a semantic version such as 1.0.0 (or 'latest')"
            )
        prerelease = tuple(match.group(4).split(".")) if match.group(4) else ()
        return cls(int(match.group(1)), int(match.group(2)), int(match.group(3)), prerelease)

    @property
    def is_prerelease(self) -> bool:
        return bool(self.prerelease)

    def _key(self):
        # semver 2.0 precedence: a release sorts after its prereleases; numeric identifiers sort
        # numerically and before alphanumeric ones.
        pre = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.prerelease)
        return (self.major, self.minor, self.patch, not self.prerelease, pre)

    def __lt__(self, other: SemVer) -> bool:
        return self._key() < other._key()

    def __str__(self) -> str:
        core = f"{self.major}.{self.minor}.{self.patch}"
        return core + ("-" + ".".join(self.prerelease) if self.prerelease else "")


def parse_ref(ref: str) -> tuple[str, str]:
    """'name', 'name@latest' or 'name@1.2.3' -> (name, version or 'latest')."""
    name, at, version = ref.partition("@")
    if not name:
        raise TemplateNotFoundError(f"template reference {ref!r} lacks a name; write NAME or NAME@VERSION")
    if at and not version:
        raise TemplateNotFoundError(f"template reference {ref!r} has an empty version after '@': write "
                                    f"{name}@VERSION (e.g. {name}@{LATEST}), or {name} for the latest")
    return name, version or LATEST


@dataclass(frozen=True)
class LockEntry:
    content: str
    spec: str
    code: str

    def to_dict(self) -> dict[str, str]:
        return {"content": self.content, "spec": self.spec, "code": self.code}


class Catalog:
    """Template versions to resolve `name@version|latest` in: a folder (`load`: its YAML files, lock
    and frozen code) or specs held in memory (`of`: resolution only, no lock and no code)."""

    def __init__(self, templates: Iterable[TemplateSpec], root: Path | None, repo_root: Path | None,
                 *, source: str | None = None):
        self.root = root
        self.repo_root = repo_root
        self.source = source or str(root)
        self._templates = {(t.name, t.version): t for t in templates}
        self._code_hashes: dict[object, str] = {}

    @classmethod
    def of(cls, templates: Iterable[TemplateSpec], *, source: str) -> Catalog:
        """Specs held in memory (e.g. a deployed environment's record), named by `source`."""
        return cls(templates, None, None, source=source)

    @classmethod
    def load(cls, root: Path | None = None, repo_root: Path | None = None) -> Catalog:
        repo = repo_root or repository_root()
        folder = root or repo / "templates"
        if not folder.is_dir():
            raise TemplateNotFoundError(f"template catalog folder {folder} does not exist")
        return cls((_load_file(path) for path in sorted(folder.glob("*/*.yaml"))), folder, repo)

    @property
    def is_platform(self) -> bool:
        """Whether this is the platform's own catalog (the one llmtrain ships), not a team's."""
        if self.root is None or self.repo_root is None:
            return False
        platform = repository_root()
        return (self.root.resolve(), self.repo_root.resolve()) == (
            (platform / "templates").resolve(), platform.resolve()
        )

    def lock_command(self, *options: str) -> str:
        """The `llmtrain templates lock` command that publishes this catalog's versions (a team's
        catalog needs its folder and the folder its code paths are relative to)."""
        words = ["llmtrain", "templates", "lock", *options]
        if not self.is_platform:
            words += ["--catalog", str(self.root), "--code-root", str(self.repo_root)]
        return shlex.join(words)

    # --- resolution -------------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted({name for name, _ in self._templates})

    def versions(self, name: str) -> list[str]:
        """The versions of `name`, lowest first."""
        found = [SemVer.parse(v) for n, v in self._templates if n == name]
        if not found:
            raise TemplateNotFoundError(
                f"unknown template {name!r}{did_you_mean(name, self.names())}; the catalog has: "
                f"{', '.join(self.names()) or '(nothing)'}"
            )
        return [str(v) for v in sorted(found)]

    def latest(self, name: str) -> TemplateSpec:
        released = [v for v in self.versions(name) if not SemVer.parse(v).is_prerelease]
        if not released:
            raise TemplateNotFoundError(
                f"template {name!r} has only prerelease versions; name one explicitly"
            )
        return self._templates[(name, released[-1])]

    def resolve(self, ref: str) -> TemplateSpec:
        name, version = parse_ref(ref)
        return self.get(name, version)

    def get(self, name: str, version: str = LATEST) -> TemplateSpec:
        if version == LATEST:
            return self.latest(name)
        SemVer.parse(version)
        known = self.versions(name)
        if version not in known:
            raise TemplateNotFoundError(
                f"template {name!r} has no version {version!r}; available: {', '.join(known)}"
            )
        return self._templates[(name, version)]

    def all(self) -> list[TemplateSpec]:
        """Every version, by name then version."""
        return [self._templates[(name, v)] for name in self.names() for v in self.versions(name)]

    def enabled_versions(self, names: Iterable[str]) -> list[TemplateSpec]:
        """Every version of each template in `names` (runs may name an older version), by name then
        version; TemplateNotFoundError names a template the catalog lacks."""
        wanted = list(dict.fromkeys(names))
        for name in wanted:
            self.versions(name)  # raises, naming the template and what the catalog has
        return [template for template in self.all() if template.name in set(wanted)]

    def instance_types(self, names: Iterable[str]) -> tuple[str, ...]:
        """Every instance type any version of the templates in `names` may run on, sorted."""
        return tuple(sorted({t for spec in self.enabled_versions(names) for t in spec.instance_types}))

    # --- hashing and the lock ---------------------------------------------------------------
    def lock_entry(self, spec: TemplateSpec) -> LockEntry:
        spec_digest = spec_hash(spec)
        if spec.code not in self._code_hashes:
            self._code_hashes[spec.code] = code_hash(collect_files(spec.code, self.repo_root))
        code_digest = self._code_hashes[spec.code]
        content = "sha256:" + hashlib.sha256(f"{spec_digest}\n{code_digest}".encode()).hexdigest()
        return LockEntry(content=content, spec=spec_digest, code=code_digest)

    @property
    def lock_path(self) -> Path:
        if self.root is None:
            raise LockError(f"the templates of {self.source} have no lock: they were published where they "
                            "came from")
        return self.root / LOCK_FILE

    @cached_property
    def _lock(self) -> dict[str, dict[str, LockEntry]]:
        return read_lock(self.lock_path)

    def published_entry(self, spec: TemplateSpec) -> LockEntry | None:
        return self._lock.get(spec.name, {}).get(spec.version)

    def verify(self, spec: TemplateSpec) -> LockEntry:
        """The lock entry of a published, unchanged version; LockError otherwise.

        Unchanged means: the same YAML, and the same code, either still in the working tree or in
        the version's snapshot (templates/_code/) once the tree's code has moved on."""
        published = self.published_entry(spec)
        if published is None:
            raise LockError(
                f"{spec.ref} is not published: run `{self.lock_command()}` to record it in {self.lock_path}"
            )
        current = self.lock_entry(spec)
        snapshot = self.snapshot_path(published.code)
        if current.spec != published.spec:
            raise LockError(self._changed_message(spec, published, current, code_frozen=snapshot.is_file()))
        if current.code == published.code:
            if not snapshot.is_file():
                raise LockError(f"{spec.ref} has no snapshot of its code ({snapshot}): run "
                                f"`{self.lock_command()}` to write it")
            return published
        if not snapshot.is_file():
            raise LockError(self._changed_message(spec, published, current, code_frozen=False) +
                            f"; or restore its code snapshot {snapshot}, which is missing")
        if archive_code_hash(snapshot.read_bytes()) != published.code:
            raise LockError(f"{spec.ref}: its code snapshot {snapshot} does not hold the published code; "
                            "restore it from version control")
        return published

    def _changed_message(self, spec: TemplateSpec, published: LockEntry, current: LockEntry, *,
                         code_frozen: bool) -> str:
        """What changed; new code in the working tree is no change to a version whose code is frozen."""
        what = []
        if published.spec != current.spec:
            what.append("its YAML")
        if published.code != current.code and not code_frozen:
            where = "training_jobs/" if spec.code.is_platform else spec.code.source
            what.append(f"the code it wraps in {where}")
        folder = f"templates/{spec.name}" if self.is_platform else str(self.root / spec.name)
        return (
            f"{spec.ref} was published and has changed since: {' and '.join(what) or 'its content'} "
            f"changed. Published versions are immutable: restore it and publish the change as a new "
            f"version ({folder}/<new semver>.yaml), then run `{self.lock_command()}`"
        )

    # --- the code of a version ------------------------------------------------------------------
    def code_moved_on(self, spec: TemplateSpec) -> bool:
        """A published version whose code in the working tree is no longer its published code: what
        deploys and runs is its snapshot, not the edits (a new version publishes those)."""
        published = self.published_entry(spec)
        return published is not None and self.lock_entry(spec).code != published.code

    def snapshot_path(self, code_digest: str) -> Path:
        """Where the code with this hash is frozen when a version wrapping it is published."""
        return self.root / snapshot_name(code_digest)

    def sourcedir(self, spec: TemplateSpec) -> bytes:
        """The code archive a version runs: its snapshot once published (identical to the working
        tree's code as long as that has not changed), else built from the working tree."""
        if self.published_entry(spec) is not None:
            return self.snapshot_path(self.verify(spec).code).read_bytes()
        return package_code(spec.code, self.repo_root)

    def program_contract(self, spec: TemplateSpec) -> ProgramContract | None:
        """The training program's contract of the code `spec` runs (what `render` checks a run's
        hyperparameters with): its frozen snapshot's once published, else the working tree's; None
        for a template that runs its own code."""
        if not spec.code.is_platform:
            return None
        published = self.published_entry(spec)
        if published is not None and self.snapshot_path(published.code).is_file():
            return archive_contract(self.snapshot_path(published.code).read_bytes(), published.code)
        return folder_contract(self.repo_root / PLATFORM_PACKAGE)

    def check_lock(self) -> None:
        """Every version published and unchanged, and no published version deleted."""
        problems = []
        for spec in self.all():
            try:
                self.verify(spec)
            except LockError as exc:
                problems.append(str(exc))
        for name, versions in self._lock.items():
            for version in versions:
                if (name, version) not in self._templates:
                    problems.append(
                        f"{name}@{version} is published in {LOCK_FILE} but its YAML file is gone; "
                        "published versions are never deleted"
                    )
        if problems:
            raise LockError("the template catalog does not match its lock:\n" + "\n".join(problems))

    def lock_new_versions(self) -> list[str]:
        """Record versions missing from the lock and freeze their code (templates/_code/); also
        writes a missing snapshot of a published version whose code is unchanged. Refuses
        (LockError) if a published one changed."""
        changed = []
        added = []
        lock = {name: dict(versions) for name, versions in self._lock.items()}
        for spec in self.all():
            published = self.published_entry(spec)
            current = self.lock_entry(spec)
            if published is None:
                lock.setdefault(spec.name, {})[spec.version] = current
                added.append(spec.ref)
                self._write_snapshot(spec, current.code)
            elif published.content == current.content:
                self._write_snapshot(spec, current.code)
            else:
                try:
                    self.verify(spec)  # the code moved on, and the version has its snapshot
                except LockError as exc:
                    changed.append(str(exc))
        if changed:
            raise LockError("refusing to update the lock:\n" + "\n".join(changed))
        write_lock(self.lock_path, lock)
        self.__dict__.pop("_lock", None)
        return added

    def _write_snapshot(self, spec: TemplateSpec, code_digest: str) -> None:
        path = self.snapshot_path(code_digest)
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(package_code(spec.code, self.repo_root))


def _load_file(path: Path) -> TemplateSpec:
    source = f"{path.parent.name}/{path.name}"
    try:
        data = load_document(path.read_text())
    except yaml.YAMLError as exc:
        raise TemplateSpecError(source, f"is not valid YAML: {exc}") from exc
    spec = TemplateSpec.from_dict(data, source)
    if (spec.name, spec.version) != (path.parent.name, path.stem):
        raise TemplateSpecError(
            source,
            f"declares {spec.ref} but lives at {source}: "
            f"the file must be templates/{spec.name}/{spec.version}.yaml",
        )
    return spec


def spec_hash(spec: TemplateSpec) -> str:
    """Hash of the template's data, insensitive to YAML formatting and comments."""
    canonical = json.dumps(spec.to_dict(), sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def read_lock(path: Path) -> dict[str, dict[str, LockEntry]]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return {
            name: {version: LockEntry(**entry) for version, entry in versions.items()}
            for name, versions in data["templates"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LockError(f"{path} is malformed ({exc}); restore it from version control") from exc


def snapshot_name(code_digest: str) -> str:
    """The frozen code's path in a catalog folder: `_code/<code hash>.tar.gz`."""
    return f"{SNAPSHOT_FOLDER}/{code_digest.removeprefix('sha256:')}.tar.gz"


def write_lock(path: Path, lock: dict[str, dict[str, LockEntry]]) -> None:
    path.write_text(lock_text(lock))


def lock_text(lock: dict[str, dict[str, LockEntry]]) -> str:
    """The lock file's content (JSON, versions in semver order)."""
    data = {
        "about": "Content hashes of published template versions. Written by `llmtrain templates lock`; "
        "never edit a published entry: publish a new version instead.",
        "templates": {
            name: {version: lock[name][version].to_dict() for version in sorted(lock[name], key=SemVer.parse)}
            for name in sorted(lock)
        },
    }
    return json.dumps(data, indent=2) + "\n"
