"""The user's cache: results that cost a subprocess or a preparation, kept for every later command.

Each entry is keyed by the content it was derived from (files' bytes, an interpreter and its torch,
the CPU's flags), so a stale entry is never read: what changed gets a new key. Deleting the folder is
always safe. Where it is: $LLMTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/llmtrain, else
~/.cache/llmtrain. A cache that cannot be written is no error: the caller computes again (or keeps
its data in its own folder, `llmtrain.local.data`).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

CACHE_VARIABLE = "LLMTRAIN_CACHE_DIR"


def cache_root() -> Path:
    configured = os.environ.get(CACHE_VARIABLE)
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "llmtrain"


def writable_folder(name: str) -> Path | None:
    """cache_root()/name, created; None where it cannot be created or written."""
    folder = cache_root() / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return folder if os.access(folder, os.W_OK | os.X_OK) else None


def content_key(paths: Iterable[Path], *extra: str) -> str:
    """A digest of the files under `paths` (names and bytes) and of `extra` strings."""
    digest = hashlib.sha256()
    for root in paths:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for path in files:
            digest.update(path.relative_to(root.parent).as_posix().encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    for value in extra:
        digest.update(b"\0" + value.encode())
    return digest.hexdigest()[:16]


def installed_version(distribution: str) -> str:
    """The version of an installed distribution (read from its metadata, never imported), or "none"."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "none"


def cached_json(kind: str, key: str, compute: Callable[[], Any]) -> Any:
    """compute()'s JSON value, stored under cache_root()/kind/key.json and read from there later. A
    value that cannot be stored is still returned; an unreadable entry is computed again."""
    folder = writable_folder(kind)
    entry = folder / f"{key}.json" if folder else None
    if entry is not None and entry.is_file():
        try:
            return json.loads(entry.read_text())
        except (OSError, ValueError):
            pass
    value = compute()
    if entry is not None:
        _write_atomically(entry, json.dumps(value))
    return value


def cached_file(kind: str, name: str, make: Callable[[Path], bool]) -> Path | None:
    """cache_root()/kind/name, made once by make(scratch), which writes the file at the path it is
    given and says whether it did; renamed into place, so no reader sees half a file. None where the
    cache cannot be written or make fails (nothing is left behind)."""
    folder = writable_folder(kind)
    if folder is None:
        return None
    entry = folder / name
    if entry.is_file():
        return entry
    try:
        handle, scratch = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
    except OSError:
        return None
    os.close(handle)
    os.unlink(scratch)  # make() creates it: a tool may refuse an existing empty file
    try:
        if not make(Path(scratch)):
            return None
        os.replace(scratch, entry)
        return entry
    except OSError:
        return None
    finally:
        Path(scratch).unlink(missing_ok=True)


def _write_atomically(path: Path, text: str) -> None:
    """Written beside and renamed: a reader never sees half an entry. A failure leaves nothing."""
    try:
        handle, scratch = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError:
        return
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.replace(scratch, path)
    except OSError:
        Path(scratch).unlink(missing_ok=True)
