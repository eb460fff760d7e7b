"""Local folders for a job's channels: the user's (`--data CHANNEL=DIR`) or the shipped tiny corpus.

A bare `--data DIR` is the train channel, or, when DIR is a folder `llmtrain data prepare` wrote, its
parts: `train/` (or the shards at its top), `validation/` and `tokenizer/` become those channels
(each left out where the template has no such channel); `--data CHANNEL=DIR` names one channel and
wins over a part of the same name.

The tiny corpus (examples/data/tiny_corpus) is tokenized with the shipped tiny tokenizer
(training_jobs/assets/tokenizer) by the platform's own `python -m training_jobs.prepare_data`, run as
a subprocess (llmtrain imports only the program's torch-free contract). The shards are cached once
per user (`data_cache_root`: every work directory's runs share them), keyed by the content of the
corpus, the tokenizer and the preparation code, so a later run reuses them and a changed corpus is
prepared again. Two runs preparing the same key at once each write a scratch folder and the first
rename wins; neither ever sees a half-written channel.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from llmtrain.core.sourcedir import repository_root
from llmtrain.core.token_data import (
    PREPARE_HINT,
    RunShape,
    ShardsManifest,
    TokenDataError,
    content_problems,
    data_problems,
    file_problems,
    job_tokenizer,
    parse_manifest,
    split_folders_hint,
    tokenizer_facts,
)
from llmtrain.core.user_cache import content_key, writable_folder
from llmtrain.local.job import LocalJob, LocalRunError
from training_jobs.contract.objectives import data_kind_problem
from training_jobs.contract.token_data import DATA_KINDS, SPLITS

TINY_CORPUS = Path("examples") / "data" / "tiny_corpus"
TINY_TOKENIZER = Path("training_jobs") / "assets" / "tokenizer"
PREPARE_MODULE = "training_jobs.prepare_data"
# The shipped corpus holds one JSONL file per channel.
DEFAULT_CHANNEL_FILES = {"train": "train.jsonl", "validation": "validation.jsonl"}


@dataclass(frozen=True)
class ShippedData:
    """The small dataset a local run of an objective trains on when given no --data."""

    folder: Path
    prepare_options: tuple[str, ...]
    channels: tuple[str, ...]


# Per objective (training_jobs/contract/objectives.py): its shipped examples and how they are prepared.
# GRPO has no validation channel (the program refuses one: each step's rewards are fresh samples).
SHIPPED_DATA = {
    "next_token": ShippedData(TINY_CORPUS, (), ("train", "validation")),
    "dpo": ShippedData(Path("examples") / "data" / "tiny_preference", ("--preference", "--max-length", "64"),
                       ("train", "validation")),
    "grpo": ShippedData(Path("examples") / "data" / "tiny_grpo", ("--prompts",), ("train",)),
}
MANIFEST = "manifest.json"
WORKDIR_CACHE = ".data"  # where a user cache cannot be written: the work directory's own
# The parts of a folder `llmtrain data prepare` wrote (prepare_data's split and tokenizer folders).
DATASET_PARTS = ("train", "validation", "tokenizer")


@dataclass(frozen=True)
class LocalData:
    """The --data folders: `channels` by name; `optional` those taken from a prepared dataset's
    parts, which a template without such a channel leaves out."""

    channels: dict[str, Path] = field(default_factory=dict)
    optional: frozenset[str] = frozenset()


def parse_data_option(values: Iterable[str]) -> LocalData:
    """`--data DIR` (the train channel, or a prepared dataset's parts) or `--data CHANNEL=DIR`,
    repeatable."""
    named: dict[str, Path] = {}
    parts: dict[str, Path] = {}
    for value in values:
        name, sep, folder = value.partition("=")
        if not sep:
            name, folder = "train", value
        if not name or not folder:
            raise LocalRunError(f"--data {value!r}: write DIR (the train channel) or CHANNEL=DIR")
        path = Path(folder).expanduser()
        if not path.is_dir():
            raise LocalRunError(f"--data {value!r}: {path} is not a folder")
        if name in named or (name == "train" and (parts or "train" in named)):
            raise LocalRunError(f"--data: channel '{name}' is given twice")
        if sep:
            named[name] = path.resolve()
        else:
            parts = dataset_parts(path.resolve())
    optional = frozenset(name for name in parts if name != "train" and name not in named)
    return LocalData({**parts, **named}, optional)


def dataset_parts(folder: Path) -> dict[str, Path]:
    """The channels a folder `llmtrain data prepare` wrote provides (only `train` for any other)."""
    train = folder if (folder / MANIFEST).is_file() else folder / "train"
    if not (train / MANIFEST).is_file():
        return {"train": folder}
    return {"train": train, **{name: folder / name for name in DATASET_PARTS[1:] if (folder / name).is_dir()}}


def check_token_channels(plan: LocalJob, channels: Mapping[str, Path],
                         manifest_versions: tuple[int, ...] = (1, 2)) -> None:
    """Refuse, before anything starts, train and validation folders the training program would fail
    on: no manifest, missing or short shards, a manifest version the code the template version runs
    (`manifest_versions`) does not read, too few samples for the run's seq_len or one evaluation
    batch, another tokenizer than the one the job reads them with, or shards whose content the
    program refuses (llmtrain.core.token_data)."""
    problems: list[str] = []
    manifests: dict[str, ShardsManifest] = {}
    objective = str(plan.hyperparameter("objective", "next_token"))
    for name in SPLITS:
        if name in channels:
            kind_problem, example_data = _data_kind(objective, name, channels[name])
            if kind_problem:
                problems.append(kind_problem)
            if kind_problem or example_data:
                continue
            try:
                manifests[name] = _local_manifest(name, channels[name])
            except TokenDataError as problem:
                problems.append(str(problem))
    if manifests and not problems:
        shape = RunShape.of(plan.hyperparameters, hosts=len(plan.hosts),
                            processes_per_host=plan.processes_per_host)
        problems = data_problems(manifests, shape, tokenizer_facts(job_tokenizer(channels)),
                                 manifest_versions)
    if manifests and not problems:
        problems = content_problems({name: channels[name] for name in manifests})
    if problems:
        raise LocalRunError("the job would fail on its data, so nothing was started:\n" +
                            "\n".join(f"  - {problem}" for problem in problems))


def _data_kind(objective: str, channel: str, folder: Path) -> tuple[str | None, bool]:
    """Why the channel's data is not of the objective's kind (None when it is), and whether it is a
    preference or prompts dataset, which the training program checks itself when it loads it."""
    try:
        version = json.loads((folder / MANIFEST).read_bytes()).get("version")
    except (OSError, ValueError, AttributeError):
        version = None
    if version not in DATA_KINDS:
        return (None, False) if objective == "next_token" else (
            f"channel {channel} ({folder}/): objective={objective} trains on a dataset of "
            f"`llmtrain data prepare --{'preference' if objective == 'dpo' else 'prompts'}`; "
            f"{folder / MANIFEST} is not one", False)
    problem = data_kind_problem(objective, version, channel)
    return (f"{problem} ({folder}/)" if problem else None), DATA_KINDS[version] in ("preference", "prompts")


def _local_manifest(channel: str, folder: Path) -> ShardsManifest:
    where = f"{folder}/"
    if not (folder / MANIFEST).is_file():
        splits = [split for split in SPLITS if (folder / split / MANIFEST).is_file()]
        if splits:
            raise TokenDataError(split_folders_hint(channel, where, splits) +
                                 "; a bare --data DIR takes them all")
        raise TokenDataError(f"channel {channel}: no {MANIFEST} in {folder}: {PREPARE_HINT}")
    manifest = parse_manifest((folder / MANIFEST).read_bytes(), where)
    sizes = {name: (folder / name).stat().st_size for name in manifest.file_sizes()
             if (folder / name).is_file()}
    problems = file_problems(manifest, sizes)
    if problems:
        raise TokenDataError(f"channel {channel}: " + "; ".join(problems) + f"; {PREPARE_HINT}")
    return manifest


def default_channels() -> tuple[str, ...]:
    return tuple(DEFAULT_CHANNEL_FILES)


def data_cache_root(workdir: Path) -> Path:
    """Where the shipped data is prepared once for all of this user's work directories: the user's
    cache (llmtrain.core.user_cache), else the work directory's own .data where that cannot be
    written."""
    return writable_folder("data") or workdir / WORKDIR_CACHE


def tiny_corpus_channels(workdir: Path, channels: Iterable[str], *, log=print,
                         objective: str = "next_token") -> dict[str, Path]:
    """The shipped small dataset of the objective (SHIPPED_DATA), prepared (under
    `data_cache_root(workdir)`), for each of `channels` that it provides (train, validation)."""
    repo = repository_root()
    shipped = SHIPPED_DATA.get(objective, SHIPPED_DATA["next_token"])
    wanted = [c for c in channels if c in shipped.channels]
    if not wanted:
        return {}
    corpus, tokenizer = repo / shipped.folder, repo / TINY_TOKENIZER
    prepare_source = repo / "training_jobs" / "prepare_data.py"
    for needed in (corpus, tokenizer, prepare_source):
        if not needed.exists():
            raise LocalRunError(f"{needed} is missing: the default local data is prepared from it")
    key = content_key([corpus, tokenizer, prepare_source, repo / "training_jobs" / "trainer" / "shards.py"])
    cache = data_cache_root(workdir) / f"{corpus.name}-{key}"
    prepared = {}
    for channel in wanted:
        target = cache / channel
        if not (target / MANIFEST).is_file():
            log(f"preparing the tiny corpus for channel '{channel}' (once; cached in {cache})")
            _prepare(repo, corpus / DEFAULT_CHANNEL_FILES[channel], tokenizer, target,
                     shipped.prepare_options)
        prepared[channel] = target
    return prepared


def _prepare(repo: Path, source: Path, tokenizer: Path, target: Path, options: tuple[str, ...]) -> None:
    # Prepare into a scratch folder of this process's own and rename: an interrupted preparation never
    # looks complete, and of two runs preparing the same channel at once the first rename wins.
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{target.name}.partial-", dir=target.parent))
    command = [sys.executable, "-m", PREPARE_MODULE, "--input", str(source), "--tokenizer", str(tokenizer),
               "--output", str(scratch), "--workers", "1", *options]
    try:
        result = subprocess.run(command, cwd=repo, capture_output=True, text=True)
        if result.returncode != 0:
            raise LocalRunError(
                f"preparing the tiny corpus failed (exit {result.returncode}): {' '.join(command)}\n"
                f"{result.stderr.strip()[-2000:]}"
            )
        if target.exists() and not (target / MANIFEST).is_file():
            shutil.rmtree(target, ignore_errors=True)  # an incomplete folder of an older version
        try:
            scratch.rename(target)
        except OSError:
            if not (target / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
