"""Turn text or JSONL files into the token shards the training program reads.

    python -m training_jobs.prepare_data --input FILES_OR_DIR... --tokenizer DIR --output DIR
        [--workers N] [--text-key text] [--validation-fraction 0.01] [--shard-tokens N]

Inputs: `.jsonl`/`.json` files hold one JSON object per line (the document is its `--text-key`
field); `.csv`/`.tsv` files have a header row (the document is the `--text-key` column of each row);
any other file (`.txt`, `.md`, ...) is one UTF-8 document. Binary and compressed formats (Parquet,
Arrow, gzip, ...) are refused with what to convert them to. Folders are searched recursively.
Documents are tokenized in parallel worker processes; the output is identical whatever the number
of workers (results are written in input order). With `--validation-fraction`, a deterministic
share of the documents goes to OUTPUT/validation and the rest to OUTPUT/train; upload each folder as
its own channel.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from training_jobs.trainer.errors import DataError  # noqa: E402
from training_jobs.trainer.shards import DTYPES, MANIFEST, dtype_for_vocab, write_manifest  # noqa: E402

JSONL_SUFFIXES = (".jsonl", ".json")
TABLE_DELIMITERS = {".csv": ",", ".tsv": "\t"}
# Formats that would otherwise be read as (garbled) text.
BINARY_SUFFIXES = (".parquet", ".arrow", ".feather", ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar",
                   ".npy", ".pkl", ".pt", ".bin", ".safetensors")
CONVERT_HINT = "convert it to JSONL (one {\"text\": ...} object per line), CSV or UTF-8 text first"
DOCUMENTS_PER_TASK = 256


@dataclass(frozen=True)
class Task:
    """A batch of documents for one worker: (source, text) pairs plus the bytes they span."""

    documents: list[tuple[str, str]]
    num_bytes: int


def find_inputs(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")))
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"--input {item}: no such file or folder")
    if not files:
        raise DataError(f"--input {' '.join(inputs)}: no files found")
    return files


def _jsonl_documents(path: Path, text_key: str) -> Iterator[tuple[str, str, int]]:
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{where}: not a JSON object ({error})") from error
            if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                raise DataError(f"{where}: no string field {text_key!r} (choose it with --text-key)")
            yield where, record[text_key], len(line)


def _table_documents(path: Path, text_key: str) -> Iterator[tuple[str, str, int]]:
    delimiter = TABLE_DELIMITERS[path.suffix.lower()]
    csv.field_size_limit(2**31 - 1)  # a cell holds a whole document (the default stops at 128 KiB)
    with path.open(newline="", encoding="utf-8") as handle:
        rows = csv.DictReader(handle, delimiter=delimiter)
        if text_key not in (rows.fieldnames or ()):
            columns = ", ".join(rows.fieldnames or ()) or "none"
            raise DataError(f"{path}: no column {text_key!r} in the header (columns: {columns}); "
                            "choose it with --text-key")
        try:
            for row in rows:
                text = row[text_key]
                if text:
                    yield f"{path}:{rows.line_num}", text, len(text.encode())
        except csv.Error as error:
            where = f"{path}:{rows.line_num}"
            raise DataError(f"{where}: not a well-formed {path.suffix} row ({error})") from error


def _text_document(path: Path) -> tuple[str, str, int]:
    data = path.read_bytes()
    try:
        return str(path), data.decode("utf-8"), len(data)
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text (byte {error.start}); {CONVERT_HINT}") from error


def iter_documents(files: list[Path], text_key: str) -> Iterator[tuple[str, str, int]]:
    """(where, text, bytes) for every document, in a fixed order."""
    for path in files:
        suffix = path.suffix.lower()
        if suffix in BINARY_SUFFIXES:
            raise DataError(f"{path}: a {suffix} file is not text; {CONVERT_HINT}")
        try:
            if suffix in JSONL_SUFFIXES:
                yield from _jsonl_documents(path, text_key)
            elif suffix in TABLE_DELIMITERS:
                yield from _table_documents(path, text_key)
            else:
                yield _text_document(path)
        except UnicodeDecodeError as error:
            raise DataError(f"{path}: not UTF-8 text ({error.reason}); {CONVERT_HINT}") from error


def iter_tasks(files: list[Path], text_key: str) -> Iterator[Task]:
    batch: list[tuple[str, str]] = []
    size = 0
    for where, text, num_bytes in iter_documents(files, text_key):
        batch.append((where, text))
        size += num_bytes
        if len(batch) == DOCUMENTS_PER_TASK:
            yield Task(batch, size)
            batch, size = [], 0
    if batch:
        yield Task(batch, size)


# --- worker side ---------------------------------------------------------------------------------

_TOKENIZER = None
_DTYPE = None


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _init_worker(tokenizer_path: str, dtype: str) -> None:
    global _TOKENIZER, _DTYPE
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _TOKENIZER = _load_tokenizer(tokenizer_path)
    _DTYPE = DTYPES[dtype]


def tokenize_task(task: Task) -> tuple[list[np.ndarray], int]:
    """Token ids of each document, with the document separators added."""
    tokenizer = _TOKENIZER
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    prefix = [bos] if bos is not None and bos != eos else []
    encoded = tokenizer([text for _, text in task.documents], add_special_tokens=False)["input_ids"]
    return [np.asarray(prefix + ids + [eos], dtype=_DTYPE) for ids in encoded], task.num_bytes


# --- output side ---------------------------------------------------------------------------------

class ShardWriter:
    """Appends documents to fixed-size shard files and writes the manifest at the end."""

    def __init__(self, split: str, folder: Path, dtype: str, shard_tokens: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if (folder / MANIFEST).exists():
            raise DataError(f"{folder} already holds a dataset ({MANIFEST}); choose another --output")
        self.split, self.folder, self.shard_tokens = split, folder, shard_tokens
        self.dtype_name = dtype
        self.shards: list[tuple[str, int]] = []
        self.buffer: list[np.ndarray] = []
        self.buffered = 0
        self.documents = 0

    def add(self, tokens: np.ndarray) -> None:
        self.buffer.append(tokens)
        self.buffered += len(tokens)
        self.documents += 1
        while self.buffered >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def _flush(self, count: int) -> None:
        joined = np.concatenate(self.buffer)
        name = f"shard_{len(self.shards):05d}.bin"
        joined[:count].tofile(self.folder / name)
        self.shards.append((name, count))
        rest = joined[count:]
        self.buffer, self.buffered = ([rest] if len(rest) else []), len(rest)

    def close(self, vocab_size: int, eos_token_id: int, tokenizer: str) -> int:
        if self.buffered:
            self._flush(self.buffered)
        if not self.shards:
            raise DataError(f"no documents went to the {self.split} split in {self.folder}: the input "
                            "holds too few documents (lower --validation-fraction or add data)")
        write_manifest(self.folder, dtype=self.dtype_name, vocab_size=vocab_size,
                       eos_token_id=eos_token_id, num_documents=self.documents,
                       shards=self.shards, tokenizer=tokenizer)
        return sum(count for _, count in self.shards)


def is_validation(index: int, fraction: float) -> bool:
    """A stable per-document coin flip, the same for any number of workers."""
    return fraction > 0 and zlib.crc32(index.to_bytes(8, "little")) / 2**32 < fraction


def _progress(total_bytes: int):
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr)


@contextlib.contextmanager
def _tokenized(args: argparse.Namespace, dtype: str, tasks: Iterator[Task]):
    """Tokenized tasks in input order: in worker processes, or here with --workers 1."""
    if args.workers == 1:
        _init_worker(args.tokenizer, dtype)
        yield map(tokenize_task, tasks)
        return
    with get_context("spawn").Pool(args.workers, _init_worker, (args.tokenizer, dtype)) as pool:
        yield pool.imap(tokenize_task, tasks)


def prepare(args: argparse.Namespace) -> dict[str, int]:
    files = find_inputs(args.input)
    tokenizer = _load_tokenizer(args.tokenizer)
    if tokenizer.eos_token_id is None:
        raise DataError(f"tokenizer {args.tokenizer} has no end-of-sequence token")
    vocab_size = len(tokenizer)
    dtype = dtype_for_vocab(vocab_size)
    output = Path(args.output)
    splits = {"train": output / "train", "validation": output / "validation"} \
        if args.validation_fraction > 0 else {"train": output}
    writers = {name: ShardWriter(name, folder, dtype, args.shard_tokens)
               for name, folder in splits.items()}
    index = 0
    with _tokenized(args, dtype, iter_tasks(files, args.text_key)) as results, \
            _progress(sum(f.stat().st_size for f in files)) as bar:
        for documents, num_bytes in results:
            for tokens in documents:
                split = "validation" if is_validation(index, args.validation_fraction) else "train"
                writers[split].add(tokens)
                index += 1
            bar.update(num_bytes)
    return {name: writer.close(vocab_size, tokenizer.eos_token_id, str(args.tokenizer))
            for name, writer in writers.items()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m training_jobs.prepare_data",
                                     description="Tokenize text or JSONL into training shards.")
    parser.add_argument("--input", nargs="+", required=True, help="files or folders")
    parser.add_argument("--tokenizer", required=True, help="an HF tokenizer folder")
    parser.add_argument("--output", required=True, help="folder to write (must not hold a dataset)")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--text-key", default="text",
                        help="JSONL field or CSV/TSV column holding the text")
    parser.add_argument("--validation-fraction", type=float, default=0.0)
    parser.add_argument("--shard-tokens", type=int, default=1 << 27, help="tokens per shard file")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if not 0.0 <= args.validation_fraction < 1.0:
        parser.error("--validation-fraction must be in [0, 1)")
    if args.shard_tokens < 1:
        parser.error("--shard-tokens must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        counts = prepare(args)
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for split, count in counts.items():
        print(f"{split}: {count} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
