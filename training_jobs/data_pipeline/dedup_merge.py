"""The deduplication of a distributed preparation, taken by its merge.

The instances of a distributed job cannot see each other's signatures, so with --dedup each unit
writes its documents' signatures (datatrove's stage 1, as a local worker writes them) and every
document the filters kept, with each one's split and tokens beside (units.py, `dedup_at_merge`). The
merge takes the step across all units on those signatures (the local step on the same files: the
same duplicates, whatever the number of instances) and rewrites each split of a unit that loses
documents without them. A document is tokenized on its own, so the rewritten split is the local
deduplicated one token for token, cut into shards alike.

A rewritten shard has a name of its own (`shard_UUUUU_NNNNN_dedup.bin`): the instances' shards stay
as their units' manifests describe them, so a merge that fails is simply run again. The shards it
replaces and the `.dedup/` folder are left for whoever publishes the dataset to remove (the launcher:
llmtrain.client.preparations); no manifest lists them.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np

from training_jobs.contract.token_data import SPLITS
from training_jobs.data_pipeline.quality import REMOVALS, SIGNATURES, Judge, QualitySettings, find_duplicates
from training_jobs.data_pipeline.units import DEDUP_FOLDER, DOCUMENT_ROW, UnitJob, UnitShardWriter
from training_jobs.trainer.errors import DataError
from training_jobs.trainer.shards import DTYPES

REWRITTEN_SUFFIX = "_dedup"


def deduplicate_units(jobs: list[UnitJob], manifests: list[dict], shards: Path, scratch: Path) -> list[dict]:
    """The units' manifests once the duplicates across all of them are removed: each unit that loses
    documents has the splits that lose them rewritten into its job's split folders. `shards`: the
    instances' output (their shards and `.dedup/`); `scratch`: a folder for datatrove's steps."""
    method = jobs[0].quality.dedup
    (scratch / REMOVALS).mkdir(parents=True, exist_ok=True)
    find_duplicates(method, scratch, shards / DEDUP_FOLDER / SIGNATURES)
    return [_deduplicated(job, manifest, replace(job, work=shards), scratch)
            for job, manifest in zip(jobs, manifests, strict=True)]


def _deduplicated(job: UnitJob, manifest: dict, written: UnitJob, scratch: Path) -> dict:
    """One unit's manifest without its duplicates; `written` is the unit as the instance wrote it."""
    if "dedup" not in manifest:  # a unit deduplicated as it was tokenized (a local work folder)
        return manifest
    method = manifest["dedup"]["method"]
    documents = _documents(written, manifest["dedup"]["documents"])
    duplicates = Judge(QualitySettings(dedup=method), scratch, job.unit.index).duplicates(len(documents))
    removed = np.zeros(len(documents), dtype=bool)
    if duplicates:
        removed[sorted(duplicates)] = True
    splits = dict(manifest["splits"])
    for split, body in manifest["splits"].items():
        in_split = documents[:, 0] == SPLITS.index(split)
        _check_tokens(written, split, body, documents[in_split])
        if removed[in_split].any():  # a split that loses nothing keeps the instance's shards
            splits[split] = _rewrite(job, written, split, body, documents[in_split, 1], removed[in_split])
    counts = {"documents": int(removed.sum()), "tokens": int(documents[removed, 1].sum())}
    body = {key: value for key, value in manifest.items() if key != "dedup"}
    return {**body, "removed": {**manifest["removed"], f"dedup-{method}": counts}, "splits": splits}


def _documents(written: UnitJob, count: int) -> np.ndarray:
    """The unit's documents file: (split number, tokens) per document the filters kept."""
    if count == 0:
        return np.zeros((0, 2), dtype=DOCUMENT_ROW)
    try:
        data = written.documents_path.read_bytes()
    except OSError as error:
        raise DataError(f"{written.documents_path}: the documents of work unit {written.unit.index} are "
                        "missing; run the preparation again (it redoes the unit), then merge") from error
    return np.frombuffer(data, dtype=DOCUMENT_ROW).reshape(-1, 2)


def _check_tokens(written: UnitJob, split: str, body: dict, rows: np.ndarray) -> None:
    if int(rows[:, 1].sum()) != body["tokens"] or len(rows) != body["documents"]:
        raise DataError(f"{written.documents_path}: its {split} documents do not add up to the unit's "
                        f"manifest ({len(rows)} documents, {int(rows[:, 1].sum())} tokens against "
                        f"{body['documents']} and {body['tokens']}); run the preparation again, then merge")


def _rewrite(job: UnitJob, written: UnitJob, split: str, body: dict, lengths: np.ndarray,
             removed: np.ndarray) -> dict:
    """The split's documents but the removed ones, cut into shards as the unit's writer cuts them."""
    source = written.split_folders[split]
    tokens = _read(source, [(entry["path"], entry["sha256"]) for entry in body["shards"]], DTYPES[job.dtype])
    masks = (_read(source, [(entry["mask"], entry["mask_sha256"]) for entry in body["shards"]], np.uint8)
             if job.fields.loss_mask else None)
    writer = UnitShardWriter(job.unit, split, job.split_folders[split], job.dtype, job.shard_tokens,
                             job.fields.loss_mask, suffix=REWRITTEN_SUFFIX)
    ends = np.cumsum(lengths)
    for start, end, drop in zip(ends - lengths, ends, removed, strict=True):
        if not drop:
            writer.add(tokens[start:end], masks[start:end] if masks is not None else None)
    return writer.finish()


def _read(folder: Path, files: list[tuple[str, str]], dtype) -> np.ndarray:
    """The files' values back to back, each checked against its SHA-256 in the unit's manifest."""
    parts = []
    for name, sha256 in files:
        path = folder / name
        try:
            data = path.read_bytes()
        except OSError as error:
            raise DataError(f"{path}: missing; run the preparation again (it redoes the unit), then "
                            "merge") from error
        if hashlib.sha256(data).hexdigest() != sha256:
            raise DataError(f"{path}: not the file its unit's manifest lists (its SHA-256 differs), so it "
                            "changed after the instance wrote it; prepare the dataset again under another "
                            "name")
        parts.append(np.frombuffer(data, dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
