"""The on-disk format of pre-tokenized data: flat token shards plus a manifest.

A dataset folder holds `manifest.json` and one or more shard files (prepare_data names them
`shard_UUUUU_NNNNN.bin`, shard N of work unit U; readers go by the manifest's list). Each shard is the
raw little-endian token ids of whole documents back to back, each document followed by the
tokenizer's end-of-sequence id (and preceded by its begin-of-sequence id when it has a distinct
one), so the loader can pack fixed-length samples with plain slicing of a memory map. The manifest
is written last: a folder without one was never finished.

A loss-masked dataset (supervised fine-tuning: prompt/completion pairs) also holds, per shard,
a `.mask` file beside it: one byte per token, 1 where the token is a training target (completions and
their end-of-sequence id) and 0 where it is only context (prompts). Its manifest has version 2, so
a reader that knows nothing of masks (a template version published before them) refuses it rather
than training on the prompts. A masked dataset must train some token besides the end-of-sequence
ids that close its examples (`trains_an_answer`): masks that train nothing else would train at a loss
near 0 and export an unchanged model.

A preference dataset (DPO: a prompt with a chosen and a rejected completion) is loss-masked the same
way, its sequences (prompt + chosen, prompt + rejected) written back to back, and holds per shard a
pair index, `shard_NNNNN.pairs`: int64 rows (chosen start, rejected start, rejected end) in tokens.
Its manifest has version 3, which readers of versions 1 and 2 refuse by number.

A prompts dataset (GRPO: prompts with their reference answers) holds no shards: `prompts.jsonl`, one
JSON line per example ({"where", "prompt", "prompt_ids", "fields"}), beside a manifest of version 4.

numpy only, so prepare_data and tests can use it without torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..contract.token_data import (
    DATA_KINDS,
    DTYPE_BYTES,
    FORMAT,
    MANIFEST,
    MASK_SUFFIX,
    MASKED_VERSION,
    PAIRS_SUFFIX,
    PREFERENCE_VERSION,
    PROMPTS_FILE,
    PROMPTS_VERSION,
    VERSION,
)
from .errors import DataError

__all__ = ["DTYPES", "FORMAT", "MANIFEST", "MASKED_VERSION", "MASK_SUFFIX", "PREFERENCE_VERSION", "VERSION"]

DTYPES = {name: np.dtype(f"<u{size}") for name, size in DTYPE_BYTES.items()}


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= np.iinfo(np.uint16).max + 1 else "uint32"


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    num_tokens: int
    mask_path: Path | None = None  # loss-masked datasets only
    pairs_path: Path | None = None  # preference datasets only


def mask_name(shard_name: str) -> str:
    return Path(shard_name).with_suffix(MASK_SUFFIX).name


def pairs_name(shard_name: str) -> str:
    return Path(shard_name).with_suffix(PAIRS_SUFFIX).name


@dataclass(frozen=True)
class Manifest:
    folder: Path
    dtype: str
    vocab_size: int
    eos_token_id: int
    num_documents: int
    shards: tuple[ShardInfo, ...]
    fingerprint: str
    loss_mask: bool = False
    version: int = VERSION

    @property
    def kind(self) -> str:
        """text, loss_masked or preference (token_data.DATA_KINDS)."""
        return DATA_KINDS[self.version]

    @property
    def num_tokens(self) -> int:
        return sum(shard.num_tokens for shard in self.shards)

    @property
    def numpy_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def write_prompts_manifest(folder: Path, *, vocab_size: int, eos_token_id: int, num_documents: int,
                           num_tokens: int, tokenizer: str) -> Path:
    """The manifest of a prompts dataset (PROMPTS_FILE already written), written last."""
    body = {"format": FORMAT, "version": PROMPTS_VERSION, "dtype": dtype_for_vocab(vocab_size),
            "vocab_size": vocab_size, "eos_token_id": eos_token_id, "num_documents": num_documents,
            "num_tokens": num_tokens, "loss_mask": False, "shards": [], "prompts": PROMPTS_FILE,
            "tokenizer": tokenizer}
    temporary = folder / (MANIFEST + ".tmp")
    temporary.write_text(json.dumps(body, indent=2) + "\n")
    os.replace(temporary, folder / MANIFEST)
    return folder / MANIFEST


def write_manifest(folder: Path, *, dtype: str, vocab_size: int, eos_token_id: int,
                   num_documents: int, shards: list[tuple[str, int]], tokenizer: str,
                   loss_mask: bool = False, checksums: dict[str, str] | None = None,
                   pairs: bool = False, answer_tokens: int | None = None) -> Path:
    """Write the manifest last, atomically, so a half-written dataset has none.

    With `loss_mask`, each shard's mask file (`mask_name`) must already be written beside it, and
    `answer_tokens` (trained tokens besides each example's closing end-of-sequence id) is recorded, so
    a check that cannot read the masks (the platform's, of a dataset in S3) can refuse one that trains
    nothing; with `pairs` (a preference dataset, loss-masked), also its pair index (`pairs_name`). With
    `checksums` (file name -> SHA-256), each entry records its files' SHA-256 (`sha256`,
    `mask_sha256`); readers need not check them."""
    sums = checksums or {}
    entries = [{"path": name, "num_tokens": count, **({"mask": mask_name(name)} if loss_mask else {}),
                **({"pairs": pairs_name(name)} if pairs else {}),
                **({"sha256": sums[name]} if name in sums else {}),
                **({"mask_sha256": sums[mask_name(name)]} if loss_mask and mask_name(name) in sums else {})}
               for name, count in shards]
    version = PREFERENCE_VERSION if pairs else MASKED_VERSION if loss_mask else VERSION
    body = {
        "format": FORMAT, "version": version, "dtype": dtype,
        "vocab_size": vocab_size, "eos_token_id": eos_token_id, "num_documents": num_documents,
        "num_tokens": sum(count for _, count in shards), "loss_mask": loss_mask,
        "shards": entries, "tokenizer": tokenizer,
        **({"answer_tokens": answer_tokens} if loss_mask and answer_tokens is not None else {}),
    }
    target = folder / MANIFEST
    temporary = folder / (MANIFEST + ".tmp")
    temporary.write_text(json.dumps(body, indent=2) + "\n")
    os.replace(temporary, target)
    return target


def _fail(folder: Path, problem: str) -> DataError:
    return DataError(f"malformed dataset in {folder}: {problem}. Prepare it with "
                     "`python -m training_jobs.prepare_data --input ... --tokenizer ... --output ...`")


def _field(body: dict, name: str, kind: type, folder: Path):
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise _fail(folder, f"manifest field {name!r} is missing or not a {kind.__name__}")
    return value


def _checked_file(folder: Path, name: str, count: int, itemsize: int, what: str) -> Path:
    path = folder / name
    if not path.is_file():
        raise _fail(folder, f"{what} {name} listed in the manifest does not exist")
    size = path.stat().st_size
    if size != count * itemsize:
        raise _fail(folder, f"{what} {name} has {size} bytes but the manifest says {count} tokens "
                            f"of {itemsize} bytes ({count * itemsize} bytes); it is truncated or "
                            "was not written by prepare_data")
    return path


def _pairs_file(folder: Path, name: str, count: int) -> Path:
    """A pair index: int64 rows of three offsets, each inside the shard's `count` tokens."""
    path = folder / name
    if not path.is_file() or path.stat().st_size % 24:
        raise _fail(folder, f"pair index {name} listed in the manifest is missing or not rows of three "
                            "int64 offsets")
    rows = np.fromfile(path, dtype="<i8").reshape(-1, 3)
    if len(rows) and (rows.min() < 0 or rows.max() > count or np.any(rows[:, 0] >= rows[:, 1])
                      or np.any(rows[:, 1] >= rows[:, 2])):
        raise _fail(folder, f"pair index {name} holds offsets outside its shard's {count} tokens or out "
                            "of order")
    return path


def _shard_infos(body: dict, folder: Path, itemsize: int, loss_mask: bool,
                 pairs: bool = False) -> tuple[ShardInfo, ...]:
    entries = body.get("shards")
    if not isinstance(entries, list):
        raise _fail(folder, "manifest field 'shards' is missing or not a list")
    infos = []
    for entry in entries:
        if not isinstance(entry, dict):
            raise _fail(folder, f"shard entry {entry!r} is not an object")
        name = _field(entry, "path", str, folder)
        count = _field(entry, "num_tokens", int, folder)
        path = _checked_file(folder, name, count, itemsize, "shard")
        mask = _checked_file(folder, _field(entry, "mask", str, folder), count, 1, "mask") \
            if loss_mask else None
        pair_index = _pairs_file(folder, _field(entry, "pairs", str, folder), count) if pairs else None
        infos.append(ShardInfo(path=path, num_tokens=count, mask_path=mask, pairs_path=pair_index))
    return tuple(infos)


def read_manifest(folder: Path) -> Manifest:
    """Read and check a dataset folder; any inconsistency is a DataError naming the file."""
    path = folder / MANIFEST
    if not path.is_file():
        raise DataError(f"no {MANIFEST} in {folder}: the channel must hold token shards written by "
                        "`python -m training_jobs.prepare_data`")
    raw = path.read_bytes()
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as error:
        raise _fail(folder, f"{MANIFEST} is not valid JSON ({error})") from error
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise _fail(folder, f"{MANIFEST} is not a {FORMAT} manifest")
    version = body.get("version")
    if version not in DATA_KINDS:
        raise _fail(folder, f"manifest version {version!r} is not supported (expected {VERSION}, "
                            f"{MASKED_VERSION} for a loss-masked dataset, {PREFERENCE_VERSION} for "
                            f"preference pairs or {PROMPTS_VERSION} for prompts)")
    loss_mask = version in (MASKED_VERSION, PREFERENCE_VERSION)
    if version == PROMPTS_VERSION and not (folder / PROMPTS_FILE).is_file():
        raise _fail(folder, f"{PROMPTS_FILE} of a prompts dataset is missing")
    if body.get("loss_mask", False) is not loss_mask:
        raise _fail(folder, f"manifest version {version} and 'loss_mask' {body.get('loss_mask')!r} "
                            "disagree")
    dtype = _field(body, "dtype", str, folder)
    if dtype not in DTYPES:
        raise _fail(folder, f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    vocab_size = _field(body, "vocab_size", int, folder)
    eos_token_id = _field(body, "eos_token_id", int, folder)
    if not 0 <= eos_token_id < vocab_size:
        raise _fail(folder, f"manifest says vocab_size {vocab_size} and eos_token_id {eos_token_id}: a "
                            "vocabulary holds at least one token and its end-of-sequence id")
    return Manifest(
        folder=folder, dtype=dtype, vocab_size=vocab_size, eos_token_id=eos_token_id,
        num_documents=_field(body, "num_documents", int, folder),
        shards=_shard_infos(body, folder, DTYPES[dtype].itemsize, loss_mask,
                            pairs=version == PREFERENCE_VERSION),
        fingerprint=hashlib.sha256(raw).hexdigest()[:16],
        loss_mask=loss_mask, version=version,
    )


_SCAN_TOKENS = 1 << 20


def largest_token(manifest: Manifest) -> int | None:
    """The largest token id in the shards (None for a dataset without tokens), scanned in chunks."""
    largest = None
    for shard in manifest.shards:
        tokens = np.memmap(shard.path, dtype=manifest.numpy_dtype, mode="r") if shard.num_tokens else ()
        for start in range(0, shard.num_tokens, _SCAN_TOKENS):
            chunk_max = int(tokens[start:start + _SCAN_TOKENS].max())
            largest = chunk_max if largest is None else max(largest, chunk_max)
    return largest


def token_range_problem(manifest: Manifest) -> str | None:
    """A manifest whose vocab_size its shards contradict (a token id at or above it): the embedding
    is sized from the vocabulary, so such a token would index past it."""
    largest = largest_token(manifest)
    if largest is None or largest < manifest.vocab_size:
        return None
    return (f"{manifest.folder}/{MANIFEST} says vocab_size {manifest.vocab_size}, but its shards hold token "
            f"id {largest} outside that vocabulary: the manifest does not describe these shards; prepare "
            "the data again with `llmtrain data prepare` (it records the tokenizer's size)")


def trains_an_answer(manifest: Manifest) -> bool:
    """Whether a loss-masked dataset trains a token that is not an end-of-sequence id. Scanned in
    chunks until the first such token, which a real dataset has in its first example."""
    for shard in manifest.shards:
        tokens = np.memmap(shard.path, dtype=manifest.numpy_dtype, mode="r")
        mask = np.memmap(shard.mask_path, dtype=np.uint8, mode="r")
        for start in range(0, shard.num_tokens, _SCAN_TOKENS):
            end = start + _SCAN_TOKENS
            if np.any(mask[start:end].astype(bool) & (tokens[start:end] != manifest.eos_token_id)):
                return True
    return False


def content_problem(manifest: Manifest, channel: str) -> str | None:
    """What the shards' content (not their manifest's form) would make the job fail on or train
    nothing from: a token id beyond the manifest's vocab_size, or masks that train no answer token.
    The job checks it when it loads a channel; the platform runs it before a job starts
    (training_jobs.data_info)."""
    contradiction = token_range_problem(manifest)
    if contradiction:
        return f"the {channel} channel: {contradiction}"
    if manifest.loss_mask and not trains_an_answer(manifest):
        return (f"the {channel} channel ({manifest.folder}) trains no answer token: its loss mask marks "
                "only prompts and end-of-sequence ids, so the job would train at a loss near 0; prepare "
                "it again with --completion-key naming the field that holds the answers (or "
                "--messages-key with assistant messages)")
    return None
