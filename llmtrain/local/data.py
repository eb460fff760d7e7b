"""Local folders for a job's channels: the user's (`--data CHANNEL=DIR`) or the shipped tiny corpus.

The tiny corpus (examples/data/tiny_corpus) is tokenized with the shipped tiny tokenizer
(training_jobs/assets/tokenizer) by the platform's own `python -m training_jobs.prepare_data`, run as
a subprocess (llmtrain imports only the program's torch-free contract). The shards are cached under
the work directory, keyed by the content of the corpus, the tokenizer and the preparation code, so a
second run reuses them and a changed corpus is prepared again.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from llmtrain.local.plan import LocalRunError
from llmtrain.sourcedir import repository_root

TINY_CORPUS = Path("examples") / "data" / "tiny_corpus"
TINY_TOKENIZER = Path("training_jobs") / "assets" / "tokenizer"
PREPARE_MODULE = "training_jobs.prepare_data"
# The shipped corpus holds one JSONL file per channel.
DEFAULT_CHANNEL_FILES = {"train": "train.jsonl", "validation": "validation.jsonl"}
MANIFEST = "manifest.json"


def parse_data_option(values: Iterable[str]) -> dict[str, Path]:
    """`--data DIR` (the train channel) or `--data CHANNEL=DIR`, repeatable."""
    channels: dict[str, Path] = {}
    for value in values:
        name, sep, folder = value.partition("=")
        if not sep:
            name, folder = "train", value
        if not name or not folder:
            raise LocalRunError(f"--data {value!r}: write DIR (the train channel) or CHANNEL=DIR")
        if name in channels:
            raise LocalRunError(f"--data: channel '{name}' is given twice")
        path = Path(folder).expanduser()
        if not path.is_dir():
            raise LocalRunError(f"--data {value!r}: {path} is not a folder")
        channels[name] = path.resolve()
    return channels


def default_channels() -> tuple[str, ...]:
    return tuple(DEFAULT_CHANNEL_FILES)


def tiny_corpus_channels(cache_root: Path, channels: Iterable[str], *, log=print) -> dict[str, Path]:
    """Shards of the tiny corpus for each of `channels` that it provides (train, validation)."""
    repo = repository_root()
    wanted = [c for c in channels if c in DEFAULT_CHANNEL_FILES]
    if not wanted:
        return {}
    corpus, tokenizer = repo / TINY_CORPUS, repo / TINY_TOKENIZER
    prepare_source = repo / "training_jobs" / "prepare_data.py"
    for needed in (corpus, tokenizer, prepare_source):
        if not needed.exists():
            raise LocalRunError(f"{needed} is missing: the default local data is prepared from it")
    key = _content_key([corpus, tokenizer, prepare_source, repo / "training_jobs" / "trainer" / "shards.py"])
    cache = cache_root / f"tiny_corpus-{key}"
    prepared = {}
    for channel in wanted:
        target = cache / channel
        if not (target / MANIFEST).is_file():
            log(f"preparing the tiny corpus for channel '{channel}' (once; cached in {cache})")
            _prepare(repo, corpus / DEFAULT_CHANNEL_FILES[channel], tokenizer, target)
        prepared[channel] = target
    return prepared


def _content_key(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for root in paths:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for path in files:
            digest.update(path.relative_to(root.parent).as_posix().encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:12]


def _prepare(repo: Path, source: Path, tokenizer: Path, target: Path) -> None:
    # Prepare into a scratch folder and rename: an interrupted preparation never looks complete.
    scratch = target.with_name(target.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", PREPARE_MODULE, "--input", str(source), "--tokenizer", str(tokenizer),
               "--output", str(scratch), "--workers", "1"]
    result = subprocess.run(command, cwd=repo, capture_output=True, text=True)
    if result.returncode != 0:
        raise LocalRunError(
            f"preparing the tiny corpus failed (exit {result.returncode}): {' '.join(command)}\n"
            f"{result.stderr.strip()[-2000:]}"
        )
    shutil.rmtree(target, ignore_errors=True)
    scratch.rename(target)
