"""One work unit: read its documents, apply the quality steps, tokenize, write its shards.

A unit writes its shards into the dataset's split folders under names of its own
(`shard_UUUUU_NNNNN.bin`), each to a temporary name first and renamed once whole, and then its unit
manifest (`units/UUUUU.json`: its shards with their checksums, documents, tokens and what each step
removed). A unit is complete when its manifest lists files that all exist with their sizes; a unit
that was interrupted has no manifest and is redone from the start, its stray files removed first.

Each document's split is drawn from (unit, position in the unit), so it does not depend on which
worker runs the unit; for unit 0 the draw is prepare_data's draw by document number.

With `dedup_at_merge` (an instance of a distributed job, which cannot see the other instances'
signatures), a unit removes no duplicates: it writes its documents' signatures and every document the
filters kept, and beside them (`.dedup/documents/UUUUU.bin`) each such document's split and tokens,
from which the merge removes the duplicates it finds across all units (dedup_merge.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from training_jobs import prepare_data
from training_jobs.contract.token_data import SPLITS
from training_jobs.data_pipeline.plan import WorkUnit, write_json_atomically
from training_jobs.data_pipeline.quality import (
    SIGNATURES,
    Judge,
    QualitySettings,
    content_text,
    write_signatures,
)
from training_jobs.trainer.errors import DataError
from training_jobs.trainer.shards import DTYPES, mask_name

UNITS_FOLDER = "units"
SIGNED_FOLDER = "signed"  # a unit's marker: its deduplication signatures are written
DOCUMENTS_PER_UNIT_BITS = 32  # a unit holds fewer than 2^32 documents (datatrove's ids are uint32)
# A distributed job's deduplication files, beside its shards (so the shards job's upload carries them
# and the listing in sizes.json sizes them): the signatures, and per unit its documents' splits and
# tokens. llmtrain.core.preparation names the same folder (tests/llmtrain/test_preparation.py).
DEDUP_FOLDER = ".dedup"
DOCUMENTS_FOLDER = "documents"
DOCUMENT_ROW = np.dtype("<i8")  # a document's row in its unit's documents file: split number, tokens
Kept = tuple[str, int]  # a document written to a split: the split and its tokens


@dataclass(frozen=True)
class UnitJob:
    """Everything a worker needs to run one unit (sent to worker processes): the unit and the path
    of each of its pieces, not the whole plan."""

    unit: WorkUnit
    paths: tuple[Path, ...]  # of the unit's pieces, in order
    work: Path
    fields: prepare_data.Fields
    validation_fraction: float
    shard_tokens: int
    dtype: str
    quality: QualitySettings
    state: Path | None = None  # where units/ goes, when not in `work` (a distributed job's instances)
    dedup_at_merge: bool = False  # signatures and every filtered document written; the merge deduplicates

    @property
    def split_folders(self) -> dict[str, Path]:
        if self.validation_fraction > 0:
            return {name: self.work / name for name in SPLITS}
        return {"train": self.work}

    @property
    def manifest_path(self) -> Path:
        return (self.state or self.work) / UNITS_FOLDER / f"{self.unit.name}.json"

    @property
    def dedup_folder(self) -> Path:
        return self.work / DEDUP_FOLDER

    @property
    def documents_path(self) -> Path:
        """With dedup_at_merge: the split number (in SPLITS) and tokens of each document the filters
        kept, in unit order, as DOCUMENT_ROW pairs."""
        return self.dedup_folder / DOCUMENTS_FOLDER / f"{self.unit.name}.bin"

    def signature_files(self) -> list[Path]:
        """The unit's files of datatrove's stage 1 (one per hash bucket, named after the unit)."""
        return sorted((self.dedup_folder / SIGNATURES).glob(f"*/{self.unit.name}.*"))


@dataclass
class Read:
    """A unit's documents that are not blank, numbered, with the blank ones' locations."""

    inputs: prepare_data.Inputs
    documents: list[prepare_data.Document] = field(default_factory=list)


class UnitShardWriter:
    """Appends a unit's documents of one split (and their loss masks) to fixed-size shard files
    named after the unit, each written whole to a temporary name and renamed, with its SHA-256."""

    def __init__(self, unit: WorkUnit, split: str, folder: Path, dtype: str, shard_tokens: int,
                 loss_mask: bool, suffix: str = "") -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.unit, self.split, self.folder, self.shard_tokens = unit, split, folder, shard_tokens
        self.suffix = suffix  # of the shards' names: a merge's rewritten shards have their own
        self.loss_mask = loss_mask
        self.shards: list[tuple[str, int]] = []
        self.checksums: dict[str, str] = {}
        self.buffer: list[np.ndarray] = []
        self.mask_buffer: list[np.ndarray] = []
        self.buffered = 0
        self.documents = 0
        self.answer_tokens = 0  # trained tokens besides each example's closing end-of-sequence id

    def add(self, tokens: np.ndarray, mask: np.ndarray | None = None) -> None:
        if (mask is not None) != self.loss_mask:
            raise ValueError("a loss-masked dataset needs a mask for every document, and only it")
        self.buffer.append(tokens)
        if mask is not None:
            self.mask_buffer.append(mask)
            self.answer_tokens += int(np.count_nonzero(mask[:-1]))
        self.buffered += len(tokens)
        self.documents += 1
        while self.buffered >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def _flush(self, count: int) -> None:
        name = f"shard_{self.unit.name}_{len(self.shards):05d}{self.suffix}.bin"
        self.buffer = self._write(self.buffer, count, name)
        if self.loss_mask:
            self.mask_buffer = self._write(self.mask_buffer, count, mask_name(name))
        self.shards.append((name, count))
        self.buffered -= count

    def _write(self, buffer: list[np.ndarray], count: int, name: str) -> list[np.ndarray]:
        """Write the first `count` values; return the rest as the new buffer."""
        joined = np.concatenate(buffer)
        data = joined[:count].tobytes()
        temporary = self.folder / f"{name}.tmp"
        temporary.write_bytes(data)
        temporary.replace(self.folder / name)
        self.checksums[name] = hashlib.sha256(data).hexdigest()
        rest = joined[count:]
        return [rest] if len(rest) else []

    def finish(self) -> dict:
        if self.buffered:
            self._flush(self.buffered)
        entries = [{"path": name, "num_tokens": count, "sha256": self.checksums[name],
                    **({"mask": mask_name(name), "mask_sha256": self.checksums[mask_name(name)]}
                       if self.loss_mask else {})}
                   for name, count in self.shards]
        return {"documents": self.documents, "tokens": sum(c for _, c in self.shards),
                "answer_tokens": self.answer_tokens, "shards": entries}


def unit_documents(job: UnitJob, inputs: prepare_data.Inputs) -> Iterator[prepare_data.Document]:
    """The unit's documents, in input order, read as prepare_data reads them."""
    for piece, path in zip(job.unit.pieces, job.paths, strict=True):
        if piece.whole:
            yield from prepare_data.iter_documents([path], job.fields, inputs, job.validation_fraction)
            continue
        try:
            yield from prepare_data._jsonl_documents(path, job.fields, piece.start, piece.end)
        except UnicodeDecodeError as error:
            raise DataError(f"{path}: not UTF-8 text ({error.reason}); "
                            f"{prepare_data.CONVERT_HINT}") from error


def _filtered_texts(job: UnitJob, judge: Judge) -> Iterator[str]:
    inputs = prepare_data.Inputs(list(job.paths))
    for document in unit_documents(job, inputs):
        if _blank(document):
            continue
        text = content_text(document.content)
        if judge.failed_filter(text) is None:
            yield text


def sign_unit(job: UnitJob) -> int:
    """Deduplication stage 1 for one unit; marks it done. Returns the unit's index."""
    judge = Judge(QualitySettings(job.quality.filters), job.work, job.unit.index)
    write_signatures(job.quality.dedup, job.work, job.unit.index, _filtered_texts(job, judge))
    marker = job.work / SIGNED_FOLDER / job.unit.name
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return job.unit.index


def _blank(document: prepare_data.Document) -> bool:
    return isinstance(document.content, str) and not document.content.strip()


def run_unit(job: UnitJob) -> dict:
    """Tokenize and write one unit; returns (and writes last) its manifest."""
    remove_unit_files(job)
    inputs = prepare_data.Inputs(list(job.paths))
    documents, fates = _judged_documents(job, inputs)
    writers = {split: UnitShardWriter(job.unit, split, folder, job.dtype, job.shard_tokens,
                                      job.fields.loss_mask)
               for split, folder in job.split_folders.items()}
    removed, kept = _tokenize_and_write(job, documents, fates, writers)
    manifest = {
        "unit": job.unit.index, "num_bytes": job.unit.num_bytes, "documents_read": len(documents),
        "blank": len(inputs.blank), "blank_example": inputs.blank[0] if inputs.blank else None,
        "too_short": [[str(path), needed] for path, needed in inputs.too_short],
        "removed": {step: {"documents": c["documents"], "tokens": c["tokens"]}
                    for step, c in removed.items()},
        "splits": {split: writer.finish() for split, writer in writers.items()},
    }
    if job.dedup_at_merge:
        manifest["dedup"] = _write_documents(job, kept)
    job.manifest_path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomically(job.manifest_path, manifest)
    return manifest


def _judged_documents(job: UnitJob, inputs: prepare_data.Inputs) -> tuple[list, list[str | None]]:
    """The unit's documents that are not blank, and each one's fate: None (kept) or the step that
    removes it. The deduplication numbers the documents the filters kept, as sign_unit signed them;
    with dedup_at_merge their signatures are written here instead, and none is removed yet."""
    judge = Judge(job.quality, job.work, job.unit.index)
    documents: list[prepare_data.Document] = []
    fates: list[str | None] = []
    signed: list[int] = []  # positions of the documents the filters kept
    for document in unit_documents(job, inputs):
        if _blank(document):
            inputs.blank.append(document.where)
            continue
        failed = judge.failed_filter(content_text(document.content))
        if failed is None:
            signed.append(len(documents))
        fates.append(failed)
        documents.append(document)
    if job.dedup_at_merge:
        with _staged(job) as staging:
            write_signatures(job.quality.dedup, staging, job.unit.index,
                             (content_text(documents[number].content) for number in signed))
        return documents, fates
    for number in judge.duplicates(len(signed)):
        fates[signed[number]] = f"dedup-{job.quality.dedup}"
    return documents, fates


def _tokenize_and_write(job: UnitJob, documents: list[prepare_data.Document], fates: list[str | None],
                        writers: dict[str, UnitShardWriter]) -> tuple[dict[str, Counter], list[Kept]]:
    """Tokenize in batches; write the kept documents to their splits, count the removed ones.
    Returns the removals by step and each kept document's split and tokens."""
    steps = job.quality.filters if job.dedup_at_merge else job.quality.steps  # the merge adds dedup's
    removed: dict[str, Counter] = {step: Counter() for step in steps}
    kept: list[Kept] = []
    for start in range(0, len(documents), prepare_data.DOCUMENTS_PER_TASK):
        batch = documents[start:start + prepare_data.DOCUMENTS_PER_TASK]
        task = prepare_data.Task([(d.where, d.content) for d in batch], [d.split for d in batch],
                                 sum(d.num_bytes for d in batch))
        tokenized, forced, _ = prepare_data.tokenize_task(task)
        for number, ((tokens, mask), split) in enumerate(zip(tokenized, forced, strict=True), start):
            if fates[number] is not None:
                removed[fates[number]].update(documents=1, tokens=len(tokens))
                continue
            draw = (job.unit.index << DOCUMENTS_PER_UNIT_BITS) + number
            drawn = "validation" if prepare_data.is_validation(draw, job.validation_fraction) else "train"
            writers[split or drawn].add(tokens, mask)
            kept.append((split or drawn, len(tokens)))
    return removed, kept


def _write_documents(job: UnitJob, kept: list[Kept]) -> dict:
    """The unit's documents file, and the manifest's record of the unit's deduplication files with
    their sizes (a unit is complete only with all of them; an empty one, of a unit whose documents the
    filters all removed, is not recorded: object storage need not keep it)."""
    rows = np.array([(SPLITS.index(split), tokens) for split, tokens in kept], dtype=DOCUMENT_ROW)
    with _staged(job) as staging:
        path = staging / job.documents_path.relative_to(job.dedup_folder)
        path.parent.mkdir(parents=True)
        path.write_bytes(rows.reshape(-1, 2).tobytes())
    sizes = {path: path.stat().st_size for path in [job.documents_path, *job.signature_files()]}
    return {"method": job.quality.dedup, "documents": len(kept),
            "files": {path.relative_to(job.work).as_posix(): size for path, size in sizes.items() if size}}


@contextlib.contextmanager
def _staged(job: UnitJob) -> Iterator[Path]:
    """A folder beside the output to write deduplication files in; on leaving, each is moved whole into
    the unit's `.dedup/`. The output is uploaded as it changes (SageMaker's Continuous mode), and
    datatrove writes a signature file twice (then sorts it in place), so the upload could otherwise
    catch a half-written or unsorted file of the right size."""
    staging = Path(tempfile.mkdtemp(prefix=f".staging-{job.unit.name}-", dir=job.work.parent))
    try:
        yield staging
        for path in sorted(p for p in staging.rglob("*") if p.is_file()):
            target = job.dedup_folder / path.relative_to(staging)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def remove_unit_files(job: UnitJob) -> None:
    """A unit's files from an interrupted attempt (shards, masks, temporaries, its manifest, its
    deduplication files)."""
    job.manifest_path.unlink(missing_ok=True)
    for folder in job.split_folders.values():
        if folder.is_dir():
            for path in folder.glob(f"shard_{job.unit.name}_*"):
                path.unlink()
    if job.dedup_at_merge:
        for path in [job.documents_path, *job.signature_files()]:
            path.unlink(missing_ok=True)


def file_size(path: Path) -> int | None:
    return path.stat().st_size if path.is_file() else None


def complete_manifest(job: UnitJob, manifest_path: Path | None = None,
                      size_of: Callable[[Path], int | None] = file_size) -> dict | None:
    """The unit's manifest when the unit is complete: every file it lists is there, whole.
    `manifest_path` and `size_of` (a file's size, None when it is missing) read another copy of the
    work folder, such as the listing of a distributed preparation's output in object storage."""
    try:
        manifest = json.loads((manifest_path or job.manifest_path).read_text())
    except (OSError, ValueError):
        return None
    itemsize = DTYPES[job.dtype].itemsize
    for split, body in manifest.get("splits", {}).items():
        folder = job.split_folders.get(split)
        if folder is None:
            return None
        for entry in body["shards"]:
            sizes = {entry["path"]: entry["num_tokens"] * itemsize}
            if "mask" in entry:
                sizes[entry["mask"]] = entry["num_tokens"]
            if any(size_of(folder / name) != size for name, size in sizes.items()):
                return None
    dedup_files = manifest.get("dedup", {}).get("files", {})
    if any(size_of(job.work / name) != size for name, size in dedup_files.items()):
        return None
    return manifest
