"""Turn text or JSONL files into the token shards the training program reads.

    python -m training_jobs.prepare_data --input FILES_OR_DIR... --tokenizer DIR --output DIR
        [--workers N] [--text-key text | --completion-key completion [--prompt-key prompt]
                       | --messages-key messages]
        [--validation-fraction 0.01] [--shard-tokens N]

Inputs: `.jsonl`/`.json` files hold one JSON object per line (the document is its `--text-key`
field); `.csv`/`.tsv` files have a header row (the document is the `--text-key` column of each row);
any other file (`.txt`, `.md`, ...) is one UTF-8 document. Binary and compressed formats (Parquet,
Arrow, gzip, ...) are refused with what to convert them to. Folders are searched recursively.
Documents are tokenized in parallel worker processes; the output is identical whatever the number
of workers (results are written in input order). With `--validation-fraction`, a deterministic
share of the documents goes to OUTPUT/validation and the rest to OUTPUT/train; upload each folder as
its own channel.

Supervised fine-tuning: with `--completion-key`, each JSONL record or CSV/TSV row is one example, a
prompt (`--prompt-key`, default `prompt`) and its completion. The two are tokenized as one text and
packed like documents (prompt, completion, end-of-sequence id), and a loss mask beside the shards
marks the completion and its end-of-sequence id as the only training targets: the model learns to
answer and to stop, not to reproduce prompts. With `--messages-key`, each JSONL record holds a
conversation (a list of {"role", "content"} messages) rendered with the tokenizer's chat template;
every assistant turn is trained (sft_examples.py).
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

from training_jobs.sft_examples import (  # noqa: E402
    Example,
    check_messages,
    document_separators,
    require_chat_template,
    tokenize_examples,
)
from training_jobs.trainer.errors import DataError  # noqa: E402
from training_jobs.trainer.shards import (  # noqa: E402
    DTYPES,
    MANIFEST,
    dtype_for_vocab,
    mask_name,
    write_manifest,
)

JSONL_SUFFIXES = (".jsonl", ".json")
TABLE_DELIMITERS = {".csv": ",", ".tsv": "\t"}
# Formats that would otherwise be read as (garbled) text.
BINARY_SUFFIXES = (".parquet", ".arrow", ".feather", ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar",
                   ".npy", ".pkl", ".pt", ".bin", ".safetensors")
CONVERT_HINT = "convert it to JSONL (one {\"text\": ...} object per line), CSV or UTF-8 text first"
DOCUMENTS_PER_TASK = 256


# A document's text, or an example (prompt and completion, or a conversation) of a loss-masked
# dataset.
Content = str | Example


@dataclass(frozen=True)
class Fields:
    """Which JSONL fields or CSV/TSV columns hold a document (text) or an example (prompt and
    completion, or a conversation's messages)."""

    text: str = "text"
    prompt: str | None = None
    completion: str | None = None
    messages: str | None = None

    @property
    def loss_mask(self) -> bool:
        return self.completion is not None or self.messages is not None

    @property
    def names(self) -> tuple[str, ...]:
        """The string fields of a record or row (a conversation's messages are read apart)."""
        if self.messages is not None:
            return ()
        return (self.prompt, self.completion) if self.completion is not None else (self.text,)

    def option(self, name: str) -> str:
        """The command-line option that chooses the field `name`."""
        if self.completion is None:
            return "--text-key"
        return "--prompt-key" if name == self.prompt else "--completion-key"

    def content(self, values: list[str]) -> Content:
        return (values[0], values[1]) if self.completion is not None else values[0]


@dataclass(frozen=True)
class Task:
    """A batch of documents for one worker: (source, content) pairs plus the bytes they span."""

    documents: list[tuple[str, Content]]
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


def _jsonl_documents(path: Path, fields: Fields) -> Iterator[tuple[str, Content, int]]:
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{where}: not a JSON object ({error})") from error
            if not isinstance(record, dict):
                raise DataError(f"{where}: not a JSON object")
            if fields.messages is not None:
                if fields.messages not in record:
                    raise DataError(f"{where}: no field {fields.messages!r} (choose it with "
                                    "--messages-key)")
                yield where, check_messages(where, record[fields.messages], fields.messages), len(line)
                continue
            for name in fields.names:
                if not isinstance(record.get(name), str):
                    raise DataError(f"{where}: no string field {name!r} (choose it with "
                                    f"{fields.option(name)})")
            yield where, fields.content([record[name] for name in fields.names]), len(line)


def _table_documents(path: Path, fields: Fields) -> Iterator[tuple[str, Content, int]]:
    if fields.messages is not None:
        raise DataError(f"{path}: a {path.suffix} file holds no conversations; with --messages-key "
                        "the input must be JSONL")
    delimiter = TABLE_DELIMITERS[path.suffix.lower()]
    csv.field_size_limit(2**31 - 1)  # a cell holds a whole document (the default stops at 128 KiB)
    with path.open(newline="", encoding="utf-8") as handle:
        rows = csv.DictReader(handle, delimiter=delimiter)
        for name in fields.names:
            if name not in (rows.fieldnames or ()):
                columns = ", ".join(rows.fieldnames or ()) or "none"
                raise DataError(f"{path}: no column {name!r} in the header (columns: {columns}); "
                                f"choose it with {fields.option(name)}")
        try:
            for row in rows:
                values = [row[name] or "" for name in fields.names]
                if values[-1]:  # a row without text (or without a completion) trains nothing
                    yield (f"{path}:{rows.line_num}", fields.content(values),
                           sum(len(value.encode()) for value in values))
        except csv.Error as error:
            where = f"{path}:{rows.line_num}"
            raise DataError(f"{where}: not a well-formed {path.suffix} row ({error})") from error


def _text_document(path: Path, fields: Fields) -> tuple[str, str, int]:
    if fields.loss_mask:
        raise DataError(f"{path}: a plain text file holds no examples; with --completion-key the "
                        "input must be JSONL, CSV or TSV, with --messages-key JSONL")
    data = path.read_bytes()
    try:
        return str(path), data.decode("utf-8"), len(data)
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text (byte {error.start}); {CONVERT_HINT}") from error


def iter_documents(files: list[Path], fields: Fields) -> Iterator[tuple[str, Content, int]]:
    """(where, content, bytes) for every document or example, in a fixed order."""
    for path in files:
        suffix = path.suffix.lower()
        if suffix in BINARY_SUFFIXES:
            raise DataError(f"{path}: a {suffix} file is not text; {CONVERT_HINT}")
        try:
            if suffix in JSONL_SUFFIXES:
                yield from _jsonl_documents(path, fields)
            elif suffix in TABLE_DELIMITERS:
                yield from _table_documents(path, fields)
            else:
                yield _text_document(path, fields)
        except UnicodeDecodeError as error:
            raise DataError(f"{path}: not UTF-8 text ({error.reason}); {CONVERT_HINT}") from error


def iter_tasks(files: list[Path], fields: Fields, blank: list[str]) -> Iterator[Task]:
    """Documents in batches for the workers; blank text documents are left out (an end-of-sequence
    token alone teaches nothing) and their locations appended to `blank`."""
    batch: list[tuple[str, Content]] = []
    size = 0
    for where, content, num_bytes in iter_documents(files, fields):
        if isinstance(content, str) and not content.strip():
            blank.append(where)
            continue
        batch.append((where, content))
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


Tokenized = tuple[np.ndarray, np.ndarray | None]  # token ids, and the loss mask of an example


def tokenize_task(task: Task) -> tuple[list[Tokenized], int]:
    """Token ids of each document, with the document separators added; for examples, also the
    loss mask (sft_examples.py)."""
    tokenizer = _TOKENIZER
    contents = [content for _, content in task.documents]
    if contents and not isinstance(contents[0], str):
        return tokenize_examples(task.documents, tokenizer, _DTYPE), task.num_bytes
    prefix, eos = document_separators(tokenizer)
    encoded = tokenizer(contents, add_special_tokens=False)["input_ids"]
    return [(np.asarray(prefix + ids + [eos], dtype=_DTYPE), None) for ids in encoded], task.num_bytes


# --- output side ---------------------------------------------------------------------------------

class ShardWriter:
    """Appends documents to fixed-size shard files (and their loss masks) and writes the manifest
    at the end."""

    def __init__(self, split: str, folder: Path, dtype: str, shard_tokens: int,
                 loss_mask: bool = False) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if (folder / MANIFEST).exists():
            raise DataError(f"{folder} already holds a dataset ({MANIFEST}); choose another --output")
        self.split, self.folder, self.shard_tokens = split, folder, shard_tokens
        self.dtype_name, self.loss_mask = dtype, loss_mask
        self.shards: list[tuple[str, int]] = []
        self.buffer: list[np.ndarray] = []
        self.mask_buffer: list[np.ndarray] = []
        self.buffered = 0
        self.documents = 0

    def add(self, tokens: np.ndarray, mask: np.ndarray | None = None) -> None:
        if (mask is not None) != self.loss_mask:
            raise ValueError("a loss-masked dataset needs a mask for every document, and only it")
        self.buffer.append(tokens)
        if mask is not None:
            self.mask_buffer.append(mask)
        self.buffered += len(tokens)
        self.documents += 1
        while self.buffered >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def _flush(self, count: int) -> None:
        name = f"shard_{len(self.shards):05d}.bin"
        self.buffer = self._write(self.buffer, count, name)
        if self.loss_mask:
            self.mask_buffer = self._write(self.mask_buffer, count, mask_name(name))
        self.shards.append((name, count))
        self.buffered -= count

    def _write(self, buffer: list[np.ndarray], count: int, name: str) -> list[np.ndarray]:
        """Write the first `count` values; return the rest as the new buffer."""
        joined = np.concatenate(buffer)
        joined[:count].tofile(self.folder / name)
        rest = joined[count:]
        return [rest] if len(rest) else []

    def close(self, vocab_size: int, eos_token_id: int, tokenizer: str) -> int:
        if self.buffered:
            self._flush(self.buffered)
        if not self.shards:
            raise DataError(f"no documents went to the {self.split} split in {self.folder}: the input "
                            "holds too few documents (lower --validation-fraction or add data)")
        write_manifest(self.folder, dtype=self.dtype_name, vocab_size=vocab_size,
                       eos_token_id=eos_token_id, num_documents=self.documents,
                       shards=self.shards, tokenizer=tokenizer, loss_mask=self.loss_mask)
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
    if args.messages_key is not None:
        require_chat_template(tokenizer)
    vocab_size = len(tokenizer)
    dtype = dtype_for_vocab(vocab_size)
    output = Path(args.output)
    splits = {"train": output / "train", "validation": output / "validation"} \
        if args.validation_fraction > 0 else {"train": output}
    fields = Fields(args.text_key, args.prompt_key, args.completion_key, args.messages_key)
    writers = {name: ShardWriter(name, folder, dtype, args.shard_tokens, fields.loss_mask)
               for name, folder in splits.items()}
    index = 0
    blank: list[str] = []
    with _tokenized(args, dtype, iter_tasks(files, fields, blank)) as results, \
            _progress(sum(f.stat().st_size for f in files)) as bar:
        for documents, num_bytes in results:
            for tokens, mask in documents:
                split = "validation" if is_validation(index, args.validation_fraction) else "train"
                writers[split].add(tokens, mask)
                index += 1
            bar.update(num_bytes)
    _check_not_blank(files, blank, documents=index)
    return {name: writer.close(vocab_size, tokenizer.eos_token_id, str(args.tokenizer))
            for name, writer in writers.items()}


def _check_not_blank(files: list[Path], blank: list[str], *, documents: int) -> None:
    if documents == 0:
        what = f"{len(blank)} empty document(s), e.g. {blank[0]}" if blank else "no documents"
        raise DataError(f"no text to train on in {', '.join(map(str, files))}: the input holds {what}; "
                        "check the file, or --text-key if the text is in another field")
    if blank:
        print(f"prepare_data: left out {len(blank)} empty document(s), e.g. {blank[0]}", file=sys.stderr)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m training_jobs.prepare_data",
                                     description="Tokenize text or JSONL into training shards.")
    parser.add_argument("--input", nargs="+", required=True, help="files or folders")
    parser.add_argument("--tokenizer", required=True, help="an HF tokenizer folder")
    parser.add_argument("--output", required=True, help="folder to write (must not hold a dataset)")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--text-key", default="text",
                        help="JSONL field or CSV/TSV column holding the text")
    parser.add_argument("--completion-key", default=None,
                        help="supervised fine-tuning: the field or column holding each example's "
                             "completion; the loss is then computed on completions only")
    parser.add_argument("--prompt-key", default=None,
                        help="with --completion-key: the field or column holding the prompt "
                             "(default: prompt)")
    parser.add_argument("--messages-key", default=None,
                        help="supervised fine-tuning on conversations: the JSONL field holding each "
                             "record's messages, rendered with the tokenizer's chat template; the "
                             "loss is computed on the assistant turns only")
    parser.add_argument("--validation-fraction", type=float, default=0.0)
    parser.add_argument("--shard-tokens", type=int, default=1 << 27, help="tokens per shard file")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if not 0.0 <= args.validation_fraction < 1.0:
        parser.error("--validation-fraction must be in [0, 1)")
    if args.shard_tokens < 1:
        parser.error("--shard-tokens must be at least 1")
    if args.prompt_key is not None and args.completion_key is None:
        parser.error("--prompt-key needs --completion-key (an example is a prompt and its completion)")
    if args.text_key != "text" and (args.completion_key or args.messages_key):
        parser.error("--text-key is for plain text; examples are read from --completion-key/"
                     "--prompt-key or --messages-key")
    if args.messages_key is not None and args.completion_key is not None:
        parser.error("--messages-key and --completion-key are two formats of examples: choose one")
    if args.completion_key is not None:
        args.prompt_key = args.prompt_key or "prompt"
        if args.prompt_key == args.completion_key:
            parser.error("--prompt-key and --completion-key name the same field")
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
